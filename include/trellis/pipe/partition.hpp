// pipe::balanced_split: which contiguous layers each pipeline stage holds, chosen from per-layer
// costs and per-stage speeds so that the slowest stage's predicted time is smallest (devices of
// different speeds: the slow one gets fewer layers). A stage's predicted time is
//   (fixed[s] + sum of its layers' costs) / speeds[s]
// (fixed: work a stage does whatever it holds, e.g. the embedding on the first stage and the LM
// head on the last). Exact: a dynamic program over the split points, O(stages x layers^2); among
// splits with the same slowest time it keeps the one whose first stages are shortest
// (deterministic: every rank computes the same split). Bounds as pipe::split_layers's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "trellis/core/error.hpp"

namespace trellis::pipe {

// bounds (stages + 1 entries): stage s holds layers [bounds[s], bounds[s + 1]).
inline std::vector<double> stage_times(std::span<const int> bounds, std::span<const double> costs,
                                       std::span<const double> speeds, std::span<const double> fixed = {}) {
  std::vector<double> t;
  for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
    double c = fixed.empty() ? 0.0 : fixed[s];
    for (int i = bounds[s]; i < bounds[s + 1]; ++i) c += costs[static_cast<std::size_t>(i)];
    t.push_back(c / speeds[s]);
  }
  return t;
}

// Every stage gets at least one layer. costs: one per layer (>= 0); speeds: one per stage (> 0);
// fixed: empty or one per stage (>= 0).
inline std::vector<int> balanced_split(std::span<const double> costs, std::span<const double> speeds,
                                       std::span<const double> fixed = {}) {
  const int L = static_cast<int>(costs.size()), P = static_cast<int>(speeds.size());
  TRELLIS_CHECK(P >= 1 && L >= P, "balanced_split: ", L, " layers cannot give each of ", P, " stages one");
  TRELLIS_CHECK(fixed.empty() || static_cast<int>(fixed.size()) == P, "balanced_split: ", fixed.size(),
                " fixed costs for ", P, " stages");
  for (double s : speeds) TRELLIS_CHECK(s > 0, "balanced_split: a stage speed of ", s, " (must be > 0)");
  for (double c : costs) TRELLIS_CHECK(c >= 0, "balanced_split: a layer cost of ", c, " (must be >= 0)");
  std::vector<double> prefix(static_cast<std::size_t>(L) + 1, 0.0);
  for (int i = 0; i < L; ++i) prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + costs[static_cast<std::size_t>(i)];
  auto time = [&](int s, int a, int b) {
    return ((fixed.empty() ? 0.0 : fixed[static_cast<std::size_t>(s)]) + prefix[static_cast<std::size_t>(b)] -
            prefix[static_cast<std::size_t>(a)]) / speeds[static_cast<std::size_t>(s)];
  };
  // best[s][i]: the smallest slowest time of stages s.. holding layers [i, L); cut[s][i]: where stage s ends
  constexpr double inf = std::numeric_limits<double>::infinity();
  const auto rows = static_cast<std::size_t>(P) + 1, cols = static_cast<std::size_t>(L) + 1;
  std::vector<double> best(rows * cols, inf);
  std::vector<int> cut(rows * cols, -1);
  auto at = [&](int s, int i) { return static_cast<std::size_t>(s) * cols + static_cast<std::size_t>(i); };
  best[at(P, L)] = 0.0;
  for (int s = P - 1; s >= 0; --s)
    for (int i = s; i <= L - (P - s); ++i)
      for (int j = i + 1; j <= L - (P - s - 1); ++j) {
        const double v = std::max(time(s, i, j), best[at(s + 1, j)]);
        if (v < best[at(s, i)]) {  // strict: the first (shortest) stage s that reaches the optimum
          best[at(s, i)] = v;
          cut[at(s, i)] = j;
        }
      }
  std::vector<int> bounds{0};
  for (int s = 0, i = 0; s < P; ++s) bounds.push_back(i = cut[at(s, i)]);
  return bounds;
}

}  // namespace trellis::pipe
