// Fuzz target `schedule`: tpipe::parse_schedule on arbitrary text (communication is inserted when
// no line has any), then the verifier in both send modes. A schedule the verifier accepts must
// survive to_text -> parse_schedule unchanged.
#include "harness.hpp"
#include "trellis/pipe/text.hpp"
#include "trellis/pipe/verify.hpp"

namespace tpipe = trellis::pipe;

TRELLIS_FUZZ_TARGET(schedule) {
  tpipe::Schedule s;
  if (!trellis::fuzz::guarded([&] { s = tpipe::parse_schedule(trellis::fuzz::text(data, size)); })) return 0;
  const bool buffered = trellis::fuzz::guarded([&] { tpipe::verify(s); });
  const bool rendezvous = trellis::fuzz::guarded([&] { tpipe::verify(s, {tpipe::SendMode::rendezvous}); });
  if (rendezvous && !buffered) trellis::fuzz::finding("verify accepts with rendezvous sends but not buffered ones");
  if (!buffered) return 0;
  const std::string text = tpipe::to_text(s);
  trellis::fuzz::must("re-parsing to_text of a verified schedule", [&] {
    if (!tpipe::same_schedule(tpipe::parse_schedule(text), s))
      trellis::fuzz::finding("to_text of a verified schedule parses to a different schedule:\n" + text);
  });
  return 0;
}
