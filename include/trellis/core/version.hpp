// The single source of trellis' version: CMake and the Conan recipe read these three lines.
#pragma once

#define TRELLIS_VERSION_MAJOR 0
#define TRELLIS_VERSION_MINOR 1
#define TRELLIS_VERSION_PATCH 0

#define TRELLIS_VERSION_STRING_(a, b, c) #a "." #b "." #c
#define TRELLIS_VERSION_STRING_X_(a, b, c) TRELLIS_VERSION_STRING_(a, b, c)
#define TRELLIS_VERSION_STRING \
  TRELLIS_VERSION_STRING_X_(TRELLIS_VERSION_MAJOR, TRELLIS_VERSION_MINOR, TRELLIS_VERSION_PATCH)

namespace trellis {
inline constexpr int version_major = TRELLIS_VERSION_MAJOR;
inline constexpr int version_minor = TRELLIS_VERSION_MINOR;
inline constexpr int version_patch = TRELLIS_VERSION_PATCH;
inline constexpr const char* version_string = TRELLIS_VERSION_STRING;
}  // namespace trellis
