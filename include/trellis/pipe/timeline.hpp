// A timeline: what ran where and when (simulated by simulate(), or measured by the executor), and
// the figures both are judged by: step time, bubble fraction, busy time per rank.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "trellis/pipe/schedule.hpp"

namespace trellis::pipe {

struct TimedAction {
  int rank = 0;
  Action action;
  double start = 0;  // seconds (or the simulator's cost unit)
  double end = 0;
};

struct Timeline {
  int stages = 0;
  std::vector<TimedAction> events;  // any order; compute and (for recv) waiting time
};

struct TimelineStats {
  double step_time = 0;               // first start to last end, over all ranks
  double bubble_fraction = 0;         // 1 - compute time / (ranks * step_time)
  double steady_bubble_fraction = 0;  // idle time inside each rank's own first-start..last-end
                                      // span / sum of spans: the bubble left when consecutive
                                      // steps overlap (ZB-H2's parallelogram)
  std::vector<double> busy;           // compute time per rank
  std::vector<double> idle_fraction;  // per rank: 1 - busy / step_time
};

// Only compute actions (F, B, W) count as busy; send/recv events are ignored.
inline TimelineStats timeline_stats(const Timeline& t) {
  TimelineStats out;
  const int p = t.stages;
  out.busy.assign(static_cast<std::size_t>(p), 0.0);
  out.idle_fraction.assign(static_cast<std::size_t>(p), 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> first(p, inf), last(p, -inf);
  double t0 = inf, t1 = -inf;
  for (const auto& e : t.events) {
    if (!e.action.is_compute() || e.rank < 0 || e.rank >= p) continue;
    out.busy[e.rank] += e.end - e.start;
    first[e.rank] = std::min(first[e.rank], e.start);
    last[e.rank] = std::max(last[e.rank], e.end);
    t0 = std::min(t0, e.start);
    t1 = std::max(t1, e.end);
  }
  if (t1 <= t0) return out;
  out.step_time = t1 - t0;
  double busy = 0, span = 0;
  for (int r = 0; r < p; ++r) {
    busy += out.busy[r];
    if (last[r] > first[r]) span += last[r] - first[r];
    out.idle_fraction[r] = 1.0 - out.busy[r] / out.step_time;
  }
  out.bubble_fraction = 1.0 - busy / (p * out.step_time);
  out.steady_bubble_fraction = span > 0 ? 1.0 - busy / span : 0.0;
  return out;
}

}  // namespace trellis::pipe
