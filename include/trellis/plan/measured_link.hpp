// plan::measure_link: a plan::Link calibrated on a real communicator -- all-reduces of growing
// size timed on the group (every rank takes part; the slowest rank's time counts, as a collective
// ends when its last rank does), then latency and bus bandwidth fitted by least squares to
//   t(S) = latency + 2(n-1)/n * S / bandwidth
// (the nccl-tests busbw convention the cost model uses). Host-memory communicators (thread ranks,
// MPI, comm::SimulatedLink over them); a device communicator needs device buffers (not yet).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/space.hpp"
#include "trellis/plan/cluster.hpp"

namespace trellis::plan {

struct LinkFit {
  Link link;
  std::vector<double> bytes, seconds;  // the points fitted: message size, slowest rank's best time
};

// Collective over `c` (every rank calls it with the same arguments; every rank returns the same
// fit). Sizes from min_bytes to max_bytes, x4 each step; the best of `repeats` per size.
template <comm::Communicator C>
LinkFit measure_link(C& c, std::size_t min_bytes = std::size_t{1} << 12, std::size_t max_bytes = std::size_t{1} << 22,
                     int repeats = 5) {
  static_assert(std::is_same_v<typename C::space, Host>,
                "plan::measure_link times host-memory communicators (device buffers: not yet)");
  TRELLIS_CHECK(c.size() >= 2, "plan::measure_link: a group of ", c.size(), " rank has no link to measure");
  TRELLIS_CHECK(min_bytes >= 4 && max_bytes >= min_bytes && repeats >= 1, "plan::measure_link: sizes ", min_bytes,
                "..", max_bytes, " bytes, ", repeats, " repeats");
  std::vector<float> buf(max_bytes / sizeof(float), 1.0f);
  const double k = 2.0 * (c.size() - 1) / c.size();
  // A busy machine can stretch one small message past the large ones: the series is measured
  // again with twice the repeats (up to 3 times). Every rank fits the same all-reduced times, so
  // all take the same decision.
  for (int attempt = 1;; ++attempt, repeats *= 2) {
    LinkFit fit;
    for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      const std::size_t n = bytes / sizeof(float);
      c.all_reduce(buf.data(), buf.data(), n, comm::ReduceOp::sum);  // warm-up
      double best = 1e300;
      for (int r = 0; r < repeats; ++r) {
        c.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        c.all_reduce(buf.data(), buf.data(), n, comm::ReduceOp::sum);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      float slowest = static_cast<float>(best);  // the collective ends with its slowest rank
      c.all_reduce(&slowest, &slowest, 1, comm::ReduceOp::max);
      fit.bytes.push_back(static_cast<double>(n * sizeof(float)));
      fit.seconds.push_back(static_cast<double>(slowest));
    }
    // least squares of t = a + b x, x = the bytes on the wire per rank
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    const double m = static_cast<double>(fit.bytes.size());
    for (std::size_t i = 0; i < fit.bytes.size(); ++i) {
      const double x = k * fit.bytes[i], y = fit.seconds[i];
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
    const double b = (m * sxy - sx * sy) / (m * sxx - sx * sx), a = (sy - b * sx) / m;
    if (b > 0) {
      fit.link = {.bandwidth = 1.0 / b, .latency = std::max(0.0, a)};
      return fit;
    }
    TRELLIS_CHECK(attempt < 3, "plan::measure_link: the times did not grow with the message size in ", attempt,
                  " series (up to ", repeats, " repeats per size): the machine is too busy to fit a bandwidth");
  }
}

}  // namespace trellis::plan
