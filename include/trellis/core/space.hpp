// Memory spaces as types. Code that must differ per space dispatches on these tags at compile
// time; there is no runtime "device" enum on the hot path.
#pragma once

#include <type_traits>

namespace trellis {

struct Host {
  static constexpr const char* name = "host";
};
struct Cuda {
  static constexpr const char* name = "cuda";
};

template <class S>
concept MemorySpace = std::is_same_v<S, Host> || std::is_same_v<S, Cuda>;

// The host's stream and event: work issued on the host has finished when the call returns, so
// "wait for this on a stream" is a plain wait and recording an event records nothing. They let
// code written for CUDA streams (cudaStream_t, cudaEvent_t) run unchanged on the host.
struct HostStream {};
struct HostEvent {};
// A named range of work (NVTX on CUDA, for Nsight Systems); nothing on the host. The empty
// destructor makes `auto r = be.range(...)` an RAII object, not an unused variable, to compilers.
struct HostRange {
  ~HostRange() {}  // NOLINT(modernize-use-equals-default): user-provided on purpose
};

}  // namespace trellis
