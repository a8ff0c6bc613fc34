// Mixture of Experts in the planner: the cost model's MoE MLP against FLOPs and link times worked
// out by hand for a small shape, the dp traffic of expert and dense gradients on their own groups'
// links (parameter counts by hand, tied to the memory model, which tests/plan/test_memory_model.cpp
// ties to Trainer::memory()), and plan::search over ep against its exhaustive loop, with the
// flags train_gpt parses back.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "train_gpt/flags.hpp"
#include "train_gpt_problems.hpp"
#include "trellis/plan/search.hpp"

using namespace trellis;

namespace {

// GEMMs at `flops` FLOP/s, everything else free: the compute is the FLOP count.
plan::Rates gemm_only(double flops) {
  plan::Rates r;
  r.gemm = [=](double m, double n, double k, plan::GemmForm) { return 2 * m * n * k / flops; };
  r.attention_forward = r.attention_backward = [](double, double, double, double) { return 0.0; };
  r.layernorm = [](double, double, bool) { return 0.0; };
  r.gelu = [](double, bool) { return 0.0; };
  r.cross_entropy = [](double, double, bool) { return 0.0; };
  r.memory = [](double) { return 0.0; };
  r.adamw = [](double) { return 0.0; };
  return r;
}

// nodes x per_node devices; the intra- and inter-node links given.
plan::Cluster cluster(int nodes, int per_node, plan::Link intra, plan::Link inter) {
  plan::Cluster c;
  c.name = "moe test";
  c.nodes = nodes;
  c.devices_per_node = per_node;
  c.device = {.name = "test", .memory_bytes = 64e9, .peak_flops_fp32 = 1e12, .peak_flops_bf16 = 4e12,
              .memory_bandwidth = 1e11};
  c.intra_node = intra;
  c.inter_node = inter;
  return c;
}

// W 32, 4 heads, vocab 64, 4 layers (blocks 0 and 2: 4 experts, top-2), T 16, batch 8.
train::TrainerConfig moe_model() {
  train::TrainerConfig c;
  c.model = {.vocab = 64, .positions = 16, .layers = 4, .heads = 4, .width = 32};
  c.model.moe_every = 2;
  c.model.experts = 4;
  c.model.moe_topk = 2;
  c.seq = 16;
  c.batch = 8;
  return c;
}

}  // namespace

TEST_CASE("MoE cost: the MoE MLP's FLOPs and ep all-to-alls by hand", "[cost][moe]") {
  const plan::Rates r = gemm_only(1e9);
  const plan::Link tp_link{.bandwidth = 2e9, .latency = 3e-6}, ep_link{.bandwidth = 1e9, .latency = 1e-5};
  struct Case {
    const char* name;
    int tp, ep, topk;
    float capacity;
    double copies;  // copies sent (= received, routing balanced) per rank, by hand
  };
  // 64 rows per rank (dp2: 4 sequences of 16). Dropless: 64 x k copies. Capacity 0.5, top-2:
  // ceil(0.5 x 64 x 2 / 4) = 16 per expert, 4 x 16 = 64 kept of 128. Capacity 2: 64 per expert
  // (all of them), 128.
  const Case cases[] = {{"tp1 ep2 top-2 dropless", 1, 2, 2, 0.0f, 128},
                        {"tp1 ep2 top-2 capacity 0.5", 1, 2, 2, 0.5f, 64},
                        {"tp1 ep1 top-1 dropless", 1, 1, 1, 0.0f, 64},
                        {"tp2 ep2 top-2 capacity 2", 2, 2, 2, 2.0f, 128}};
  for (const Case& k : cases) {
    INFO(k.name);
    train::TrainerConfig c = moe_model();
    c.dp = 2;
    c.tp = k.tp;
    c.ep = k.ep;
    c.model.moe_topk = k.topk;
    c.options.moe_capacity = k.capacity;
    const plan::detail::Shape s = plan::detail::shape_of(c);
    const plan::detail::MoeShape e = plan::detail::moe_shape_of(c, s);
    REQUIRE(s.R == 64);
    CHECK(e.copies == k.copies);
    CHECK(e.El == 4.0 / k.ep);
    double tp_f = 0, tp_b = 0, ep_f = 0, ep_b = 0;
    const plan::PassTimes p = plan::detail::moe_mlp_times(s, e, r, tp_link, ep_link, &tp_f, &tp_b, &ep_f, &ep_b);
    // FLOPs: the router 2 R W E (F: logits, B: the input gradient, W: its weight gradient); the
    // experts, whatever their split over ranks, 2 GEMMs of 2 x copies x W x H each per pass (H the
    // hidden width on this tp rank, 4 W / tp)
    const double R = 64, W = 32, E = 4, n = k.copies, H = 4 * W / k.tp;
    const double router = 2 * R * W * E, experts = 2 * (2 * n * W * H);
    // ep: the kept-per-expert counts all-gathered (E int32 per rank) and 2 all-to-alls of each
    // rank's copies x W floats in F, 2 in B: latency + (ep - 1)/ep x bytes / bandwidth each
    const double a2a = k.ep > 1 ? 1e-5 + (k.ep - 1.0) / k.ep * (4 * n * W) / 1e9 : 0.0;
    const double counts = k.ep > 1 ? 1e-5 + (k.ep - 1.0) / k.ep * (4 * E * k.ep) / 1e9 : 0.0;
    // tp: the output all-reduced in F (R x W floats, ring: 2 (t - 1)/t x bytes / bandwidth); in B
    // dx, and the gates' gradient (R x k floats)
    auto ar = [&](double bytes) { return k.tp > 1 ? 3e-6 + 2.0 * (k.tp - 1) / k.tp * bytes / 2e9 : 0.0; };
    const double tf = ar(4 * R * W), tb = ar(4 * R * W) + ar(4 * R * k.topk);
    CHECK(p.forward == Approx(router / 1e9 + experts / 1e9 + counts + 2 * a2a).epsilon(1e-12));
    CHECK(p.backward_input == Approx(router / 1e9 + experts / 1e9 + 2 * a2a).epsilon(1e-12));
    CHECK(p.backward_weight == Approx(router / 1e9 + experts / 1e9).epsilon(1e-12));
    CHECK(ep_f == Approx(counts + 2 * a2a).margin(1e-18));
    CHECK(ep_b == Approx(2 * a2a).margin(1e-18));
    CHECK(tp_f == Approx(tf).margin(1e-18));
    CHECK(tp_b == Approx(tb).margin(1e-18));
  }
}

TEST_CASE("MoE cost: predict_step puts the all-to-alls on the ep group's link, expert gradients on their replicas'",
          "[cost][moe]") {
  // dp4 x tp2 on 2 nodes of 4: tp at stride 1, dp at stride 2. The ep group (ep2: dp ranks 0, 1 =
  // ranks 0, 2) sits in a node; an expert's replicas (dp 0 and 2 = ranks 0, 4) span both, as do
  // the dp replicas (ranks 0, 2, 4, 6).
  const plan::Link intra{.bandwidth = 4e9, .latency = 2e-6}, inter{.bandwidth = 5e8, .latency = 3e-5};
  const plan::Cluster cl = cluster(2, 4, intra, inter);
  train::TrainerConfig c = moe_model();
  c.dp = 4;
  c.tp = 2;
  c.ep = 2;
  c.overlap_dp = false;  // every bucket after the schedule: the dp time is the reductions' sum
  c.microbatches = 2;
  const plan::Rates free = gemm_only(1e300);  // no compute: what is left is communication
  // parameters on a tp rank, by hand: an MoE block's dense part (attention 3 W^2/2 + 3 W/2 and
  // W^2/2 + W, 2 norms 4 W, the router W x E) and its 2 local experts (c_fc W x 2W + 2W, c_proj
  // 2W x W + W); a dense block 12 W^2/2 + 7 W/2 + 6 W; wte 32 x W rows, wpe 16 x W, ln_f 2 W.
  const double W = 32, moe_dense = 1536 + 48 + 512 + 32 + 128 + 128, moe_expert = 2 * (2048 + 64 + 2048 + 32);
  const double dense_block = 6 * 1024 + 7 * 16 + 6 * 32;
  const double dense = 2 * moe_dense + 2 * dense_block + (32 + 16) * W + 2 * W, expert = 2 * moe_expert;
  // the same count as the memory model's (no padding at these sizes), which equals the trainer's
  const plan::MemoryEstimate mem = plan::predict_memory(c, 0);
  CHECK(mem.parameters == 4 * (dense + expert));
  for (int zero : {0, 1}) {
    INFO("ZeRO-" << zero);
    c.zero = zero;
    const plan::StepCost cost = plan::predict_step(c, cl, free);
    // ep: per MoE block and microbatch the counts' all-gather and 4 all-to-alls, intra-node
    const double rows = 8.0 / 4 / 2 * 16, copies = rows * 2;
    const double a2a = intra.latency + 0.5 * 4 * copies * W / intra.bandwidth;
    const double counts = intra.latency + 0.5 * 4 * 4 * 2 / intra.bandwidth;
    CHECK(cost.ep_comm == Approx(2 * 2 * (counts + 4 * a2a)).epsilon(1e-12));
    // dp: the dense gradients over the 4 replicas, the experts' over their 2, both inter-node
    // (ZeRO-0 all-reduce; ZeRO-1 a reduce-scatter and, after the update, an all-gather)
    const double dp = zero == 0 ? (inter.latency + 2 * 0.75 * 4 * dense / inter.bandwidth) +
                                      (inter.latency + 2 * 0.5 * 4 * expert / inter.bandwidth)
                                : 2 * ((inter.latency + 0.75 * 4 * dense / inter.bandwidth) +
                                       (inter.latency + 0.5 * 4 * expert / inter.bandwidth));
    CHECK(cost.dp_exposed == Approx(dp).epsilon(1e-12));
  }
  // without ep the all-to-alls go and the experts (all 4 on every rank) reduce over all 4 replicas
  c.ep = 1;
  c.zero = 0;
  const plan::StepCost one = plan::predict_step(c, cl, free);
  CHECK(one.ep_comm == 0);
  CHECK(one.dp_exposed ==
        Approx((inter.latency + 2 * 0.75 * 4 * dense / inter.bandwidth) +
               (inter.latency + 2 * 0.75 * 4 * 2 * expert / inter.bandwidth)).epsilon(1e-12));
}

TEST_CASE("MoE search: ep searched, equal to the exhaustive loop; train_gpt takes the flags", "[search][moe]") {
  // one node of 4 on a slow link: expert gradients are costly to reduce, so ep > 1 can win
  const plan::Link slow{.bandwidth = 2e8, .latency = 2e-5};
  const plan::Cluster cl = cluster(1, 4, slow, slow);
  const plan::Rates r = plan::cluster_rates(cl, plan::Precision::fp32);
  train::TrainerConfig base = moe_model();
  plan::SearchSpace space;
  space.schedules = {"gpipe", "1f1b"};
  space.zero = {0, 1, 2};
  space.max_microbatches = 2;
  space.overlap_chunks = {1};
  space.cp_modes = {nn::CpMode::ring};
  space.max_cp = 1;
  space.offload_optimizer = {false};
  const int top = 6;
  const plan::Plan plan = plan::search(base, cl, r, space, top);
  // the exhaustive loop: every layout checked, fitted and timed, sorted
  std::vector<double> all;
  int eps[5] = {0, 0, 0, 0, 0};
  double best_dp4 = 1e300;
  int best_dp4_ep = 0;
  for (const auto& c : plan::layouts(base, cl.devices(), cl.devices_per_node, space)) {
    if (!train::config_problems(c).empty()) continue;
    ++eps[c.ep];
    INFO(plan::train_gpt_flags(c));
    CHECK(plan_test::train_gpt_problems(c).empty());
    std::istringstream words(plan::train_gpt_flags(c));
    std::vector<std::string> args;
    for (std::string w; words >> w;) args.push_back(w);
    CHECK(train_gpt::trainer_config(train_gpt::parse_flags(args)).ep == c.ep);
    if (plan::predict_peak_memory(c).memory.device_total() > cl.device.memory_bytes) continue;
    all.push_back(plan::predict_step(c, cl, r).step);
    if (c.dp == 4 && all.back() < best_dp4) best_dp4 = all.back(), best_dp4_ep = c.ep;
  }
  // on this slow link the experts' gradients cost more than the all-to-alls: dp4's best splits them
  CHECK(best_dp4_ep > 1);
  CHECK(eps[1] > 0);
  CHECK(eps[2] > 0);
  CHECK(eps[4] > 0);
  CHECK(eps[3] == 0);  // 3 divides neither 4 experts nor dp
  std::sort(all.begin(), all.end());
  REQUIRE(plan.best.size() == static_cast<std::size_t>(top));
  REQUIRE(all.size() > static_cast<std::size_t>(top));
  for (int i = 0; i < top; ++i) {
    INFO("rank " << i << ": " << plan::train_gpt_flags(plan.best[i].config));
    CHECK(plan.best[i].cost.step == Approx(all[static_cast<std::size_t>(i)]).epsilon(1e-12));
    CHECK(plan_test::train_gpt_problems(plan.best[i].config).empty());
  }
  // a dense base: ep is never varied
  train::TrainerConfig dense = base;
  dense.model.moe_every = 0;
  dense.model.experts = 0;
  for (const auto& c : plan::layouts(dense, cl.devices(), cl.devices_per_node, space)) CHECK(c.ep == 1);
}

TEST_CASE("model_flops: an MoE block counts its router and top-k experts; train_gpt's MFU count agrees", "[cost][moe][mfu]") {
  // by hand, forward GEMM FLOPs per token x 3 (forward + backward): a dense block's qkv 6 W^2,
  // attention projection 2 W^2, MLP 16 W^2; an MoE block's router 2 W E and k experts' MLPs
  // 16 W^2 each instead of the MLP; attention's QK^T and AV 4 T W per block; the LM head 2 V W
  const double W = 32, V = 64, T = 16, L = 4, E = 4, P = 16, tokens = 8 * 16;
  auto by_hand = [&](double moe_blocks, double k) {
    const double dense_blocks = L - moe_blocks;
    return 3 * (dense_blocks * 24 * W * W + moe_blocks * (8 * W * W + 2 * W * E + k * 16 * W * W) + L * 4 * T * W + 2 * V * W);
  };
  train::TrainerConfig dense = moe_model();
  dense.model.moe_every = 0;
  dense.model.experts = 0;
  dense.model.moe_topk = 1;
  CHECK(plan::model_flops(dense) == Approx(tokens * by_hand(0, 0)).epsilon(1e-12));
  CHECK(plan::model_flops(dense) == Approx(tokens * (6 * (L * 12 * W * W + V * W) + 12 * L * T * W)).epsilon(1e-12));
  for (int k : {1, 2}) {
    INFO("top-" << k);
    train::TrainerConfig c = moe_model();  // blocks 0 and 2: MoE
    c.model.moe_topk = k;
    CHECK(plan::model_flops(c) == Approx(tokens * by_hand(2, k)).epsilon(1e-12));
    // every block MoE
    train::TrainerConfig all = c;
    all.model.moe_every = 1;
    CHECK(plan::model_flops(all) == Approx(tokens * by_hand(4, k)).epsilon(1e-12));

    // train_gpt's count (examples/train_gpt/run.hpp): 6 x every parameter a token uses, biases,
    // norms and wpe included: wte, wpe, ln_f; a dense block 12 W^2 + 13 W; an MoE block 4 W^2 + 8 W,
    // the router W E and E experts of 8 W^2 + 5 W, of which k are used
    const double n_params = V * W + P * W + 2 * W + 2 * (12 * W * W + 13 * W) + 2 * (4 * W * W + 8 * W + W * E + E * (8 * W * W + 5 * W));
    const double active = V * W + P * W + 2 * W + 2 * (12 * W * W + 13 * W) + 2 * (4 * W * W + 8 * W + W * E + k * (8 * W * W + 5 * W));
    CHECK(train::moe_active_parameters(n_params, 2, 4, k, 32) == Approx(active).epsilon(1e-12));
    // the two agree but for what the planner leaves out: biases, norms and wpe (6 each per token)
    const double left_out = P * W + 2 * W + 2 * 13 * W + 2 * (8 * W + k * 5 * W);
    const double train_gpt_flops = train::gpt_flops_per_token(active, 4, 32, T);
    CHECK(train_gpt_flops - plan::model_flops(c) / tokens == Approx(6 * left_out).epsilon(1e-12));
  }
  CHECK_THROWS_WITH(train::moe_active_parameters(1e6, 2, 2, 3, 32), Catch::Contains("top-3 of 2 experts"));
}
