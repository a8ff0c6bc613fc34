// train::GradBuckets: the data-parallel side of a Trainer's step. Gradients leave the backward
// Partial(sum) over the replicas (the ranks holding the same parameters: dp x cp, or an expert
// tensor's replicas) and go to the optimizer's placement bucket by bucket. A bucket is a run of one
// weight unit's consecutive parameters (<= bucket_elements; experts apart, they reduce over other
// ranks), one range of its chunk's packed layout (nn/parameter_buffer.hpp), so it reduces in place:
//   ZeRO 0: Replicate, an all-reduce in the packed gradient buffer;
//   ZeRO 1: Shard(0), a reduce-scatter into this rank's shard of the bucket (shards_), once per
//           step when the unit's last microbatch's W is done (Megatron's distributed optimizer);
//   ZeRO 2: Shard(0) too, but the gradients have no packed buffer. A weight unit's gradients live
//           in a slot (one of `slots`, each as large as the largest unit) bound just before its W
//           and reduce-scattered right after it, every microbatch; the shard accumulates the
//           microbatches in fp32 and the slot is reused once its reduce-scatter finished
//           (DeepSpeed's stage 2, FSDP's SHARD_GRAD_OP). wte keeps a whole gradient: two units
//           (embedding and head) add to it and the tied sum over pp comes first, so its bucket
//           reduce-scatters once, after that sum;
//   ZeRO 3: the gradients as ZeRO 2; the values are sharded too, by train::ParamShards on the same
//           buckets (train/param_shards.hpp).
// Hybrid sharding (ZeRO 1-3 with `groups`: FSDP's HYBRID_SHARD, Megatron's distributed-optimizer
// instances): `replicas` is then a shard group, a part of the replicas; the groups hold the same
// shards, so a bucket's reduced shard is all-reduced over `groups` (the ranks with the same shard
// in every group) once per step, after its last microbatch (ZeRO-2/3: started as that
// microbatch's reduce-scatter is retired, overlapping the rest of the backward; ZeRO-1 and wte:
// after their reduce-scatters, at the end): every group then updates the same shard. Expert
// buckets shard over all their replicas.
// A bucket's padding is zero in every buffer, so reducing it adds zeros. The optimizer then runs
// on the shards (pieces(), cut at parameter boundaries), and gather_values() all-gathers each
// bucket's updated values in place in the packed values (ZeRO 1, 2).
#pragma once

#include <algorithm>
#include <cstddef>
#include <deque>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/optim/zero.hpp"
#include "trellis/shard/flat.hpp"

namespace trellis::train {

template <comm::Communicator C, backend::Backend B>
class GradBuckets {
 public:
  using Model = nn::GptModel<C, B>;
  struct Options {
    int zero = 0;                         // 0 to 3 (see above)
    std::size_t bucket_elements = 1 << 18;
    int slots = 2;                        // ZeRO-2: unit gradient slots (one in W, one reducing)
  };
  // Elements [tensor_begin, +size) of params[param], this rank's, at shard_offset of bucket
  // `bucket`'s shard.
  struct Piece {
    std::size_t param = 0, bucket = 0;
    index_t tensor_begin = 0, shard_offset = 0, size = 0;
  };
  // A bucket: a range of chunk `owner`'s packed layout, reduced over `comm`.
  struct Bucket {
    int chunk = 0, unit = 0;  // chunk -1: wte, after the tied sum
    int owner = 0;            // the chunk whose packed layout holds it (wte's too)
    C* comm = nullptr;        // the ranks holding the same values: dp x cp, or its expert replicas
    C* groups = nullptr;      // hybrid sharding: the same shard in the other shard groups
    std::vector<std::size_t> params;         // indices into params_
    std::vector<std::size_t> param_offsets;  // each one's offset in the range
    std::size_t packed_begin = 0, size = 0;  // the range in the owner's packed layout (floats)
    float* grads = nullptr;  // the packed gradients of that range (ZeRO-2/3: wte's own; null for units' slots)
    std::size_t shard_begin = 0;  // ZeRO-1/2/3: this rank's reduced shard, at shards_[shard_begin]
    std::optional<typename C::request_type> request;
    bool reduced = false;  // this step's reduction finished (waited for)
    bool summed_over_groups = false;  // hybrid: this step's all-reduce over `groups` done

    std::size_t shard_size() const { return size / static_cast<std::size_t>(comm->size()); }
  };
  // A weight unit of a chunk: its parameters (packing order), their range and buckets.
  struct Unit {
    std::vector<nn::Parameter*> params;
    std::size_t begin = 0, size = 0;
    std::vector<std::size_t> buckets;
  };

  GradBuckets() = default;
  // chunks: this rank's models (their packed buffers: ZeRO-2 needs GptOptions::packed_gradients
  // off); params: this rank's parameters, each once; replicas: the ranks holding the same dense
  // parameters, expert_replicas: the same experts (the same communicator without ep). groups:
  // hybrid sharding (ZeRO 1-3): `replicas` is one shard group, `groups` the same rank of every
  // group (null: no hybrid).
  GradBuckets(const Options& o, std::vector<Model*> chunks, std::vector<nn::Parameter*> params, C& replicas,
              C& expert_replicas, B be, C* groups = nullptr)
      : opt_(o), chunks_(std::move(chunks)), params_(std::move(params)), be_(std::move(be)), groups_(groups) {
    TRELLIS_CHECK(o.zero >= 0 && o.zero <= 3, "GradBuckets: ZeRO stage ", o.zero, " (0 to 3)");
    TRELLIS_CHECK(!groups || o.zero >= 1, "GradBuckets: hybrid sharding needs a ZeRO stage (1 to 3)");
    TRELLIS_CHECK(o.slots >= 1, "GradBuckets: ", o.slots, " gradient slots");
    for (Model* m : chunks_)
      TRELLIS_CHECK((m->parameter_buffer().gradients() == nn::ParameterBuffer<B>::Gradients::external) == (o.zero >= 2),
                    "GradBuckets: ZeRO-2 and 3 need models without packed gradients (GptOptions::packed_gradients), "
                    "the other stages need them");
    for (int c = static_cast<int>(chunks_.size()) - 1; c >= 0; --c) {
      Model& m = *chunks_[static_cast<std::size_t>(c)];
      unit_of_.emplace_back();
      for (int u = 0; u < m.weight_units(); ++u) add_unit(c, u, replicas, expert_replicas);
    }
    std::reverse(unit_of_.begin(), unit_of_.end());
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i]->name == "wte.weight") add_wte(i, replicas);
    if (opt_.zero >= 1) setup_shards();
    if (opt_.zero >= 2) setup_slots();
  }

  int zero() const { return opt_.zero; }
  std::size_t size() const { return buckets_.size(); }
  const Bucket& bucket(std::size_t k) const { return buckets_.at(k); }
  const Unit& unit(int c, int u) const { return unit_of_.at(static_cast<std::size_t>(c)).at(static_cast<std::size_t>(u)); }
  const std::vector<Model*>& chunks() const { return chunks_; }
  const std::vector<nn::Parameter*>& parameters() const { return params_; }
  // ZeRO-1/2/3: floats of this rank's shards of every bucket (the shards' layout).
  std::size_t shard_elements() const { return shards_.size(); }
  const std::vector<Piece>& pieces() const { return pieces_; }
  // Whether piece pc is counted on this rank (the global norm): hybrid sharding's first group
  // holds the shards once; every rank without it.
  bool first_group(const Piece& pc) const {
    const Bucket& b = buckets_[pc.bucket];
    return !b.groups || b.groups->rank() == 0;
  }
  // Piece k's reduced gradient (in the shards) and value (in the packed values).
  std::span<const float> piece_grad(const Piece& pc) const {
    return {shards_.data() + buckets_[pc.bucket].shard_begin + pc.shard_offset, static_cast<std::size_t>(pc.size)};
  }
  std::span<float> piece_value(const Piece& pc) const {
    TRELLIS_CHECK(opt_.zero < 3, "GradBuckets: under ZeRO-3 the values' shards are ParamShards'");
    return {params_[pc.param]->value.data() + pc.tensor_begin, static_cast<std::size_t>(pc.size)};
  }
  // Bytes of gradient storage this object holds (ZeRO-1/2 shards, ZeRO-2 slots and wte's gradient).
  std::size_t gradient_bytes() const {
    std::size_t n = shards_.size() + wte_grad_.size();
    for (const auto& s : slots_) n += s.grads.size() + s.received.size();
    return n * sizeof(float);
  }

  // ---- during the step --------------------------------------------------------------------------
  void begin_step() {
    for (auto& b : buckets_) b.reduced = b.summed_over_groups = false;
    if (opt_.zero < 2) return;
    be_.fill_zero(shards_.data(), shards_.size());
    be_.fill_zero(wte_grad_.data(), wte_grad_.size());
  }
  // Before unit u of chunk c runs one microbatch's W. ZeRO-2/3: its gradients get a zeroed slot.
  void begin_unit(int c, int u) {
    if (opt_.zero < 2) return;
    Unit& unit = unit_at(c, u);
    if (unit.params.empty()) return;
    TRELLIS_CHECK(active_ < 0, "GradBuckets: weight unit ", u, " of chunk ", c, " began inside another unit's W");
    active_ = free_slot();
    Slot& s = slots_[static_cast<std::size_t>(active_)];
    be_.fill_zero(s.grads.data(), unit.size);
    for (nn::Parameter* p : unit.params) p->grad.rebind(s.grads.data() + (offset_of(c, *p) - unit.begin), B::host_readable);
  }
  // After unit u of chunk c ran one microbatch's W (its tp-partial gradients already summed over
  // tp); `last`: its last microbatch of the step. Starts the unit's buckets when their gradients
  // are ready to leave (ZeRO-2: every microbatch; otherwise after the last, when `start_now`);
  // returns how many started.
  int end_unit(int c, int u, bool last, bool start_now) {
    Unit& unit = unit_at(c, u);
    if (opt_.zero >= 2) {
      if (unit.params.empty()) return 0;
      Slot& s = slots_[static_cast<std::size_t>(active_)];
      std::size_t received = 0;
      for (std::size_t k : unit.buckets) {
        Bucket& b = buckets_[k];
        const std::size_t n = b.shard_size();
        s.pending.push_back(
            {k, received, start(b, s.grads.data() + (b.packed_begin - unit.begin), s.received.data() + received), last});
        received += n;
      }
      for (nn::Parameter* p : unit.params) p->grad.rebind(nullptr, B::host_readable);  // misuse shows at once
      in_flight_.push_back(active_);
      active_ = -1;
      return static_cast<int>(unit.buckets.size());
    }
    if (!last || !start_now) return 0;
    for (std::size_t k : unit.buckets) buckets_[k].request = start(buckets_[k], buckets_[k].grads, shard_of(buckets_[k]));
    return static_cast<int>(unit.buckets.size());
  }
  // After the schedule and the tied wte sum: starts what has not started (wte; every bucket when
  // the units did not start theirs) and waits for all (ZeRO-2: the slots' shards added in).
  void finish() {
    for (auto& b : buckets_)
      if (!b.request && !b.reduced && (b.chunk < 0 || opt_.zero < 2)) b.request = start(b, b.grads, shard_of(b));
    while (!in_flight_.empty()) retire_oldest();
    for (auto& b : buckets_) wait(b);
    std::vector<std::size_t> all(buckets_.size());
    std::iota(all.begin(), all.end(), std::size_t{0});
    sum_over_groups(all);
  }
  // Unit u of chunk c (-1: wte, after the tied sum) reduced: its buckets started if they were not
  // and waited for (ZeRO-2: every slot in flight retired). For an update of that unit alone (the
  // optimizer step fused into the backward), after its last microbatch's end_unit.
  void wait_unit(int c, int u) {
    if (opt_.zero >= 2)
      while (!in_flight_.empty()) retire_oldest();
    const auto ks = bucket_indices(c, u);
    for (std::size_t k : ks) {
      Bucket& b = buckets_[k];
      if (!b.request && !b.reduced && (b.chunk < 0 || opt_.zero < 2)) b.request = start(b, b.grads, shard_of(b));
      wait(b);
    }
    sum_over_groups(ks);
  }
  // ZeRO-1/2/3: the indices (into pieces()) of unit u of chunk c's shard pieces (-1: wte's).
  std::vector<std::size_t> pieces_of(int c, int u) const {
    std::vector<std::size_t> out;
    const auto ks = bucket_indices(c, u);
    for (std::size_t q = 0; q < pieces_.size(); ++q)
      if (std::find(ks.begin(), ks.end(), pieces_[q].bucket) != ks.end()) out.push_back(q);
    return out;
  }

  // ---- after the optimizer ----------------------------------------------------------------------
  // The updated values go from the optimizer's placement, Shard(0), back to the parameters'
  // (Replicate): an all-gather per bucket, in place (this rank's shard is already at r L/n), all
  // started, then all waited for. ZeRO-1/2 (ZeRO-3 gathers a unit's values when it computes).
  void gather_values() {
    TRELLIS_CHECK(opt_.zero >= 1 && opt_.zero < 3, "GradBuckets::gather_values: ZeRO stage ", opt_.zero);
    for (auto& b : buckets_) {
      float* values = chunks_[static_cast<std::size_t>(b.owner)]->parameter_buffer().values().data() + b.packed_begin;
      b.request = shard::start_flat_redistribute(*b.comm, shard::shard_code(0), shard::replicate_code(), values,
                                                 values + static_cast<std::size_t>(b.comm->rank()) * b.shard_size(), b.size);
    }
    for (auto& b : buckets_)
      if (b.request) {
        b.request->wait();
        b.request.reset();
      }
  }
  // AdamW moments of the shards (state's tensor q is piece q; read_m/read_v(q, host pointer))
  // gathered into each parameter's local shape (m[i], v[i] sized like params[i]): a collective
  // over every bucket's replicas.
  template <class State>
  void gather_moments(const State& state, std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) const {
    for (int which = 0; which < 2; ++which) {
      auto& out = which == 0 ? m : v;
      for (std::size_t k = 0; k < buckets_.size(); ++k) {
        const Bucket& b = buckets_[k];
        const auto parts = static_cast<std::size_t>(b.comm->size());
        const std::size_t n = b.shard_size();
        std::vector<float> mine(n, 0.0f), all(n * parts);
        for (std::size_t q = 0; q < pieces_.size(); ++q)
          if (pieces_[q].bucket == k) {
            float* dst = mine.data() + pieces_[q].shard_offset;
            which == 0 ? state.read_m(q, dst) : state.read_v(q, dst);
          }
        b.comm->all_gather(mine.data(), all.data(), n);
        for (std::size_t j = 0; j < b.params.size(); ++j) {
          const std::size_t i = b.params[j];
          std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(b.param_offsets[j]), out[i].size(), out[i].begin());
        }
      }
    }
  }

 private:
  struct Pending {
    std::size_t bucket, received;
    std::optional<typename C::request_type> request;
    bool last = false;  // the bucket's last microbatch of the step
  };
  struct Slot {
    typename B::template buffer<float> grads, received;  // a unit's gradients; its buckets' reduced shards
    std::vector<Pending> pending;                        // reduce-scatters from it still to finish
  };

  std::vector<std::size_t> bucket_indices(int c, int u) const {
    if (c >= 0) return unit_of_.at(static_cast<std::size_t>(c)).at(static_cast<std::size_t>(u)).buckets;
    std::vector<std::size_t> out;
    for (std::size_t k = 0; k < buckets_.size(); ++k)
      if (buckets_[k].chunk < 0) out.push_back(k);
    return out;
  }
  void wait(Bucket& b) {
    if (b.request) {
      b.request->wait();
      b.request.reset();
    }
    b.reduced = true;
  }
  // Hybrid sharding: buckets ks' reduced shards (every microbatch's part in) summed over the
  // shard groups, all started, then waited for.
  void sum_over_groups(const std::vector<std::size_t>& ks) {
    std::vector<typename C::request_type> started;
    for (std::size_t k : ks) {
      Bucket& b = buckets_[k];
      if (!b.groups || b.summed_over_groups) continue;
      float* shard = shards_.data() + b.shard_begin;
      started.push_back(b.groups->all_reduce_async(shard, shard, b.shard_size(), comm::ReduceOp::sum));
      b.summed_over_groups = true;
    }
    for (auto& r : started) r.wait();
  }
  Unit& unit_at(int c, int u) { return unit_of_.at(static_cast<std::size_t>(c)).at(static_cast<std::size_t>(u)); }
  std::size_t offset_of(int c, const nn::Parameter& p) const {
    return chunks_[static_cast<std::size_t>(c)]->parameter_buffer().packed_range(p, p).first;
  }
  std::size_t param_index(const nn::Parameter* p) const {
    const auto it = std::find(params_.begin(), params_.end(), p);
    TRELLIS_CHECK(it != params_.end(), "GradBuckets: parameter ", p->name, " is not one of this rank's");
    return static_cast<std::size_t>(it - params_.begin());
  }
  float* shard_of(const Bucket& b) { return opt_.zero >= 1 ? shards_.data() + b.shard_begin : b.grads; }

  // Partial(sum) over the bucket's replicas -> the optimizer's placement (Replicate in place, or
  // this rank's Shard(0) part into `out`): the planner's step (shard/flat.hpp).
  std::optional<typename C::request_type> start(Bucket& b, float* grads, float* out) {
    const auto to = opt_.zero >= 1 ? shard::shard_code(0) : shard::replicate_code();
    return shard::start_flat_redistribute(*b.comm, shard::partial_code(comm::ReduceOp::sum), to, grads, out, b.size);
  }

  // Unit u's parameters (wte apart) cut into buckets; experts in their own.
  void add_unit(int c, int u, C& replicas, C& expert_replicas) {
    Model& m = *chunks_[static_cast<std::size_t>(c)];
    auto& buffer = m.parameter_buffer();
    Unit unit;
    unit.params = m.weight_unit_parameters(u);
    if (!unit.params.empty())
      std::tie(unit.begin, unit.size) = buffer.packed_range(*unit.params.front(), *unit.params.back());
    std::vector<nn::Parameter*> run;
    std::size_t n = 0;
    auto close = [&] {
      if (run.empty()) return;
      for (std::size_t k = 1; k < run.size(); ++k)
        TRELLIS_CHECK(buffer.index_of(*run[k]) == buffer.index_of(*run[k - 1]) + 1, "GradBuckets: bucket parameters ",
                      run[k - 1]->name, " and ", run[k]->name, " are not consecutive in the packed buffer");
      Bucket b;
      b.chunk = b.owner = c;
      b.unit = u;
      b.comm = run.front()->expert() ? &expert_replicas : &replicas;
      b.groups = run.front()->expert() ? nullptr : groups_;
      std::tie(b.packed_begin, b.size) = buffer.packed_range(*run.front(), *run.back());
      for (nn::Parameter* p : run) {
        b.params.push_back(param_index(p));
        b.param_offsets.push_back(buffer.packed_range(*p, *p).first - b.packed_begin);
      }
      if (opt_.zero < 2) b.grads = buffer.grad_range(*run.front(), *run.back()).data();
      unit.buckets.push_back(buckets_.size());
      buckets_.push_back(std::move(b));
      run.clear();
      n = 0;
    };
    for (nn::Parameter* p : unit.params) {
      const auto sz = static_cast<std::size_t>(p->numel());
      if (!run.empty() && (n + sz > opt_.bucket_elements || run.back()->expert() != p->expert())) close();
      run.push_back(p);
      n += sz;
    }
    close();
    auto& units = unit_of_.back();
    if (static_cast<int>(units.size()) <= u) units.resize(static_cast<std::size_t>(u) + 1);
    units[static_cast<std::size_t>(u)] = std::move(unit);
  }
  // wte: its own bucket, reduced after the tied sum (ZeRO-2: its gradient whole, in wte_grad_).
  void add_wte(std::size_t i, C& replicas) {
    nn::Parameter& w = *params_[i];
    auto owner = std::find_if(chunks_.begin(), chunks_.end(), [&](Model* m) {
      auto ps = m->parameters();
      return std::find(ps.begin(), ps.end(), &w) != ps.end();
    });
    TRELLIS_CHECK(owner != chunks_.end(), "GradBuckets: no chunk holds ", w.name);
    auto& buffer = (*owner)->parameter_buffer();
    Bucket b;
    b.chunk = -1;
    b.owner = static_cast<int>(owner - chunks_.begin());
    b.comm = &replicas;
    b.groups = groups_;
    b.params.push_back(i);
    b.param_offsets.push_back(0);
    std::tie(b.packed_begin, b.size) = buffer.packed_range(w, w);
    if (opt_.zero >= 2) {
      wte_grad_ = be_.template allocate<float>(b.size);  // zeroed; the padding stays zero
      w.grad.rebind(wte_grad_.data(), B::host_readable);
      b.grads = wte_grad_.data();
    } else {
      b.grads = buffer.grad_range(w, w).data();
    }
    buckets_.push_back(std::move(b));
  }

  // Each bucket (L elements, a multiple of its replica count n: the packing alignment) split over
  // its replicas: rank r owns [r L/n, (r+1) L/n), cut at parameter boundaries into pieces.
  void setup_shards() {
    std::size_t total = 0;
    for (std::size_t k = 0; k < buckets_.size(); ++k) {
      Bucket& b = buckets_[k];
      const int r = b.comm->rank(), parts = b.comm->size();
      const auto n = b.size / static_cast<std::size_t>(parts);
      TRELLIS_CHECK(n * static_cast<std::size_t>(parts) == b.size, "GradBuckets: a ZeRO bucket of ", b.size,
                    " elements does not split over its ", parts, " replicas");
      b.shard_begin = total;
      total += n;
      optim::FlatLayout layout;  // the bucket's parameters at their offsets in the range
      for (std::size_t j = 0; j < b.params.size(); ++j) {
        layout.offsets.push_back(static_cast<index_t>(b.param_offsets[j]));
        layout.sizes.push_back(params_[b.params[j]]->numel());
      }
      layout.total = static_cast<index_t>(b.size);
      const shard::Chunk mine{static_cast<index_t>(n) * r, static_cast<index_t>(n)};
      for (const optim::FlatPiece& pc : optim::pieces_in(layout, mine))
        pieces_.push_back({b.params[pc.tensor], k, pc.tensor_begin, pc.partition_begin, pc.size});
    }
    shards_ = be_.template allocate<float>(total);
  }
  void setup_slots() {
    std::size_t grads = 0, received = 0;
    for (auto& units : unit_of_)
      for (auto& u : units) {
        grads = std::max(grads, u.size);
        std::size_t r = 0;
        for (std::size_t k : u.buckets) r += buckets_[k].shard_size();
        received = std::max(received, r);
      }
    slots_.resize(static_cast<std::size_t>(opt_.slots));
    for (auto& s : slots_) {
      s.grads = be_.template allocate<float>(grads);
      s.received = be_.template allocate<float>(received);
    }
  }
  // A slot no reduce-scatter reads: the oldest in flight is finished first when all are busy.
  int free_slot() {
    for (int s = 0; s < static_cast<int>(slots_.size()); ++s)
      if (std::find(in_flight_.begin(), in_flight_.end(), s) == in_flight_.end()) return s;
    return retire_oldest();
  }
  // Waits for the oldest slot's reduce-scatters and adds their shards into shards_ (in the order
  // they started: a bucket's microbatches add up in order on every rank).
  int retire_oldest() {
    const int s = in_flight_.front();
    in_flight_.pop_front();
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    for (auto& p : slot.pending) {
      if (p.request) p.request->wait();
      Bucket& b = buckets_[p.bucket];
      const auto n = static_cast<index_t>(b.shard_size());
      float* shard = shards_.data() + b.shard_begin;
      be_.add(n, shard, slot.received.data() + p.received, shard);
      if (p.last && b.groups) {  // hybrid: the shard is final in this group; its sum over the groups overlaps what follows
        b.request = b.groups->all_reduce_async(shard, shard, b.shard_size(), comm::ReduceOp::sum);
        b.summed_over_groups = true;
      }
    }
    slot.pending.clear();
    return s;
  }

  Options opt_;
  std::vector<Model*> chunks_;
  std::vector<nn::Parameter*> params_;
  B be_;
  C* groups_ = nullptr;  // hybrid sharding (see the top)
  std::vector<Bucket> buckets_;
  std::vector<std::vector<Unit>> unit_of_;  // [chunk][unit]
  std::vector<Piece> pieces_;
  typename B::template buffer<float> shards_, wte_grad_;
  std::vector<Slot> slots_;
  std::deque<int> in_flight_;  // slots whose reduce-scatters may still run, oldest first
  int active_ = -1;            // the slot bound to the unit in W
};

}  // namespace trellis::train
