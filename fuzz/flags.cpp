// Fuzz target `flags`: train_gpt's command line (examples/train_gpt/flags.hpp). The input is split
// into argv words at '\n' and NUL bytes; accepted options then go through problems() (the layout
// and range checks, with and without an MPI world size), data_files() and checkpoint_root().
// A --schedule-file the input names is replaced by a fixed valid schedule (2 ranks, 2
// microbatches, in a memfd) before problems(): the fuzzer must not pick files to read (a FIFO
// would block), yet the checks of a loaded schedule against the flags are exercised.
#include <optional>
#include <string>
#include <vector>

#include "harness.hpp"
#include "train_gpt/flags.hpp"

TRELLIS_FUZZ_TARGET(flags) {
  std::vector<std::string> args;
  std::string word;
  for (char c : trellis::fuzz::text(data, size)) {
    if (c == '\n' || c == '\0') {
      args.push_back(std::move(word));
      word.clear();
    } else {
      word += c;
    }
  }
  if (!word.empty()) args.push_back(std::move(word));
  train_gpt::Options o;
  if (!trellis::fuzz::guarded([&] { o = train_gpt::parse_flags(args); })) return 0;
  static trellis::fuzz::MemFile schedule_file;
  static const std::string schedule_path = schedule_file.hold("@ name=fuzz\nF0 F1 B0 W0 B1 W1\nF0 B0 W0 F1 B1 W1\n");
  if (!o.schedule_file.empty()) o.schedule_file = schedule_path;
  trellis::fuzz::guarded([&] { (void)train_gpt::problems(o); });
  trellis::fuzz::guarded([&] { (void)train_gpt::problems(o, std::optional<int>(o.dp)); });
  (void)train_gpt::data_files(o, "data/tiny_corpus.txt");
  (void)train_gpt::checkpoint_root(o);
  return 0;
}
