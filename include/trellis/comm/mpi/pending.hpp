// MpiPending: one MPI operation in flight (its requests, staging buffers and finishing step),
// and the polite polling wait for it (part of comm/mpi.hpp).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "trellis/comm/mpi/datatypes.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/check_mpi.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

namespace detail {

// ---- operations in flight ----------------------------------------------------------------------

// Everything one started operation needs until it completes: the MPI requests, the buffers MPI
// reads or writes (staging copies, int count arrays) and what to do once it is done. Heap
// allocated so its addresses stay put while requests are moved around or abandoned.
struct MpiPending {
  enum class Finish : std::uint8_t { none, divide, narrow, check_recv_counts };

  std::vector<MPI_Request> requests;
  std::vector<MPI_Status> statuses;
  OpFingerprint call;
  Finish finish = Finish::none;
  void* out = nullptr;           // final destination (narrow / divide)
  std::size_t out_count = 0;
  DType dtype = DType::f32;
  int divisor = 1;
  Buffer<float> staging;         // widened 16-bit data
  Buffer<std::byte> scratch;     // input copies where input and output overlap
  std::vector<int> counts;       // all_to_allv: send counts, send displs, recv counts, recv displs
  std::vector<std::size_t> expected_counts;  // batch/recv: elements each receive must bring (or SIZE_MAX)
  std::vector<DType> dtypes;                 // batch/recv: the element type of each request
  std::vector<int> peers;                    // batch/recv: the peer of each request

  // Polls once; true when every request has completed (errors raise).
  bool test() {
    if (requests.empty()) return true;
    int flag = 0;
    statuses.resize(requests.size());
    int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, statuses.data());
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& s : statuses)
        if (s.MPI_ERROR != MPI_ERR_PENDING) TRELLIS_CHECK_MPI(s.MPI_ERROR);
    }
    TRELLIS_CHECK_MPI(rc);
    return flag != 0;
  }

  // Runs the finishing step once all requests completed.
  void complete() {
    switch (finish) {
      case Finish::none: break;
      case Finish::divide: mpi_divide_in_place(out, out_count, dtype, divisor); break;
      case Finish::narrow: mpi_narrow_16(staging.data(), out, out_count, dtype, divisor); break;
      case Finish::check_recv_counts:
        for (std::size_t i = 0; i < expected_counts.size() && i < statuses.size(); ++i) {
          if (expected_counts[i] == SIZE_MAX) continue;
          int got = 0;
          TRELLIS_CHECK_MPI(MPI_Get_count(&statuses[i], mpi_datatype(dtypes[i]), &got));
          if (static_cast<std::size_t>(got) != expected_counts[i])
            TRELLIS_THROW("recv from rank ", peers[i], ": expected ", expected_counts[i], " ",
                          dtype_name(dtypes[i]), " elements, the message held ", got);
        }
        break;
    }
    finish = Finish::none;
  }
};

// Waits for `pending` with polite polling until `deadline` (none when `forever`); true if done.
// `idle()` runs between polls once the wait has lasted a millisecond (fast calls never run it).
template <class Idle>
inline bool mpi_wait_until(MpiPending& pending, std::chrono::steady_clock::time_point deadline, bool forever,
                           Idle&& idle) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (;;) {
    if (pending.test()) return true;
    const auto now = clock::now();
    if (!forever && now >= deadline) return false;
    const auto waited = std::chrono::duration_cast<std::chrono::microseconds>(now - start);
    if (waited >= std::chrono::milliseconds(1)) idle();
    if (waited < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else {
      // Sleep about 1/16 of the time waited so far, between 20 us and 1 ms: short operations keep
      // a low latency, long ones cost little CPU (other ranks may share this core).
      std::this_thread::sleep_for(std::clamp(waited / 16, std::chrono::microseconds(20), std::chrono::microseconds(1000)));
    }
  }
}
inline bool mpi_wait_until(MpiPending& pending, std::chrono::steady_clock::time_point deadline, bool forever) {
  return mpi_wait_until(pending, deadline, forever, [] {});
}

}  // namespace detail

}  // namespace trellis::comm
