// ZeRO-2/3's traffic in the cost model (plan/sharded_traffic.hpp): the buckets against the real
// model's parameters, the unit-by-unit play-out against timelines worked out by hand, and
// predict_step's ZeRO-2/3 ranks against the units built by hand from the documented rule.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "trellis/comm/threads.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/plan/cost_model.hpp"

using namespace trellis;
using plan::detail::HeldTraffic;
using plan::detail::ShardedUnit;

namespace {

// GEMMs at 1 TFLOP/s, attention at 0.5, memory passes at 10 GB/s, everything else free.
plan::Rates rates_by_hand() {
  plan::Rates r;
  r.gemm = [](double m, double n, double k, plan::GemmForm) { return 2 * m * n * k / 1e12; };
  r.attention_forward = [](double b, double h, double t, double d) { return 2 * b * h * t * t * d / 5e11; };
  r.attention_backward = [](double b, double h, double t, double d) { return 5 * b * h * t * t * d / 5e11; };
  r.layernorm = [](double, double, bool) { return 0.0; };
  r.gelu = [](double, bool) { return 0.0; };
  r.cross_entropy = [](double, double, bool) { return 0.0; };
  r.memory = [](double bytes) { return bytes / 1e10; };
  r.adamw = [](double n) { return 1e-9 * n; };
  r.collective_copy_bytes = 2;
  return r;
}

}  // namespace

TEST_CASE("ZeRO buckets: a block's parameters in packing order, cut as GradBuckets cuts them", "[cost][zero]") {
  CHECK(plan::detail::bucket_count({}, 10) == 0);
  CHECK(plan::detail::bucket_count({4, 4, 2}, 10) == 1);
  CHECK(plan::detail::bucket_count({4, 4, 3}, 10) == 2);      // 11 > 10: the third starts a bucket
  CHECK(plan::detail::bucket_count({25, 1, 1}, 10) == 2);     // a parameter larger than a bucket is one alone
  CHECK(plan::detail::bucket_count({1, 25, 1, 1}, 10) == 3);
  for (int tp : {1, 2}) {
    INFO("tp " << tp);
    nn::GptConfig cfg{.vocab = 96, .positions = 32, .layers = 2, .heads = 4, .width = 64};
    comm::ThreadWorld(tp).run([&](comm::ThreadComm& comm) {
      nn::GptModel<comm::ThreadComm> model(cfg, comm);
      train::TrainerConfig c;
      c.model = cfg;
      c.tp = tp;
      c.seq = 32;
      c.batch = 2;
      const std::vector<double> sizes = plan::detail::block_parameter_sizes(plan::detail::shape_of(c));
      for (int u = 1; u <= 2; ++u) {  // unit 0 is the head, then the blocks
        std::vector<double> real;
        for (const nn::Parameter* p : model.weight_unit_parameters(u)) real.push_back(static_cast<double>(p->numel()));
        CHECK(real == sizes);
      }
    });
  }
  // a GPT-2 block (W 256): c_fc's and c_proj's weights fill a bucket each, so 6 buckets of 2^18
  train::TrainerConfig c;
  c.model = {.vocab = 512, .positions = 128, .layers = 4, .heads = 8, .width = 256};
  CHECK(plan::detail::bucket_count(plan::detail::block_parameter_sizes(plan::detail::shape_of(c)), 1 << 18) == 6);
}

TEST_CASE("ZeRO-2/3 unit by unit: timelines by hand", "[cost][zero]") {
  // two units computing F 1 s, B + W 2 s
  ShardedUnit a{.forward = 1, .backward = 2, .gather = 0.5, .reduce = 0.5};
  std::vector<ShardedUnit> units{a, a};
  // compute-bound: the first gather and the last reduce-scatter are all that shows.
  // F0 gathers 0-0.5, prefetches F1 (0.5-1), computes 0.5-1.5; F1 1.5-2.5; B1 keeps F1's values,
  // prefetches B0 (2.5-3), computes 2.5-4.5, reduces 4.5-5; B0 4.5-6.5, reduces 6.5-7.
  CHECK(plan::detail::sharded_step_seconds(units, 1, true) == Approx(7.0));
  // the same in general: m microbatches of 6 s, plus 0.5 at each end
  CHECK(plan::detail::sharded_step_seconds(units, 4, true) == Approx(4 * 6 + 1.0));
  // link-bound (3 s a transfer): F0 waits 3, prefetch F1 3-6, F0 3-4, F1 waits to 6, 6-7; B1 kept,
  // prefetch B0 7-10, B1 7-9, reduce 10-13; B0 10-12, reduce 13-16.
  for (auto& u : units) u.gather = u.reduce = 3;
  CHECK(plan::detail::sharded_step_seconds(units, 1, true) == Approx(16.0));
  // without prefetch each gather starts when its unit needs it: F0 0-3, 3-4; F1 gathers 4-7,
  // 7-8; B1 kept 8-10, reduce 10-13; B0 gathers 13-16 (behind the reduce), 16-18, reduce 18-21.
  CHECK(plan::detail::sharded_step_seconds(units, 1, false) == Approx(21.0));
  // ZeRO-2: reduce-scatters only; the link free while the forward runs
  for (auto& u : units) u.gather = 0;
  // F 0-2; B1 2-4, reduce 4-7; B0 4-6, reduce 7-10
  CHECK(plan::detail::sharded_step_seconds(units, 1, true) == Approx(10.0));
  // copies: the device's own time at each transfer's start (0.25 a reduce-scatter here)
  for (auto& u : units) u.reduce_copy = 0.25;
  // F 0-2; B1 2-4, reduce 4-7, copy 4-4.25; B0 4.25-6.25, reduce 7-10, copy to 6.5
  CHECK(plan::detail::sharded_step_seconds(units, 1, true) == Approx(10.0));
  for (auto& u : units) u.reduce = 0.1;  // now the device is the bottleneck: 6 s of compute and 2 copies
  CHECK(plan::detail::sharded_step_seconds(units, 1, true) == Approx(6.5));
  // held traffic (the tied wte): gathered before the first unit, reduced after the last
  units = {a, a};
  const HeldTraffic held{.gather = 1, .reduce = 2};
  // held gather 0-1; F0 gathers 1-1.5, then as the first case shifted by 1: B0 ends 7.5, reduce
  // 7.5-8; the held reduce 8-10
  CHECK(plan::detail::sharded_step_seconds(units, 1, true, held) == Approx(10.0));
  // the embedding's backward reads no values: B0 (unit 0 here) gathers nothing
  units[0].gathered_in_backward = false;
  units[0].gather = units[1].gather = 3;
  // F0 0-3 + prefetch F1 3-6; F0 3-4; F1 6-7; B1 kept 7-9, reduce 9-9.5; B0 (no gather) 9-11, reduce 11-11.5
  CHECK(plan::detail::sharded_step_seconds(units, 1, true) == Approx(11.5));
  // two microbatches: B0 of the first prefetches F0 of the second at 9, behind B1's reduce:
  // 9.5-12.5; B0 9-11, reduce 12.5-13; F0 waits to 12.5, prefetches F1 13-16, 12.5-13.5; F1 16-17;
  // B1 17-19, reduce 19-19.5; B0 19-21, reduce 21-21.5
  CHECK(plan::detail::sharded_step_seconds(units, 2, true) == Approx(21.5));
}

TEST_CASE("predict_step under ZeRO-2/3: a rank's units by hand, played out", "[cost][zero]") {
  // dp 2 on one node of 2 (link 1 GB/s, 50 us), the GPT of 4 blocks (W 256: 6 buckets each)
  plan::Cluster cl;
  cl.name = "2 test devices";
  cl.nodes = 1;
  cl.devices_per_node = 2;
  cl.device = {.name = "test", .memory_bytes = 64e9, .peak_flops_fp32 = 1e12, .peak_flops_bf16 = 4e12, .memory_bandwidth = 1e11};
  cl.intra_node = cl.inter_node = {.bandwidth = 1e9, .latency = 50e-6};
  const plan::Link& l = cl.intra_node;
  const plan::Rates r = rates_by_hand();
  train::TrainerConfig c;
  c.model = {.vocab = 512, .positions = 128, .layers = 4, .heads = 8, .width = 256};
  c.seq = 128;
  c.batch = 8;
  c.dp = 2;
  const double W = 256, V = 512, P = 128;
  // a transfer over the 2 ranks: a latency per bucket and half the bytes on the wire; the device
  // copies 2 x the wire bytes at 10 GB/s
  auto wire = [&](double elements, int buckets) { return buckets * l.latency + 0.5 * 4 * elements / l.bandwidth; };
  auto copy = [&](double elements) { return 2 * 0.5 * 4 * elements / 1e10; };
  for (int zero : {2, 3})
    for (int m : {1, 4}) {
      INFO("ZeRO-" << zero << ", " << m << " microbatches");
      c.zero = zero;
      c.microbatches = m;
      const plan::detail::Shape s = plan::detail::shape_of(c);
      double ignored = 0;
      const plan::PassTimes emb = plan::detail::embedding_times(s, r, l, &ignored);
      const plan::PassTimes block = plan::detail::block_times(s, r, l, l, false, &ignored);
      const plan::PassTimes head = plan::detail::head_times(s, r, l, &ignored);
      auto unit = [&](const plan::PassTimes& t, double elements, int buckets) {
        ShardedUnit u{.forward = t.forward, .backward = t.backward_input + t.backward_weight};
        u.reduce = wire(elements, buckets);
        u.reduce_copy = copy(elements);
        if (zero == 3) u.gather = u.reduce, u.gather_copy = u.reduce_copy;
        return u;
      };
      // forward order: the embedding (wpe), the 4 blocks, the head (ln_f); wte held
      std::vector<ShardedUnit> units{unit(emb, P * W, 1)};
      units.back().gathered_in_backward = false;
      for (int b = 0; b < 4; ++b) units.push_back(unit(block, 12 * W * W + 13 * W, 6));
      units.push_back(unit(head, 2 * W, 1));
      HeldTraffic held{.reduce = wire(V * W, 1), .reduce_copy = copy(V * W)};
      if (zero == 3) held.gather = held.reduce, held.gather_copy = held.reduce_copy;
      const double expected = plan::detail::sharded_step_seconds(units, m, true, held);
      const plan::StepCost cost = plan::predict_step(c, cl, r);
      CHECK(cost.pipeline == Approx(expected).epsilon(1e-12));
      // the play-out is never below the compute alone, and the traffic shows
      CHECK(expected > m * cost.stage.at(0).total());
      // without prefetch (ZeRO-3) every gather is waited for
      if (zero == 3) {
        c.prefetch_values = false;
        const double unprefetched = plan::detail::sharded_step_seconds(units, m, false, held);
        CHECK(plan::predict_step(c, cl, r).pipeline == Approx(unprefetched).epsilon(1e-12));
        CHECK(unprefetched > expected);
        c.prefetch_values = true;
      }
    }
}
