// Fuzz target `data_shard`: the input is an llm.c token shard (256 int32 header, then uint16
// tokens) read with train::load_llmc_tokens; the same bytes as text go to train::DataState::parse
// (the data position stored in checkpoints), whose accepted values must round-trip.
#include "harness.hpp"
#include "trellis/train/data.hpp"

namespace train = trellis::train;

TRELLIS_FUZZ_TARGET(data_shard) {
  static trellis::fuzz::MemFile file;
  const std::string_view input = trellis::fuzz::text(data, size);
  const std::string& path = file.hold(input);
  trellis::fuzz::guarded([&] {
    // The vocabulary comes from the input too: header int 3 (unused by the format, 0 in real
    // shards) when its low byte is not 0, so small vocabularies exercise the token range check.
    const int vocab = size > 12 && data[12] != 0 ? data[12] : 50257;
    train::TokenData d = train::load_llmc_tokens(path, vocab);
    if (d.tokens.size() * sizeof(train::token_t) + train::llmc_header_ints * 4 != size)
      trellis::fuzz::finding("accepted shard's tokens do not account for the file size");
  });
  train::DataState s;
  if (!trellis::fuzz::guarded([&] { s = train::DataState::parse(input, "fuzz input"); })) return 0;
  trellis::fuzz::must("re-parsing DataState::to_string", [&] {
    if (!(train::DataState::parse(s.to_string()) == s)) trellis::fuzz::finding("DataState does not round-trip");
  });
  return 0;
}
