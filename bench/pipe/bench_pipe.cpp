// Pipeline schedules on thread ranks: measured bubble fraction vs the simulator's prediction.
//
// Each rank's stage costs a controlled time per action (t_F, t_B, t_W for one microbatch through
// the rank's whole share of layers; a chunk action takes 1/v of that). By default the cost is a
// sleep (ending in a spin of at most 0.3 ms for precision): honest on a 2-core machine running more
// ranks than cores, because a sleeping rank does not take a core from the others, just as a rank
// waiting on its GPU would not. --busy spins the whole time (only meaningful with at least as many
// free cores as ranks).
//
// For each schedule: the executor runs it (warm-up + --iters repetitions, the fastest kept); the
// measured bubble is 1 - compute / (p * step time) from the recorded timeline. The prediction is
// simulate() fed with the measured mean duration of each action kind and the measured median
// message latency (send end to the end of a recv that had to wait). Goal: within 10%. A second
// prediction, "replay", feeds the simulator every action's own measured duration (and each
// message's own latency where its receiver waited): it separates
// the executor's faithfulness to the schedule from the noise of the one-cost-per-kind model.
//
//   bench_pipe [--p 4] [--m 8] [--t-ms 5] [--iters 5] [--busy] [--svg-dir DIR] [--json FILE]
// Writes DIR/pipe_<schedule>.svg (simulated, unit costs), DIR/pipe_<schedule>_measured.svg and
// DIR/pipe_<schedule>_trace.json (Chrome trace of the kept run; open in ui.perfetto.dev).
#include <filesystem>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "support/report.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/pipe.hpp"

namespace {

using namespace trellis;
using Clock = std::chrono::steady_clock;

// Sleeps until 0.3 ms before the deadline, then spins: the sleep's wake-up jitter (tens to hundreds
// of microseconds on a loaded machine) stays out of the action's duration, while a rank spends at
// most 0.3 ms per action on a core. --busy spins the whole time.
void spend(double seconds, bool busy) {
  if (seconds <= 0) return;
  const auto until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  constexpr auto spin = std::chrono::microseconds(300);
  if (!busy && until - Clock::now() > spin) std::this_thread::sleep_until(until - spin);
  while (Clock::now() < until) {
  }
}

// A stage whose actions cost a set time; activations are small real buffers that travel.
class TimedStage {
 public:
  using value_type = float;
  TimedStage(const pipe::Costs& costs, int chunks, bool busy) : costs_(costs), chunks_(chunks), busy_(busy) {}
  std::size_t input_size(int) const { return 256; }
  std::size_t output_size(int) const { return 256; }
  void forward(int, int, std::span<const float>, std::span<float> out) {
    spend(costs_.forward / chunks_, busy_);
    std::fill(out.begin(), out.end(), 1.0f);
  }
  void backward_input(int, int, std::span<const float>, std::span<float> grad_in) {
    spend(costs_.backward_input / chunks_, busy_);
    std::fill(grad_in.begin(), grad_in.end(), 1.0f);
  }
  void backward_weight(int, int) { spend(costs_.backward_weight / chunks_, busy_); }

 private:
  pipe::Costs costs_;
  int chunks_;
  bool busy_;
};

pipe::Timeline run_once(const pipe::Schedule& s, const pipe::Costs& costs, bool busy) {
  std::vector<pipe::ExecutionResult> per_rank(s.stages);
  const auto origin = Clock::now();
  comm::ThreadWorld(s.stages).run([&](comm::ThreadComm& c) {
    TimedStage stage(costs, s.chunks, busy);
    per_rank[c.rank()] = pipe::execute(c, s, stage, {.origin = origin});
  });
  return pipe::merge_timelines(s.stages, per_rank);
}

// Mean measured duration per compute kind (scaled back to a rank's whole share) and the median
// latency of messages a receiver actually waited for.
pipe::Costs measured_costs(const pipe::Schedule& s, const pipe::Timeline& t) {
  double sum[3] = {0, 0, 0};
  int count[3] = {0, 0, 0};
  std::map<std::tuple<int, int, int>, double> send_end;
  for (const auto& e : t.events) {
    if (e.action.is_compute()) {
      const int k = static_cast<int>(e.action.kind);
      sum[k] += e.end - e.start;
      ++count[k];
    } else if (e.action.kind == pipe::ActionKind::send) {
      send_end[pipe::message_key(s, e.rank, e.action)] = e.end;
    }
  }
  std::vector<double> latency;
  for (const auto& e : t.events)
    if (e.action.kind == pipe::ActionKind::recv) {
      auto it = send_end.find(pipe::message_key(s, e.rank, e.action));
      if (it != send_end.end() && it->second > e.start) latency.push_back(std::max(0.0, e.end - it->second));
    }
  std::sort(latency.begin(), latency.end());
  pipe::Costs c;
  c.forward = count[0] ? sum[0] / count[0] * s.chunks : 0;
  c.backward_input = count[1] ? sum[1] / count[1] * s.chunks : 0;
  c.backward_weight = count[2] ? sum[2] / count[2] * s.chunks : 0;
  c.comm = latency.empty() ? 0 : latency[latency.size() / 2];
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const int p = static_cast<int>(bench::int_flag(argc, argv, "--p", 4));
  const int m = static_cast<int>(bench::int_flag(argc, argv, "--m", 8));
  const int iters = std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--iters", 5)));
  const double t = bench::double_flag(argc, argv, "--t-ms", 5.0) * 1e-3;
  const bool busy = bench::has_flag(argc, argv, "--busy");
  const std::string svg_dir = bench::flag_value(argc, argv, "--svg-dir", ".");
  std::filesystem::create_directories(svg_dir);  // the pictures go there; make it if missing
  const pipe::Costs costs{t, t, t, 0};

  std::printf("# pipeline schedules on %d thread ranks, m=%d, t_F=t_B=t_W=%.2f ms per rank share (%s)\n", p,
              m, t * 1e3, busy ? "busy-wait" : "sleep");
  std::printf("# predicted = simulate() with the measured mean action costs and message latency\n");
  std::printf("# replay = simulate() with every action's own measured duration and message latency\n");
  std::printf("%-17s %3s %8s %8s %8s %9s %9s %7s %9s %7s %7s\n", "schedule", "v", "step_ms", "pred_ms",
              "comm_us", "bubble", "pred", "err%", "replay", "err%", "mem");
  bench::JsonReport report("pipe");
  for (const auto& name : pipe::schedule_names()) {
    const int v = name == "interleaved_1f1b" ? 2 : 1;
    pipe::Schedule s;
    try {
      s = pipe::make_schedule(name, p, m, v);
    } catch (const Error& e) {
      std::printf("%-17s skipped: %s\n", name.c_str(), e.message().c_str());
      continue;
    }
    pipe::write_file(svg_dir + "/pipe_" + name + ".svg", pipe::to_svg(s));
    run_once(s, costs, busy);  // warm-up
    pipe::Timeline best;
    double best_step = 1e30;
    for (int i = 0; i < iters; ++i) {
      auto timeline = run_once(s, costs, busy);
      auto st = pipe::timeline_stats(timeline);
      if (st.step_time < best_step) {
        best_step = st.step_time;
        best = std::move(timeline);
      }
    }
    const auto measured = pipe::timeline_stats(best);
    const pipe::Costs fitted = measured_costs(s, best);
    const auto predicted = pipe::simulate(s, fitted);
    const double err = std::abs(measured.bubble_fraction - predicted.bubble_fraction) /
                       std::max(predicted.bubble_fraction, 1e-9);
    // replay: the simulator fed every action's own measured duration (isolates the schedule and
    // executor from the cost model's one-number-per-kind simplification)
    std::map<std::tuple<int, int, int, int>, double> duration;
    for (const auto& e : best.events)
      if (e.action.is_compute())
        duration[{e.rank, static_cast<int>(e.action.kind), e.action.microbatch, e.action.chunk}] =
            e.end - e.start;
    // each message's own latency where its receiver had to wait (data arrived at the recv's end);
    // the median elsewhere
    std::map<pipe::MessageKey, double> send_end, latency;
    for (const auto& e : best.events)
      if (e.action.kind == pipe::ActionKind::send) send_end[pipe::message_key(s, e.rank, e.action)] = e.end;
    for (const auto& e : best.events)
      if (e.action.kind == pipe::ActionKind::recv) {
        const auto key = pipe::message_key(s, e.rank, e.action);
        auto it = send_end.find(key);
        if (it != send_end.end() && it->second > e.start) latency[key] = std::max(0.0, e.end - it->second);
      }
    const auto replay = pipe::simulate_with(
        s,
        [&](int r, const pipe::Action& a) {
          return duration.at({r, static_cast<int>(a.kind), a.microbatch, a.chunk});
        },
        [&](int r, const pipe::Action& send) {
          auto it = latency.find(pipe::message_key(s, r, send));
          return it != latency.end() ? it->second : fitted.comm;
        });
    const double replay_err =
        std::abs(measured.bubble_fraction - replay.bubble_fraction) / std::max(replay.bubble_fraction, 1e-9);
    const auto sim_unit = pipe::simulate(s, costs);
    std::printf("%-17s %3d %8.2f %8.2f %8.1f %9.4f %9.4f %7.1f %9.4f %7.1f %7.2f\n", name.c_str(), s.chunks,
                measured.step_time * 1e3, predicted.step_time * 1e3, fitted.comm * 1e6,
                measured.bubble_fraction, predicted.bubble_fraction, 100 * err, replay.bubble_fraction,
                100 * replay_err, sim_unit.max_peak_memory);
    pipe::write_file(svg_dir + "/pipe_" + name + "_measured.svg", pipe::to_svg(best, name + " measured"));
    pipe::write_file(svg_dir + "/pipe_" + name + "_trace.json", pipe::to_chrome_trace(best));
    bench::Row row;
    row.add_text("schedule", name)
        .add("p", static_cast<long long>(p))
        .add("m", static_cast<long long>(m))
        .add("v", static_cast<long long>(s.chunks))
        .add("step_ms", measured.step_time * 1e3)
        .add("step_pred_ms", predicted.step_time * 1e3)
        .add("comm_us", fitted.comm * 1e6)
        .add("bubble", measured.bubble_fraction, "%.5f")
        .add("bubble_pred", predicted.bubble_fraction, "%.5f")
        .add("bubble_rel_err", err, "%.4f")
        .add("bubble_replay", replay.bubble_fraction, "%.5f")
        .add("bubble_replay_rel_err", replay_err, "%.4f")
        .add("peak_memory", predicted.max_peak_memory);
    report.add(row);
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}
