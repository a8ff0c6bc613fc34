// Fuzz target `json`: io::json::parse on arbitrary bytes. An accepted document must write
// (compact and pretty) to text that parses again and writes back to the same compact text.
#include "harness.hpp"
#include "trellis/io/json.hpp"

namespace json = trellis::io::json;
using trellis::fuzz::finding;

TRELLIS_FUZZ_TARGET(json) {
  json::Value v;
  if (!trellis::fuzz::guarded([&] { v = json::parse(trellis::fuzz::text(data, size), "fuzz input"); })) return 0;
  const std::string compact = json::dump(v);
  const std::string pretty = json::dump(v, 2);
  trellis::fuzz::must("re-reading the compact dump", [&] {
    if (json::dump(json::parse(compact, "compact dump")) != compact)
      finding("compact dump does not read back to itself: " + compact);
  });
  trellis::fuzz::must("re-reading the pretty dump", [&] {
    if (json::dump(json::parse(pretty, "pretty dump")) != compact)
      finding("pretty dump does not read back to the compact one: " + compact);
  });
  return 0;
}
