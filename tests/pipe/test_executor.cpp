// The executor on thread ranks: every generator over a grid of (p, m, v) runs small real stages
// (tanh(x W + b) layers, fp32, split unevenly over the virtual stages) and must produce the same
// parameter gradients as the whole model on one rank (tolerance: summation order only). Also: the
// activations alive at once match the simulator, broken schedules are rejected before any stage
// runs, and the recorded timeline is complete and ordered.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "pipe/tanh_stage.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/pipe/executor.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/picture.hpp"
#include "trellis/pipe/simulate.hpp"

using namespace trellis::pipe;
using trellis::comm::ThreadComm;
using trellis::comm::ThreadWorld;

namespace {

using namespace pipe_test;

struct RunResult {
  Grads grads;
  std::vector<ExecutionResult> per_rank;
  std::vector<int> stage_peaks;
};

RunResult run_pipeline(const Schedule& s, const Model& model, const std::vector<int>& bounds,
                       ExecuteOptions::P2P p2p = ExecuteOptions::P2P::isend) {
  RunResult out{Grads(model.layers), std::vector<ExecutionResult>(s.stages), std::vector<int>(s.stages)};
  std::mutex mutex;
  const auto origin = std::chrono::steady_clock::now();
  ThreadWorld(s.stages).run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(20000));
    TanhStage stage(model, s, comm.rank(), bounds);
    auto result = execute(comm, s, stage, {.origin = origin, .p2p = p2p});
    TRELLIS_CHECK(stage.alive() == 0u);
    std::lock_guard lock(mutex);
    for (int l : stage.layers()) {
      out.grads.weight[l] = stage.grads().weight[l];
      out.grads.bias[l] = stage.grads().bias[l];
    }
    out.per_rank[comm.rank()] = std::move(result);
    out.stage_peaks[comm.rank()] = stage.peak_saved;
  });
  return out;
}

void require_close(const Grads& got, const Grads& want) {
  for (std::size_t l = 0; l < want.weight.size(); ++l) {
    for (std::size_t i = 0; i < want.weight[l].size(); ++i) {
      INFO("layer " << l << " weight " << i);
      REQUIRE(got.weight[l][i] == Approx(want.weight[l][i]).epsilon(1e-5).margin(1e-5));
    }
    for (std::size_t i = 0; i < want.bias[l].size(); ++i) {
      INFO("layer " << l << " bias " << i);
      REQUIRE(got.bias[l][i] == Approx(want.bias[l][i]).epsilon(1e-5).margin(1e-5));
    }
  }
}

}  // namespace

TEST_CASE("every generator on thread ranks gives the single-rank gradients", "[pipe][executor]") {
  int runs = 0;
  for (const auto& name : schedule_names())
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 2, 3, 4, 8}) {
        std::vector<int> vs{1};
        if (name == "interleaved_1f1b") vs = {1, 2, 3};
        for (int v : vs) {
          if (name == "interleaved_1f1b" && v > 1 && m % p != 0) continue;
          if (name == "dualpipe_v" && m < 2 * p) continue;
          INFO(name << " p=" << p << " m=" << m << " v=" << v);
          Schedule s = make_schedule(name, p, m, v);
          const int stages = s.virtual_stages();
          const int layers = 2 * stages + 1;  // uneven: the first stage gets one layer more
          const auto bounds = split_layers(layers, stages);
          const Model model = make_model(layers, m);
          const Grads want = serial_gradients(model, bounds, s.local_learning);
          RunResult got = run_pipeline(s, model, bounds);
          require_close(got.grads, want);
          // activations alive at once: executor count == stage's own count == simulator
          auto sim = simulate(s);
          for (int r = 0; r < p; ++r) {
            REQUIRE(got.per_rank[r].peak_live_activations == sim.peak_chunk_activations[r]);
            REQUIRE(got.stage_peaks[r] == sim.peak_chunk_activations[r]);
            REQUIRE(got.per_rank[r].events.size() == s.ranks[r].size());
          }
          ++runs;
        }
      }
  REQUIRE(runs > 100);
}

TEST_CASE("batched point-to-point (one comm.batch per run of send/recv)", "[pipe][executor]") {
  // every generator passes the rendezvous check (receives paired with sends), so each runs with
  // batches and gives the single-rank gradients
  int runs = 0;
  for (const auto& name : schedule_names())
    for (int p : {2, 3, 4})
      for (int m : {1, 4, 7, 2 * p, 3 * p}) {
        std::vector<int> vs{1};
        if (name == "interleaved_1f1b") vs = {1, 2, 3};
        for (int v : vs) {
          if (name == "interleaved_1f1b" && v > 1 && m % p != 0) continue;
          if (name == "dualpipe_v" && m < 2 * p) continue;
          INFO(name << " p=" << p << " m=" << m << " v=" << v);
          Schedule s = make_schedule(name, p, m, v);
          const int stages = s.virtual_stages();
          const auto bounds = split_layers(stages + 2, stages);
          const Model model = make_model(stages + 2, m);
          RunResult got = run_pipeline(s, model, bounds, ExecuteOptions::P2P::batch);
          require_close(got.grads, serial_gradients(model, bounds, s.local_learning));
          ++runs;
        }
      }
  REQUIRE(runs > 100);
  // with every receive right before its consumer, interleaved needs asynchronous sends: refused
  // up front
  Schedule s = insert_communication(interleaved_1f1b(4, 8, 2), CommPlacement::at_use);
  const auto bounds = split_layers(8, 8);
  const Model model = make_model(8, 8);
  REQUIRE_THROWS_WITH(run_pipeline(s, model, bounds, ExecuteOptions::P2P::batch),
                      Catch::Contains("deadlock (rendezvous sends)"));
}

// Every activation and gradient padded past ThreadComm's eager limit, so that a send completes only
// once its receive is posted (rendezvous, like NCCL): batch mode then really hangs where the
// verifier says it would.
struct PaddedStage : TanhStage {
  static constexpr std::size_t kPad = ThreadComm::eager_limit / sizeof(float);
  using TanhStage::TanhStage;
  static std::size_t padded(std::size_t n) { return n ? n + kPad : 0; }
  std::size_t input_size(int c) const { return padded(TanhStage::input_size(c)); }
  std::size_t output_size(int c) const { return padded(TanhStage::output_size(c)); }
  void forward(int mb, int c, std::span<const float> in, std::span<float> out) {
    TanhStage::forward(mb, c, in.first(std::min(in.size(), TanhStage::input_size(c))),
                       out.first(TanhStage::output_size(c)));
  }
  void backward_input(int mb, int c, std::span<const float> grad_out, std::span<float> grad_in) {
    TanhStage::backward_input(mb, c, grad_out.first(std::min(grad_out.size(), TanhStage::output_size(c))),
                              grad_in.first(std::min(grad_in.size(), TanhStage::input_size(c))));
  }
};
static_assert(Stage<PaddedStage>);

TEST_CASE("batches with rendezvous sends: paired receives run, receives at their consumers hang",
          "[pipe][executor]") {
  auto run = [](const Schedule& s, const Model& model, const std::vector<int>& bounds, bool verify) {
    Grads grads(model.layers);
    std::mutex mutex;
    ThreadWorld(s.stages).run([&](ThreadComm& comm) {
      comm.set_timeout(std::chrono::milliseconds(verify ? 20000 : 500));
      PaddedStage stage(model, s, comm.rank(), bounds);
      execute(comm, s, stage, {.verify = verify, .p2p = ExecuteOptions::P2P::batch});
      std::lock_guard lock(mutex);
      for (int l : stage.layers()) {
        grads.weight[l] = stage.grads().weight[l];
        grads.bias[l] = stage.grads().bias[l];
      }
    });
    return grads;
  };
  for (const auto& s : {interleaved_1f1b(2, 4, 2), interleaved_1f1b(3, 6, 3), zero_bubble_v(2, 4), zero_bubble_v(3, 6),
                        dualpipe_v(2, 4), dualpipe_v(3, 6)}) {
    INFO(s.name << " p=" << s.stages << " m=" << s.microbatches);
    const auto bounds = split_layers(s.virtual_stages(), s.virtual_stages());
    const Model model = make_model(s.virtual_stages(), s.microbatches);
    require_close(run(s, model, bounds, true), serial_gradients(model, bounds, false));
  }
  // the same interleaved order with each receive right before its consumer, unverified: the cycle
  // of sends the verifier names happens
  const Schedule at_use = insert_communication(interleaved_1f1b(2, 4, 2), CommPlacement::at_use);
  const auto bounds = split_layers(4, 4);
  const Model model = make_model(4, 4);
  REQUIRE_THROWS_WITH(run(at_use, model, bounds, false), Catch::Contains("timeout after 500 ms"));
}

TEST_CASE("the recorded timeline is complete, per-rank ordered, and traceable", "[pipe][executor]") {
  Schedule s = zero_bubble_h1(3, 6);
  const auto bounds = split_layers(7, 3);
  const Model model = make_model(7, 6);
  RunResult got = run_pipeline(s, model, bounds);
  Timeline t = merge_timelines(3, got.per_rank);
  REQUIRE(t.events.size() == s.ranks[0].size() + s.ranks[1].size() + s.ranks[2].size());
  for (int r = 0; r < 3; ++r) {
    const auto& ev = got.per_rank[r].events;
    for (std::size_t i = 0; i < ev.size(); ++i) {
      REQUIRE(ev[i].rank == r);
      REQUIRE(ev[i].action == s.ranks[r][i]);
      REQUIRE(ev[i].end >= ev[i].start);
      if (i) REQUIRE(ev[i].start >= ev[i - 1].end);
    }
  }
  // a forward on rank 1 cannot start before the same microbatch's forward ended on rank 0
  for (const auto& e1 : got.per_rank[1].events)
    if (e1.action.kind == ActionKind::forward)
      for (const auto& e0 : got.per_rank[0].events)
        if (e0.action == forward_action(e1.action.microbatch)) REQUIRE(e1.start >= e0.end);
  auto stats = timeline_stats(t);
  REQUIRE(stats.step_time > 0);
  REQUIRE(stats.bubble_fraction >= 0);
  REQUIRE(stats.bubble_fraction < 1);
  const std::string trace = to_chrome_trace(t);
  REQUIRE(trace.find("\"tid\": 2") != std::string::npos);
}

// ThreadComm with every point-to-point tag 0: messages between two ranks then match in the order
// they are posted, as on NCCL (which has no tags).
struct TaglessComm : ThreadComm {
  explicit TaglessComm(ThreadComm&& c) : ThreadComm(std::move(c)) {}
  template <class T>
  trellis::comm::ThreadRequest isend(const T* buffer, std::size_t n, int peer, int = 0) {
    return ThreadComm::isend(buffer, n, peer, 0);
  }
  template <class T>
  trellis::comm::ThreadRequest irecv(T* buffer, std::size_t n, int peer, int = 0) {
    return ThreadComm::irecv(buffer, n, peer, 0);
  }
  trellis::comm::ThreadRequest batch(std::span<const trellis::comm::P2POp> ops) {
    std::vector<trellis::comm::P2POp> untagged(ops.begin(), ops.end());
    for (auto& op : untagged) op.tag = 0;
    return ThreadComm::batch(untagged);
  }
  TaglessComm split(int color, int key) { return TaglessComm(ThreadComm::split(color, key)); }
};
static_assert(trellis::comm::Communicator<TaglessComm>);

TEST_CASE("without tags (as on NCCL) every message still reaches its receive", "[pipe][executor]") {
  auto run = [](const Schedule& s, const Model& model, const std::vector<int>& bounds, ExecuteOptions::P2P p2p) {
    Grads grads(model.layers);
    std::mutex mutex;
    ThreadWorld(s.stages).run([&](ThreadComm& world) {
      world.set_timeout(std::chrono::milliseconds(20000));
      TaglessComm comm(world.split(0, world.rank()));
      PaddedStage stage(model, s, comm.rank(), bounds);
      execute(comm, s, stage, {.p2p = p2p});
      std::lock_guard lock(mutex);
      for (int l : stage.layers()) {
        grads.weight[l] = stage.grads().weight[l];
        grads.bias[l] = stage.grads().bias[l];
      }
    });
    return grads;
  };
  for (auto p2p : {ExecuteOptions::P2P::isend, ExecuteOptions::P2P::batch})
    for (const auto& s : {interleaved_1f1b(2, 4, 2), interleaved_1f1b(3, 6, 3), zero_bubble_v(2, 4),
                          zero_bubble_v(3, 6), dualpipe_v(2, 4), dualpipe_v(3, 6), one_f_one_b(3, 5)}) {
      INFO(s.name << " p=" << s.stages << " m=" << s.microbatches << " batch " << (p2p == ExecuteOptions::P2P::batch));
      const auto bounds = split_layers(s.virtual_stages(), s.virtual_stages());
      const Model model = make_model(s.virtual_stages(), s.microbatches);
      require_close(run(s, model, bounds, p2p), serial_gradients(model, bounds, false));
    }
  // ZB-V with each receive right before its consumer takes rank 0's messages out of the order
  // rank 0 sends them: without tags they land in the wrong buffers
  const Schedule at_use = insert_communication(zero_bubble_v(2, 4), CommPlacement::at_use);
  const auto bounds = split_layers(4, 4);
  const Model model = make_model(4, 4);
  const Grads got = run(at_use, model, bounds, ExecuteOptions::P2P::isend), want = serial_gradients(model, bounds, false);
  double worst = 0;
  for (std::size_t l = 0; l < want.weight.size(); ++l)
    for (std::size_t i = 0; i < want.weight[l].size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(got.weight[l][i] - want.weight[l][i])));
  REQUIRE(worst > 1e-2);
}

TEST_CASE("isend mode waits for a receive right before its consumer", "[pipe][executor]") {
  // interleaved pairs some receives with earlier sends; the rank waits for each only where its
  // data is needed, so its recorded wait sits right before the consumer
  Schedule s = interleaved_1f1b(2, 4, 2);
  const auto bounds = split_layers(4, 4);
  const Model model = make_model(4, 4);
  RunResult got = run_pipeline(s, model, bounds);
  int early = 0;
  for (int r = 0; r < 2; ++r) {
    const auto& list = s.ranks[r];
    for (std::size_t i = 0; i < list.size(); ++i)
      if (list[i].kind == ActionKind::recv && list[i + 1].is_compute() &&
          !(list[i + 1].microbatch == list[i].microbatch && list[i + 1].chunk == list[i].chunk))
        ++early;  // followed by a compute that is not its consumer
    const auto& ev = got.per_rank[r].events;
    REQUIRE(ev.size() == list.size());
    for (std::size_t i = 0; i < ev.size(); ++i) {
      if (ev[i].action.kind != ActionKind::recv) continue;
      REQUIRE(i + 1 < ev.size());
      const auto want =
          ev[i].action.direction == Direction::activation ? ActionKind::forward : ActionKind::backward_input;
      REQUIRE(ev[i + 1].action == Action{want, ev[i].action.microbatch, ev[i].action.chunk});
      REQUIRE(ev[i + 1].start >= ev[i].end);
    }
  }
  REQUIRE(early > 0);
}

TEST_CASE("a broken schedule is rejected before any stage runs", "[pipe][executor]") {
  Schedule s = one_f_one_b(2, 3);
  std::erase(s.ranks[1], recv_action(Direction::activation, 1, 0, 0));
  const auto bounds = split_layers(4, 2);
  const Model model = make_model(4, 3);
  std::vector<int> forwards(2, -1);
  try {
    ThreadWorld(2).run([&](ThreadComm& comm) {
      comm.set_timeout(std::chrono::milliseconds(20000));
      TanhStage stage(model, s, comm.rank(), bounds);
      try {
        execute(comm, s, stage);
      } catch (...) {
        forwards[comm.rank()] = stage.forwards;
        throw;
      }
    });
    FAIL("no error");
  } catch (const trellis::Error& e) {
    INFO(e.what());
    REQUIRE_THAT(e.what(),
                 Catch::Contains("rank 0: send activation of microbatch 1, chunk 0 to rank 1 (Sa1.0>1) has "
                                 "no matching receive"));
  }
  REQUIRE(forwards[0] == 0);
  REQUIRE(forwards[1] == 0);
}

TEST_CASE("the communicator must have one rank per stage", "[pipe][executor]") {
  Schedule s = gpipe(3, 2);
  const auto bounds = split_layers(3, 3);
  const Model model = make_model(3, 2);
  REQUIRE_THROWS_WITH(ThreadWorld(2).run([&](ThreadComm& comm) {
    TanhStage stage(model, s, comm.rank(), bounds);
    execute(comm, s, stage);
  }),
                      Catch::Contains("has 3 stages but the communicator has 2 ranks"));
}

TEST_CASE("a stage failing mid-step fails the run on every rank, without hanging", "[pipe][executor]") {
  struct FailingStage : TanhStage {
    using TanhStage::TanhStage;
    int fail_rank = -1, rank = -1;
    void forward(int mb, int chunk, std::span<const float> in, std::span<float> out) {
      if (rank == fail_rank && mb == 2) TRELLIS_THROW("stage broke on microbatch ", mb);
      TanhStage::forward(mb, chunk, in, out);
    }
  };
  static_assert(Stage<FailingStage>);
  for (const auto& name : {"1f1b", "zb_v"}) {
    Schedule s = make_schedule(name, 3, 6);
    const auto bounds = split_layers(s.virtual_stages(), s.virtual_stages());
    const Model model = make_model(s.virtual_stages(), 6);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      ThreadWorld(3).run([&](ThreadComm& comm) {
        comm.set_timeout(std::chrono::milliseconds(20000));
        FailingStage stage(model, s, comm.rank(), bounds);
        stage.fail_rank = 1;
        stage.rank = comm.rank();
        execute(comm, s, stage);
      });
      FAIL("no error");
    } catch (const trellis::Error& e) {
      INFO(e.what());
      REQUIRE(e.rank() == 1);
      REQUIRE_THAT(e.what(), Catch::Contains("stage broke on microbatch 2"));
    }
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  }
}
