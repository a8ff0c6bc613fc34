// tp overlap chunks (TrainerConfig::options.overlap_chunks, train_gpt --overlap K) in the cost
// model (plan/cost_model.hpp, detail::chunk_pipeline): K = 1 is the model as it was before overlap
// was modelled, bit for bit (a frozen copy of those functions below); K = 2, 4 equal the chunk
// pipeline computed by hand from known GEMM and link rates.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <vector>

#include "trellis/plan/search.hpp"

using namespace trellis;

namespace {

// ---- the per-microbatch functions of plan/cost_model.hpp as they were before tp overlap chunks
// were modelled (git: the commit before this test), copied unchanged: the K = 1 reference ----
namespace before_overlap {
using plan::GemmForm;
using plan::Link;
using plan::PassTimes;
using plan::Rates;
using plan::all_reduce_seconds;
using plan::gather_seconds;
using plan::send_seconds;
using plan::detail::Shape;

// One block on one tp rank, one microbatch of R rows (b sequences of T): compute and tp comm.
PassTimes block_times(const Shape& s, const Rates& r, const Link& tp_link, const Link& cp_link, bool recompute,
                             double* comm) {
  const double R = s.R, W = s.W, t = s.tp;
  const double Rn = s.sp ? R / t : R;  // rows of the norm/residual region on this rank
  PassTimes p;
  // GEMMs: qkv (W -> 3W/t), attention projection (W/t -> W), MLP up (W -> 4W/t), down (4W/t -> W)
  const double outs[4] = {3 * W / t, W, 4 * W / t, W}, ins[4] = {W, W / t, W, 4 * W / t};
  for (int i = 0; i < 4; ++i) {
    p.forward += r.gemm(R, outs[i], ins[i], GemmForm::nn);
    p.backward_input += r.gemm(R, ins[i], outs[i], GemmForm::nt);
    p.backward_weight += r.gemm(ins[i], outs[i], R, GemmForm::tn);
  }
  const double heads = s.H / t;
  // context parallel: a ring member's cp steps each attend its T/cp queries to T/cp keys (the
  // zig-zag halves of the off-diagonal blocks make each step about a causal block of T/cp: 1/cp of
  // the causal work in all, at the efficiency of blocks that size), merging the partial outputs
  // after each step (dK, dV accumulated in B). K and V go round the ring (cp - 1 hops) in F, K, V,
  // dK and dV in B, each hop during the next step's compute: what that compute does not cover is
  // exposed; where the device copies them itself, the hops cost memory traffic too.
  const double Tl = s.T / s.cp;
  const double attn_f = s.cp * r.attention_forward(s.b, heads, Tl, s.d), attn_b = s.cp * r.attention_backward(s.b, heads, Tl, s.d);
  p.forward += attn_f;
  p.backward_input += attn_b;
  if (s.cp > 1) {
    const double kv = 2 * 4 * R * W / t;  // this member's K and V, bytes
    // (the ring's hops as nn/ring_attention.hpp overlaps them, updated after the freeze)
    const double hop = send_seconds(cp_link, kv), step_f = attn_f / s.cp, step_b = attn_b / s.cp;
    const double ring_f = (s.cp - 1) * std::max(0.0, hop - step_f);
    const double ring_b = 2 * std::max(0.0, hop - step_b / 2) + (s.cp - 2) * std::max(0.0, 2 * hop - step_b);
    p.forward += ring_f + r.memory((s.cp - 1) * (4 * 3 * R * W / t + r.collective_copy_bytes * kv));
    p.backward_input += ring_b + r.memory((s.cp - 1) * (2 * kv + r.collective_copy_bytes * 2 * kv));
  }
  // the norms and GELU; other memory passes (fp32 bytes read + written): F, 2 residual adds and
  // the block input's copy over Rn x W, each linear's input saved (R x (2W + 5W/t)), q/k/v/o
  // between row and head layouts (R x 4W/t each way); B, the residual gradients' adds, each
  // linear's output gradient saved (R x (2W + 7W/t)), the head layouts again; W, the bias sums.
  p.forward += 2 * r.layernorm(Rn, W, false) + r.gelu(R * 4 * W / t, false);
  p.backward_input += 2 * r.layernorm(Rn, W, true) + r.gelu(R * 4 * W / t, true);
  p.forward += r.memory(4 * (2 * 3 * Rn * W + 2 * Rn * W + 2 * R * (2 * W + 5 * W / t) + 8 * R * W / t));
  p.backward_input += r.memory(4 * (2 * 3 * Rn * W + 2 * R * (2 * W + 7 * W / t) + 8 * R * W / t));
  p.backward_weight += r.memory(4 * R * (2 * W + 7 * W / t));
  double c_f = 0, c_b = 0;
  if (t > 1) {
    const double bytes = 4 * R * W;
    const int n = static_cast<int>(t);
    if (s.sp) {
      c_f = 4 * gather_seconds(tp_link, bytes, n);  // gather before attention and MLP, scatter after
      c_b = 6 * gather_seconds(tp_link, bytes, n);  // the same, plus the inputs gathered again for W
    } else {
      c_f = 2 * all_reduce_seconds(tp_link, bytes, n);
      c_b = 2 * all_reduce_seconds(tp_link, bytes, n);
    }
  }
  p.forward += c_f;
  p.backward_input += c_b;
  if (recompute) p.backward_input += p.forward;
  if (comm) *comm += c_f + c_b + (recompute ? c_f : 0);
  return p;
}

PassTimes embedding_times(const Shape& s, const Rates& r, const Link& tp_link, double* comm) {
  PassTimes p;
  p.forward = r.memory(4 * 3 * s.R * s.W);
  p.backward_weight = r.memory(4 * 3 * s.R * s.W);
  if (s.tp > 1) {  // vocab-parallel: partial rows summed (sp: reduce-scattered)
    const double c = s.sp ? gather_seconds(tp_link, 4 * s.R * s.W, static_cast<int>(s.tp))
                          : all_reduce_seconds(tp_link, 4 * s.R * s.W, static_cast<int>(s.tp));
    p.forward += c;
    if (comm) *comm += c;
  }
  return p;
}

PassTimes head_times(const Shape& s, const Rates& r, const Link& tp_link, double* comm) {
  const double R = s.R, W = s.W, Vl = s.V / s.tp;
  const double Rn = s.sp ? R / s.tp : R;
  PassTimes p;
  p.forward = r.gemm(R, Vl, W, GemmForm::nt) + r.layernorm(Rn, W, false) + r.cross_entropy(R, Vl, false);
  p.backward_input = r.gemm(R, W, Vl, GemmForm::nn) + r.layernorm(Rn, W, true) + r.cross_entropy(R, Vl, true);
  p.backward_weight = r.gemm(Vl, W, R, GemmForm::tn);
  if (s.tp > 1) {
    const int n = static_cast<int>(s.tp);
    const double f = (s.sp ? gather_seconds(tp_link, 4 * R * W, n) : 0.0) + 3 * all_reduce_seconds(tp_link, 4 * R, n);
    const double b = s.sp ? gather_seconds(tp_link, 4 * R * W, n) : all_reduce_seconds(tp_link, 4 * R * W, n);
    p.forward += f;
    p.backward_input += b;
    if (comm) *comm += f + b;
  }
  return p;
}


}  // namespace before_overlap

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool same_bits(const plan::PassTimes& a, const plan::PassTimes& b) {
  return same_bits(a.forward, b.forward) && same_bits(a.backward_input, b.backward_input) &&
         same_bits(a.backward_weight, b.backward_weight);
}

// one node of `devices`: tp groups on the intra-node link
plan::Cluster node(int devices, double bandwidth = 1e10, double latency = 5e-6) {
  plan::Cluster c;
  c.name = "one node";
  c.nodes = 1;
  c.devices_per_node = devices;
  c.device = {.name = "test", .memory_bytes = 64e9, .peak_flops_fp32 = 1e12, .peak_flops_bf16 = 4e12,
              .memory_bandwidth = 1e11};
  c.intra_node = c.inter_node = {.bandwidth = bandwidth, .latency = latency};
  return c;
}

train::TrainerConfig small_model() {
  train::TrainerConfig c;
  c.model = {.vocab = 512, .positions = 128, .layers = 4, .heads = 8, .width = 256};
  c.seq = 128;
  c.batch = 16;
  return c;
}

// Rates whose GEMM costs `overhead` per call plus its FLOPs at `flops` per second (so K smaller
// GEMMs cost (K - 1) overheads more, as a measured rate would charge them); memory passes at
// `bandwidth` (0: free); everything else free.
plan::Rates hand_rates(double flops, double overhead, double bandwidth) {
  plan::Rates r;
  r.gemm = [=](double m, double n, double k, plan::GemmForm) { return overhead + 2 * m * n * k / flops; };
  r.attention_forward = r.attention_backward = [](double, double, double, double) { return 0.0; };
  r.layernorm = [](double, double, bool) { return 0.0; };
  r.gelu = [](double, bool) { return 0.0; };
  r.cross_entropy = [](double, double, bool) { return 0.0; };
  r.memory = [=](double bytes) { return bandwidth > 0 ? bytes / bandwidth : 0.0; };
  r.adamw = [](double) { return 0.0; };
  return r;
}

}  // namespace

TEST_CASE("tp overlap: K = 1 predicts exactly what the model did before overlap was modelled", "[cost][overlap]") {
  // every layout of a small model on 4 devices (tp 1, 2, 4; sp; recompute; cp ring; pp schedules;
  // ZeRO) at K = 1, on peak rates and on rates with a per-GEMM overhead: the per-microbatch times
  // and tp communication bit for bit, and predict_step's stages built from them
  const plan::Cluster cl = node(4);
  for (const plan::Rates& r : {plan::cluster_rates(cl, plan::Precision::fp32), hand_rates(1e12, 2e-6, 5e10)}) {
    plan::SearchSpace space;
    space.max_microbatches = 4;
    space.overlap_chunks = {1};
    // the dimensions added since (Ulysses and hybrid cp, hybrid sharding, offload) are off: the
    // frozen copy predates them
    space.cp_modes = {nn::CpMode::ring};
    space.shard_degrees = false;
    space.offload_optimizer = {false};
    int checked = 0;
    for (const auto& c : plan::layouts(small_model(), cl.devices(), 4, space)) {
      if (!train::config_problems(c).empty()) continue;
      REQUIRE(c.options.overlap_chunks == 1);
      const plan::detail::Shape s = plan::detail::shape_of(c);
      const plan::Link& tp_link = cl.link(1, c.tp);
      const plan::Link& cp_link = cl.link(c.tp, c.cp);
      double comm = 0, comm_ref = 0;
      const plan::PassTimes block = plan::detail::block_times(s, r, tp_link, cp_link, c.options.recompute, &comm);
      const plan::PassTimes block_ref =
          before_overlap::block_times(s, r, tp_link, cp_link, c.options.recompute, &comm_ref);
      const plan::PassTimes emb = plan::detail::embedding_times(s, r, tp_link, &comm);
      const plan::PassTimes emb_ref = before_overlap::embedding_times(s, r, tp_link, &comm_ref);
      const plan::PassTimes head = plan::detail::head_times(s, r, tp_link, &comm);
      const plan::PassTimes head_ref = before_overlap::head_times(s, r, tp_link, &comm_ref);
      INFO(plan::train_gpt_flags(c));
      CHECK(same_bits(block, block_ref));
      CHECK(same_bits(emb, emb_ref));
      CHECK(same_bits(head, head_ref));
      CHECK(same_bits(comm, comm_ref));
      if (c.pp == 1) {  // one stage: the blocks, the embedding and the head, summed as predict_step does
        plan::PassTimes t;
        for (index_t i = 0; i < c.model.layers; ++i) t += block_ref;
        t += emb_ref;
        t += head_ref;
        const plan::StepCost cost = plan::predict_step(c, cl, r);
        REQUIRE(cost.stage.size() == 1);
        CHECK(same_bits(cost.stage[0], t));
      }
      ++checked;
    }
    CHECK(checked > 300);
  }
  // K > 1 on one tp rank: the layers chunk nothing (n == 1), and neither does the model
  train::TrainerConfig c = small_model();
  c.dp = 4;
  const plan::Cluster four = node(4);
  const plan::Rates r = plan::cluster_rates(four, plan::Precision::fp32);
  const plan::StepCost k1 = plan::predict_step(c, four, r);
  c.options.overlap_chunks = 4;
  CHECK(same_bits(plan::predict_step(c, four, r).step, k1.step));
}

TEST_CASE("tp overlap: K = 2, 4 equal the chunk pipeline by hand", "[cost][overlap]") {
  // tp 2 on a link of 10 GB/s (bus) and 5 us; GEMMs at 1e12 FLOP/s plus 1 us per call; rows
  // R = 4 x 128 = 512, width 256, vocab 512: a row-parallel attention projection's chunk is
  // link-bound (33.6 / K us of GEMM against 5 + 52.4 / K us of all-reduce), the MLP's
  // compute-bound (134 / K us against the same).
  const double F = 1e12, alpha = 1e-6, bw = 1e10, lat = 5e-6, t = 2;
  const double R = 512, W = 256, V = 512, bytes = 4 * R * W;
  const plan::Link link{.bandwidth = bw, .latency = lat};
  auto G = [&](double m, double n, double k) { return alpha + 2 * m * n * k / F; };
  auto all_reduce = [&](double b) { return lat + 2 * (t - 1) / t * b / bw; };
  auto gather = [&](double b) { return lat + (t - 1) / t * b / bw; };  // all-gather / reduce-scatter of b in all
  // K chunks of compute g and collective c, transfers serialised on the link, compute not waiting
  // for it: the first chunk's compute, then K - 1 steps of the longer, then the last collective
  auto pipeline = [](double g, double c, int K) { return g + (K - 1) * std::max(g, c) + c; };

  for (int K : {2, 4}) {
    INFO("K = " << K);
    for (double memory_bw : {0.0, 2e10}) {  // staging copies free, then at 20 GB/s
      INFO("memory bandwidth " << memory_bw);
      const plan::Rates r = hand_rates(F, alpha, memory_bw);
      train::TrainerConfig c = small_model();
      c.tp = 2;
      c.dp = 1;
      c.batch = 4;  // one microbatch of 4 x 128 rows
      c.options.overlap_chunks = K;
      const plan::Cluster two = node(2, bw, lat);
      const plan::Link& tp_link = two.link(1, 2);
      REQUIRE(tp_link == link);

      // without sp: the row-parallel forwards (attn.c_proj W/t -> W, mlp.c_proj 4W/t -> W) and the
      // column-parallel input gradients (c_fc, c_attn) each all-reduce K chunks of R / K rows
      c.options.sequence_parallel = false;
      plan::detail::Shape s = plan::detail::shape_of(c);
      REQUIRE(s.chunks == K);
      double comm = 0;
      plan::PassTimes p = plan::detail::block_times(s, r, tp_link, tp_link, false, &comm);
      // the memory passes (residuals, saved copies, head layouts) are the same at every K: the
      // block at K = 1 minus its GEMMs and all-reduces leaves them
      train::TrainerConfig c1 = c;
      c1.options.overlap_chunks = 1;
      auto block_of = [&](const train::TrainerConfig& x) {
        return plan::detail::block_times(plan::detail::shape_of(x), r, tp_link, tp_link, false, nullptr);
      };
      const plan::PassTimes p1 = block_of(c1);
      const double mem_f = p1.forward - (G(R, 3 * W / t, W) + G(R, W, W / t) + G(R, 4 * W / t, W) + G(R, W, 4 * W / t) +
                                         2 * all_reduce(bytes));
      const double mem_b = p1.backward_input - (G(R, W, 3 * W / t) + G(R, W / t, W) + G(R, W, 4 * W / t) +
                                                G(R, 4 * W / t, W) + 2 * all_reduce(bytes));
      if (memory_bw == 0) {
        CHECK(mem_f == Approx(0).margin(1e-15));
        CHECK(mem_b == Approx(0).margin(1e-15));
      }
      const double attn_f = pipeline(G(R / K, W, W / t), all_reduce(bytes / K), K);
      const double mlp_f = pipeline(G(R / K, W, 4 * W / t), all_reduce(bytes / K), K);
      CHECK(G(R / K, W, W / t) < all_reduce(bytes / K));      // link-bound
      CHECK(G(R / K, W, 4 * W / t) > all_reduce(bytes / K));  // compute-bound
      CHECK(p.forward == Approx(mem_f + G(R, 3 * W / t, W) + G(R, 4 * W / t, W) + attn_f + mlp_f).epsilon(1e-12));
      const double fc_b = pipeline(G(R / K, W, 4 * W / t), all_reduce(bytes / K), K);
      const double attn_b = pipeline(G(R / K, W, 3 * W / t), all_reduce(bytes / K), K);
      CHECK(p.backward_input == Approx(mem_b + G(R, W / t, W) + G(R, 4 * W / t, W) + fc_b + attn_b).epsilon(1e-12));
      CHECK(p.backward_weight == p1.backward_weight);
      // the exposed communication: each pipeline less its K chunks' compute
      const double exposed = attn_f - K * G(R / K, W, W / t) + mlp_f - K * G(R / K, W, 4 * W / t) + fc_b -
                             K * G(R / K, W, 4 * W / t) + attn_b - K * G(R / K, W, 3 * W / t);
      CHECK(comm == Approx(exposed).epsilon(1e-12));

      // the head without sp: its input gradient (d logits x wte, V/t -> W) all-reduced in K chunks
      double head_comm = 0;
      const plan::PassTimes h = plan::detail::head_times(s, r, tp_link, &head_comm);
      const plan::PassTimes h1 = plan::detail::head_times(plan::detail::shape_of(c1), r, tp_link, nullptr);
      CHECK(h.forward == h1.forward);  // the logits need no collective; the loss's small all-reduces are whole
      const double head_b = pipeline(G(R / K, W, V / t), all_reduce(bytes / K), K);
      CHECK(h.backward_input - h1.backward_input == Approx(head_b - G(R, W, V / t) - all_reduce(bytes)).epsilon(1e-9));
      // the embedding: the lookup (2 x 4 R W bytes) and the sum in K chunks
      const double lookup = memory_bw > 0 ? 2 * 4 * R * W / memory_bw : 0.0;
      const plan::PassTimes e = plan::detail::embedding_times(s, r, tp_link, nullptr);
      const plan::PassTimes e1 = plan::detail::embedding_times(plan::detail::shape_of(c1), r, tp_link, nullptr);
      CHECK(e.forward - e1.forward ==
            Approx(pipeline(lookup / K, all_reduce(bytes / K), K) - lookup - all_reduce(bytes)).epsilon(1e-9));

      // with sp: every block GEMM's section is chunked (F: gather before c_attn and c_fc, reduce-
      // scatter after the projections; B: gather dy before the projections' dX, reduce-scatter
      // after c_fc's and c_attn's), a chunk being t GEMMs of R / (t K) rows (one per rank's rows)
      // plus, for a gather, the copy out of staging; the two whole re-gathers of B stay as at K = 1
      c.options.sequence_parallel = true;
      c1.options.sequence_parallel = true;
      s = plan::detail::shape_of(c);
      REQUIRE(s.chunks == K);
      const plan::PassTimes q = block_of(c);
      const plan::PassTimes q1 = block_of(c1);
      const double copy = memory_bw > 0 ? 2 * 4 * (R / K) * W / memory_bw : 0.0;
      auto chunk = [&](double n, double k, bool gathers) { return t * G(R / (t * K), n, k) + (gathers ? copy : 0.0); };
      const double sp_mem_f = q1.forward - (G(R, 3 * W / t, W) + G(R, W, W / t) + G(R, 4 * W / t, W) +
                                            G(R, W, 4 * W / t) + 4 * gather(bytes));
      const double sp_mem_b = q1.backward_input - (G(R, W, 3 * W / t) + G(R, W / t, W) + G(R, W, 4 * W / t) +
                                                   G(R, 4 * W / t, W) + 6 * gather(bytes));
      const double c_chunk = gather(bytes / K);
      CHECK(q.forward == Approx(sp_mem_f + pipeline(chunk(3 * W / t, W, true), c_chunk, K) +
                                pipeline(chunk(W, W / t, false), c_chunk, K) +
                                pipeline(chunk(4 * W / t, W, true), c_chunk, K) +
                                pipeline(chunk(W, 4 * W / t, false), c_chunk, K))
                             .epsilon(1e-12));
      CHECK(q.backward_input == Approx(sp_mem_b + 2 * gather(bytes) + pipeline(chunk(4 * W / t, W, true), c_chunk, K) +
                                       pipeline(chunk(W, 4 * W / t, false), c_chunk, K) +
                                       pipeline(chunk(W / t, W, true), c_chunk, K) +
                                       pipeline(chunk(W, 3 * W / t, false), c_chunk, K))
                                    .epsilon(1e-12));
      // recompute: B runs the (chunked) forward again
      const plan::PassTimes qr = plan::detail::block_times(s, r, tp_link, tp_link, true, nullptr);
      CHECK(qr.backward_input == Approx(q.backward_input + q.forward).epsilon(1e-12));

      // predict_step: one stage of 4 blocks, the embedding and the head, at this K
      const plan::StepCost cost = plan::predict_step(c, two, r);
      REQUIRE(cost.stage.size() == 1);
      const plan::PassTimes he = plan::detail::head_times(s, r, tp_link, nullptr);
      const plan::PassTimes em = plan::detail::embedding_times(s, r, tp_link, nullptr);
      CHECK(cost.stage[0].forward == Approx(4 * q.forward + he.forward + em.forward).epsilon(1e-12));
    }
  }
}

TEST_CASE("tp overlap: chunks as the layers cut them", "[cost][overlap]") {
  // nn::detail::effective_chunks: at most one chunk per row of what is split (this rank's R / tp
  // rows under sp); no chunks on one tp rank
  CHECK(plan::detail::overlap_chunks_of(4, 2, 512, false) == 4);
  CHECK(plan::detail::overlap_chunks_of(4, 2, 6, true) == 3);  // 3 rows per rank under sp
  CHECK(plan::detail::overlap_chunks_of(4, 1, 512, false) == 1);
  CHECK(plan::detail::overlap_chunks_of(1, 4, 512, true) == 1);
  // the search's K: tp > 1, and K dividing those rows (equal chunks, as the model takes them)
  train::TrainerConfig c = small_model();
  c.tp = 2;
  c.dp = 2;
  c.microbatches = 8;  // 1 row x 128 positions per microbatch
  CHECK(plan::overlap_fits(c, 4));
  c.options.sequence_parallel = true;
  CHECK(plan::overlap_fits(c, 4));  // 64 rows per rank
  c.seq = 12;                       // 6 rows per rank under sp
  c.model.positions = 12;
  CHECK(plan::overlap_fits(c, 2));
  CHECK_FALSE(plan::overlap_fits(c, 4));
  c.tp = 1;
  c.options.sequence_parallel = false;
  CHECK_FALSE(plan::overlap_fits(c, 2));  // train_gpt refuses --overlap > 1 without tp
  CHECK(plan::overlap_fits(c, 1));
}
