// Fuzz target `flags`: train_gpt's command line (examples/train_gpt/flags.hpp). The input is split
// into argv words at '\n' and NUL bytes; accepted options then go through problems() (the layout
// and range checks, with and without an MPI world size), data_files() and checkpoint_root().
// --schedule-file is dropped before problems(): reading a file the fuzzer names is not the
// parser's behaviour (the schedule text has its own target).
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
  o.schedule_file.clear();
  trellis::fuzz::guarded([&] { (void)train_gpt::problems(o); });
  trellis::fuzz::guarded([&] { (void)train_gpt::problems(o, std::optional<int>(o.dp)); });
  (void)train_gpt::data_files(o, "data/tiny_corpus.txt");
  (void)train_gpt::checkpoint_root(o);
  return 0;
}
