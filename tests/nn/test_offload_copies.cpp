// Offloaded arena pools with their copies on the backend's copy queue (nn/activation_arena.hpp,
// OffloadCopies::queue; backend::HostCopyQueue):
//  - the overlapped policy, step by step on a three-unit pool of two frames: a region's write-back
//    starts when the pool's next unit begins, none for a region whose unit computes again at once,
//    eviction of a written-back region copies nothing, a resident region is not fetched, prefetch
//    starts a fetch that begin_unit waits for; values survive the round trip; the byte counts
//    follow from that policy (and the synchronous mode's, from the old one, on the same sequence);
//  - the pool's calls known (set_unit_calls): a region is written back after its forward only if
//    its frame is taken before its backward. By hand, a 1-rank GPT's pool (5 units: the embedding
//    is unit 4, blocks 3..1, the head 0; forward 4..0, then each unit's backward with its W, 0..4)
//    in 2 frames: the forward evicts units 4, 3 and 2 (unit 1 and the head are in the two frames
//    when the backward starts), so only they leave, each microbatch, each step; without the calls
//    the queue writes back units 1..4, and the synchronous mode (writes at eviction) 2..4;
//  - overlap, measured: over a SIMULATED host link (each copy held for bytes / bandwidth, a few ms)
//    a forward and backward of 8 units that each compute for a few ms; the time the queue's
//    copies spend inside the units' compute intervals (recorded by the test around each unit) must
//    be over 30 % of all copy time with the queue (it is ~all of it), also with the pool's calls
//    known (one write-back fewer, the others still started after each forward), while the
//    synchronous mode, whose copies run inside begin_unit before the compute, overlaps under 10 %.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>
#include <vector>

#include "trellis/backend/host.hpp"
#include "trellis/nn/activation_arena.hpp"

namespace {

using Host = trellis::backend::Host<float>;
using Arena = trellis::nn::ActivationArena<Host>;
using trellis::nn::OffloadCopies;

double now(const Arena& a) { return a.copy_queue()->seconds_since_start(); }

// Seconds of [s, e) inside the union of `intervals`.
double covered(double s, double e, std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double in = 0, reach = s;
  for (auto [a, b] : intervals) {
    a = std::max(a, reach);
    b = std::min(b, e);
    if (b > a) in += b - a, reach = b;
  }
  return in;
}

}  // namespace

TEST_CASE("offloaded pool on the copy queue: write-backs after the forward, fetches ahead, values kept",
          "[nn][arena][offload][copy_queue]") {
  const Host be;
  for (bool queue : {true, false}) {
    INFO((queue ? "copy queue" : "synchronous"));
    Arena arena(be, OffloadCopies{.queue = queue});
    const int pool = arena.add_offloaded_pool("chunk 0", {1000, 300, 600}, 1, 2);
    arena.allocate(/*poison=*/true);
    trellis::nn::SavedMemory<Host> saved(&arena, pool);
    std::vector<trellis::nn::SavedTensor<Host, float>> t;
    // forward: units 0, 1, 2 of microbatch 5 (50 floats each: 256 bytes a region)
    for (int u = 0; u < 3; ++u) {
      arena.begin_unit(pool, 5, u);
      t.push_back(saved.take<float>(be, 5, 50, "x"));
      std::fill(t.back().data(), t.back().data() + 50, 10.0f + u);
      arena.end_forward(pool, 5, u);
    }
    arena.copy_queue()->drain();
    if (queue) {
      // units 0 and 1 written back when units 1 and 2 began; unit 2's waits for the next unit;
      // unit 0's frame went to unit 2 without a copy (its bytes were on the host already)
      CHECK(arena.offloaded_bytes() == 2 * 256);
      CHECK(arena.host_held_bytes() == 2 * 256);  // unit 1 both in a frame and on the host
    } else {
      CHECK(arena.offloaded_bytes() == 256);  // only unit 0, evicted for unit 2
      CHECK(arena.host_held_bytes() == 256);
    }
    CHECK(arena.held_bytes() == 2 * 256);
    // backward, last unit first: unit 2 computes again at once (no write-back, no fetch)
    arena.begin_unit(pool, 5, 2);
    CHECK_FALSE(arena.prefetch(pool, 5, 1));  // resident: nothing to fetch
    CHECK(std::all_of(t[2].data(), t[2].data() + 50, [](float v) { return v == 12.0f; }));
    arena.release_unit(pool, 5, 2);
    arena.end_unit(pool, 5, 2);
    arena.begin_unit(pool, 5, 1);
    CHECK(std::all_of(t[1].data(), t[1].data() + 50, [](float v) { return v == 11.0f; }));
    CHECK(arena.prefetch(pool, 5, 0));  // unit 0 from its host room into unit 2's freed frame
    CHECK(arena.fetched_bytes() == 256);
    arena.release_unit(pool, 5, 1);
    arena.end_unit(pool, 5, 1);
    arena.begin_unit(pool, 5, 0);  // waits for the fetch
    CHECK(std::all_of(t[0].data(), t[0].data() + 50, [](float v) { return v == 10.0f; }));
    arena.release_unit(pool, 5, 0);
    CHECK(arena.offloaded_bytes() == (queue ? 2 * 256 : 256));  // no copy since the forward
    CHECK(arena.fetched_bytes() == 256);
    CHECK(arena.held_bytes() == 0);
    CHECK(arena.host_held_bytes() == 0);
    CHECK(arena.held_slots() == 0);
    // the errors stay: a read outside the unit, too few frames
    arena.begin_unit(pool, 6, 0);
    auto x = saved.take<float>(be, 6, 10, "y");
    arena.end_forward(pool, 6, 0);
    CHECK_THROWS_WITH(x.data(), Catch::Contains("not pinned"));
    arena.begin_unit(pool, 6, 0);
    arena.begin_unit(pool, 6, 1);
    CHECK_THROWS_WITH(arena.begin_unit(pool, 6, 2), Catch::Contains("all 2 frames"));
    arena.release(pool, 6);
  }
}

TEST_CASE("offloaded pool with its calls known: only the regions that must leave are written back",
          "[nn][arena][offload][copy_queue][calls]") {
  using trellis::nn::UnitCall;
  using Op = UnitCall::Op;
  const Host be;
  constexpr int units = 5, microbatches = 2;
  auto floats = [](int u) { return 64 * (u + 1); };  // 256 (u + 1) bytes: each region's size tells it apart
  std::vector<std::size_t> unit_bytes;
  for (int u = 0; u < units; ++u) unit_bytes.push_back(static_cast<std::size_t>(floats(u)) * sizeof(float));
  std::vector<UnitCall> step;  // the Trainer's pp = 1 loop (train/saved_activations.hpp), written out
  for (int mb = 0; mb < microbatches; ++mb) {
    for (int u = units - 1; u >= 0; --u) step.insert(step.end(), {{Op::begin, mb, u}, {Op::end_forward, mb, u}});
    for (int u = 0; u < units; ++u)
      step.insert(step.end(), {{Op::begin, mb, u}, {Op::prefetch, mb, u + 1}, {Op::begin, mb, u}, {Op::prefetch, mb, u + 1},
                               {Op::release, mb, u}, {Op::end, mb, u}});
  }
  const std::size_t must_leave = 256 * (3 + 4 + 5), all_but_head = 256 * (2 + 3 + 4 + 5);  // per microbatch
  struct Mode {
    const char* name;
    bool queue, calls;
    std::size_t per_step;
  };
  for (const Mode& m : {Mode{"queue, calls known", true, true, microbatches * must_leave},
                        Mode{"queue, calls unknown", true, false, microbatches * all_but_head},
                        Mode{"synchronous", false, false, microbatches * must_leave}}) {
    INFO(m.name);
    Arena arena(be, OffloadCopies{.queue = m.queue});
    const int pool = arena.add_offloaded_pool("chunk 0", unit_bytes, 1, 2);
    if (m.calls) arena.set_unit_calls(pool, step);
    arena.allocate(/*poison=*/true);
    trellis::nn::SavedMemory<Host> saved(&arena, pool);
    std::vector<trellis::nn::SavedTensor<Host, float>> t(units);
    int bad = 0;
    auto run_step = [&](int s) {
      for (const UnitCall& c : step) {
        arena.call(pool, c);
        const float v = static_cast<float>(100 * s + 10 * c.mb + c.unit);
        if (c.op == Op::end_forward) continue;
        if (c.op == Op::begin) {
          auto& x = t[static_cast<std::size_t>(c.unit)];
          if (x.empty()) {  // its forward: save, fill
            x = saved.take<float>(be, c.mb, floats(c.unit), "x");
            std::fill(x.data(), x.data() + x.size(), v);
          } else {  // its backward: the bytes of its forward, whichever tier they came back from
            bad += static_cast<int>(std::count_if(x.data(), x.data() + x.size(), [&](float y) { return y != v; }));
          }
        }
        if (c.op == Op::release) t[static_cast<std::size_t>(c.unit)] = {};
      }
    };
    run_step(0);
    CHECK(arena.offloaded_bytes() == m.per_step);
    CHECK(arena.fetched_bytes() == microbatches * must_leave);  // every mode fetches what was evicted
    // an evaluation-like forward off the list (begin, release): the pool stops following its list,
    // then finds it again at the next step's first call
    for (int u = units - 1; u >= 0; --u) {
      arena.begin_unit(pool, 0, u);
      arena.release_unit(pool, 0, u);
    }
    CHECK_FALSE(arena.following_calls(pool));
    run_step(1);
    run_step(2);
    CHECK(arena.following_calls(pool) == m.calls);
    CHECK(arena.offloaded_bytes() == 3 * m.per_step);
    CHECK(arena.fetched_bytes() == 3 * microbatches * must_leave);
    CHECK(bad == 0);
    CHECK(arena.held_bytes() == 0);
    CHECK(arena.host_held_bytes() == 0);
  }
}

TEST_CASE("offloaded pool on the copy queue: copies overlap the units' compute (simulated link)",
          "[nn][arena][offload][copy_queue][overlap]") {
  const Host be;
  constexpr int units = 8;
  constexpr int floats = 50'000;                                // 200 KB a region
  const auto compute = std::chrono::microseconds(4000);         // each unit's compute
  const trellis::backend::SimulatedCopyLink link{.bandwidth = 5e7, .latency = 0};  // 200 KB: 4 ms
  double fraction[3] = {0, 0, 0};
  for (int mode : {0, 1, 2}) {  // the queue; synchronous; the queue with the pool's calls known
    const bool queue = mode != 1;
    INFO((mode == 0 ? "copy queue" : mode == 1 ? "synchronous" : "copy queue, calls known"));
    Arena arena(be, OffloadCopies{.queue = queue, .simulated = link});
    const int pool = arena.add_offloaded_pool("chunk 0", std::vector<std::size_t>(units, floats * sizeof(float)), 1, 2);
    if (mode == 2) {
      using Op = trellis::nn::UnitCall::Op;
      std::vector<trellis::nn::UnitCall> calls;
      for (int u = units - 1; u >= 0; --u) calls.insert(calls.end(), {{Op::begin, 0, u}, {Op::end_forward, 0, u}});
      for (int u = 0; u < units; ++u) calls.insert(calls.end(), {{Op::begin, 0, u}, {Op::prefetch, 0, u + 1}, {Op::release, 0, u}});
      arena.set_unit_calls(pool, std::move(calls));
    }
    arena.allocate();
    arena.copy_queue()->set_recording(true);
    trellis::nn::SavedMemory<Host> saved(&arena, pool);
    std::vector<trellis::nn::SavedTensor<Host, float>> t;
    std::vector<std::pair<double, double>> computing;
    auto work = [&](float* p, float v, bool write) {  // the unit's compute: touches its region, then spins
      const double s = now(arena);
      const auto until = std::chrono::steady_clock::now() + compute;
      if (write) std::fill(p, p + floats, v);
      int bad = 0;
      for (int i = 0; i < floats; i += 97) bad += p[i] != v;
      while (std::chrono::steady_clock::now() < until) {
      }
      computing.emplace_back(s, now(arena));
      return bad;
    };
    int bad = 0;
    for (int u = units - 1; u >= 0; --u) {  // the forward meets the units last first (as GptModel)
      arena.begin_unit(pool, 0, u);
      t.resize(units);
      t[static_cast<std::size_t>(u)] = saved.take<float>(be, 0, floats, "x");
      bad += work(t[static_cast<std::size_t>(u)].data(), static_cast<float>(u), true);
      arena.end_forward(pool, 0, u);
    }
    for (int u = 0; u < units; ++u) {  // backward with its W, prefetching the next unit
      arena.begin_unit(pool, 0, u);
      arena.prefetch(pool, 0, u + 1);
      bad += work(t[static_cast<std::size_t>(u)].data(), static_cast<float>(u), false);
      arena.release_unit(pool, 0, u);
    }
    CHECK(bad == 0);
    arena.copy_queue()->drain();
    double copy = 0, inside = 0;
    for (const auto& r : arena.copy_queue()->records()) {
      copy += r.end - r.start;
      inside += covered(r.start, r.end, computing);
    }
    // both modes copy: 6 units evicted in the forward (2 frames), fetched back in the backward
    const std::size_t region = trellis::nn::saved_size<float>(floats);
    CHECK(arena.fetched_bytes() == 6 * region);
    // the queue writes back every unit but the last of the forward (7); synchronous, and the queue
    // knowing the calls: the 6 evicted (units 7..2; 1 and 0 stay in the two frames)
    CHECK(arena.offloaded_bytes() == (mode == 0 ? 7 : 6) * region);
    if (mode == 2) CHECK(arena.following_calls(pool));
    REQUIRE(copy > 0);
    fraction[mode] = inside / copy;
    std::printf("copy %s: %zu copies, %.1f ms copying (simulated link), %.1f ms of it inside compute (%.0f %%)\n",
                mode == 0 ? "queue" : mode == 1 ? "synchronous" : "queue, calls known", arena.copy_queue()->records().size(),
                copy * 1e3, inside * 1e3, 100 * inside / copy);
  }
  CHECK(fraction[0] > 0.3);
  CHECK(fraction[1] < 0.1);
  CHECK(fraction[2] > 0.3);  // the write-backs that must happen still start after each forward
}
