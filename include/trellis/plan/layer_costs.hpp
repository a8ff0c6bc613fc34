// The time of each piece of a GPT training step on one device, the pieces plan::predict_step
// (plan/cost_model.hpp, where the whole model is described) puts together: the rates a device
// works at (plan::Rates: from a cluster file here, or timed, plan/measured_rates.hpp), the
// collectives' times on a link, and one microbatch's forward, input-gradient and weight-gradient
// times of a transformer block (dense or Mixture-of-Experts), the embedding and the LM head on
// one tp rank, with the tp, cp and ep communication inside them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/plan/cluster.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::plan {

// The operand layouts of the layers' GEMMs (row-major; the speed differs with them): nn, a linear
// layer's forward y = x w (+ bias); nt, its input gradient dy w^T (and the LM head's logits
// x wte^T); tn, its weight gradient dw += x^T dy.
enum class GemmForm { nn, nt, tn };

// Seconds a device takes for the kinds of work a GPT step is made of.
struct Rates {
  std::function<double(double m, double n, double k, GemmForm form)> gemm;  // C[m,n] from A[m,k], B[k,n]
  // Causal attention over `heads` heads of `seq` positions and head size d, `batch` sequences.
  std::function<double(double batch, double heads, double seq, double d)> attention_forward, attention_backward;
  std::function<double(double rows, double dim, bool backward)> layernorm;
  std::function<double(double n, bool backward)> gelu;
  // The LM head's cross-entropy over rows x cols logits: forward (max, sum of exponentials,
  // target) or backward (the softmax gradient written in place).
  std::function<double(double rows, double cols, bool backward)> cross_entropy;
  std::function<double(double bytes)> memory;  // any other memory-bound pass touching `bytes`
  std::function<double(double n)> adamw;       // the AdamW update of n parameters (values, grads, moments)
  // The offloaded optimizer (TrainerConfig::offload_optimizer): AdamW of n parameters on the host's
  // CPU, and `bytes` copied between device and host memory (one direction). Empty: adamw and
  // memory(2 bytes) -- the host backends, where the host is the device and a copy reads and writes.
  std::function<double(double n)> host_adamw;
  std::function<double(double bytes)> host_copy;
  // Bytes of memory traffic a rank's compute pays per byte its dp collectives put on the wire:
  // 0 where a copy engine or NIC moves them (cluster_rates), about 2 (read + write) where the
  // processor copies them itself -- thread ranks, whose collectives are memcpy on the same cores.
  double collective_copy_bytes = 0;
  // Devices that share one machine and slow each other down (thread ranks on one CPU's cores):
  // shared_by is how many of a node's devices computed at once when these rates were timed (1:
  // none, as on GPUs), alone the rates of one device computing by itself on it (null: the same).
  // predict_step charges a pipeline's actions between the two (see the header).
  int shared_by = 1;
  std::shared_ptr<const Rates> alone;
};

enum class Precision { fp32, bf16 };

// Rates from a cluster file: FLOPs over peak x efficiency, bytes over memory bandwidth.
// Causal attention does 2 b h T^2 d FLOP forward (half of QK^T and PV) and 2.5x that backward.
inline Rates cluster_rates(const Cluster& c, Precision p = Precision::bf16) {
  const double peak = p == Precision::bf16 ? c.device.peak_flops_bf16 : c.device.peak_flops_fp32;
  const double gemm_rate = peak * c.gemm_efficiency, attention_rate = peak * c.attention_efficiency;
  const double bw = c.device.memory_bandwidth;
  Rates r;
  r.gemm = [=](double m, double n, double k, GemmForm) { return 2 * m * n * k / gemm_rate; };
  r.attention_forward = [=](double b, double h, double t, double d) { return 2 * b * h * t * t * d / attention_rate; };
  r.attention_backward = [=](double b, double h, double t, double d) { return 5 * b * h * t * t * d / attention_rate; };
  r.layernorm = [=](double rows, double dim, bool bwd) { return (bwd ? 4.0 : 2.0) * 4 * rows * dim / bw; };
  r.gelu = [=](double n, bool bwd) { return (bwd ? 3.0 : 2.0) * 4 * n / bw; };
  r.cross_entropy = [=](double rows, double cols, bool bwd) { return (bwd ? 2.0 : 3.0) * 4 * rows * cols / bw; };
  r.memory = [=](double bytes) { return bytes / bw; };
  r.adamw = [=](double n) { return 28 * n / bw; };  // read value, gradient, 2 moments; write 3 (fp32)
  const double host_bw = c.host_memory_bandwidth, host_link = c.host_link_bandwidth;
  r.host_adamw = [=](double n) { return 28 * n / host_bw; };  // the same passes over host memory
  r.host_copy = [=](double bytes) { return bytes / host_link; };
  return r;
}

// Collectives on a link of bus bandwidth `l` (the nccl-tests convention, as comm::SimulatedLink).
inline double all_reduce_seconds(const Link& l, double bytes, int n) {
  return n <= 1 ? 0.0 : l.latency + 2.0 * (n - 1) / n * bytes / l.bandwidth;
}
// all-gather (bytes: the gathered output) or reduce-scatter (bytes: the full input)
inline double gather_seconds(const Link& l, double bytes, int n) {
  return n <= 1 ? 0.0 : l.latency + static_cast<double>(n - 1) / n * bytes / l.bandwidth;
}
inline double send_seconds(const Link& l, double bytes) { return l.latency + bytes / l.bandwidth; }
// all-to-all (bytes: one rank's whole send buffer, n blocks, its own included): (n - 1)/n of it
// crosses the link, as comm::SimulatedLink charges it (comm::wire::all_to_all)
inline double all_to_all_seconds(const Link& l, double bytes, int n) { return gather_seconds(l, bytes, n); }

// `pieces` equal transfers of total duration `total` on one link, ready one by one at even
// intervals over a window of `window` seconds (the last at its end): the time the last finishes
// after the window ends.
inline double exposed_after(double window, double total, int pieces) {
  if (total <= 0 || pieces < 1) return 0.0;
  const double each = total / pieces;
  double free_at = 0;
  for (int j = 1; j <= pieces; ++j) free_at = std::max(free_at, window * j / pieces) + each;
  return std::max(0.0, free_at - window);
}

// F, B and W of one microbatch through some layers on one tp rank, seconds.
struct PassTimes {
  double forward = 0, backward_input = 0, backward_weight = 0;
  double total() const { return forward + backward_input + backward_weight; }
  PassTimes& operator+=(const PassTimes& o) {
    forward += o.forward;
    backward_input += o.backward_input;
    backward_weight += o.backward_weight;
    return *this;
  }
};

namespace detail {

struct Shape {  // the sizes the formulas need, as doubles
  double W, H, d, V, L, P, tp, dp, pp, R, T, b;
  double cp = 1;  // context parallel: R = b T / cp rows; attention by the ring (zig-zag balanced)
  double u = 1;   // Ulysses' all-to-all group: 1 (ring), cp (ulysses) or cp_ulysses (hybrid); cp / u ring members
  bool sp;
  int chunks = 1;  // tp overlap: the row chunks of each tp collective (1: none; overlap_chunks_of)
};

// The chunks each tp collective of `c` is cut into: options.overlap_chunks, as the layers cut
// them (nn::detail::effective_chunks: at most one per row of what is split -- this rank's R / tp
// rows under sp, all R rows otherwise); 1 without tp, where the layers do not chunk.
inline int overlap_chunks_of(double K, double tp, double R, bool sp) {
  if (tp <= 1 || K <= 1) return 1;
  return static_cast<int>(std::max(1.0, std::min(K, std::floor(sp ? R / tp : R))));
}

// The shape of one microbatch of `c` on one rank (b: the batch's mean rows per dp rank).
inline Shape shape_of(const train::TrainerConfig& c) {
  const auto& m = c.model;
  Shape s{};
  s.W = static_cast<double>(m.width);
  s.H = static_cast<double>(m.heads);
  s.d = s.W / s.H;
  s.V = static_cast<double>(m.vocab);
  s.L = static_cast<double>(m.layers);
  s.P = static_cast<double>(m.positions);
  s.tp = c.tp;
  s.dp = c.dp;
  s.pp = c.pp;
  s.b = static_cast<double>(c.batch) / (c.dp * c.microbatches);
  s.T = static_cast<double>(c.seq);
  s.cp = c.cp;
  s.u = c.cp <= 1 ? 1 : c.cp_mode == nn::CpMode::ulysses ? c.cp : c.cp_mode == nn::CpMode::hybrid ? c.cp_ulysses : 1;
  s.R = s.b * s.T / s.cp;
  s.sp = c.options.sequence_parallel && c.tp > 1;
  s.chunks = overlap_chunks_of(c.options.overlap_chunks, s.tp, s.R, s.sp);
  return s;
}

// TP overlap (options.overlap_chunks = K > 1), from what nn/tensor_parallel.hpp does. Each tp
// collective of a layer is cut into K row chunks (equal here; the trainer's differ by a row at
// most) and paired with the GEMM on the other side of it:
//   - produce-then-reduce (all-reduce: the row-parallel forward, the column-parallel input
//     gradient; reduce-scatter under sp): chunk j's GEMM, then its collective started async, then
//     chunk j+1's GEMM; all waited at the end;
//   - gather-then-compute (all-gather under sp: a column-parallel forward, a row-parallel input
//     gradient, the LM head's logits): chunk j+1's gather started, chunk j waited, copied from its
//     staging buffer into place and computed.
// One communicator's transfers run one after another (NCCL's stream order, comm::SimulatedLink's
// queue), and compute does not wait for the link, so with g one chunk's compute and c one chunk's
// collective (latency + its share of the bytes: K latencies in all) a section takes
//     g + (K - 1) max(g, c) + c
// in both directions: the first chunk's compute (or collective) is not hidden, each further step
// is the longer of the two, the last collective (or compute) is not hidden. K = 1: g + c, the
// K = 1 model's GEMM plus collective. Under sp a chunk's compute is tp GEMMs of R / (tp K) rows
// (one per rank's block of rows), plus, for a gather, the copy out of staging (2 x 4 R W / K
// bytes); without sp one GEMM of R / K rows. Each GEMM is charged at its own shape
// (Rates::gemm), so measured rates give the smaller GEMMs' lower efficiency; peak rates
// (cluster_rates) give none.
inline double chunk_pipeline(double g, double c, int K) { return g + (K - 1) * std::max(g, c) + c; }

// One overlapped section at K chunks, against the K = 1 model's terms for it (`whole`: its GEMM
// over all rows): the compute added (K chunks' compute - whole: efficiency loss, staging copies)
// and the communication left exposed (the pipeline - K chunks' compute).
struct OverlapTimes {
  double compute = 0, comm = 0;
  OverlapTimes& operator+=(const OverlapTimes& o) {
    compute += o.compute;
    comm += o.comm;
    return *this;
  }
};
inline OverlapTimes overlap_section(double whole, double g, double c, int K) {
  return {K * g - whole, chunk_pipeline(g, c, K) - K * g};
}

// Mixture of Experts (nn/moe.hpp): an MoE block's MLP on one rank. `copies`: the copies of this
// rank's tokens it sends to the experts and, routing balanced, the copies its experts receive: R k,
// or where a capacity factor cuts them E x capacity (each expert R k / E from each source, at most
// its capacity). Routing imbalance is not modelled: a real router's busiest expert gets more (up
// to the capacity with one; dropless, without bound), and the grouped GEMM waits for it.
struct MoeShape {
  double E = 0, k = 1, El = 0;  // experts, top-k, experts on this rank (E / ep)
  int ep = 1;
  double copies = 0;
};
inline MoeShape moe_shape_of(const train::TrainerConfig& c, const Shape& s) {
  const auto& m = c.model;
  MoeShape e;
  e.E = static_cast<double>(m.experts);
  e.k = static_cast<double>(m.moe_topk);
  e.ep = c.ep;
  e.El = e.E / c.ep;
  e.copies = s.R * e.k;
  if (c.options.moe_capacity > 0.0f) {
    const double cap = static_cast<double>(c.options.moe(m).capacity(static_cast<index_t>(std::llround(s.R))));
    e.copies = std::min(e.copies, e.E * std::min(cap, s.R));
  }
  return e;
}

// The MoE MLP of one block, one microbatch of R rows (whole rows: under sp gathered first), on
// one tp rank, from what MoeMlp does (each expert's hidden 4W split over tp, H = 4W / tp):
//   F  the router GEMM (R x E from W); routing (softmax, top-k, the dispatch plan: memory passes
//      over R x E and R x k); the kept copies gathered (copies x W) and sent to the experts'
//      ranks (ep > 1: the kept-per-expert counts all-gathered over ep, an all-to-all of copies x W
//      and a regroup by expert; ep = 1: a copy); the grouped GEMM: each of the El local experts
//      copies / El rows, W -> H (bias, GELU) and H -> W; back to the tokens (a regroup, the
//      reverse all-to-all); the gate-weighted combine into R x W; tp: the input gathered (sp)
//      and the output all-reduced (sp: reduce-scattered), as the dense MLP's.
//   B  dy gathered (sp) or copied; the combine's backward; dispatch, the experts' input
//      gradients (H from W with dGELU, W from H; nt), back, the router's softmax/top-k backward
//      and its input gradient (this rank's rows x W from E); the gates' gradient all-reduced
//      over tp (R x k), dx all-reduced (sp: reduce-scattered). No re-gather for W: the layer
//      keeps its whole input.
//   W  the router's dW (W x E over R) and each expert's dW1, dW2 (over its rows), the bias sums.
// ep's all-to-alls (2 in F, 2 in B, each one rank's copies x W x 4 bytes, all_to_all_seconds on
// the ep group's link) block the layer: on the critical path; their time goes to *ep_f, *ep_b,
// the tp collectives' to *tp_f, *tp_b (all counted in the returned times too). The grouped GEMM
// is charged as El GEMMs at their own shape (Rates::gemm: the host backend runs it as such).
// tp overlap chunks: the MoE layer's tp collectives are charged whole (not chunked here).
inline PassTimes moe_mlp_times(const Shape& s, const MoeShape& e, const Rates& r, const Link& tp_link, const Link& ep_link,
                               double* tp_f, double* tp_b, double* ep_f, double* ep_b) {
  const double R = s.R, W = s.W, t = s.tp, H = 4 * W / t, E = e.E, k = e.k, n = e.copies;
  const double Rn = s.sp ? R / t : R;
  const double rows = n / e.El;  // per local expert
  PassTimes p;
  // the copies to the experts and back: ep = 1 a copy; ep > 1 a regroup (row gather) + an all-to-all
  const double move = r.memory(4 * 2 * n * W);
  const double a2a = e.ep > 1 ? all_to_all_seconds(ep_link, 4 * n * W, e.ep) : 0.0;
  const double counts = e.ep > 1 ? gather_seconds(ep_link, 4 * E * e.ep, e.ep) : 0.0;
  double f = 0, b = 0, w = 0;
  f += r.gemm(R, E, W, GemmForm::nn);                                 // router logits
  f += r.memory(4 * (2 * R * W + 3 * R * E + R + 4 * R * k));         // x kept whole; softmax, top-k, plan
  f += r.memory(4 * 2 * n * W) + move + move;                         // gathered in expert order; to and from the experts
  f += e.El * (r.gemm(rows, H, W, GemmForm::nn) + r.gemm(rows, W, H, GemmForm::nn)) + r.gelu(n * H, false);
  f += r.memory(4 * (n * W + R * W));                                 // the combine
  b += r.memory(4 * (2 * R * W + R * W + 2 * n * W + R * k));         // dy kept whole; the combine's backward
  b += move + move;
  b += e.El * (r.gemm(rows, H, W, GemmForm::nt) + r.gemm(rows, W, H, GemmForm::nt)) + r.gelu(n * H, true);
  b += r.memory(4 * (6 * R * E + 2 * R * k)) + r.memory(4 * (n * W + R * W));  // router backward; dx combined
  b += r.gemm(Rn, W, E, GemmForm::nt);                                // the router's input gradient
  w += r.gemm(W, E, R, GemmForm::tn) + e.El * (r.gemm(W, H, rows, GemmForm::tn) + r.gemm(H, W, rows, GemmForm::tn));
  w += r.memory(4 * n * (H + W));                                      // bias sums
  double cf = 0, cb = 0;
  if (t > 1) {
    const int tn = static_cast<int>(t);
    const double bytes = 4 * R * W;
    cf = s.sp ? 2 * gather_seconds(tp_link, bytes, tn) : all_reduce_seconds(tp_link, bytes, tn);
    cb = (s.sp ? 2 * gather_seconds(tp_link, bytes, tn) : all_reduce_seconds(tp_link, bytes, tn)) +
         all_reduce_seconds(tp_link, 4 * R * k, tn);
  }
  // ep: the counts and two all-to-alls in F, two in B; where the device copies them itself
  // (thread ranks), their bytes cost memory traffic too
  const double ef = counts + 2 * a2a, eb = 2 * a2a;
  const double copy_traffic = e.ep > 1 ? r.memory(r.collective_copy_bytes * 2 * (e.ep - 1.0) / e.ep * 4 * n * W) : 0.0;
  p.forward = f + ef + copy_traffic;
  p.backward_input = b + eb + copy_traffic;
  p.backward_weight = w;
  *tp_f += cf;
  *tp_b += cb;
  *ep_f += ef;
  *ep_b += eb;
  return p;
}

// One block on one tp rank, one microbatch of R rows (b sequences of T): compute and tp comm.
// cp_link: the ring's (the cp / u ring members at stride tp u); a2a_link: Ulysses' all-to-all's
// (u ranks at stride tp; null: cp_link).
inline PassTimes block_times(const Shape& s, const Rates& r, const Link& tp_link, const Link& cp_link, bool recompute,
                             double* comm, const Link* a2a_link = nullptr, const MoeShape* moe = nullptr,
                             const Link* ep_link = nullptr, double* ep_comm = nullptr) {
  const double R = s.R, W = s.W, t = s.tp;
  const double Rn = s.sp ? R / t : R;  // rows of the norm/residual region on this rank
  PassTimes p;
  // GEMMs: qkv (W -> 3W/t), attention projection (W/t -> W), MLP up (W -> 4W/t), down (4W/t -> W);
  // an MoE block has the first two (its MLP: moe_mlp_times)
  const double outs[4] = {3 * W / t, W, 4 * W / t, W}, ins[4] = {W, W / t, W, 4 * W / t};
  const int linears = moe ? 2 : 4;
  for (int i = 0; i < linears; ++i) {
    p.forward += r.gemm(R, outs[i], ins[i], GemmForm::nn);
    p.backward_input += r.gemm(R, ins[i], outs[i], GemmForm::nt);
    p.backward_weight += r.gemm(ins[i], outs[i], R, GemmForm::tn);
  }
  // context parallel: g = cp / u ring members (u: Ulysses' group, 1 for the plain ring), each
  // attending heads / (tp u) heads. A member's g steps each attend its T/g queries to T/g keys (the
  // zig-zag halves of the off-diagonal blocks make each step about a causal block of T/g: 1/g of
  // the causal work in all, at the efficiency of blocks that size), merging the partial outputs
  // after each step (dK, dV accumulated in B). As nn/ring_attention.hpp runs it (one link: its
  // hops in turn): in F the next step's K and V travel during a step's compute (g - 1 hops); in B
  // the first remote block's K and V travel during the member's own diagonal blocks (half a step),
  // each middle step carries the next K, V in and the last accumulator (dK, dV) out during its
  // compute, and the last accumulator goes home during the own off-diagonal blocks (the other
  // half). What the compute a hop runs beside does not cover is exposed; where the device copies
  // them itself, the hops cost memory traffic too. A hybrid member holds u R rows of W / (tp u)
  // columns: the same bytes as a plain ring member's.
  // Ulysses (g = 1): one call over the whole sequence.
  const double heads = s.H / t / s.u, g_ring = s.cp / s.u;
  const double Tl = s.T / g_ring;
  const double attn_f = g_ring * r.attention_forward(s.b, heads, Tl, s.d),
               attn_b = g_ring * r.attention_backward(s.b, heads, Tl, s.d);
  p.forward += attn_f;
  p.backward_input += attn_b;
  if (g_ring > 1) {
    const double kv = 2 * 4 * R * W / t;  // this member's K and V (or their dK, dV sums), bytes
    const double hop = send_seconds(cp_link, kv), step_f = attn_f / g_ring, step_b = attn_b / g_ring;
    const double ring_f = (g_ring - 1) * std::max(0.0, hop - step_f);
    const double ring_b = 2 * std::max(0.0, hop - step_b / 2) + (g_ring - 2) * std::max(0.0, 2 * hop - step_b);
    p.forward += ring_f + r.memory((g_ring - 1) * (4 * 3 * R * W / t + r.collective_copy_bytes * kv));
    p.backward_input += ring_b + r.memory((g_ring - 1) * (2 * kv + r.collective_copy_bytes * 2 * kv));
  }
  if (s.u > 1) {
    // Ulysses' exchange (nn/ulysses.hpp, nn/attention.hpp): F all-to-alls q, k, v (one call, 3
    // tensors) before the attention and the output after; B dO before and dQ, dK, dV after. Each
    // rank sends its whole R x 3W/tp (or R x W/tp) buffer, (u - 1)/u of it over the link; the
    // calls block (the attention waits for its input, the projection for its rows), so they are
    // on the critical path. Each of the 4 tensors per pass is copied twice more than without
    // Ulysses (packed per destination, put in sequence order, besides the head layout).
    const int u = static_cast<int>(s.u);
    const Link& link = a2a_link ? *a2a_link : cp_link;
    const double one = 4 * R * W / t;  // one tensor of this rank's rows and heads, bytes
    const double a2a = all_to_all_seconds(link, 3 * one, u) + all_to_all_seconds(link, one, u);
    const double copies = r.memory(4 * 2 * 2 * one + r.collective_copy_bytes * (s.u - 1) / s.u * 4 * one);
    p.forward += a2a + copies;
    p.backward_input += a2a + copies;
  }
  // the norms and GELU; other memory passes (fp32 bytes read + written): F, 2 residual adds and
  // the block input's copy over Rn x W, each linear's input saved (R x (2W + 5W/t)), q/k/v/o
  // between row and head layouts (R x 4W/t each way); B, the residual gradients' adds, each
  // linear's output gradient saved (R x (2W + 7W/t)), the head layouts again; W, the bias sums.
  // (an MoE block: the attention's linears only, W + W/t inputs and W + 3W/t outputs; no GELU here)
  const double linear_in = moe ? W + W / t : 2 * W + 5 * W / t, linear_out = moe ? W + 3 * W / t : 2 * W + 7 * W / t;
  p.forward += 2 * r.layernorm(Rn, W, false) + (moe ? 0.0 : r.gelu(R * 4 * W / t, false));
  p.backward_input += 2 * r.layernorm(Rn, W, true) + (moe ? 0.0 : r.gelu(R * 4 * W / t, true));
  p.forward += r.memory(4 * (2 * 3 * Rn * W + 2 * Rn * W + 2 * R * linear_in + 8 * R * W / t));
  p.backward_input += r.memory(4 * (2 * 3 * Rn * W + 2 * R * linear_out + 8 * R * W / t));
  p.backward_weight += r.memory(4 * R * linear_out);
  double c_f = 0, c_b = 0;
  const double sublayers = moe ? 1 : 2;  // the tp collectives of the attention and the dense MLP
  if (t > 1) {
    const double bytes = 4 * R * W;
    const int n = static_cast<int>(t);
    if (s.sp) {
      c_f = 2 * sublayers * gather_seconds(tp_link, bytes, n);  // gather before attention and MLP, scatter after
      c_b = 3 * sublayers * gather_seconds(tp_link, bytes, n);  // the same, plus the inputs gathered again for W
    } else {
      c_f = sublayers * all_reduce_seconds(tp_link, bytes, n);
      c_b = sublayers * all_reduce_seconds(tp_link, bytes, n);
    }
  }
  if (s.chunks > 1) {  // tp overlap: each collective's section becomes a chunk pipeline (chunk_pipeline)
    const int K = s.chunks, n = static_cast<int>(t);
    const double bytes = 4 * R * W;
    // section i's GEMM (m = rows, the operand widths a x b), whole and one chunk's
    auto section = [&](double a, double b, GemmForm form, bool gather) {
      const double whole = r.gemm(R, a, b, form);
      const double g = s.sp ? t * r.gemm(R / (t * K), a, b, form) + (gather ? r.memory(2 * 4 * R * W / K) : 0.0)
                            : r.gemm(R / K, a, b, form);
      const double c = s.sp ? gather_seconds(tp_link, bytes / K, n) : all_reduce_seconds(tp_link, bytes / K, n);
      return overlap_section(whole, g, c, K);
    };
    OverlapTimes f, b;
    if (s.sp) {
      // F: c_attn and c_fc gather their input (i = 0, 2), attn.c_proj and mlp.c_proj reduce-scatter
      // their output (1, 3); B: the row-parallel layers gather dy (3, 1), the column-parallel ones
      // reduce-scatter dx (2, 0) -- and gather their input again for W, one whole all-gather
      // started before the chunks and not chunked: charged as at K = 1.
      for (int i = 0; i < linears; ++i) {
        f += section(outs[i], ins[i], GemmForm::nn, i % 2 == 0);
        b += section(ins[i], outs[i], GemmForm::nt, i % 2 == 1);
      }
      c_b = sublayers * gather_seconds(tp_link, bytes, n);
    } else {
      // F: the row-parallel forwards all-reduce (attn.c_proj, mlp.c_proj: i = 1, 3); B: the
      // column-parallel input gradients (c_fc, c_attn: 2, 0)
      for (int i : {1, 3})
        if (i < linears) f += section(outs[i], ins[i], GemmForm::nn, false);
      for (int i : {0, 2})
        if (i < linears) b += section(ins[i], outs[i], GemmForm::nt, false);
      c_b = 0;
    }
    c_f = f.comm;
    c_b += b.comm;
    p.forward += f.compute;
    p.backward_input += b.compute;
  }
  double e_f = 0, e_b = 0;  // the MoE MLP's ep all-to-alls
  if (moe) {
    double m_f = 0, m_b = 0;
    p += moe_mlp_times(s, *moe, r, tp_link, ep_link ? *ep_link : tp_link, &m_f, &m_b, &e_f, &e_b);
    c_f += m_f;
    c_b += m_b;
  }
  p.forward += c_f;
  p.backward_input += c_b;
  if (recompute) p.backward_input += p.forward;
  if (comm) *comm += c_f + c_b + (recompute ? c_f : 0);
  if (ep_comm) *ep_comm += e_f + e_b + (recompute ? e_f : 0);
  return p;
}

inline PassTimes embedding_times(const Shape& s, const Rates& r, const Link& tp_link, double* comm) {
  PassTimes p;
  p.forward = r.memory(4 * 3 * s.R * s.W);
  p.backward_weight = r.memory(4 * 3 * s.R * s.W);
  if (s.tp > 1) {  // vocab-parallel: partial rows summed (sp: reduce-scattered)
    double c = s.sp ? gather_seconds(tp_link, 4 * s.R * s.W, static_cast<int>(s.tp))
                    : all_reduce_seconds(tp_link, 4 * s.R * s.W, static_cast<int>(s.tp));
    if (s.chunks > 1) {  // overlap: chunks of the lookup (2 x 4 R W bytes of the above) and of the sum
      const int K = s.chunks, n = static_cast<int>(s.tp);
      const double bytes = 4 * s.R * s.W / K;  // one chunk's
      const double piece = s.sp ? gather_seconds(tp_link, bytes, n) : all_reduce_seconds(tp_link, bytes, n);
      const OverlapTimes o = overlap_section(r.memory(2 * 4 * s.R * s.W), r.memory(2 * 4 * s.R * s.W / K), piece, K);
      p.forward += o.compute;
      c = o.comm;
    }
    p.forward += c;
    if (comm) *comm += c;
  }
  return p;
}

inline PassTimes head_times(const Shape& s, const Rates& r, const Link& tp_link, double* comm) {
  const double R = s.R, W = s.W, Vl = s.V / s.tp;
  const double Rn = s.sp ? R / s.tp : R;
  PassTimes p;
  p.forward = r.gemm(R, Vl, W, GemmForm::nt) + r.layernorm(Rn, W, false) + r.cross_entropy(R, Vl, false);
  p.backward_input = r.gemm(R, W, Vl, GemmForm::nn) + r.layernorm(Rn, W, true) + r.cross_entropy(R, Vl, true);
  p.backward_weight = r.gemm(Vl, W, R, GemmForm::tn);
  if (s.tp > 1) {
    const int n = static_cast<int>(s.tp);
    double f = (s.sp ? gather_seconds(tp_link, 4 * R * W, n) : 0.0) + 3 * all_reduce_seconds(tp_link, 4 * R, n);
    double b = s.sp ? gather_seconds(tp_link, 4 * R * W, n) : all_reduce_seconds(tp_link, 4 * R * W, n);
    if (s.chunks > 1) {  // overlap (chunk_pipeline): sp, the logits over gathered chunks; the input
      // gradient's chunks reduced (sp: reduce-scattered); the loss's small all-reduces are whole
      const int K = s.chunks, t = n;
      const double bytes = 4 * R * W / K;  // one chunk's
      const double piece = s.sp ? gather_seconds(tp_link, bytes, n) : all_reduce_seconds(tp_link, bytes, n);
      if (s.sp) {
        const double g = t * r.gemm(R / (t * K), Vl, W, GemmForm::nt) + r.memory(2 * bytes);
        const OverlapTimes o = overlap_section(r.gemm(R, Vl, W, GemmForm::nt), g, piece, K);
        p.forward += o.compute;
        f = o.comm + 3 * all_reduce_seconds(tp_link, 4 * R, n);
      }
      const double g = s.sp ? t * r.gemm(R / (t * K), W, Vl, GemmForm::nn) : r.gemm(R / K, W, Vl, GemmForm::nn);
      const OverlapTimes o = overlap_section(r.gemm(R, W, Vl, GemmForm::nn), g, piece, K);
      p.backward_input += o.compute;
      b = o.comm;
    }
    p.forward += f;
    p.backward_input += b;
    if (comm) *comm += f + b;
  }
  return p;
}

// Parameters one tp rank of a stage holds: blocks (12W^2/t + 7W/t + 6W), embedding (V/t + positions) x W,
// ln_f 2W; a block's share is what ZeRO-3 gathers.
inline double block_params(const Shape& s) { return 12 * s.W * s.W / s.tp + 7 * s.W / s.tp + 6 * s.W; }
// The same, parameter by parameter in packing order (nn::GptModel::weight_unit_parameters: the
// block's for_each_parameter reversed): the MLP's c_proj bias and weight, c_fc's, ln_2's bias and
// weight, attention's c_proj, c_attn, ln_1's. ZeRO's buckets are cut from this list.
inline std::vector<double> block_parameter_sizes(const Shape& s) {
  const double W = s.W, t = s.tp;
  return {W, 4 * W * W / t, 4 * W / t, 4 * W * W / t, W, W, W, W * W / t, 3 * W / t, 3 * W * W / t, W, W};
}
// An MoE block's: dense (attention, norms, the router W x E: 4W^2/t + 3W/t + 5W + W E) and its
// experts' on this rank (E/ep of c_fc, c_proj and their biases: El (8W^2/t + 4W/t + W)).
struct BlockParams {
  double dense = 0, expert = 0;
  double total() const { return dense + expert; }
};
inline BlockParams moe_block_params(const Shape& s, const MoeShape& e) {
  return {4 * s.W * s.W / s.tp + 3 * s.W / s.tp + 5 * s.W + s.W * e.E, e.El * (8 * s.W * s.W / s.tp + 4 * s.W / s.tp + s.W)};
}

}  // namespace detail

}  // namespace trellis::plan
