// Data: bytes-as-tokens, llm.c shards, split, unigram baselines vs hand formulas, and the loader
// (window contents, determinism, epochs are permutations, dp shards == single-rank batch,
// exact resume); packed mode (documents split and packed, every input once per epoch).
#include <catch2/catch.hpp>

#include <cmath>
#include <algorithm>
#include <fstream>
#include <set>
#include <vector>

#include <sys/stat.h>

#include "train/temp_dir.hpp"
#include "trellis/train/data.hpp"

using namespace trellis;
using namespace trellis::train;

namespace {
std::vector<token_t> counting_tokens(std::size_t n, int vocab) {
  std::vector<token_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<token_t>((i * 7 + i / 13) % static_cast<std::size_t>(vocab));
  return t;
}
}  // namespace

TEST_CASE("text bytes become tokens; llm.c shards round trip", "[data]") {
  auto d = tokens_from_bytes("Hi\xff");
  REQUIRE(d.vocab_size == 256);
  REQUIRE(d.tokens == std::vector<token_t>{'H', 'i', 255});

  TempDir dir("data-llmc");
  auto tokens = counting_tokens(1000, 50257);
  tokens[5] = 50256;
  auto path = dir.path / "train_000.bin";
  write_llmc_tokens(path, tokens);
  REQUIRE(std::filesystem::file_size(path) == 1024 + 2000);
  {  // header by hand
    std::ifstream in(path, std::ios::binary);
    std::int32_t h[3];
    in.read(reinterpret_cast<char*>(h), sizeof h);
    REQUIRE(h[0] == 20240520);
    REQUIRE(h[1] == 1);
    REQUIRE(h[2] == 1000);
  }
  REQUIRE(load_llmc_tokens(path).tokens == tokens);
  auto second = dir.path / "train_001.bin";
  write_llmc_tokens(second, std::vector<token_t>{7, 8, 9});
  auto both = load_llmc_shards({path, second});
  REQUIRE(both.tokens.size() == 1003);
  REQUIRE(std::vector<token_t>(both.tokens.begin(), both.tokens.begin() + 1000) == tokens);
  REQUIRE(both.tokens.back() == 9);
  REQUIRE_THROWS_WITH(load_llmc_tokens(path, 50000), Catch::Contains("outside the vocabulary"));
  std::filesystem::resize_file(path, 1024 + 1998);
  REQUIRE_THROWS_WITH(load_llmc_tokens(path), Catch::Contains("train_000.bin") && Catch::Contains("truncated"));
  std::ofstream(path, std::ios::binary) << std::string(1100, 'x');
  REQUIRE_THROWS_WITH(load_llmc_tokens(path), Catch::Contains("magic"));
}

TEST_CASE("train/val split and unigram baselines match the formulas", "[data]") {
  TokenData all{counting_tokens(1000, 256), 256};
  auto [train, val] = train_val_split(all, 0.1);
  REQUIRE(train.tokens.size() == 900);
  REQUIRE(val.tokens.size() == 100);
  REQUIRE(val.tokens.front() == all.tokens[900]);

  std::vector<token_t> aabb = {0, 0, 1, 1};
  REQUIRE(unigram_entropy(aabb, 4) == Approx(std::log(2.0)));
  std::vector<token_t> aaab = {2, 2, 2, 3};
  REQUIRE(unigram_entropy(aaab, 4) == Approx(-(0.75 * std::log(0.75) + 0.25 * std::log(0.25))));
  // Add-one smoothing: counts {0: 3, 1: 1, 2: 1} over 5 + 3 = ... with vocab 3, train {0,0,1}.
  std::vector<token_t> tr = {0, 0, 1}, ev = {0, 2};
  REQUIRE(unigram_cross_entropy(tr, ev, 3) == Approx(-(std::log(3.0 / 6) + std::log(1.0 / 6)) / 2));
}

TEST_CASE("the shipped corpus loads and has an English-like unigram entropy", "[data]") {
  auto corpus = load_text_as_bytes(TRELLIS_SOURCE_DIR "/data/tiny_corpus.txt");
  REQUIRE(corpus.tokens.size() > 10000);
  double h = unigram_entropy(corpus.tokens, 256);
  REQUIRE(h > 2.5);  // English letters: about 4.1 bits = 2.85 nats per character
  REQUIRE(h < 3.2);
  auto [train, val] = train_val_split(corpus, 0.1);
  double baseline = unigram_cross_entropy(train.tokens, val.tokens, 256);
  REQUIRE(baseline > h - 0.3);
  REQUIRE(baseline < h + 0.5);
}

TEST_CASE("loader windows hold the right tokens, shifted by one", "[data][loader]") {
  auto tokens = counting_tokens(1001, 256);
  DataLoader loader(tokens, {.batch_rows = 4, .seq_len = 10, .seed = 3, .shuffle = true});
  REQUIRE(loader.windows() == 100);
  REQUIRE(loader.batches_per_epoch() == 25);
  for (int step = 0; step < 30; ++step) {
    Batch b = loader.next();
    REQUIRE(b.rows == 4);
    for (index_t r = 0; r < 4; ++r) {
      // Find the window from the first input token's position: inputs must be a run of the data.
      bool found = false;
      for (index_t w = 0; w < 100 && !found; ++w) {
        bool match = true;
        for (index_t t = 0; t < 10 && match; ++t) {
          match = b.input_view()(r, t) == tokens[static_cast<std::size_t>(w * 10 + t)] &&
                  b.target_view()(r, t) == tokens[static_cast<std::size_t>(w * 10 + t + 1)];
        }
        found = match;
      }
      REQUIRE(found);
    }
  }
}

TEST_CASE("loader order: deterministic per seed, each epoch a permutation", "[data][loader]") {
  std::vector<token_t> tokens(241);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<token_t>(i);  // token == position
  auto first_tokens = [&](std::uint64_t seed, int batches) {
    DataLoader l(tokens, {.batch_rows = 3, .seq_len = 4, .seed = seed});
    std::vector<int> firsts;
    for (int i = 0; i < batches; ++i) {
      Batch b = l.next();
      for (index_t r = 0; r < b.rows; ++r) firsts.push_back(b.inputs[static_cast<std::size_t>(r * 4)]);
    }
    return firsts;
  };
  // 60 windows, 20 batches per epoch.
  auto a = first_tokens(1, 40), b = first_tokens(1, 40), c = first_tokens(2, 40);
  REQUIRE(a == b);
  REQUIRE(a != c);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::set<int> seen(a.begin() + epoch * 60, a.begin() + epoch * 60 + 60);
    REQUIRE(seen.size() == 60);
    for (int s : seen) REQUIRE(s % 4 == 0);
  }
  REQUIRE(std::vector<int>(a.begin(), a.begin() + 60) != std::vector<int>(a.begin() + 60, a.end()));
  // No shuffle: windows in order.
  DataLoader plain(tokens, {.batch_rows = 3, .seq_len = 4, .shuffle = false});
  Batch p = plain.next();
  REQUIRE(p.inputs[0] == 0);
  REQUIRE(p.inputs[4] == 4);
  REQUIRE(p.targets[3] == 4);
}

TEST_CASE("dp ranks' rows together are exactly the single-rank batch", "[data][loader]") {
  auto tokens = counting_tokens(5000, 256);
  for (int dp : {1, 2, 3, 4, 5}) {
    INFO("dp = " << dp);
    DataLoader single(tokens, {.batch_rows = 8, .seq_len = 16, .seed = 9});
    std::vector<DataLoader> ranks;
    for (int r = 0; r < dp; ++r) ranks.emplace_back(tokens, DataLoader::Options{.batch_rows = 8, .seq_len = 16, .seed = 9, .dp_rank = r, .dp_size = dp});
    for (int step = 0; step < 50; ++step) {
      Batch whole = single.next();
      std::vector<std::int32_t> in, tg;
      index_t rows = 0;
      for (auto& l : ranks) {
        Batch part = l.next();
        REQUIRE(part.first_row == rows);
        rows += part.rows;
        in.insert(in.end(), part.inputs.begin(), part.inputs.end());
        tg.insert(tg.end(), part.targets.begin(), part.targets.end());
      }
      REQUIRE(rows == 8);
      REQUIRE(in == whole.inputs);
      REQUIRE(tg == whole.targets);
    }
  }
}

TEST_CASE("loader position saves and resumes the exact sequence", "[data][loader]") {
  auto tokens = counting_tokens(3000, 256);
  DataLoader a(tokens, {.batch_rows = 4, .seq_len = 8, .seed = 77});
  for (int i = 0; i < 123; ++i) a.next();  // crosses epoch boundaries (93 windows, 23 per epoch)
  const std::string saved = a.state().to_string();
  REQUIRE(saved == "seed=77;next_batch=123");
  DataLoader b(tokens, {.batch_rows = 4, .seq_len = 8, .seed = 77});
  b.restore(DataState::parse(saved));
  for (int i = 0; i < 30; ++i) REQUIRE(a.next().inputs == b.next().inputs);
  DataLoader other(tokens, {.batch_rows = 4, .seq_len = 8, .seed = 78});
  REQUIRE_THROWS_WITH(other.restore(DataState::parse(saved)), Catch::Contains("seed 77"));
  REQUIRE_THROWS_AS(DataState::parse("seed=1;batch=2"), Error);
  REQUIRE_THROWS_WITH(DataLoader(std::span<const token_t>(tokens.data(), 20), {.batch_rows = 4, .seq_len = 8}),
                      Catch::Contains("fewer than one batch"));
}

TEST_CASE("loader positions out of range are refused, not read out of bounds", "[data][loader][errors]") {
  auto tokens = counting_tokens(3000, 256);
  DataLoader a(tokens, {.batch_rows = 4, .seq_len = 8, .seed = 5, .shuffle = false});
  // "-1" is no number of batches (sscanf's %llu read it as 2^64 - 1); 2^63 does not fit index_t.
  REQUIRE_THROWS_WITH(DataState::parse("seed=5;next_batch=-1"), Catch::Contains("next_batch") && Catch::Contains("\"-1\""));
  REQUIRE_THROWS_WITH(DataState::parse("seed=5;next_batch=9223372036854775808"), Catch::Contains("next_batch"));
  REQUIRE_THROWS_WITH(DataState::parse("seed=18446744073709551616;next_batch=1"), Catch::Contains("seed"));
  REQUIRE_THROWS_WITH(DataState::parse("seed=5;next_batch=+3"), Catch::Contains("next_batch"));
  REQUIRE_THROWS_WITH(DataState::parse("seed=5;next_batch=3 "), Catch::Contains("next_batch"));
  REQUIRE_THROWS_WITH(a.restore({.seed = 5, .next_batch = std::uint64_t{1} << 63}), Catch::Contains("next_batch"));
  // The largest position is valid and reads the batch the formula gives (no shuffle: global batch
  // b of an epoch takes windows [b*B, b*B + B) in order; (3000 - 1) / 8 = 374 windows, 93 batches
  // per epoch).
  REQUIRE(a.batches_per_epoch() == 93);
  const std::uint64_t last = (std::uint64_t{1} << 63) - 1;
  REQUIRE(DataState::parse("seed=5;next_batch=" + std::to_string(last)) == DataState{5, last});
  a.restore({.seed = 5, .next_batch = last});
  const Batch b = a.next();
  const std::uint64_t in_epoch = last % 93;
  for (index_t r = 0; r < 4; ++r)
    for (index_t t = 0; t < 8; ++t) {
      const auto window = static_cast<std::size_t>(in_epoch * 4 + static_cast<std::uint64_t>(r));
      REQUIRE(b.input_view()(r, t) == tokens[window * 8 + static_cast<std::size_t>(t)]);
    }
}

TEST_CASE("a FIFO or directory as a data file is refused at once, not read or waited on", "[data][errors]") {
  TempDir dir("data-fifo");
  const auto fifo = dir.path / "tokens.bin";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);  // no writer: a blocking open() would wait forever
  REQUIRE_THROWS_WITH(load_text_as_bytes(fifo), Catch::Contains(fifo.string()) && Catch::Contains("not a regular file (a FIFO)"));
  REQUIRE_THROWS_WITH(load_llmc_tokens(fifo), Catch::Contains("not a regular file (a FIFO)"));
  REQUIRE_THROWS_WITH(load_text_as_bytes(dir.path), Catch::Contains("not a regular file (a directory)"));
  const auto file = dir.path / "text.txt";
  std::ofstream(file) << "abc";
  REQUIRE(load_text_as_bytes(file).tokens == std::vector<token_t>{'a', 'b', 'c'});
}

namespace {
// Documents of 2..40 tokens, each starting with the separator 0; any other token is its stream
// index + 1, so a token says where it came from.
constexpr std::int64_t kSeparator = 0;
std::vector<token_t> document_stream(std::size_t n) {
  std::vector<token_t> t(n);
  std::uint64_t x = 5;
  std::size_t next_doc = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i == next_doc) {
      t[i] = static_cast<token_t>(kSeparator);
      x = splitmix64(x);
      next_doc = i + 2 + x % 39;
    } else {
      t[i] = static_cast<token_t>(i + 1);
    }
  }
  return t;
}
}  // namespace

TEST_CASE("packed rows hold whole documents once each, positions and targets inside them", "[data][loader][packed]") {
  const auto stream = document_stream(3001);
  const index_t T = 32;
  const auto pieces = split_documents(std::span<const token_t>(stream), kSeparator, T);
  index_t covered = 0, previous = 0;
  for (const auto& p : pieces) {
    REQUIRE(p.start == covered);  // in stream order, no gap, no overlap
    REQUIRE((p.length >= 1 && p.length <= T));
    // A piece starts a document (its separator) or continues one cut after T tokens.
    REQUIRE((stream[static_cast<std::size_t>(p.start)] == kSeparator || previous == T));
    for (index_t i = 1; i < p.length; ++i) REQUIRE(stream[static_cast<std::size_t>(p.start + i)] != kSeparator);
    covered += p.length;
    previous = p.length;
  }
  REQUIRE(covered == 3000);  // the last token is a target only

  const PackedRows packed = pack_best_fit(pieces, T);
  index_t total = 0;
  for (const auto& row : packed.rows) {
    index_t used = 0;
    for (const auto& p : row) used += p.length;
    REQUIRE(used <= T);
    total += used;
  }
  REQUIRE(total == 3000);
  CHECK(packed.efficiency() == Approx(3000.0 / (static_cast<double>(packed.rows.size()) * T)));
  double sum_sq = 0;  // MFU's attention span: sum of len^2 / sum of len over the pieces
  for (const auto& p : pieces) sum_sq += static_cast<double>(p.length * p.length);
  CHECK(packed.attention_span() == Approx(sum_sq / 3000.0));
  // Best-fit decreasing uses at most 11/9 OPT + 1 rows, and OPT >= ceil(tokens / T).
  const auto lower = static_cast<double>((3000 + T - 1) / T);
  CHECK(static_cast<double>(packed.rows.size()) <= 11.0 / 9.0 * lower + 1.0);
  WARN("packing efficiency " << packed.efficiency() << " in " << packed.rows.size() << " rows (lower bound "
                             << lower << ")");

  // The loader over one epoch (batch of 1 row: every row visited): each input index once.
  DataLoader loader(stream, {.batch_rows = 1, .seq_len = T, .seed = 3, .shuffle = true, .pack_separator = kSeparator});
  REQUIRE(loader.packed());
  REQUIRE(loader.windows() == static_cast<index_t>(packed.rows.size()));
  CHECK(loader.packing_efficiency() == packed.efficiency());
  std::vector<index_t> seen;
  for (index_t r = 0; r < loader.batches_per_epoch(); ++r) {
    const Batch b = loader.next();
    REQUIRE(b.packed());
    REQUIRE(b.segments.size() == static_cast<std::size_t>(T));
    for (index_t t = 0; t < T; ++t) {
      const bool pad = b.targets[t] < 0;
      if (t > 0) {
        REQUIRE(b.segments[t] >= b.segments[t - 1]);
        if (b.segments[t] == b.segments[t - 1] && !pad) REQUIRE(b.targets[t - 1] == b.inputs[t]);  // the stream, shifted
      }
      if (pad) {
        REQUIRE(b.inputs[t] == kSeparator);
        REQUIRE((t == T - 1 || b.targets[t + 1] < 0));  // padding only at the end
        continue;
      }
      // The token's stream index: its value - 1, or (a separator) its target's index - 1.
      const index_t index = b.inputs[t] != kSeparator ? b.inputs[t] - 1 : b.targets[t] - 2;
      REQUIRE(b.targets[t] == static_cast<std::int32_t>(stream[static_cast<std::size_t>(index + 1)]));
      seen.push_back(index);
    }
  }
  std::sort(seen.begin(), seen.end());
  REQUIRE(seen.size() == 3000);
  for (std::size_t i = 0; i < seen.size(); ++i) REQUIRE(seen[i] == static_cast<index_t>(i));
}
