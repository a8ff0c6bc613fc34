// Runs a fuzz harness (fuzz/*.cpp) over inputs without libFuzzer: the regression test of the g++
// host build (ctest -L fuzz), and a way to replay a libFuzzer finding under gdb.
//
//   fuzz_regress TARGET PATH...   each PATH a file, or a directory whose files are all run
//   fuzz_regress --list
//
// Exit status 0 only when every input ran and the harness returned normally. A harness reports a
// finding by aborting or crashing (exit 3) or by letting an exception other than trellis::Error
// escape (exit 1); each input gets --timeout seconds (default 10), past that the run fails (a hang,
// exit 2). Every failure names the input. An empty directory is an error: a regression run over
// nothing proves nothing. Memory errors need a sanitizer build to be seen (the asan preset).
#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#define TRELLIS_FUZZ_TARGETS(X) X(json) X(checkpoint_index) X(safetensors) X(schedule) X(flags) X(data_shard) X(selftest)

#define TRELLIS_FUZZ_DECLARE(name) int trellis_fuzz_##name(const std::uint8_t*, std::size_t);
TRELLIS_FUZZ_TARGETS(TRELLIS_FUZZ_DECLARE)

namespace {
namespace fs = std::filesystem;

struct Target {
  const char* name;
  int (*run)(const std::uint8_t*, std::size_t);
};
#define TRELLIS_FUZZ_ENTRY_ROW(name) Target{#name, &trellis_fuzz_##name},
constexpr Target targets[] = {TRELLIS_FUZZ_TARGETS(TRELLIS_FUZZ_ENTRY_ROW)};

char current[4096] = "";  // the input being run, for the alarm handler

void on_alarm(int) {
  const char msg[] = "fuzz_regress: timeout (a hang) on input ";
  ssize_t ignored = ::write(2, msg, sizeof msg - 1);
  ignored = ::write(2, current, std::strlen(current));
  ignored = ::write(2, "\n", 1);
  (void)ignored;
  ::_exit(2);
}

// A crash of the harness (abort() from finding(), a segfault...): name the input, exit 3.
void on_crash(int sig) {
  const char msg[] = "fuzz_regress: crash (signal ";
  char num[8];
  int n = 0;
  for (int v = sig; v > 0 && n < 7; v /= 10) num[n++] = static_cast<char>('0' + v % 10);
  ssize_t ignored = ::write(2, msg, sizeof msg - 1);
  while (n > 0) ignored = ::write(2, &num[--n], 1);
  ignored = ::write(2, ") on input ", 11);
  ignored = ::write(2, current, std::strlen(current));
  ignored = ::write(2, "\n", 1);
  (void)ignored;
  ::_exit(3);
}

int usage() {
  std::fprintf(stderr, "usage: fuzz_regress [--timeout SECONDS] TARGET PATH...   (targets:");
  for (const auto& t : targets) std::fprintf(stderr, " %s", t.name);
  std::fprintf(stderr, ")\n");
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  unsigned timeout = 10;
  if (args.size() >= 2 && args[0] == "--timeout") {
    timeout = static_cast<unsigned>(std::stoul(std::string(args[1])));
    args.erase(args.begin(), args.begin() + 2);
  }
  if (args.size() == 1 && args[0] == "--list") {
    for (const auto& t : targets) std::printf("%s\n", t.name);
    return 0;
  }
  if (args.size() < 2) return usage();
  const Target* target = nullptr;
  for (const auto& t : targets)
    if (args[0] == t.name) target = &t;
  if (!target) return usage();

  std::vector<fs::path> inputs;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const fs::path p(args[i]);
    if (fs::is_directory(p)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
      if (files.empty()) {
        std::fprintf(stderr, "fuzz_regress: %s has no inputs\n", p.c_str());
        return 1;
      }
      std::sort(files.begin(), files.end());
      inputs.insert(inputs.end(), files.begin(), files.end());
    } else if (fs::is_regular_file(p)) {
      inputs.push_back(p);
    } else {
      std::fprintf(stderr, "fuzz_regress: %s is neither a file nor a directory\n", p.c_str());
      return 1;
    }
  }

  std::signal(SIGALRM, on_alarm);
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, on_crash);
  for (const auto& p : inputs) {
    std::snprintf(current, sizeof current, "%s", p.c_str());
    std::ifstream in(p, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "fuzz_regress: cannot read %s\n", p.c_str());
      return 1;
    }
    ::alarm(timeout);
    try {
      target->run(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fuzz_regress: %s: input %s: uncaught exception: %s\n", target->name, p.c_str(), e.what());
      return 1;
    } catch (...) {
      std::fprintf(stderr, "fuzz_regress: %s: input %s: uncaught exception of unknown type\n", target->name,
                   p.c_str());
      return 1;
    }
    ::alarm(0);
  }
  std::printf("fuzz_regress: %s: %zu inputs, no findings\n", target->name, inputs.size());
  return 0;
}
