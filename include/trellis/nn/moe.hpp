// Mixture-of-Experts MLP (Switch / GShard / Mixtral style), a drop-in for the dense GPT-2 MLP:
// a router (linear, no bias; softmax; top-k with k = 1 or 2), experts shaped as GPT-2 MLPs
// (c_fc + GELU, c_proj), a capacity factor with token dropping or a dropless mode, the Switch
// load-balancing loss and the router z-loss.
//
// Parallelism
//   ep  experts split over the expert-parallel group (rank r holds experts [r E/P, (r+1) E/P));
//       each rank routes its own tokens, sends every kept copy to its expert's rank with one
//       all_to_allv (counts first: the kept-per-expert table is all-gathered), and gets the
//       outputs back with the reverse all_to_allv. Arrived rows come grouped by source rank and
//       are regrouped by expert (a row gather) so each local expert's rows are contiguous.
//   tp  each expert's hidden features split over tp as in the dense MLP (c_fc by columns, c_proj
//       by rows); every tp rank routes the same tokens, and the combined partial outputs are
//       all-reduced over tp (sp: the input rows all-gathered first, the output reduce-scattered).
//
// Routing (kernels/moe.hpp): gates are the chosen probabilities (top-1, Switch) or those divided
// by their sum (top-2, normalised as Mixtral does); a capacity of ceil(factor * rows * k / E) per
// expert (per rank, as GShard's groups) keeps the earliest tokens; a dropped copy contributes 0
// (its token goes on through the residual). Dropless: capacity_factor = 0.
//
// Losses, added to the model's loss with weight aux_weight (set by the trainer so that they are a
// mean over microbatches), on each rank's tokens:
//   load balancing  aux_coef * E * sum_e f_e P_e,  f_e = copies routed to e / (rows k) (before
//                   dropping), P_e = mean router probability of e (Switch; Megatron's form for k>1)
//   z-loss          z_coef * mean over rows of logsumexp(logits)^2  (ST-MoE)
// Their gradients enter the router in backward_input. The values of the last forward and the
// tokens routed to each expert since reset_load() are kept for the progress line.
//
// Parameters: "<name>.router.weight" (width, E), replicated; "<name>.experts.c_fc.weight"
// (E, width, hidden), ".c_fc.bias" (E, hidden), ".c_proj.weight" (E, hidden, width),
// ".c_proj.bias" (E, width): this rank's experts (dimension 0) and tp part of hidden.
//
// Saved state per microbatch is data-dependent (how many copies reach this rank's experts), so it
// lives in owning backend buffers, not in the activation arena: saved_bytes() counts only the
// fixed-size part.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "trellis/kernels/moe.hpp"
#include "trellis/nn/linear.hpp"

namespace trellis::nn {

struct MoeConfig {
  int experts = 8;
  int topk = 1;                 // 1 (Switch) or 2 (GShard, Mixtral)
  float capacity_factor = 0.0f; // copies per expert = ceil(factor * rows * k / E); 0: dropless
  float aux_loss_coef = 0.01f;  // Switch load-balancing loss
  float z_loss_coef = 0.0f;     // router z-loss (ST-MoE: 1e-3)

  void check(const std::string& who, int ep_size) const {
    TRELLIS_CHECK(experts >= 1, who, ": ", experts, " experts");
    TRELLIS_CHECK(topk == 1 || topk == 2, who, ": top-", topk, " routing (1 or 2)");
    TRELLIS_CHECK(topk <= experts, who, ": top-", topk, " of ", experts, " experts");
    TRELLIS_CHECK(capacity_factor >= 0.0f && std::isfinite(capacity_factor), who, ": capacity factor ", capacity_factor);
    TRELLIS_CHECK(aux_loss_coef >= 0.0f && z_loss_coef >= 0.0f, who, ": negative loss coefficients");
    TRELLIS_CHECK(ep_size >= 1 && experts % ep_size == 0, who, ": ", experts,
                  " experts do not split evenly over an expert-parallel group of ", ep_size);
  }
  // Copies each expert keeps from `rows` tokens (-1: all).
  index_t capacity(index_t rows) const {
    if (capacity_factor <= 0.0f) return -1;
    return static_cast<index_t>(std::ceil(static_cast<double>(capacity_factor) * rows * topk / experts));
  }
};

// Where an MoE layer's time goes (MoeMlp::set_timing): routing (router GEMMs, softmax / top-k,
// the plan and its count exchange; backward: the router's gradient), dispatch (the permutation and
// the all_to_allv to the experts; backward: back to the tokens), the experts' grouped GEMMs, and
// the combine (outputs back and the weighted sum; backward: the gates' gradient and the dispatch
// of the output gradients).
struct MoePhaseSeconds {
  double route = 0, dispatch = 0, experts = 0, combine = 0;
  double total() const { return route + dispatch + experts + combine; }
};

// The expert-parallel group a layer's experts are split over (nullptr: all experts here).
template <comm::Communicator C>
struct ExpertParallel {
  C* comm = nullptr;
  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
};

namespace detail {
// A parameter of shape (E, ...) holding experts [e0, e0 + El) (Shard(0) over ep) and, along
// `tp_dim` (-1: none), this tp rank's part: a box of the global tensor, so values (counter-based
// init) and checkpoints are the same whatever the ep and tp sizes.
inline Parameter make_expert_parameter(std::string name, std::vector<index_t> shape, int tp_dim, int tp_size,
                                       int tp_rank, index_t e0, index_t local_experts) {
  const ParamSharding on_tp = tp_dim >= 0 ? ParamSharding::tp_sharded(tp_dim) : ParamSharding::replicated();
  Parameter p = make_parameter(std::move(name), shape, {}, on_tp, tp_size, tp_rank);
  p.sharding = ParamSharding::expert(on_tp);
  p.shard_offsets[0] = e0;
  p.shard_shape[0] = local_experts;
  index_t n = 1;
  for (index_t s : p.shard_shape) n *= s;
  p.value = ParamArray(static_cast<std::size_t>(n));
  p.grad = ParamArray(static_cast<std::size_t>(n));
  return p;
}
}  // namespace detail

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class MoeMlp {
 public:
  using act_t = typename B::act_t;

  // name: e.g. "h.1.mlp"; hidden: each expert's hidden width (4 * width in GPT-2).
  MoeMlp(const std::string& name, index_t width, index_t hidden, const MoeConfig& cfg, TensorParallel<C> tp,
         ExpertParallel<C> ep = {}, B be = {})
      : cfg_(cfg), tp_(tp), ep_(ep), be_(std::move(be)), width_(width) {
    tp_.check();
    cfg_.check(name, ep_.size());
    TRELLIS_CHECK(width > 0 && hidden > 0 && hidden % tp_.size() == 0, name, ": hidden ", hidden,
                  " does not split over tp ", tp_.size());
    local_experts_ = cfg_.experts / ep_.size();
    first_expert_ = static_cast<index_t>(ep_.rank()) * local_experts_;
    const index_t E = cfg_.experts;
    const int tps = tp_.size(), tpr = tp_.rank();
    router_ = make_parameter(name + ".router.weight", {width, E});
    w1_ = detail::make_expert_parameter(name + ".experts.c_fc.weight", {E, width, hidden}, 2, tps, tpr, first_expert_, local_experts_);
    b1_ = detail::make_expert_parameter(name + ".experts.c_fc.bias", {E, hidden}, 1, tps, tpr, first_expert_, local_experts_);
    w2_ = detail::make_expert_parameter(name + ".experts.c_proj.weight", {E, hidden, width}, 1, tps, tpr, first_expert_, local_experts_);
    b2_ = detail::make_expert_parameter(name + ".experts.c_proj.bias", {E, width}, -1, tps, tpr, first_expert_, local_experts_);
    hidden_local_ = w1_.shard_shape[2];
    load_.assign(static_cast<std::size_t>(E), 0);
  }

  const MoeConfig& config() const { return cfg_; }
  Parameter& router() { return router_; }
  template <class F> void for_each_parameter(F&& f) {
    f(router_);
    f(w1_);
    f(b1_);
    f(w2_);
    f(b2_);
  }
  // The weight of this layer's auxiliary losses in the total loss (the trainer: 1 / microbatches).
  void set_aux_weight(float w) { aux_weight_ = w; }
  // Of the last forward, unweighted: the load-balancing loss (with its coefficient) and z-loss.
  double aux_loss() const { return last_aux_; }
  double z_loss() const { return last_z_; }
  // Over this rank's training forwards since reset_load(): copies routed to each expert (all E,
  // before dropping), copies dropped, and the sum of both auxiliary losses (unweighted).
  const std::vector<std::int64_t>& load() const { return load_; }
  std::int64_t dropped() const { return dropped_; }
  double loss_sum() const { return loss_sum_; }
  void reset_load() {
    std::fill(load_.begin(), load_.end(), 0);
    dropped_ = 0;
    loss_sum_ = 0;
  }

  // x: (local_rows, width) (sp: this rank's sequence shard) -> y: same shape.
  void forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) { run_forward(tp_, mb, shape, x, y); }

  // Inference (decoding): whole rows on every tp rank whatever the sp option, nothing kept. With
  // ep > 1 every rank of the ep group must call it together (its tokens go to the experts' ranks).
  void infer(index_t rows, const act_t* x, act_t* y) {
    TensorParallel<C> whole = tp_;
    whole.sequence_parallel = false;
    TokenShape shape{1, rows};
    shape.train = false;
    constexpr int inference_mb = -1;
    run_forward(whole, inference_mb, shape, x, y);
    store_.erase(inference_mb);
  }

 private:
  void run_forward(TensorParallel<C>& tp, int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    Saved& s = store_.create(mb);
    const index_t rows = tp.full_rows(shape), local = tp.local_rows(shape), d = width_, E = cfg_.experts;
    const int k = cfg_.topk;
    s.rows = rows;
    // Whole rows: every tp rank routes the same tokens.
    s.x = be_.template allocate<act_t>(static_cast<std::size_t>(rows * d));
    if (tp.sequence_parallel) detail::gather_rows_then(tp, be_, x, local, d, s.x.data(), [](index_t, index_t) {});
    else be_.copy(s.x.data(), x, static_cast<std::size_t>(local * d));

    Phases phases(timing_ ? &times_ : nullptr, be_);
    // Router.
    auto logits = be_.template scratch<float>(static_cast<std::size_t>(rows * E));
    detail::matmul(be_, rows, E, d, s.x.data(), router_op_.of(be_, router_), logits.data());
    s.probs = be_.template allocate<float>(static_cast<std::size_t>(rows * E));
    s.lse = be_.template allocate<float>(static_cast<std::size_t>(rows));
    s.expert = be_.template allocate<std::int32_t>(static_cast<std::size_t>(rows * k));
    s.gate = be_.template allocate<float>(static_cast<std::size_t>(rows * k));
    auto routed = be_.template allocate<std::int32_t>(static_cast<std::size_t>(E));
    auto prob_sums = be_.template allocate<float>(static_cast<std::size_t>(E));
    be_.moe_route_forward(route_args(rows), logits.data(), s.probs.data(), s.lse.data(), s.expert.data(), s.gate.data(),
                          routed.data(), prob_sums.data());
    s.routed = backend::download_vector(be_, routed.data(), routed.size());
    record_losses(s, rows, backend::download_vector(be_, prob_sums.data(), prob_sums.size()),
                  backend::download_vector(be_, s.lse.data(), s.lse.size()));

    // Dispatch plan: kept copies sorted by expert.
    s.slot = be_.template allocate<std::int32_t>(static_cast<std::size_t>(rows * k));
    s.source_row = be_.template allocate<std::int32_t>(static_cast<std::size_t>(std::max<index_t>(rows * k, 1)));
    auto kept = be_.template allocate<std::int32_t>(static_cast<std::size_t>(E));
    be_.moe_dispatch_plan(rows, k, E, cfg_.capacity(rows), s.expert.data(), s.slot.data(), s.source_row.data(), kept.data());
    plan_exchange(s, kept);
    std::int64_t kept_total = 0;
    for (index_t e = 0; e < E; ++e) kept_total += s.kept[static_cast<std::size_t>(e)];
    s.sent = kept_total;
    if (shape.train) {
      s.counted_loss = last_aux_ + last_z_;
      s.counted = true;
      count(s, +1);
    }

    // Permute, send to the experts, regroup by expert.
    phases.next(&MoePhaseSeconds::route);
    auto xp = be_.template scratch<act_t>(static_cast<std::size_t>(s.sent * d));
    be_.gather_rows(s.sent, d, s.x.data(), s.source_row.data(), xp.data());
    s.xe = be_.template allocate<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * d, 1)));
    to_experts(s, xp.data(), s.xe.data(), d);

    phases.next(&MoePhaseSeconds::dispatch);
    // Experts: h = gelu(xe W1_e + b1_e) (pre saved), ye = h W2_e + b2_e (b2 on tp rank 0 only: it
    // enters the tp sum once).
    const index_t H = hidden_local_;
    s.pre = be_.template allocate<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * H, 1)));
    s.h = be_.template allocate<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * H, 1)));
    auto ye = be_.template scratch<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * d, 1)));
    const act_t* w1 = w1_op_.of(be_, w1_);
    const act_t* b1 = b1_op_.of(be_, b1_);
    const act_t* w2 = w2_op_.of(be_, w2_);
    const act_t* b2 = b2_op_.of(be_, b2_);
    using namespace kernels::epilogue;
    experts<BiasGelu<act_t>, act_t>(s, [&](index_t e, index_t row, index_t n) {
      return Group<BiasGelu<act_t>, act_t>{kernels::gemm_args(n, H, d), s.xe.data() + row * d, w1 + e * d * H,
                                           s.h.data() + row * H, {b1 + e * H, s.pre.data() + row * H}};
    });
    auto second = [&](auto ep) {
      using Ep = decltype(ep);
      experts<Ep, act_t>(s, [&](index_t e, index_t row, index_t n) {
        Ep bias{};
        if constexpr (!std::is_same_v<Ep, None>) bias = Ep{b2 + e * d};
        return Group<Ep, act_t>{kernels::gemm_args(n, d, H), s.h.data() + row * H, w2 + e * H * d, ye.data() + row * d, bias};
      });
    };
    if (tp_.rank() == 0) second(Bias<act_t>{});
    else second(None{});
    phases.next(&MoePhaseSeconds::experts);
    // Back to the tokens' ranks, then y = sum over the token's kept copies of gate * output.
    s.yp = be_.template allocate<act_t>(static_cast<std::size_t>(std::max<index_t>(s.sent * d, 1)));
    from_experts(s, ye.data(), s.yp.data(), d);
    detail::produce_then_leave_region(tp, be_, shape, d, y, [&](index_t row0, index_t n, act_t* dst) {
      be_.moe_combine(n, k, d, s.yp.data(), s.slot.data() + row0 * k, s.gate.data() + row0 * k, dst, false);
    });
    phases.next(&MoePhaseSeconds::combine);
  }

 public:

  // dy: (local_rows, width) -> dx: same shape.
  void backward_input(int mb, const TokenShape& shape, const act_t* dy, act_t* dx) {
    Saved& s = store_.at(mb, "MoeMlp::backward_input");
    const index_t rows = s.rows, local = tp_.local_rows(shape), d = width_, E = cfg_.experts, H = hidden_local_;
    const int k = cfg_.topk;
    TRELLIS_CHECK(rows == tp_.full_rows(shape), "MoeMlp::backward_input: token shape differs from forward");
    auto dy_full = be_.template scratch<act_t>(static_cast<std::size_t>(rows * d));
    if (tp_.sequence_parallel) detail::gather_rows_then(tp_, be_, dy, local, d, dy_full.data(), [](index_t, index_t) {});
    else be_.copy(dy_full.data(), dy, static_cast<std::size_t>(local * d));

    Phases phases(timing_ ? &times_ : nullptr, be_);
    // Gates' gradient, and each kept copy's output gradient gate * dy, sent to its expert.
    auto dgate = be_.template scratch<float>(static_cast<std::size_t>(rows * k));
    auto dyp = be_.template scratch<act_t>(static_cast<std::size_t>(std::max<index_t>(s.sent * d, 1)));
    be_.moe_combine_backward(rows, k, d, dy_full.data(), s.yp.data(), s.slot.data(), s.gate.data(), dgate.data(), dyp.data());
    s.yp = {};
    // Under tp each rank's expert outputs are terms of a sum, and so are the gates' gradients.
    if (tp_.size() > 1) tp_.comm->all_reduce(dgate.data(), dgate.data(), dgate.size(), comm::ReduceOp::sum);
    s.dye = be_.template allocate<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * d, 1)));
    to_experts(s, dyp.data(), s.dye.data(), d);

    phases.next(&MoePhaseSeconds::combine);  // the combine's backward, and the dispatch
    // Experts backward: dh = (dye W2_e^T) * gelu'(pre); dxe = dh W1_e^T (a term of the tp sum).
    s.dh = be_.template allocate<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * H, 1)));
    auto dxe = be_.template scratch<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * d, 1)));
    const act_t* w1 = w1_op_.of(be_, w1_);
    const act_t* w2 = w2_op_.of(be_, w2_);
    using namespace kernels::epilogue;
    using kernels::Op;
    experts<DGelu<act_t>, act_t>(s, [&](index_t e, index_t row, index_t n) {
      return Group<DGelu<act_t>, act_t>{kernels::gemm_args(n, H, d, Op::none, Op::transpose), s.dye.data() + row * d,
                                        w2 + e * H * d, s.dh.data() + row * H, {s.pre.data() + row * H}};
    });
    s.pre = {};
    experts<None, act_t>(s, [&](index_t e, index_t row, index_t n) {
      return Group<None, act_t>{kernels::gemm_args(n, d, H, Op::none, Op::transpose), s.dh.data() + row * H,
                                w1 + e * d * H, dxe.data() + row * d, {}};
    });
    phases.next(&MoePhaseSeconds::experts);
    auto dxp = be_.template scratch<act_t>(static_cast<std::size_t>(std::max<index_t>(s.sent * d, 1)));
    from_experts(s, dxe.data(), dxp.data(), d);

    phases.next(&MoePhaseSeconds::dispatch);  // the dispatch's backward: back to the tokens
    // Router: dlogits from the gates' gradient and the two auxiliary losses.
    auto dlogits = be_.template scratch<float>(static_cast<std::size_t>(rows * E));
    auto aux = be_.template allocate<float>(static_cast<std::size_t>(E));
    if (cfg_.aux_loss_coef > 0.0f) {
      // d/dp[r, e] of coef E sum_e f_e P_e, f_e = routed_e / (rows k), P_e = sum_r p[r, e] / rows.
      std::vector<float> g(static_cast<std::size_t>(E));
      for (index_t e = 0; e < E; ++e)
        g[e] = static_cast<float>(aux_weight_ * cfg_.aux_loss_coef * E * s.routed[e] / (double(rows) * rows * k));
      be_.upload(aux.data(), g.data(), g.size());
    }
    const float z_grad = static_cast<float>(aux_weight_ * cfg_.z_loss_coef * 2.0 / rows);
    be_.moe_route_backward(route_args(rows), s.probs.data(), s.lse.data(), s.expert.data(), s.gate.data(), dgate.data(),
                           cfg_.aux_loss_coef > 0.0f ? aux.data() : nullptr, z_grad, dlogits.data());
    s.dlogits = be_.template allocate<act_t>(static_cast<std::size_t>(rows * E));
    be_.convert(s.dlogits.size(), dlogits.data(), s.dlogits.data());

    // dx = (sum over tp of) the experts' input gradients, summed per token, + the router's part
    // (the same on every tp rank, so added after the reduction, to this rank's rows).
    detail::produce_then_leave_region(tp_, be_, shape, d, dx, [&](index_t row0, index_t n, act_t* dst) {
      be_.moe_combine(n, k, d, dxp.data(), s.slot.data() + row0 * k, nullptr, dst, false);
    });
    const index_t first = tp_.first_local_row(shape);
    be_.gemm(kernels::gemm_args(local, d, E, kernels::Op::none, kernels::Op::transpose, 1.0f, 1.0f),
             s.dlogits.data() + first * E, router_op_.of(be_, router_), dx);
    s.backward_done = true;
    phases.next(&MoePhaseSeconds::route);
  }

  // Router and expert weight gradients (fp32, accumulated); frees the microbatch's state.
  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "MoeMlp::backward_weight");
    Phases phases(timing_ ? &times_ : nullptr, be_);
    TRELLIS_CHECK(s.backward_done, "MoeMlp::backward_weight before backward_input (microbatch ", mb, ")");
    const index_t d = width_, E = cfg_.experts, H = hidden_local_;
    detail::matmul_at_acc(be_, d, E, s.rows, s.x.data(), s.dlogits.data(), router_.grad.data());
    using kernels::Op;
    using None = kernels::epilogue::None;
    experts<None, float>(s, [&](index_t e, index_t row, index_t n) {
      return Group<None, float>{kernels::gemm_args(d, H, n, Op::transpose, Op::none, 1.0f, 1.0f), s.xe.data() + row * d,
                                s.dh.data() + row * H, w1_.grad.data() + e * d * H, {}};
    });
    experts<None, float>(s, [&](index_t e, index_t row, index_t n) {
      return Group<None, float>{kernels::gemm_args(H, d, n, Op::transpose, Op::none, 1.0f, 1.0f), s.h.data() + row * H,
                                s.dye.data() + row * d, w2_.grad.data() + e * H * d, {}};
    });
    // Bias gradients: column sums of each expert's rows (b2's from the whole output gradient, the
    // same on every tp rank, like a row-parallel layer's bias).
    for (index_t e = 0, row = 0; e < local_experts_; row += s.expert_rows[e], ++e) {
      const index_t n = s.expert_rows[e];
      if (n == 0) continue;
      be_.column_sums(n, H, H, s.dh.data() + row * H, b1_.grad.data() + e * H);
      be_.column_sums(n, d, d, s.dye.data() + row * d, b2_.grad.data() + e * d);
    }
    phases.next(&MoePhaseSeconds::experts);  // the router's dW too (E columns: small)
    store_.erase(mb);
  }
  // Drops a microbatch's state without gradients. Its forward leaves the statistics again: a
  // recomputed block (forward, release, forward again in its backward) counts each microbatch once.
  void release(int mb) {
    if (store_.contains(mb) && store_.at(mb, "MoeMlp::release").counted) count(store_.at(mb, "MoeMlp::release"), -1);
    store_.erase(mb);
  }

  // Seconds spent per phase (forward and backward together) since timing was switched on: what
  // bench/nn/moe_bench reports. Each phase ends with a backend synchronize(), so this is for
  // measurements only (off by default).
  void set_timing(bool on) {
    timing_ = on;
    times_ = {};
  }
  const MoePhaseSeconds& phase_seconds() const { return times_; }
  std::size_t saved_microbatches() const { return store_.size(); }
  // Scratch the backend's kernels need for microbatches of `shape` (CUB style, asked at set-up):
  // the dispatch plan's sort and scans, and the experts' bias-gradient column sums over the most
  // rows an expert can get (every copy of every ep rank dropless, else the capacity per rank).
  std::size_t workspace_bytes(const TokenShape& shape) const {
    const index_t rows = tp_.full_rows(shape), cap = cfg_.capacity(rows);
    const index_t expert_rows = (cap < 0 ? rows * cfg_.topk : cap) * ep_.size();
    return std::max(be_.moe_dispatch_plan_workspace(rows, cfg_.topk, cfg_.experts),
                    be_.column_sums_workspace(expert_rows, std::max(hidden_local_, width_)));
  }
  void set_saved_memory(SavedMemory<B>) {}
  std::size_t saved_bytes(const TokenShape&) const { return 0; }

 private:
  struct Saved {
    index_t rows = 0;
    bool backward_done = false;
    bool counted = false;    // in load(), dropped() and loss_sum() (a training forward)
    double counted_loss = 0;  // its auxiliary losses there
    std::vector<std::int32_t> routed, kept;  // per expert (all E), this rank's tokens
    std::vector<index_t> expert_rows;        // rows of each local expert after the exchange
    index_t sent = 0, received = 0;          // kept copies of this rank's tokens; copies at its experts
    // all_to_allv layout (elements per row given at the call) and the regroup by expert.
    std::vector<std::size_t> send_rows, send_at, recv_rows, recv_at;
    typename B::template buffer<std::int32_t> by_expert, by_source;  // received row order <-> expert-major
    typename B::template buffer<act_t> x, xe, pre, h, yp, dye, dh, dlogits;
    typename B::template buffer<float> probs, lse, gate;
    typename B::template buffer<std::int32_t> expert, slot, source_row;
  };

  // Wall time between marks, charged to the phase a mark closes (nothing when `to` is null).
  struct Phases {
    MoePhaseSeconds* to;
    const B& be;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    Phases(MoePhaseSeconds* t, const B& b) : to(t), be(b) {
      if (to) be.synchronize(), t0 = std::chrono::steady_clock::now();
    }
    void next(double MoePhaseSeconds::*phase) {
      if (!to) return;
      be.synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      to->*phase += std::chrono::duration<double>(t1 - t0).count();
      t0 = t1;
    }
  };

  template <class Ep, class TC>
  using Group = kernels::GemmGroup<act_t, act_t, TC, Ep>;
  // One grouped GEMM over this rank's experts: member(e, first row, rows) gives expert e's GEMM.
  template <class Ep, class TC, class F>
  void experts(const Saved& s, F&& member) {
    std::vector<Group<Ep, TC>> groups;
    groups.reserve(static_cast<std::size_t>(local_experts_));
    for (index_t e = 0, row = 0; e < local_experts_; row += s.expert_rows[e], ++e)
      groups.push_back(member(e, row, s.expert_rows[e]));
    be_.grouped_gemm(std::span<const Group<Ep, TC>>(groups));
  }

  // Adds (sign +1) or takes back (-1) a training forward's statistics.
  void count(const Saved& s, int sign) {
    std::int64_t kept = 0;
    for (std::size_t e = 0; e < load_.size(); ++e) {
      load_[e] += sign * static_cast<std::int64_t>(s.routed[e]);
      kept += s.kept[e];
    }
    dropped_ += sign * (s.rows * cfg_.topk - kept);
    loss_sum_ += sign * s.counted_loss;
  }

  kernels::MoeRouteArgs route_args(index_t rows) const {
    return kernels::MoeRouteArgs{rows, cfg_.experts, cfg_.topk, cfg_.topk > 1};
  }

  void record_losses(const Saved& s, index_t rows, const std::vector<float>& prob_sums, const std::vector<float>& lse) {
    const index_t E = cfg_.experts;
    double aux = 0.0;
    for (index_t e = 0; e < E; ++e) aux += double(prob_sums[e]) * s.routed[e];
    last_aux_ = rows > 0 ? cfg_.aux_loss_coef * E * aux / (double(rows) * rows * cfg_.topk) : 0.0;
    double z = 0.0;
    for (float v : lse) z += double(v) * v;
    last_z_ = rows > 0 ? cfg_.z_loss_coef * z / rows : 0.0;
  }

  // Counts of the exchange: every rank's kept-per-expert table, all-gathered over ep.
  void plan_exchange(Saved& s, typename B::template buffer<std::int32_t>& kept) {
    const int P = ep_.size(), me = ep_.rank();
    const index_t E = cfg_.experts, El = local_experts_;
    std::vector<std::int32_t> table;  // (P, E)
    if (P > 1) {
      auto all = be_.template allocate<std::int32_t>(static_cast<std::size_t>(P * E));
      ep_.comm->all_gather(kept.data(), all.data(), static_cast<std::size_t>(E));
      table = backend::download_vector(be_, all.data(), all.size());
    } else {
      table = backend::download_vector(be_, kept.data(), kept.size());
    }
    s.kept.assign(table.begin() + me * E, table.begin() + (me + 1) * E);
    s.send_rows.assign(P, 0), s.send_at.assign(P, 0), s.recv_rows.assign(P, 0), s.recv_at.assign(P, 0);
    for (int q = 0; q < P; ++q)
      for (index_t e = q * El; e < (q + 1) * El; ++e) s.send_rows[q] += s.kept[e];
    for (int q = 1; q < P; ++q) s.send_at[q] = s.send_at[q - 1] + s.send_rows[q - 1];
    // From source q: its copies for my experts, expert by expert.
    auto count = [&](int q, index_t e) { return static_cast<index_t>(table[q * E + me * El + e]); };
    for (int q = 0; q < P; ++q)
      for (index_t e = 0; e < El; ++e) s.recv_rows[q] += count(q, e);
    for (int q = 1; q < P; ++q) s.recv_at[q] = s.recv_at[q - 1] + s.recv_rows[q - 1];
    s.received = P > 0 ? static_cast<index_t>(s.recv_at[P - 1] + s.recv_rows[P - 1]) : 0;
    s.expert_rows.assign(El, 0);
    for (int q = 0; q < P; ++q)
      for (index_t e = 0; e < El; ++e) s.expert_rows[e] += count(q, e);
    if (P == 1) return;
    // by_expert[i] = arrival position of expert-major row i; by_source is its inverse.
    std::vector<std::int32_t> by_expert(static_cast<std::size_t>(s.received)), by_source(by_expert.size());
    std::size_t i = 0;
    for (index_t e = 0; e < El; ++e)
      for (int q = 0; q < P; ++q) {
        index_t at = static_cast<index_t>(s.recv_at[q]);
        for (index_t f = 0; f < e; ++f) at += count(q, f);
        for (index_t r = 0; r < count(q, e); ++r, ++i) {
          by_expert[i] = static_cast<std::int32_t>(at + r);
          by_source[static_cast<std::size_t>(at + r)] = static_cast<std::int32_t>(i);
        }
      }
    s.by_expert = be_.template allocate<std::int32_t>(std::max<std::size_t>(by_expert.size(), 1));
    s.by_source = be_.template allocate<std::int32_t>(std::max<std::size_t>(by_source.size(), 1));
    be_.upload(s.by_expert.data(), by_expert.data(), by_expert.size());
    be_.upload(s.by_source.data(), by_source.data(), by_source.size());
  }

  // This rank's kept copies (expert-sorted, `sent` rows) -> rows at this rank's experts,
  // expert-major (`received` rows); and back.
  void to_experts(const Saved& s, const act_t* sorted, act_t* expert_major, index_t cols) {
    if (ep_.size() == 1) {
      be_.copy(expert_major, sorted, static_cast<std::size_t>(s.sent * cols));
      return;
    }
    auto arrived = be_.template scratch<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * cols, 1)));
    exchange(sorted, s.send_rows, s.send_at, arrived.data(), s.recv_rows, s.recv_at, cols);
    be_.gather_rows(s.received, cols, arrived.data(), s.by_expert.data(), expert_major);
  }
  void from_experts(const Saved& s, const act_t* expert_major, act_t* sorted, index_t cols) {
    if (ep_.size() == 1) {
      be_.copy(sorted, expert_major, static_cast<std::size_t>(s.sent * cols));
      return;
    }
    auto leaving = be_.template scratch<act_t>(static_cast<std::size_t>(std::max<index_t>(s.received * cols, 1)));
    be_.gather_rows(s.received, cols, expert_major, s.by_source.data(), leaving.data());
    exchange(leaving.data(), s.recv_rows, s.recv_at, sorted, s.send_rows, s.send_at, cols);
  }
  void exchange(const act_t* in, const std::vector<std::size_t>& in_rows, const std::vector<std::size_t>& in_at, act_t* out,
                const std::vector<std::size_t>& out_rows, const std::vector<std::size_t>& out_at, index_t cols) {
    auto scaled = [&](const std::vector<std::size_t>& v) {
      std::vector<std::size_t> r(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) r[i] = v[i] * static_cast<std::size_t>(cols);
      return r;
    };
    const auto sc = scaled(in_rows), sd = scaled(in_at), rc = scaled(out_rows), rd = scaled(out_at);
    ep_.comm->all_to_allv(in, std::span<const std::size_t>(sc), std::span<const std::size_t>(sd), out,
                          std::span<const std::size_t>(rc), std::span<const std::size_t>(rd));
  }

  MoeConfig cfg_;
  TensorParallel<C> tp_;
  ExpertParallel<C> ep_;
  B be_;
  index_t width_ = 0, hidden_local_ = 0, local_experts_ = 0, first_expert_ = 0;
  Parameter router_, w1_, b1_, w2_, b2_;
  Operand<B> router_op_, w1_op_, b1_op_, w2_op_, b2_op_;
  MicrobatchStore<Saved> store_;
  float aux_weight_ = 1.0f;
  double last_aux_ = 0.0, last_z_ = 0.0, loss_sum_ = 0.0;
  std::vector<std::int64_t> load_;
  std::int64_t dropped_ = 0;
  bool timing_ = false;
  MoePhaseSeconds times_;
};

}  // namespace trellis::nn
