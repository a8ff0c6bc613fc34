// The executor on thread ranks: every generator over a grid of (p, m, v) runs small real stages
// (tanh(x W + b) layers, fp32, split unevenly over the virtual stages) and must produce the same
// parameter gradients as the whole model on one rank (tolerance: summation order only). Also: the
// activations alive at once match the simulator, broken schedules are rejected before any stage
// runs, and the recorded timeline is complete and ordered.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "trellis/comm/threads.hpp"
#include "trellis/pipe/executor.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/picture.hpp"
#include "trellis/pipe/simulate.hpp"

using namespace trellis::pipe;
using trellis::comm::ThreadComm;
using trellis::comm::ThreadWorld;

// Catch2's assertions are not thread-safe: checks on rank threads throw instead, and ThreadWorld
// rethrows the first failure on the test's thread.
#define STAGE_CHECK(cond) TRELLIS_CHECK(cond)

namespace {

constexpr int kWidth = 5;  // d: features
constexpr int kRows = 3;   // rows per microbatch

struct Model {
  int layers = 0;
  std::vector<std::vector<float>> weight;  // [layer] (d, d), row-major
  std::vector<std::vector<float>> bias;    // [layer] (d)
  std::vector<std::vector<float>> data;    // [mb] (rows, d)
};

Model make_model(int layers, int microbatches) {
  Model model;
  model.layers = layers;
  unsigned state = 12345u + static_cast<unsigned>(layers * 31 + microbatches);
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>((state >> 8) & 0xffff) / 65536.0f - 0.5f;
  };
  for (int l = 0; l < layers; ++l) {
    std::vector<float> w(kWidth * kWidth), b(kWidth);
    for (auto& x : w) x = 1.2f * next();
    for (auto& x : b) x = 0.2f * next();
    model.weight.push_back(w);
    model.bias.push_back(b);
  }
  for (int mb = 0; mb < microbatches; ++mb) {
    std::vector<float> x(kRows * kWidth);
    for (auto& v : x) v = 2.0f * next();
    model.data.push_back(x);
  }
  return model;
}

// y = tanh(x W + b); x, y: (rows, d)
void layer_forward(const Model& model, int l, const float* x, float* y) {
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kWidth; ++j) {
      float z = model.bias[l][j];
      for (int k = 0; k < kWidth; ++k) z += x[i * kWidth + k] * model.weight[l][k * kWidth + j];
      y[i * kWidth + j] = std::tanh(z);
    }
}
// gz = gy * (1 - y^2); gx = gz W^T
void layer_backward_input(const Model& model, int l, const float* y, const float* gy, float* gz, float* gx) {
  for (int e = 0; e < kRows * kWidth; ++e) gz[e] = gy[e] * (1.0f - y[e] * y[e]);
  for (int i = 0; i < kRows; ++i)
    for (int k = 0; k < kWidth; ++k) {
      float s = 0;
      for (int j = 0; j < kWidth; ++j) s += gz[i * kWidth + j] * model.weight[l][k * kWidth + j];
      gx[i * kWidth + k] = s;
    }
}
// gW += x^T gz; gb += column sums of gz
void layer_backward_weight(const float* x, const float* gz, float* gw, float* gb) {
  for (int k = 0; k < kWidth; ++k)
    for (int j = 0; j < kWidth; ++j) {
      float s = 0;
      for (int i = 0; i < kRows; ++i) s += x[i * kWidth + k] * gz[i * kWidth + j];
      gw[k * kWidth + j] += s;
    }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kWidth; ++j) gb[j] += gz[i * kWidth + j];
}

struct Grads {
  std::vector<std::vector<float>> weight, bias;
  explicit Grads(int layers)
      : weight(layers, std::vector<float>(kWidth * kWidth, 0.0f)), bias(layers, std::vector<float>(kWidth, 0.0f)) {}
};

// The reference: the whole model on one rank. The loss of a microbatch is 0.5 * sum(y^2) of the
// last layer; under local learning every stage [bounds[s], bounds[s+1]) has that loss on its own
// output, with its input detached.
Grads serial_gradients(const Model& model, const std::vector<int>& bounds, bool local) {
  Grads g(model.layers);
  const int n = kRows * kWidth;
  for (const auto& input : model.data) {
    std::vector<std::vector<float>> acts(model.layers + 1, std::vector<float>(n));
    acts[0] = input;
    for (int l = 0; l < model.layers; ++l) layer_forward(model, l, acts[l].data(), acts[l + 1].data());
    std::vector<float> gy(n), gz(n), gx(n);
    for (int l = model.layers - 1; l >= 0; --l) {
      const bool loss_here = l == model.layers - 1 ||
                             (local && std::find(bounds.begin(), bounds.end(), l + 1) != bounds.end());
      if (loss_here) gy = acts[l + 1];  // d(0.5 sum y^2)/dy = y; detaches under local learning
      layer_backward_input(model, l, acts[l + 1].data(), gy.data(), gz.data(), gx.data());
      layer_backward_weight(acts[l].data(), gz.data(), g.weight[l].data(), g.bias[l].data());
      gy = gx;
    }
  }
  return g;
}

// One rank's stage: its chunks' layers, gradients, and what F/B keep per (mb, chunk).
class TanhStage {
 public:
  using value_type = float;

  TanhStage(const Model& model, const Schedule& s, int rank, const std::vector<int>& bounds)
      : model_(model), schedule_(s), rank_(rank), grads_(model.layers) {
    for (int c = 0; c < s.chunks; ++c) {
      const int vs = s.virtual_stage(rank, c);
      first_layer_.push_back(bounds[vs]);
      end_layer_.push_back(bounds[vs + 1]);
    }
  }
  std::size_t input_size(int) const { return kRows * kWidth; }
  std::size_t output_size(int chunk) const { return schedule_.is_last(rank_, chunk) ? 0 : kRows * kWidth; }

  void forward(int mb, int chunk, std::span<const float> in, std::span<float> out) {
    const bool first = schedule_.is_first(rank_, chunk);
    STAGE_CHECK(in.size() == (first ? 0u : static_cast<std::size_t>(kRows * kWidth)));
    STAGE_CHECK(out.size() == output_size(chunk));
    Saved& saved = saved_[{mb, chunk}];
    STAGE_CHECK(saved.acts.empty());
    const int a = first_layer_[chunk], b = end_layer_[chunk], n = kRows * kWidth;
    saved.acts.assign(b - a + 1, std::vector<float>(n));
    if (first) saved.acts[0] = model_.data[mb];
    else saved.acts[0].assign(in.begin(), in.end());
    for (int l = a; l < b; ++l) layer_forward(model_, l, saved.acts[l - a].data(), saved.acts[l - a + 1].data());
    std::copy(saved.acts.back().begin(), saved.acts.back().begin() + static_cast<long>(out.size()), out.begin());
    ++forwards;
    peak_saved = std::max(peak_saved, static_cast<int>(saved_.size()));
  }

  void backward_input(int mb, int chunk, std::span<const float> grad_out, std::span<float> grad_in) {
    auto it = saved_.find({mb, chunk});
    STAGE_CHECK(it != saved_.end());
    Saved& saved = it->second;
    STAGE_CHECK(saved.gz.empty());
    const bool own_loss = schedule_.local_learning || schedule_.is_last(rank_, chunk);
    STAGE_CHECK(grad_out.size() == (own_loss ? 0u : static_cast<std::size_t>(kRows * kWidth)));
    const bool pass = !schedule_.local_learning && !schedule_.is_first(rank_, chunk);
    STAGE_CHECK(grad_in.size() == (pass ? static_cast<std::size_t>(kRows * kWidth) : 0u));
    const int a = first_layer_[chunk], b = end_layer_[chunk], n = kRows * kWidth;
    std::vector<float> gy = own_loss ? saved.acts.back() : std::vector<float>(grad_out.begin(), grad_out.end());
    std::vector<float> gx(n);
    saved.gz.assign(b - a, std::vector<float>(n));
    for (int l = b - 1; l >= a; --l) {
      layer_backward_input(model_, l, saved.acts[l - a + 1].data(), gy.data(), saved.gz[l - a].data(), gx.data());
      gy = gx;
    }
    std::copy(gy.begin(), gy.begin() + static_cast<long>(grad_in.size()), grad_in.begin());
  }

  void backward_weight(int mb, int chunk) {
    auto it = saved_.find({mb, chunk});
    STAGE_CHECK(it != saved_.end());
    STAGE_CHECK(!it->second.gz.empty());  // B before W
    const int a = first_layer_[chunk], b = end_layer_[chunk];
    for (int l = a; l < b; ++l)
      layer_backward_weight(it->second.acts[l - a].data(), it->second.gz[l - a].data(), grads_.weight[l].data(),
                            grads_.bias[l].data());
    saved_.erase(it);  // this activation is freed as soon as its W is done
  }

  const Grads& grads() const { return grads_; }
  std::vector<int> layers() const {
    std::vector<int> out;
    for (std::size_t c = 0; c < first_layer_.size(); ++c)
      for (int l = first_layer_[c]; l < end_layer_[c]; ++l) out.push_back(l);
    return out;
  }
  std::size_t alive() const { return saved_.size(); }

  int forwards = 0;
  int peak_saved = 0;

 private:
  struct Saved {
    std::vector<std::vector<float>> acts;  // layer inputs and the chunk's output
    std::vector<std::vector<float>> gz;    // per layer, from B, for W
  };
  const Model& model_;
  const Schedule& schedule_;
  int rank_;
  Grads grads_;
  std::vector<int> first_layer_, end_layer_;
  std::map<std::pair<int, int>, Saved> saved_;
};

static_assert(Stage<TanhStage>);

struct RunResult {
  Grads grads;
  std::vector<ExecutionResult> per_rank;
  std::vector<int> stage_peaks;
};

RunResult run_pipeline(const Schedule& s, const Model& model, const std::vector<int>& bounds) {
  RunResult out{Grads(model.layers), std::vector<ExecutionResult>(s.stages), std::vector<int>(s.stages)};
  std::mutex mutex;
  const auto origin = std::chrono::steady_clock::now();
  ThreadWorld(s.stages).run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(20000));
    TanhStage stage(model, s, comm.rank(), bounds);
    auto result = execute(comm, s, stage, {.origin = origin});
    STAGE_CHECK(stage.alive() == 0u);
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
    REQUIRE_THAT(e.what(), Catch::Contains("rank 0: send activation of microbatch 1, chunk 0 to rank 1 (Sa1.0>1) has "
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
