// The MPI backend's defaults from the environment: TRELLIS_COMM_DEBUG, TRELLIS_COMM_TIMEOUT_MS
// (part of comm/mpi.hpp).
#pragma once

#include <chrono>
#include <cstdlib>
#include <cstring>

namespace trellis::comm {

namespace detail {

// ---- environment -------------------------------------------------------------------------------

inline bool mpi_env_debug() {
  const char* v = std::getenv("TRELLIS_COMM_DEBUG");
  return v && *v && std::strcmp(v, "0") != 0;
}

// TRELLIS_COMM_TIMEOUT_MS, or 60 s (as the thread backend); 0 (or less) switches the timeout off.
inline std::chrono::milliseconds mpi_env_timeout() {
  if (const char* v = std::getenv("TRELLIS_COMM_TIMEOUT_MS"); v && *v) {
    char* end = nullptr;
    long long ms = std::strtoll(v, &end, 10);
    if (end && *end == '\0') return std::chrono::milliseconds(ms);
  }
  return std::chrono::seconds(60);
}

}  // namespace detail

}  // namespace trellis::comm
