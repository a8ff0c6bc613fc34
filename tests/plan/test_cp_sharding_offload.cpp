// The cost model's Ulysses and hybrid context parallelism, hybrid sharding and offloaded optimizer
// (plan/cost_model.hpp) against hand formulas with known rates and links, each in a link-bound (or
// host-bound) and a compute-bound case; the all-to-all formula against comm::SimulatedLink's own
// accounting; and plan::search with each dimension in its space against an exhaustive evaluation.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "train_gpt/flags.hpp"
#include "train_gpt_problems.hpp"
#include "trellis/comm/simulated_link.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/plan/search.hpp"

using namespace trellis;

namespace {

// 2 nodes of 2 devices: intra-node link `in`, inter-node link `across`.
plan::Cluster two_nodes(plan::Link in, plan::Link across, double memory_bytes = 64e9) {
  plan::Cluster c;
  c.name = "2 x 2 test devices";
  c.nodes = 2;
  c.devices_per_node = 2;
  c.device = {.name = "test", .memory_bytes = memory_bytes, .peak_flops_fp32 = 1e12, .peak_flops_bf16 = 4e12,
              .memory_bandwidth = 1e11};
  c.intra_node = in;
  c.inter_node = across;
  return c;
}

train::TrainerConfig small_model() {
  train::TrainerConfig c;
  c.model = {.vocab = 512, .positions = 128, .layers = 4, .heads = 8, .width = 256};
  c.seq = 128;
  c.batch = 4;
  return c;
}

// GEMMs at `flops` per second; causal attention's 2 b h T^2 d FLOP forward (5 backward) at
// `attention_flops`; AdamW at `adamw` s per parameter; the host's AdamW and copies at `host_adamw`
// s per parameter and `host_link` bytes/s; memory passes and everything else free.
plan::Rates hand_rates(double flops, double attention_flops, double adamw = 0, double host_adamw = 0,
                       double host_link = 1e300) {
  plan::Rates r;
  r.gemm = [=](double m, double n, double k, plan::GemmForm) { return 2 * m * n * k / flops; };
  r.attention_forward = [=](double b, double h, double t, double d) { return 2 * b * h * t * t * d / attention_flops; };
  r.attention_backward = [=](double b, double h, double t, double d) { return 5 * b * h * t * t * d / attention_flops; };
  r.layernorm = [](double, double, bool) { return 0.0; };
  r.gelu = [](double, bool) { return 0.0; };
  r.cross_entropy = [](double, double, bool) { return 0.0; };
  r.memory = [](double) { return 0.0; };
  r.adamw = [=](double n) { return adamw * n; };
  r.host_adamw = [=](double n) { return host_adamw * n; };
  r.host_copy = [=](double bytes) { return bytes / host_link; };
  return r;
}

double a2a(const plan::Link& l, double bytes, int n) { return l.latency + (n - 1.0) / n * bytes / l.bandwidth; }
double all_reduce(const plan::Link& l, double bytes, int n) { return l.latency + 2.0 * (n - 1) / n * bytes / l.bandwidth; }
double gather(const plan::Link& l, double bytes, int n) { return l.latency + (n - 1.0) / n * bytes / l.bandwidth; }
double send(const plan::Link& l, double bytes) { return l.latency + bytes / l.bandwidth; }

// The block's GEMMs of R rows at tp t by hand: F (nn), B (nt).
double gemms_f(double R, double W, double t, double F) {
  return 2 * R * (3 * W / t * W + W * W / t + 4 * W / t * W + W * 4 * W / t) / F;
}

using plan_test::train_gpt_problems;

// The search's first `top` against every layout of `space` checked, tried (offload_tried), fitted
// and simulated here, then sorted; each proposed layout runs (train::config_problems, train_gpt's
// checks). Returns how many evaluated layouts satisfy `counted`.
template <class Counted>
long check_search(const train::TrainerConfig& base, const plan::Cluster& cl, const plan::Rates& r,
                  const plan::SearchSpace& space, int top, Counted&& counted) {
  const plan::Plan p = plan::search(base, cl, r, space, top);
  const plan::Plan no_pruning = plan::search(base, cl, r, space, top, false);
  std::vector<double> all;
  long n = 0;
  for (const auto& c : plan::layouts(base, cl.devices(), space.max_tp > 0 ? space.max_tp : cl.devices_per_node, space)) {
    if (!train::config_problems(c).empty()) continue;
    if (!plan::offload_tried(c, cl, space.activation_scale)) continue;
    if (plan::predict_peak_memory(c).memory.device_total() > cl.device.memory_bytes) continue;
    all.push_back(plan::predict_step(c, cl, r).step);
    n += counted(c) ? 1 : 0;
  }
  std::sort(all.begin(), all.end());
  REQUIRE(!all.empty());
  const std::size_t k = std::min<std::size_t>(all.size(), static_cast<std::size_t>(top));
  REQUIRE(p.best.size() == k);
  REQUIRE(no_pruning.best.size() == k);
  for (std::size_t i = 0; i < k; ++i) {
    INFO("rank " << i << ": search " << p.best[i].cost.step << " " << plan::train_gpt_flags(p.best[i].config));
    CHECK(p.best[i].cost.step == Approx(all[i]).epsilon(1e-12));
    CHECK(no_pruning.best[i].cost.step == Approx(all[i]).epsilon(1e-12));
    CHECK(train::config_problems(p.best[i].config).empty());
    CHECK(train_gpt_problems(p.best[i].config).empty());
  }
  return n;
}

}  // namespace

TEST_CASE("all_to_all_seconds equals comm::SimulatedLink's modelled all-to-all", "[cost][ulysses]") {
  const comm::LinkModel model{.bandwidth = 2e9, .latency = 30e-6};
  const plan::Link link{.bandwidth = model.bandwidth, .latency = model.latency};
  const std::size_t block = 1 << 14;  // floats to each rank
  for (int ranks : {2, 4}) {
    comm::ThreadWorld(ranks).run([&](comm::ThreadComm& world) {
      comm::SimulatedLink<comm::ThreadComm> c(world.split(0, world.rank()), model);
      std::vector<float> x(block * static_cast<std::size_t>(ranks), 1.0f), y(x.size());
      const double t0 = c.modelled_seconds();
      c.all_to_all(x.data(), y.data(), block);
      const double t1 = c.modelled_seconds();
      if (world.rank() == 0)  // bytes: the rank's whole send buffer
        CHECK(t1 - t0 == Approx(plan::all_to_all_seconds(link, 4.0 * block * ranks, ranks)).epsilon(1e-9));
    });
  }
}

TEST_CASE("Ulysses and hybrid cp: the block's F and B by hand, on the links their groups use", "[cost][ulysses]") {
  const double F = 1e12, A = 5e10, W = 256, H = 8, T = 128, d = W / H;
  const plan::Link in{.bandwidth = 2e10, .latency = 5e-6};
  for (double across_bw : {1e12, 1e8}) {  // the inter-node link: fast (compute-bound ring), slow (link-bound)
    INFO("inter-node bandwidth " << across_bw);
    const plan::Link across{.bandwidth = across_bw, .latency = 2e-5};
    const plan::Cluster cl = two_nodes(in, across);
    const plan::Rates r = hand_rates(F, A);
    auto attn_f = [&](double b, double h, double t) { return 2 * b * h * t * t * d / A; };
    auto attn_b = [&](double b, double h, double t) { return 5 * b * h * t * t * d / A; };

    // Ulysses, tp 2 x cp 2 (cp at stride 2: across the nodes): tp's all-reduces on the intra-node
    // link; the all-to-alls of q, k, v (3 tensors) and o in F, dO and dq, dk, dv in B of this
    // rank's R rows x W / tp columns, on the inter-node one; attention over the whole sequence of
    // H / (tp cp) heads.
    {
      train::TrainerConfig c = small_model();
      c.tp = 2;
      c.cp = 2;
      c.cp_mode = nn::CpMode::ulysses;
      REQUIRE(train::config_problems(c).empty());
      const double t = 2, b = 4, R = b * T / 2, one = 4 * R * W / t;
      const double x = a2a(across, 3 * one, 2) + a2a(across, one, 2);
      const double f = gemms_f(R, W, t, F) + attn_f(b, H / 4, T) + 2 * all_reduce(in, 4 * R * W, 2) + x;
      const double bwd = gemms_f(R, W, t, F) + attn_b(b, H / 4, T) + 2 * all_reduce(in, 4 * R * W, 2) + x;
      const plan::detail::Shape s = plan::detail::shape_of(c);
      REQUIRE(s.u == 2);
      const plan::PassTimes p = plan::detail::block_times(s, r, in, across, false, nullptr, &across);
      CHECK(p.forward == Approx(f).epsilon(1e-12));
      CHECK(p.backward_input == Approx(bwd).epsilon(1e-12));
      // predict_step: the same block (so the links it picks are these), 4 of them with the embedding and head
      const plan::StepCost cost = plan::predict_step(c, cl, r);
      const plan::PassTimes e = plan::detail::embedding_times(s, r, in, nullptr);
      const plan::PassTimes h = plan::detail::head_times(s, r, in, nullptr);
      CHECK(cost.stage[0].forward == Approx(4 * f + e.forward + h.forward).epsilon(1e-12));
      CHECK(cost.stage[0].backward_input == Approx(4 * bwd + e.backward_input + h.backward_input).epsilon(1e-12));
      // recompute: B runs F again, all-to-alls included
      const plan::PassTimes q = plan::detail::block_times(s, r, in, across, true, nullptr, &across);
      CHECK(q.backward_input == Approx(bwd + f).epsilon(1e-12));
    }
    // Hybrid, cp 4 = Ulysses groups of u = 2 (stride 1: inside a node) x a ring of 2 members
    // (stride 2: across the nodes): the all-to-alls on the intra-node link; the ring's 2 steps over
    // blocks of T / 2 of H / 2 heads, its one hop of K, V (F) and K, V, dK, dV (B) of u R rows x
    // W / u columns exposed where the attention does not cover it.
    {
      train::TrainerConfig c = small_model();
      c.cp = 4;
      c.cp_mode = nn::CpMode::hybrid;
      c.cp_ulysses = 2;
      REQUIRE(train::config_problems(c).empty());
      const double b = 4, R = b * T / 4, one = 4 * R * W, kv = 2 * 4 * R * W;
      const double x = a2a(in, 3 * one, 2) + a2a(in, one, 2);
      const double af = 2 * attn_f(b, H / 2, T / 2), ab = 2 * attn_b(b, H / 2, T / 2);
      // F: the hop during the first step (half the attention); B: the K, V hop during the own
      // diagonal blocks (a quarter of the backward), the dK, dV sum's during the own off-diagonal ones
      const double hop = send(across, kv);
      if (across_bw > 1e9) {
        CHECK(hop < ab / 4);  // compute-bound: the hops hide
      } else {
        CHECK(hop > af / 2);  // link-bound
        CHECK(hop > ab / 4);
      }
      const double f = gemms_f(R, W, 1, F) + af + std::max(0.0, hop - af / 2) + x;
      const double bwd = gemms_f(R, W, 1, F) + ab + 2 * std::max(0.0, hop - ab / 4) + x;
      const plan::detail::Shape s = plan::detail::shape_of(c);
      REQUIRE(s.u == 2);
      const plan::StepCost cost = plan::predict_step(c, cl, r);
      const plan::PassTimes e = plan::detail::embedding_times(s, r, in, nullptr);
      const plan::PassTimes h = plan::detail::head_times(s, r, in, nullptr);
      CHECK(cost.stage[0].forward == Approx(4 * f + e.forward + h.forward).epsilon(1e-12));
      CHECK(cost.stage[0].backward_input == Approx(4 * bwd + e.backward_input + h.backward_input).epsilon(1e-12));
      // the plain ring of cp 4 (stride 1, size 4: across the nodes), for comparison: 3 hops
      c.cp_mode = nn::CpMode::ring;
      const plan::detail::Shape sr = plan::detail::shape_of(c);
      const plan::PassTimes pr = plan::detail::block_times(sr, r, in, across, false, nullptr);
      const double rf = 4 * attn_f(b, H, T / 4);
      CHECK(pr.forward == Approx(gemms_f(R, W, 1, F) + rf + 3 * std::max(0.0, send(across, kv) - rf / 4)).epsilon(1e-12));
      // B: the first and last hop beside half a step, the 2 middle steps carrying two hops each
      const double rb = 4 * attn_b(b, H, T / 4), hop4 = send(across, kv);
      CHECK(pr.backward_input ==
            Approx(gemms_f(R, W, 1, F) + rb + 2 * std::max(0.0, hop4 - rb / 8) + 2 * std::max(0.0, 2 * hop4 - rb / 4))
                .epsilon(1e-12));
    }
  }
}

TEST_CASE("hybrid sharding: reduce-scatter and all-gather in the group, the shards all-reduced across", "[cost][sharding]") {
  // dp 4 on 2 nodes of 2: shard groups of S = 2 inside a node, the 2 groups across the nodes
  const plan::Link in{.bandwidth = 1e10, .latency = 5e-6};
  const double F = 1e12, A = 5e11, adamw = 1e-9;
  const plan::Rates r = hand_rates(F, A, adamw);
  for (double across_bw : {1e11, 2e8}) {  // compute-bound: the across-group sum hides; link-bound: it does not
    INFO("inter-node bandwidth " << across_bw);
    const plan::Link across{.bandwidth = across_bw, .latency = 2e-5};
    const plan::Cluster cl = two_nodes(in, across);
    train::TrainerConfig c = small_model();
    c.batch = 16;
    c.dp = 4;
    c.microbatches = 2;
    c.shard_degree = 2;
    const double W = 256, V = 512, P = 128, L = 4;
    const double params = L * (12 * W * W + 13 * W) + (V + P) * W + 2 * W, bytes = 4 * params;
    const int buckets = static_cast<int>(std::ceil(params / static_cast<double>(c.bucket_elements)));
    for (int zero : {1, 2}) {
      INFO("ZeRO " << zero);
      c.zero = zero;
      REQUIRE(train::config_problems(c).empty());
      const plan::StepCost cost = plan::predict_step(c, cl, r);
      const plan::PassTimes& st = cost.stage.at(0);
      const double sum = all_reduce(across, bytes / 2, 2);  // half the gradients over the 2 groups
      double step = 0;
      if (zero == 1) {  // reduce-scatter through the last backward, the sum at the end, then the gather
        const double window = st.backward_input + st.backward_weight;
        step = 2 * st.total() + plan::exposed_after(window, gather(in, bytes, 2), buckets) + sum + gather(in, bytes, 2);
      } else {  // every microbatch reduce-scattered in the group (the units' play-out stretches the
                // actions: test_sharded_traffic.cpp); the sum through the last backward
        const double compute = st.total(), stretch = cost.pipeline / (2 * compute);
        CHECK(stretch >= 1.0);
        const double window = (st.backward_input + st.backward_weight) * stretch;
        step = cost.pipeline + gather(in, bytes, 2) + plan::exposed_after(window, sum, buckets);
        if (across_bw > 1e10)
          CHECK(plan::exposed_after(window, sum, buckets) < 0.1 * sum);  // mostly hidden
        else
          CHECK(sum > window);  // the link is the bottleneck
      }
      step += adamw * params / 2;  // AdamW over this rank's half
      CHECK(cost.step == Approx(step).epsilon(1e-12));
      // full sharding over the 4 replicas (stride 1, size 4: across the nodes) for comparison
      train::TrainerConfig full = c;
      full.shard_degree = 0;
      const plan::StepCost f = plan::predict_step(full, cl, r);
      double full_step = 0;
      if (zero == 1) {
        const double window = st.backward_input + st.backward_weight;
        full_step = 2 * st.total() + plan::exposed_after(window, gather(across, bytes, 4), buckets) + gather(across, bytes, 4);
      } else {
        CHECK(f.pipeline > 2 * st.total());  // the reduce-scatters across the nodes show
        full_step = f.pipeline + gather(across, bytes, 4);
      }
      CHECK(f.step == Approx(full_step + adamw * params / 4).epsilon(1e-12));
    }
  }
}

TEST_CASE("offloaded optimizer: host copies and AdamW after the schedule, or hidden under the fused update",
          "[cost][offload]") {
  const plan::Link in{.bandwidth = 1e11, .latency = 5e-6};
  const plan::Cluster cl = two_nodes(in, in);
  const double F = 1e12, A = 5e11, device_adamw = 1e-10, host_link = 2e10;
  const double W = 256, V = 512, P = 128, L = 4;
  const double params = L * (12 * W * W + 13 * W) + (V + P) * W + 2 * W;
  train::TrainerConfig c = small_model();
  c.batch = 16;
  c.dp = 4;
  c.microbatches = 2;
  for (double host_adamw : {5e-10, 1e-6}) {  // the host update hides behind one backward, or not
    INFO("host AdamW " << host_adamw << " s per parameter");
    const plan::Rates r = hand_rates(F, A, device_adamw, host_adamw, host_link);
    for (int zero : {0, 3}) {
      INFO("ZeRO " << zero);
      c.zero = zero;
      c.offload_optimizer = false;
      c.fused_update = train::TrainerConfig::FusedUpdate::off;
      c.clip = 1.0;
      const plan::StepCost on_device = plan::predict_step(c, cl, r);
      const double n = zero >= 1 ? params / 4 : params;  // this rank's AdamW elements
      const double copies = 12 * n / host_link;        // values and gradients down, values up
      c.offload_optimizer = true;
      REQUIRE(train::config_problems(c).empty());
      const plan::StepCost off = plan::predict_step(c, cl, r);
      CHECK(off.step - on_device.step == Approx(copies + host_adamw * n - device_adamw * n).epsilon(1e-9));
      CHECK(off.optimizer == Approx(copies + host_adamw * n).epsilon(1e-12));
      // fused_update with the update thread: unit by unit (4 blocks, wpe, ln_f, wte) on the host
      // while the last backward runs
      c.fused_update = train::TrainerConfig::FusedUpdate::unclipped;
      c.clip = 0;
      REQUIRE(train::config_problems(c).empty());
      const plan::StepCost fused = plan::predict_step(c, cl, r);
      // the last backward, stretched as every action by ZeRO-3's traffic (pipeline / compute)
      const double window = (off.stage[0].backward_input + off.stage[0].backward_weight) * off.pipeline /
                            (2 * off.stage[0].total());
      const double hidden = plan::exposed_after(window, host_adamw * n, 7);
      CHECK(fused.optimizer == Approx(copies + hidden).epsilon(1e-12));
      CHECK(fused.step == Approx(off.step - host_adamw * n + hidden).epsilon(1e-12));
      if (host_adamw < 1e-8)
        CHECK(host_adamw * n < window);  // compute-bound: the host keeps up
      else
        CHECK(host_adamw * n > 2 * window);  // host-bound
      // without the thread the update runs on the training thread: as unfused
      c.offload_update_thread = false;
      CHECK(plan::predict_step(c, cl, r).step == Approx(off.step).epsilon(1e-12));
      c.offload_update_thread = true;
    }
  }
  // the cluster's rates: host AdamW over the host memory bandwidth's share, copies over the link
  plan::Cluster h = cl;
  h.host_memory_bandwidth = 40e9;
  h.host_link_bandwidth = 20e9;
  const plan::Rates cr = plan::cluster_rates(h, plan::Precision::fp32);
  CHECK(cr.host_adamw(1e6) == Approx(28e6 / 40e9));
  CHECK(cr.host_copy(1e6) == Approx(1e6 / 20e9));
}

TEST_CASE("search: Ulysses and hybrid cp, hybrid sharding, offload -- the exhaustive optimum; flags that run", "[search]") {
  const plan::Link in{.bandwidth = 1e11, .latency = 5e-6};
  train::TrainerConfig base = small_model();
  base.batch = 16;
  plan::SearchSpace space;
  space.max_microbatches = 4;
  space.overlap_chunks = {1};
  space.schedules = {"1f1b", "zb_h1"};
  space.recompute = {false};
  SECTION("cp modes") {
    plan::SearchSpace s = space;
    s.zero = {0, 1};
    s.shard_degrees = false;
    s.offload_optimizer = {false};
    const plan::Cluster cl = two_nodes(in, {.bandwidth = 1e9, .latency = 2e-5});
    const plan::Rates r = plan::cluster_rates(cl, plan::Precision::fp32);
    const long ulysses = check_search(base, cl, r, s, 40, [](const train::TrainerConfig& c) {
      return c.cp > 1 && c.cp_mode != nn::CpMode::ring;
    });
    CHECK(ulysses > 10);  // the space had them, and they were evaluated
  }
  SECTION("shard degrees: hybrid sharding comes first where the link across nodes is slow") {
    plan::SearchSpace s = space;
    s.cp_modes = {nn::CpMode::ring};
    s.offload_optimizer = {false};
    s.max_cp = 1;
    s.sequence_parallel = {false};
    const plan::Cluster cl = two_nodes(in, {.bandwidth = 2e8, .latency = 2e-5});
    const plan::Rates r = plan::cluster_rates(cl, plan::Precision::fp32);
    const long hybrid = check_search(base, cl, r, s, 20, [](const train::TrainerConfig& c) { return c.shard_degree > 0; });
    CHECK(hybrid >= 9);  // dp 4: 3 microbatch counts x ZeRO 1-3 with S = 2
    // dp 4 with ZeRO: S = 2 inside a node (the sum of half the gradients across) beats sharding
    // over both nodes (reduce-scatter and all-gather across)
    plan::SearchSpace z = s;
    z.zero = {1, 2, 3};
    z.max_tp = 1;
    z.schedules = {};  // no pipelines: dp 4 only
    const plan::Plan p = plan::search(base, cl, r, z, 1);
    REQUIRE_FALSE(p.best.empty());
    INFO(plan::train_gpt_flags(p.best[0].config));
    CHECK(p.best[0].config.shard_degree == 2);
    CHECK(plan::train_gpt_flags(p.best[0].config).find("--shard-degree 2") != std::string::npos);
  }
  SECTION("offload: only where memory forces it (or the fused update could hide it)") {
    plan::SearchSpace s = space;
    s.cp_modes = {nn::CpMode::ring};
    s.shard_degrees = false;
    s.max_cp = 1;
    s.max_tp = 1;
    // the smallest footprint without offload, and with it
    double without = 1e300, with = 1e300;
    for (const auto& c : plan::layouts(base, 4, 1, s)) {
      if (!train::config_problems(c).empty()) continue;
      const double m = plan::predict_peak_memory(c).memory.device_total();
      (c.offload_optimizer ? with : without) = std::min(c.offload_optimizer ? with : without, m);
    }
    REQUIRE(with < without);
    const double tight = (with + without) / 2;  // only offloaded layouts fit
    const plan::Cluster cl = two_nodes(in, in, tight);
    const plan::Rates r = plan::cluster_rates(cl, plan::Precision::fp32);
    const long offloaded = check_search(base, cl, r, s, 5, [](const train::TrainerConfig& c) { return c.offload_optimizer; });
    CHECK(offloaded > 0);
    const plan::Plan p = plan::search(base, cl, r, s, 3);
    REQUIRE_FALSE(p.best.empty());
    for (const auto& cand : p.best) {
      INFO(plan::train_gpt_flags(cand.config));
      CHECK(cand.config.offload_optimizer);
      CHECK(plan::train_gpt_flags(cand.config).find("--offload optimizer") != std::string::npos);
    }
    // with room, offload is not tried (fused_update off): never proposed
    const plan::Cluster roomy = two_nodes(in, in);
    const plan::Plan q = plan::search(base, roomy, plan::cluster_rates(roomy, plan::Precision::fp32), s, 10);
    CHECK(q.offload_not_needed > 0);
    for (const auto& cand : q.best) CHECK_FALSE(cand.config.offload_optimizer);
    check_search(base, roomy, plan::cluster_rates(roomy, plan::Precision::fp32), s, 10,
                 [](const train::TrainerConfig&) { return true; });
  }
}
