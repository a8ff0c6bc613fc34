// Shared pieces of the fuzz harnesses (fuzz/*.cpp). Each harness is one function
// `int trellis_fuzz_<name>(const std::uint8_t*, std::size_t)` declared with TRELLIS_FUZZ_TARGET:
// built with -DTRELLIS_FUZZ_LIBFUZZER (scripts/fuzz.sh, clang++ -fsanitize=fuzzer) it is also the
// libFuzzer entry point LLVMFuzzerTestOneInput; built without (the g++ host build), fuzz/driver.cpp
// runs it over the checked-in corpus as a regression test (docs/design.md, "Fuzzing").
//
// Contract of a harness: a trellis::Error thrown by the code under test is a clean rejection of the
// input (guarded() swallows it); anything else is a finding: a crash, a sanitizer report, any other
// exception (std::bad_alloc included), a hang, or a property the harness checks failing (finding()
// aborts, so libFuzzer saves the input and the driver's run fails).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <sys/mman.h>
#include <unistd.h>

#include "trellis/core/error.hpp"

namespace trellis::fuzz {

inline std::string_view text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A property of an accepted input does not hold: report and abort.
[[noreturn]] inline void finding(std::string_view what) {
  std::fprintf(stderr, "fuzz finding: %.*s\n", static_cast<int>(what.size()), what.data());
  std::fflush(stderr);
  std::abort();
}

// Runs `f`; a trellis::Error is a clean rejection (false), success is true. Other exceptions pass.
template <class F>
bool guarded(F&& f) {
  try {
    f();
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Runs `f` on data the code itself produced from an accepted input: a trellis::Error here is a
// finding (e.g. a value that was parsed, written and no longer parses).
template <class F>
void must(std::string_view what, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    finding(std::string(what) + ": " + e.what());
  }
}

// The input as a file for readers that take a path: a memfd, named /proc/self/fd/N (Linux), reused
// from one input to the next.
class MemFile {
 public:
  MemFile() {
    fd_ = ::memfd_create("trellis-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  // Replaces the content with `bytes`; returns the path.
  const std::string& hold(std::string_view bytes) {
    if (::ftruncate(fd_, 0) != 0) std::abort();
    std::size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
      if (n <= 0) std::abort();
      done += static_cast<std::size_t>(n);
    }
    return path_;
  }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace trellis::fuzz

#ifdef TRELLIS_FUZZ_LIBFUZZER
#define TRELLIS_FUZZ_ENTRY(name)                                                   \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    return trellis_fuzz_##name(data, size);                                        \
  }
#else
#define TRELLIS_FUZZ_ENTRY(name)
#endif

// Declares harness `name`; the body follows (parameters `data`, `size`; return 0).
#define TRELLIS_FUZZ_TARGET(name)                                         \
  int trellis_fuzz_##name(const std::uint8_t* data, std::size_t size);   \
  TRELLIS_FUZZ_ENTRY(name)                                                \
  int trellis_fuzz_##name(const std::uint8_t* data, std::size_t size)
