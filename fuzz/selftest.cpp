// Fuzz target `selftest`: proves that fuzz_regress fails when a harness finds something (ctest
// runs it over fuzz/selftest/* with WILL_FAIL). Inputs starting with "error" throw trellis::Error
// (a clean rejection), "abort" calls finding(), "throw" throws std::logic_error, "hang" loops.
#include <stdexcept>

#include "harness.hpp"

TRELLIS_FUZZ_TARGET(selftest) {
  const std::string_view input = trellis::fuzz::text(data, size);
  trellis::fuzz::guarded([&] {
    if (input.starts_with("error")) TRELLIS_THROW("a clean rejection");
    if (input.starts_with("abort")) trellis::fuzz::finding("selftest: a finding");
    if (input.starts_with("throw")) throw std::logic_error("selftest: not a trellis::Error");
  });
  if (input.starts_with("hang"))
    for (;;) ::pause();  // until the driver's alarm
  return 0;
}
