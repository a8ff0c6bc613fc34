// Strict decimal integers from text (checkpoint metadata, headers): digits only, with a leading
// '-' for signed types; no spaces, no '+', no trailing characters; overflow detected (unlike
// strtoll, which saturates, or sscanf's %llu, which reads "-1" as 2^64 - 1); the value must lie
// in [lo, hi]. Errors say `what` (the file and field), the text and the range.
#pragma once

#include <charconv>
#include <concepts>
#include <string_view>
#include <system_error>

#include "trellis/core/error.hpp"

namespace trellis::io {

template <std::integral T>
T parse_integer(std::string_view text, T lo, T hi, std::string_view what) {
  T value{};
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec == std::errc::invalid_argument || p != end)
    TRELLIS_THROW(what, ": \"", text, "\" is not a decimal integer in [", lo, ", ", hi, "]");
  if (ec == std::errc::result_out_of_range || value < lo || value > hi)
    TRELLIS_THROW(what, ": \"", text, "\" is out of range [", lo, ", ", hi, "]");
  return value;
}

}  // namespace trellis::io
