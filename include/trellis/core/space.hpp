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

}  // namespace trellis
