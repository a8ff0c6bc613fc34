// plan::measure_link: a plan::Link calibrated on a real communicator -- all-reduces of growing
// size timed on the group (every rank takes part; the slowest rank's time counts, as a collective
// ends when its last rank does), then latency and bus bandwidth fitted by least squares to
//   t(S) = latency + 2(n-1)/n * S / bandwidth
// (the nccl-tests busbw convention the cost model uses). measure_link(c) for host-memory
// communicators (thread ranks, MPI, comm::SimulatedLink over them); measure_link(backend, c) for
// any, on a buffer of a backend of the communicator's memory space (NcclComm: backend::Cuda).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/comm/communicator.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/space.hpp"
#include "trellis/plan/cluster.hpp"

namespace trellis::plan {

struct LinkFit {
  Link link;
  std::vector<double> bytes, seconds;  // the points fitted: message size, slowest rank's best time
};

namespace detail {

// The memory calls measure_link makes of a backend, on host memory: the host communicators' buffers
// without a host backend (whose constructor would change the caller's floating-point mode).
struct HostMemory {
  template <class T> Buffer<T, Host> allocate(std::size_t n) const { return Buffer<T, Host>(n); }
  template <class T> void upload(T* dst, const T* src, std::size_t n) const { std::copy_n(src, n, dst); }
  template <class T> void download(T* dst, const T* src, std::size_t n) const { std::copy_n(src, n, dst); }
  void synchronize() const {}
};

template <class Memory, comm::Communicator C>
LinkFit measure_link_in(const Memory& mem, C& c, std::size_t min_bytes, std::size_t max_bytes, int repeats) {
  TRELLIS_CHECK(c.size() >= 2, "plan::measure_link: a group of ", c.size(), " rank has no link to measure");
  TRELLIS_CHECK(min_bytes >= 4 && max_bytes >= min_bytes && repeats >= 1, "plan::measure_link: sizes ", min_bytes,
                "..", max_bytes, " bytes, ", repeats, " repeats");
  auto buf = mem.template allocate<float>(max_bytes / sizeof(float));
  {
    const std::vector<float> ones(buf.size(), 1.0f);
    mem.upload(buf.data(), ones.data(), ones.size());
  }
  auto word = mem.template allocate<float>(1);  // the slowest rank's time, all-reduced
  // Everything enqueued so far has finished: the backend's stream and the communicator's (NCCL).
  auto settle = [&] {
    mem.synchronize();
    if constexpr (requires { c.synchronize(); }) c.synchronize();
  };
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
        settle();
        const auto t0 = std::chrono::steady_clock::now();
        c.all_reduce(buf.data(), buf.data(), n, comm::ReduceOp::sum);
        settle();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      float slowest = static_cast<float>(best);  // the collective ends with its slowest rank
      mem.upload(word.data(), &slowest, 1);
      settle();
      c.all_reduce(word.data(), word.data(), 1, comm::ReduceOp::max);
      settle();
      mem.download(&slowest, word.data(), 1);
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

}  // namespace detail

// Collective over `c` (every rank calls it with the same arguments; every rank returns the same
// fit). Sizes from min_bytes to max_bytes, x4 each step; the best of `repeats` per size. The
// buffer is `be`'s; be's stream and, for a stream-ordered communicator (NcclComm), c's are
// synchronised before the clock starts and before it stops.
template <backend::Backend B, comm::Communicator C>
  requires backend::CompatibleWith<B, C>
LinkFit measure_link(const B& be, C& c, std::size_t min_bytes = std::size_t{1} << 12,
                     std::size_t max_bytes = std::size_t{1} << 22, int repeats = 5) {
  return detail::measure_link_in(be, c, min_bytes, max_bytes, repeats);
}

// The same for a host-memory communicator, on a host buffer.
template <comm::Communicator C>
LinkFit measure_link(C& c, std::size_t min_bytes = std::size_t{1} << 12, std::size_t max_bytes = std::size_t{1} << 22,
                     int repeats = 5) {
  static_assert(std::is_same_v<typename C::space, Host>,
                "plan::measure_link(c) times host-memory communicators; a device communicator: "
                "measure_link(backend, c) with a backend of its memory space");
  return detail::measure_link_in(detail::HostMemory{}, c, min_bytes, max_bytes, repeats);
}

}  // namespace trellis::plan
