// Parameters of the parallel layers: this rank's shard of one named tensor, its gradient, and
// where the shard sits in the global tensor (for checkpoints, ZeRO and tests).
//
// Sharding is said once, as placements over the mesh axes (dp, tp) (shard/placement.hpp): a layer
// gives each parameter a ParamSharding when it makes it, and everything else reads it. The box a
// rank holds is shard::dim_range of the value placement; the Trainer's gradient reductions are
// the planner's steps from the gradient placement (what backward leaves) to the value placement;
// the global norm counts a gradient once per axis where it ends replicated; a checkpoint box is
// written by coordinate 0 of every axis where the value is replicated. Over dp a value is always
// replicated here (ZeRO-1 shards optimizer state, not parameters: train/trainer.hpp), and a
// gradient starts as Partial(sum) (each dp rank's rows). Over tp, a sharded layer's value and
// gradient are Shard(d) in whole units (heads); a replicated parameter's gradient is Replicate
// when every tp rank computes it from all rows, and Partial(sum) when each computes it from its
// own rows (LayerNorm under sequence parallelism, reduced once per step, as Megatron-Core does).
//
// A shard is always a box of the parameter's `sharded_shape`, a row-major reshape of its GPT-2
// `global_shape` (same elements, same order). For most parameters the two are equal; the fused
// q/k/v projection c_attn.weight (C, 3C) is viewed as (C, 3, C) so that "the heads of this rank"
// (columns h0*D .. h1*D of each of q, k and v) is one box: offsets {0, 0, h0*D}, shape {C, 3, Cl}.
// Shards along a dimension follow shard::chunk() (the library's one uneven-size rule).
//
// Initial values are a pure function of (seed, name, global element index), so a model built
// with any tensor-parallel size holds exactly the slices of the single-rank model.
//
// Storage: a parameter's value and gradient are ParamArrays: their own arrays when built, views
// into a model's flat buffers once packed (nn/parameter_buffer.hpp), so gradient buckets are
// contiguous ranges that reduce in place.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trellis/core/buffer.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/hash.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/kernels/thread_pool.hpp"
#include "trellis/shard/flat.hpp"
#include "trellis/shard/layout.hpp"
#include "trellis/shard/placement.hpp"

namespace trellis::nn {

// The mesh axes a parameter is described over, in this order. ep (expert parallel) is a
// sub-axis of dp: a Mixture-of-Experts layer's experts are Shard(0) over it (nn/moe.hpp), and
// their gradients are then summed over the rest of dp only (the ranks holding the same experts).
inline constexpr int dp_axis = 0;
inline constexpr int tp_axis = 1;
inline constexpr int ep_axis = 2;
using ParamPlacements = std::array<shard::PlacementCode, 3>;

// A parameter's sharding: placements of its value and of the gradient backward leaves in `grad`,
// over (dp, tp, ep), and the unit a sharded dimension splits in.
struct ParamSharding {
  ParamPlacements value{shard::replicate_code(), shard::replicate_code(), shard::replicate_code()};
  ParamPlacements grad{shard::partial_code(comm::ReduceOp::sum), shard::replicate_code(), shard::replicate_code()};
  index_t unit = 1;

  // Whole on every tp rank; `tp_partial_grad`: each tp rank's gradient is a term of the sum.
  static ParamSharding replicated(bool tp_partial_grad = false) {
    ParamSharding s;
    if (tp_partial_grad) s.grad[tp_axis] = shard::partial_code(comm::ReduceOp::sum);
    return s;
  }
  // Dimension `dim` (of the sharded view) split over tp in whole units of `unit` elements.
  static ParamSharding tp_sharded(int dim, index_t unit = 1) {
    ParamSharding s;
    s.value[tp_axis] = s.grad[tp_axis] = shard::shard_code(dim);
    s.unit = unit;
    return s;
  }
  // An expert's tensor: dimension 0 (experts) split over ep, on top of `s`.
  static ParamSharding expert(ParamSharding s) {
    s.value[ep_axis] = s.grad[ep_axis] = shard::shard_code(0);
    return s;
  }
  bool operator==(const ParamSharding&) const = default;
};

inline std::string sharding_string(const ParamPlacements& p) {
  std::string s = "(dp " + shard::placement_string(p[dp_axis]) + ", tp " + shard::placement_string(p[tp_axis]);
  if (!p[ep_axis].is_replicate()) s += ", ep " + shard::placement_string(p[ep_axis]);
  return s + ")";
}

// The fp32 elements of a parameter's value or gradient: an owned, zeroed host array, or a view
// into a flat buffer after ParameterBuffer packed it, possibly in device memory. Move-only;
// copying elements is explicit (assign_from), so `a = b` can never silently rebind a view.
//
// data() and elements() give the elements where they live (for kernels and collectives). Element
// access from the host (operator[], begin/end, the span conversions, fill, assign_from) is refused
// once the elements live in memory the host cannot read (a GPU's, or backend::DeviceChecked's):
// host code reaches such parameters through its backend's upload/download.
class ParamArray {
 public:
  ParamArray() = default;
  explicit ParamArray(std::size_t n) : own_(n), data_(own_.data()), size_(n) {}
  ParamArray(ParamArray&& o) noexcept
      : own_(std::move(o.own_)),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        host_readable_(std::exchange(o.host_readable_, true)) {}
  ParamArray& operator=(ParamArray&& o) noexcept {
    own_ = std::move(o.own_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    host_readable_ = std::exchange(o.host_readable_, true);
    return *this;
  }
  ParamArray(const ParamArray&) = delete;
  ParamArray& operator=(const ParamArray&) = delete;

  float* data() noexcept { return data_; }
  const float* data() const noexcept { return data_; }
  std::span<float> elements() noexcept { return {data_, size_}; }
  std::span<const float> elements() const noexcept { return {data_, size_}; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  bool host_readable() const noexcept { return host_readable_; }

  float& operator[](std::size_t i) { return host()[i]; }
  const float& operator[](std::size_t i) const { return host()[i]; }
  float* begin() { return host(); }
  float* end() { return host() + size_; }
  const float* begin() const { return host(); }
  const float* end() const { return host() + size_; }
  operator std::span<float>() { return {host(), size_}; }
  operator std::span<const float>() const { return {host(), size_}; }

  void assign_from(std::span<const float> src) {
    TRELLIS_CHECK(src.size() == size_, "ParamArray::assign_from: ", src.size(), " elements into ", size_);
    std::copy(src.begin(), src.end(), host());
  }
  void fill(float v) { std::fill_n(host(), size_, v); }
  // Views size() floats at `flat` (owned by someone else, which already holds this array's
  // elements) instead of its own storage. host_readable: whether the host may touch them.
  void rebind(float* flat, bool host_readable) {
    own_ = {};
    data_ = flat;
    host_readable_ = host_readable;
  }
  bool is_view() const noexcept { return own_.empty() && size_ > 0; }

 private:
  float* host() const {
    TRELLIS_CHECK(data_ != nullptr || size_ == 0,
                  "ParamArray: elements not bound (a gradient with external storage, outside its weight unit's W)");
    TRELLIS_CHECK(host_readable_ || size_ == 0,
                  "ParamArray: host access to parameter elements that live in device memory (use the backend's "
                  "upload/download)");
    return data_;
  }
  Buffer<float, Host> own_;
  float* data_ = nullptr;
  std::size_t size_ = 0;
  bool host_readable_ = true;
};

// A box of the global tensor (GPT-2 shape) held by this rank, and where its elements sit in
// Parameter::value: element idx of the box is value[local_offset + sum_d idx[d] * local_strides[d]].
// This is what a checkpoint writer stores per rank (train/checkpoint.hpp boxes).
struct ShardPiece {
  std::vector<index_t> offsets;  // in global_shape coordinates
  std::vector<index_t> shape;
  index_t local_offset = 0;
  std::vector<index_t> local_strides;
};

struct Parameter {
  std::string name;                        // GPT-2 name, e.g. "h.0.attn.c_attn.weight"
  std::vector<index_t> global_shape;       // GPT-2 shape of the whole tensor
  std::vector<index_t> sharded_shape;      // row-major reshape of global_shape the shard is a box of
  std::vector<index_t> shard_offsets;      // this rank's box in sharded_shape: start ...
  std::vector<index_t> shard_shape;        // ... and extent (product == value.size())
  ParamSharding sharding;                  // placements of value and gradient over (dp, tp)
  ParamArray value;                        // this rank's elements, row-major over shard_shape
  ParamArray grad;                         // same shape; backward_weight adds into it

  index_t numel() const { return static_cast<index_t>(value.size()); }
  index_t global_numel() const {
    index_t n = 1;
    for (index_t s : global_shape) n *= s;
    return n;
  }
  // Whether every tp rank holds the whole tensor.
  bool replicated() const { return sharding.value[tp_axis].is_replicate(); }
  // Whether backward leaves a term of a sum over tp in `grad` (to be all-reduced over tp).
  bool tp_partial_grad() const { return sharding.grad[tp_axis].is_partial(); }
  // Whether this is an expert's tensor, split over ep (its dp reduction skips the ep ranks).
  bool expert() const { return sharding.value[ep_axis].is_shard(); }
  void zero_grad() { grad.fill(0.0f); }

  // This rank's shard as boxes of the global tensor: one box, or for a grouped view (the last
  // global dimension factored into (groups, width), sharded along width) one box per group.
  std::vector<ShardPiece> pieces() const {
    const std::size_t r = global_shape.size();
    std::vector<index_t> shard_strides(shard_shape.size(), 1);
    for (std::size_t d = shard_shape.size(); d-- > 1;) shard_strides[d - 1] = shard_strides[d] * shard_shape[d];
    if (sharded_shape == global_shape) return {ShardPiece{shard_offsets, shard_shape, 0, shard_strides}};
    TRELLIS_CHECK(sharded_shape.size() == r + 1 && r >= 1 &&
                      std::equal(global_shape.begin(), global_shape.end() - 1, sharded_shape.begin()) &&
                      sharded_shape[r - 1] * sharded_shape[r] == global_shape[r - 1],
                  "parameter ", name, ": its sharded view is not (..., groups, width) of the global shape");
    const index_t width = sharded_shape[r];
    std::vector<ShardPiece> out;
    for (index_t g = 0; g < shard_shape[r - 1]; ++g) {
      ShardPiece p;
      p.offsets.assign(shard_offsets.begin(), shard_offsets.begin() + static_cast<std::ptrdiff_t>(r));
      p.offsets[r - 1] = (shard_offsets[r - 1] + g) * width + shard_offsets[r];
      p.shape.assign(shard_shape.begin(), shard_shape.begin() + static_cast<std::ptrdiff_t>(r));
      p.shape[r - 1] = shard_shape[r];
      p.local_offset = g * shard_strides[r - 1];
      p.local_strides.assign(shard_strides.begin(), shard_strides.begin() + static_cast<std::ptrdiff_t>(r));
      p.local_strides[r - 1] = 1;
      out.push_back(std::move(p));
    }
    return out;
  }

  // Row-major index in the global tensor of local element `i`.
  index_t global_index(index_t i) const {
    const int r = static_cast<int>(shard_shape.size());
    index_t g = 0, rest = i;
    std::vector<index_t> local(static_cast<std::size_t>(r));
    for (int d = r - 1; d >= 0; --d) {
      local[d] = rest % shard_shape[d];
      rest /= shard_shape[d];
    }
    for (int d = 0; d < r; ++d) g = g * sharded_shape[d] + shard_offsets[d] + local[d];
    return g;
  }
};

// Builds this tp rank's parameter of `global_shape`, viewed as `sharded_shape` ({} = same), laid
// out by `sharding` over a tp group of `tp_size` ranks: its box is shard::dim_range of each
// dimension under the value placement (tp_rank's part, in whole units).
inline Parameter make_parameter(std::string name, std::vector<index_t> global_shape, std::vector<index_t> sharded_shape,
                                const ParamSharding& sharding, int tp_size, int tp_rank) {
  Parameter p;
  p.name = std::move(name);
  p.global_shape = std::move(global_shape);
  p.sharded_shape = sharded_shape.empty() ? p.global_shape : std::move(sharded_shape);
  p.sharding = sharding;
  index_t g = 1, s = 1;
  for (index_t e : p.global_shape) g *= e;
  for (index_t e : p.sharded_shape) s *= e;
  TRELLIS_CHECK(g == s, "parameter ", p.name, ": sharded shape is not a reshape of the global shape");
  TRELLIS_CHECK(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size, "parameter ", p.name, ": tp rank ", tp_rank,
                " of ", tp_size);
  const ParamPlacements& v = sharding.value;
  TRELLIS_CHECK(v[dp_axis].is_replicate() && !v[tp_axis].is_partial() && sharding.unit >= 1, "parameter ", p.name,
                ": value placement ", sharding_string(v), " (values are replicated over dp and not partial)");
  TRELLIS_CHECK(!sharding.grad[dp_axis].is_shard() && (!sharding.grad[tp_axis].is_shard() || sharding.grad[tp_axis] == v[tp_axis]),
                "parameter ", p.name, ": gradient placement ", sharding_string(sharding.grad),
                " does not fit value placement ", sharding_string(v));
  const int rank = static_cast<int>(p.sharded_shape.size());
  if (v[tp_axis].is_shard())
    TRELLIS_CHECK(v[tp_axis].dim < rank && p.sharded_shape[v[tp_axis].dim] % sharding.unit == 0, "parameter ",
                  p.name, ": tp shard of dimension ", v[tp_axis].dim, " in units of ", sharding.unit,
                  " does not fit its sharded shape");
  const std::array<int, 3> sizes{1, tp_size, 1}, coords{0, tp_rank, 0};
  p.shard_offsets.resize(static_cast<std::size_t>(rank));
  p.shard_shape.resize(static_cast<std::size_t>(rank));
  for (int d = 0; d < rank; ++d) {
    const shard::Chunk c = shard::dim_range(p.sharded_shape[d], d, v, sizes, coords, -1,
                                            v[tp_axis].is_shard(d) ? sharding.unit : 1);
    p.shard_offsets[d] = c.offset;
    p.shard_shape[d] = c.size;
  }
  index_t n = 1;
  for (index_t e : p.shard_shape) n *= e;
  p.value = ParamArray(static_cast<std::size_t>(n));
  p.grad = ParamArray(static_cast<std::size_t>(n));
  return p;
}

// A parameter whole on every rank (tests, and layers without tensor parallelism).
inline Parameter make_parameter(std::string name, std::vector<index_t> global_shape) {
  return make_parameter(std::move(name), std::move(global_shape), {}, ParamSharding::replicated(), 1, 0);
}

// Takes every gradient of `params` that backward left Partial over tp to its value placement
// (Replicate): the planner's step, an all-reduce over `tp`, in place. Gradients that follow each
// other in `params` and in memory with no gap (a LayerNorm's weight and bias, packed) go as one
// range; all are started, then all waited for. The Trainer calls it per weight unit once the
// unit's last W is done; code that drives a GptModel directly calls
// GptModel::reduce_tp_partial_grads after its backward.
template <comm::Communicator C>
void reduce_tp_partial_grads(C& tp, const std::vector<Parameter*>& params) {
  if (tp.size() == 1) return;
  struct Run {
    const Parameter* first;
    float* begin;
    std::size_t size;
  };
  std::vector<Run> runs;
  const Parameter* last = nullptr;  // the previous entry of `params`
  for (Parameter* p : params) {
    if (p->tp_partial_grad() && p->numel() > 0) {
      const bool joins = last != nullptr && !runs.empty() && last->grad.data() + last->grad.size() == p->grad.data() &&
                         runs.back().begin + runs.back().size == p->grad.data() &&
                         p->sharding.grad == runs.back().first->sharding.grad &&
                         p->sharding.value == runs.back().first->sharding.value;
      if (joins) runs.back().size += p->grad.size();
      else runs.push_back({p, p->grad.data(), p->grad.size()});
      last = p;
    } else {
      last = nullptr;
    }
  }
  std::vector<typename C::request_type> started;
  for (const Run& r : runs)
    if (auto req = shard::start_flat_redistribute(tp, r.first->sharding.grad[tp_axis], r.first->sharding.value[tp_axis],
                                                  r.begin, r.begin, r.size))
      started.push_back(std::move(*req));
  for (auto& r : started) r.wait();
}

namespace detail {
inline std::uint64_t counter_normal_base(std::uint64_t seed, std::string_view name) {
  return splitmix64(seed ^ name_hash(name));
}
inline float counter_normal_at(std::uint64_t base, index_t index) {
  const std::uint64_t r = splitmix64(base + static_cast<std::uint64_t>(index) * 2);
  const std::uint64_t s = splitmix64(base + static_cast<std::uint64_t>(index) * 2 + 1);
  const double u1 = (static_cast<double>(r >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(s >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}
}  // namespace detail

// A standard normal sample that depends only on (seed, name, global index): tp-independent init.
inline float counter_normal(std::uint64_t seed, std::string_view name, index_t index) {
  return detail::counter_normal_at(detail::counter_normal_base(seed, name), index);
}

// value[i] = stddev * counter_normal(seed, name, global_index(i)), the same bits, in chunks on the
// kernel pool, each walking its elements' global indices as an odometer: per element, the name
// hash and global_index()'s index vector took ~9 s of a GPT-2 124M model's set-up on one thread.
inline void init_normal(Parameter& p, std::uint64_t seed, float stddev) {
  const index_t n = p.numel();
  if (n == 0) return;
  float* out = p.value.begin();  // refused here, once, if the values are not host memory
  const std::uint64_t base = detail::counter_normal_base(seed, p.name);
  const std::size_t rank = p.shard_shape.size();
  std::vector<index_t> stride(rank, 1);  // of sharded_shape: a global index is sum (offset + local) x stride
  for (std::size_t d = rank; d-- > 1;) stride[d - 1] = stride[d] * p.sharded_shape[d];
  constexpr index_t chunk = index_t{1} << 15;
  kernels::host::parallel_for((n + chunk - 1) / chunk, [&](std::int64_t c) {
    const index_t i0 = c * chunk, i1 = std::min(n, i0 + chunk);
    std::vector<index_t> local(rank);
    index_t rest = i0, g = 0;
    for (std::size_t d = rank; d-- > 0;) {
      local[d] = rest % p.shard_shape[d];
      rest /= p.shard_shape[d];
    }
    for (std::size_t d = 0; d < rank; ++d) g += (p.shard_offsets[d] + local[d]) * stride[d];
    for (index_t i = i0; i < i1; ++i) {
      out[i] = stddev * detail::counter_normal_at(base, g);
      for (std::size_t d = rank; d-- > 0;) {  // next element: the last dimension first, carries up
        g += stride[d];
        if (++local[d] < p.shard_shape[d]) break;
        g -= p.shard_shape[d] * stride[d];
        local[d] = 0;
      }
    }
  });
}
inline void init_constant(Parameter& p, float v) { p.value.fill(v); }

}  // namespace trellis::nn
