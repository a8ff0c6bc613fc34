// The simulator pinned to published results (units: see simulate.hpp; costs are per microbatch for
// one rank's whole share of layers, memory in microbatches of one rank's share):
//   GPipe / 1F1B (Huang et al. 2019; Narayanan et al. 2019): bubble (p-1)/(m+p-1); peak memory m
//     (GPipe) vs p (1F1B) on rank 0.
//   Interleaved 1F1B (Narayanan et al. 2021): bubble time divided by v; memory p + (p-1)/v.
//   ZB-H1 / ZB-H2 (Qi et al. 2024): H1 bubble (p-1)(t_F+t_B-t_W), one third of 1F1B's when
//     t_F = t_B = t_W; H2 no bubble inside each rank's span, memory 2p-1.
//   DualPipeV (DeepSeek-V3 report, DualPipe table "Activation PP+1"): the report counts one
//     pipeline stage's activation as the unit and PP = number of pipeline stages; cut in a V over
//     p ranks that is PP = 2p chunks, and the peak is exactly PP+1 = 2p+1 chunk activations
//     (p + 1/2 in this simulator's rank-share unit).
//   Local learning: no backward message between stages.
// And: where a receive is posted does not change the timeline (its consumer waits for the data),
// checked by hand and against every receive placed right before its consumer.
#include <algorithm>
#include <cstdint>
#include <catch2/catch.hpp>
#include <tuple>
#include <vector>

#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/partition.hpp"
#include "trellis/pipe/simulate.hpp"

using namespace trellis::pipe;

TEST_CASE("GPipe and 1F1B: bubble (p-1)/(m+p-1), memory m vs p", "[pipe][simulate]") {
  for (Costs c : {Costs{1, 1, 1, 0}, Costs{1, 2, 0.5, 0}, Costs{2, 3, 1, 0}})
    for (int p : {1, 2, 3, 4, 6})
      for (int m : {1, 2, 4, 7, 16}) {
        INFO("p=" << p << " m=" << m << " tF=" << c.forward << " tB=" << c.backward_input);
        const double full = c.forward + c.backward_input + c.backward_weight;
        for (const auto& s : {gpipe(p, m), one_f_one_b(p, m)}) {
          auto sim = simulate(s, c);
          REQUIRE(sim.step_time == Approx((m + p - 1) * full));
          REQUIRE(sim.bubble_fraction == Approx(double(p - 1) / (m + p - 1)).margin(1e-12));
          for (int r = 0; r < p; ++r) REQUIRE(sim.busy[r] == Approx(m * full));
        }
        auto g = simulate(gpipe(p, m), c);
        auto o = simulate(one_f_one_b(p, m), c);
        for (int r = 0; r < p; ++r) {
          REQUIRE(g.peak_memory[r] == m);
          REQUIRE(o.peak_memory[r] == std::min(p - r, m));
        }
      }
}

TEST_CASE("communication time adds 2(p-1) message latencies to GPipe", "[pipe][simulate]") {
  const Costs c{1, 1, 1, 0.25};
  for (int p : {2, 4})
    for (int m : {1, 4, 8}) {
      auto sim = simulate(gpipe(p, m), c);
      REQUIRE(sim.step_time == Approx((m + p - 1) * 3.0 + 2 * (p - 1) * 0.25));
      REQUIRE(sim.forward_messages == (p - 1) * m);
      REQUIRE(sim.backward_messages == (p - 1) * m);
    }
}

TEST_CASE("interleaved 1F1B: bubble divided by v, memory p + (p-1)/v", "[pipe][simulate]") {
  for (Costs c : {Costs{1, 1, 1, 0}, Costs{1, 2, 1, 0}})
    for (int p : {2, 3, 4})
      for (int v : {1, 2, 3, 4})
        for (int groups : {2, 3, 4}) {
          const int m = groups * p;
          INFO("p=" << p << " v=" << v << " m=" << m);
          const double full = c.forward + c.backward_input + c.backward_weight;
          auto sim = simulate(interleaved_1f1b(p, m, v), c);
          // bubble time per rank = (p-1)(t_F+t_B)/v  (Megatron-LM 2021, section 2.2)
          REQUIRE(sim.step_time == Approx(m * full + (p - 1) * full / v));
          REQUIRE(sim.bubble_fraction == Approx(((p - 1) * full / v) / (m * full + (p - 1) * full / v)));
          // Megatron-LM's interleaved warm-up keeps p + (p-1)/v on rank 0 (v = 1 is plain 1F1B: p)
          const double memory = v == 1 ? p : p + double(p - 1) / v;
          REQUIRE(sim.peak_memory[0] == Approx(memory));
          REQUIRE(sim.max_peak_memory == Approx(memory));
        }
}

TEST_CASE("ZB-H1: one third of 1F1B's bubble at t_F = t_B = t_W, same memory", "[pipe][simulate]") {
  for (int p : {2, 3, 4, 6})
    for (int m : {p, 2 * p, 3 * p + 1}) {
      INFO("p=" << p << " m=" << m);
      const Costs c{1, 1, 1, 0};
      auto zb = simulate(zero_bubble_h1(p, m), c);
      auto base = simulate(one_f_one_b(p, m), c);
      const double zb_bubble = zb.step_time - 3.0 * m, base_bubble = base.step_time - 3.0 * m;
      REQUIRE(base_bubble == Approx(3.0 * (p - 1)));
      REQUIRE(zb_bubble == Approx(base_bubble / 3));
      REQUIRE(zb.max_peak_memory == Approx(base.max_peak_memory));
      REQUIRE(zb.max_peak_memory == p);
    }
  // the paper's general form (p-1)(t_F + t_B - t_W) while t_W <= t_F
  const int p = 4, m = 12;
  const Costs c{1, 1.5, 0.5, 0};
  auto zb = simulate(zero_bubble_h1(p, m), c);
  REQUIRE(zb.step_time - m * 3.0 == Approx((p - 1) * (1 + 1.5 - 0.5)));
}

TEST_CASE("ZB-H2: no bubble inside each rank's span, memory 2p-1", "[pipe][simulate]") {
  for (int p : {2, 3, 4, 6})
    for (int m : {2 * p, 3 * p}) {
      INFO("p=" << p << " m=" << m);
      auto sim = simulate(zero_bubble_h2(p, m), {1, 1, 1, 0});
      REQUIRE(sim.steady_bubble_fraction == Approx(0).margin(1e-12));
      REQUIRE(sim.peak_memory[0] == 2 * p - 1);
      REQUIRE(sim.max_peak_memory == 2 * p - 1);
      // what remains is the parallelogram's start-up: rank r starts r forwards late
      REQUIRE(sim.step_time == Approx(3.0 * m + (p - 1)));
      auto base = simulate(one_f_one_b(p, m), {1, 1, 1, 0});
      REQUIRE(sim.bubble_fraction < base.bubble_fraction);
    }
}

TEST_CASE("ZB-V and DualPipeV: vee memory, smaller bubble than 1F1B", "[pipe][simulate]") {
  for (int p : {2, 3, 4, 6})
    for (int m : {2 * p, 4 * p}) {
      INFO("p=" << p << " m=" << m);
      auto base = simulate(one_f_one_b(p, m), {1, 1, 1, 0});
      auto zbv = simulate(zero_bubble_v(p, m), {1, 1, 1, 0});
      auto dpv = simulate(dualpipe_v(p, m), {1, 1, 1, 0});
      REQUIRE(zbv.max_peak_memory == Approx(p));  // 2p chunk activations: 1F1B's memory
      REQUIRE(dpv.max_peak_memory == Approx(p + 0.5));
      const int pipeline_stages = 2 * p;  // the report's PP
      for (int r = 0; r < p; ++r) REQUIRE(dpv.peak_chunk_activations[r] == pipeline_stages + 1);
      for (int r = 0; r < p; ++r) REQUIRE(zbv.peak_chunk_activations[r] == pipeline_stages);
      REQUIRE(zbv.bubble_fraction < base.bubble_fraction / 2);
      // ZB-V keeps only the unavoidable start-up: rank p-1's first forward waits for p-1 chunk
      // forwards of t_F/2 (the V's other end finishes on the rank that started)
      REQUIRE(zbv.step_time == Approx(3.0 * m + (p - 1) * 0.5));
      REQUIRE(dpv.bubble_fraction < base.bubble_fraction / 2);
    }
}

TEST_CASE("local learning: no backward traffic, one microbatch alive", "[pipe][simulate]") {
  for (int p : {1, 2, 4})
    for (int m : {1, 5}) {
      auto sim = simulate(local_learning(p, m), {1, 1, 1, 0.1});
      REQUIRE(sim.backward_messages == 0);
      REQUIRE(sim.forward_messages == (p - 1) * m);
      REQUIRE(sim.max_peak_memory == 1);
      // each rank is busy 3m; the last starts after p-1 forwards and messages
      REQUIRE(sim.step_time == Approx(3.0 * m + (p - 1) * 1.1));
    }
}

TEST_CASE("simulated timelines respect the costs and list order", "[pipe][simulate]") {
  const Costs c{1, 2, 0.5, 0};
  auto s = interleaved_1f1b(2, 4, 2);
  auto sim = simulate(s, c);
  for (int r = 0; r < 2; ++r) {
    double last_end = 0;
    for (const auto& e : sim.timeline.events) {
      if (e.rank != r || !e.action.is_compute()) continue;
      const double expected = (e.action.kind == ActionKind::forward          ? 1.0
                               : e.action.kind == ActionKind::backward_input ? 2.0
                                                                             : 0.5) /
                              2;
      REQUIRE(e.end - e.start == Approx(expected));
      REQUIRE(e.start >= last_end - 1e-12);
      last_end = e.end;
    }
  }
}

TEST_CASE("simulate_with: per-action costs, checked by hand", "[pipe][simulate]") {
  // identical to simulate() for uniform costs
  auto s = zero_bubble_v(3, 6);
  const Costs c{1, 2, 0.5, 0.1};
  auto uniform = simulate(s, c);
  auto same = simulate_with(
      s,
      [&](int, const Action& a) {
        return (a.kind == ActionKind::forward ? 1.0 : a.kind == ActionKind::backward_input ? 2.0 : 0.5) / 2;
      },
      0.1);
  REQUIRE(same.step_time == Approx(uniform.step_time));
  REQUIRE(same.bubble_fraction == Approx(uniform.bubble_fraction));
  // GPipe, p=2, m=2, rank 1 twice as slow. Rank 0: F0 [0,1] F1 [1,2]. Rank 1: F0 [1,3] F1 [3,5]
  // B0 [5,7] W0 [7,9] (gradient sent after the full backward) B1 [9,11] W1 [11,13]. Rank 0:
  // B0 [9,10] W0 [10,11] B1 [13,14] W1 [14,15].
  auto slow = simulate_with(
      gpipe(2, 2), [](int rank, const Action&) { return rank == 0 ? 1.0 : 2.0; }, 0.0);
  REQUIRE(slow.step_time == Approx(15));
  REQUIRE(slow.busy[0] == Approx(6));
  REQUIRE(slow.busy[1] == Approx(12));
  REQUIRE(slow.bubble_fraction == Approx(1 - 18.0 / 30));
}

TEST_CASE("a receive posted early does not wait early: its consumer waits", "[pipe][simulate]") {
  // By hand: GPipe p=2 m=2, messages take 5. Rank 0: F0 [0,1] F1 [1,2]; rank 1 posts both
  // receives first: F0 [6,7] (activation 0 arrives at 1+5), F1 [7,8] (arrives at 2+5 = 7).
  // Waiting at the receives would have started F0 at 7.
  Schedule s = gpipe(2, 2);
  auto& r1 = s.ranks[1];
  REQUIRE(r1[2] == recv_action(Direction::activation, 1, 0, 0));
  std::rotate(r1.begin() + 1, r1.begin() + 2, r1.begin() + 3);  // Ra0 Ra1 F0 F1 ...
  REQUIRE(r1[1] == recv_action(Direction::activation, 1, 0, 0));
  auto sim = simulate(s, {1, 1, 1, 5});
  for (const auto& e : sim.timeline.events) {
    if (e.rank != 1 || e.action.kind != ActionKind::forward) continue;
    REQUIRE(e.start == Approx(e.action.microbatch == 0 ? 6.0 : 7.0));
  }
  // paired receives (interleaved, vee) against every receive right before its consumer: the same
  // compute timeline for any costs
  for (const char* name : {"interleaved_1f1b", "zb_v", "dualpipe_v"})
    for (int p : {2, 3, 4})
      for (int m : {2 * p, 3 * p})
        for (Costs c : {Costs{1, 1, 1, 0}, Costs{1, 2, 0.5, 0.25}, Costs{2, 3, 1, 0.5}, Costs{1, 1, 1, 2}}) {
          INFO(name << " p=" << p << " m=" << m << " comm=" << c.comm);
          const Schedule paired = make_schedule(name, p, m, 2);
          const Schedule at_use = insert_communication(paired, CommPlacement::at_use);
          REQUIRE(!(paired.ranks == at_use.ranks));
          auto a = simulate(paired, c), b = simulate(at_use, c);
          auto computes = [](const Simulation& sim) {
            std::vector<TimedAction> out;
            for (const auto& e : sim.timeline.events)
              if (e.action.is_compute()) out.push_back(e);
            std::sort(out.begin(), out.end(), [](const TimedAction& x, const TimedAction& y) {
              return std::tie(x.rank, x.start) < std::tie(y.rank, y.start);
            });
            return out;
          };
          const auto ea = computes(a), eb = computes(b);
          REQUIRE(ea.size() == eb.size());
          for (std::size_t i = 0; i < ea.size(); ++i) {
            REQUIRE(ea[i].action == eb[i].action);
            REQUIRE(ea[i].start == eb[i].start);
            REQUIRE(ea[i].end == eb[i].end);
          }
          REQUIRE(a.step_time == b.step_time);
        }
}

// pipe::balanced_split (devices of different speeds): its slowest stage is the fastest over every
// contiguous split, found by brute force over all compositions of the layers, for random costs,
// speeds and fixed costs; the split is valid and stage_times agrees with a hand computation.
TEST_CASE("balanced_split minimises the slowest stage (against brute force)", "[pipe][partition]") {
  using trellis::pipe::balanced_split;
  using trellis::pipe::stage_times;
  std::uint64_t x = 12345;
  auto uniform = [&] {  // xorshift in [0, 1)
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return static_cast<double>(x >> 11) / 9007199254740992.0;
  };
  for (int trial = 0; trial < 300; ++trial) {
    const int L = 1 + static_cast<int>(uniform() * 9), P = 1 + static_cast<int>(uniform() * std::min(L, 4));
    std::vector<double> costs, speeds, fixed;
    for (int i = 0; i < L; ++i) costs.push_back(trial % 3 == 0 ? 1.0 : 0.1 + uniform());
    for (int s = 0; s < P; ++s) speeds.push_back(trial % 5 == 0 ? 1.0 : 0.25 + uniform());
    for (int s = 0; s < P; ++s) fixed.push_back(trial % 2 == 0 ? 0.0 : uniform() * 2);
    const auto bounds = balanced_split(costs, speeds, fixed);
    REQUIRE(static_cast<int>(bounds.size()) == P + 1);
    CHECK((bounds.front() == 0 && bounds.back() == L));
    for (int s = 0; s < P; ++s) CHECK(bounds[s] < bounds[s + 1]);
    const auto times = stage_times(bounds, costs, speeds, fixed);
    const double got = *std::max_element(times.begin(), times.end());
    double brute = 1e300;  // every composition of L into P positive parts
    std::vector<int> b(static_cast<std::size_t>(P) + 1, 0);
    b[P] = L;
    auto rec = [&](auto&& self, int s) -> void {
      if (s == P) {
        const auto t = stage_times(b, costs, speeds, fixed);
        brute = std::min(brute, *std::max_element(t.begin(), t.end()));
        return;
      }
      for (int e = b[s - 1] + 1; e <= L - (P - s); ++e) {
        b[s] = e;
        self(self, s + 1);
      }
    };
    rec(rec, 1);
    INFO("trial " << trial << ": L " << L << " P " << P);
    CHECK(got == Approx(brute).epsilon(1e-12));
  }
  // by hand: 4 equal layers, the second stage half as fast -> 3 + 1 (times 3 and 2), not 2 + 2 (2 and 4)
  const std::vector<double> ones(4, 1.0), speeds{1.0, 0.5};
  CHECK(balanced_split(ones, speeds) == std::vector<int>{0, 3, 4});
  CHECK(stage_times(std::vector<int>{0, 2, 4}, ones, speeds) == std::vector<double>{2.0, 4.0});
  CHECK_THROWS_WITH(balanced_split(std::vector<double>(2, 1.0), std::vector<double>(3, 1.0)),
                    Catch::Contains("2 layers cannot give each of 3 stages one"));
  CHECK_THROWS_WITH(balanced_split(ones, std::vector<double>{1.0, 0.0}), Catch::Contains("speed of 0"));
}
