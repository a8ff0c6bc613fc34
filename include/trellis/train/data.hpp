// Training data: token sequences from text (bytes as tokens, vocab 256) or llm.c token shards,
// a train/validation split, the unigram baseline, and a loader of (inputs, targets) batches
// that is deterministic given a seed, shardable over data-parallel ranks and restorable.
//
// llm.c shard format: a header of 256 int32 (little-endian): [0] = 20240520 (magic),
// [1] = 1 (version), [2] = token count; then `count` uint16 tokens.
//
// Batches: the token stream is cut into windows of T + 1 tokens starting at multiples of T
// (inputs = window[0..T), targets = window[1..T]), W = (N - 1) / T windows. Each epoch visits
// the windows in a permutation drawn from Rng(seed, epoch) (or in order when shuffle is off);
// global batch b of the epoch takes windows [b*B, b*B + B) of it (the last W % B windows of an
// epoch are skipped). Data-parallel rank r of n gets the rows shard::chunk(B, n, r) of every
// global batch (or its Options::dp_rows share), so the union of the ranks' rows is exactly the
// single-rank batch.
// The loader's position is one integer (the next global batch), saved with the seed.
//
// Packed mode (Options::pack_separator >= 0): the "windows" are rows of T tokens packed from whole
// documents (train/packing.hpp), each batch carrying the documents' ids (Batch::segments) and -1
// targets on padding; the same shuffle, dp split and position apply to those rows.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/io/atomic_file.hpp"
#include "trellis/io/number.hpp"
#include "trellis/shard/layout.hpp"
#include "trellis/train/packing.hpp"
#include "trellis/train/rng.hpp"

namespace trellis::train {

using token_t = std::uint16_t;

struct TokenData {
  std::vector<token_t> tokens;
  int vocab_size = 256;
};

// Each byte of `text` is a token (vocab 256).
inline TokenData tokens_from_bytes(std::string_view text) {
  TokenData d;
  d.tokens.assign(reinterpret_cast<const unsigned char*>(text.data()),
                  reinterpret_cast<const unsigned char*>(text.data()) + text.size());
  d.vocab_size = 256;
  return d;
}
inline TokenData load_text_as_bytes(const std::filesystem::path& path) {
  return tokens_from_bytes(io::read_whole_file(path));
}

inline constexpr std::int32_t llmc_magic = 20240520;
inline constexpr std::int32_t llmc_version = 1;
inline constexpr std::size_t llmc_header_ints = 256;

inline void write_llmc_tokens(const std::filesystem::path& path, std::span<const token_t> tokens) {
  TRELLIS_CHECK(tokens.size() <= 0x7fffffffu, "llm.c shard ", path, ": ", tokens.size(), " tokens is too many");
  std::int32_t header[llmc_header_ints] = {};
  header[0] = llmc_magic;
  header[1] = llmc_version;
  header[2] = static_cast<std::int32_t>(tokens.size());
  io::AtomicFileWriter out(path);
  out.write(header, sizeof header);
  out.write(tokens.data(), tokens.size() * sizeof(token_t));
  out.commit();
}

// `vocab_size` is not stored in the format: give the tokenizer's (50257 for GPT-2).
inline TokenData load_llmc_tokens(const std::filesystem::path& path, int vocab_size = 50257) {
  io::ReadOnlyFile f(path);
  std::int32_t header[llmc_header_ints];
  TRELLIS_CHECK(f.size() >= sizeof header, path, ": ", f.size(), " bytes is too short for an llm.c token shard");
  f.read_at(0, header, sizeof header);
  TRELLIS_CHECK(header[0] == llmc_magic, path, ": magic ", header[0], " is not ", llmc_magic, " (not an llm.c token shard)");
  TRELLIS_CHECK(header[1] == llmc_version, path, ": unsupported llm.c shard version ", header[1]);
  TRELLIS_CHECK(header[2] >= 0, path, ": negative token count");
  const std::size_t count = static_cast<std::size_t>(header[2]);
  TRELLIS_CHECK(f.size() == sizeof header + count * sizeof(token_t), path, ": header says ", count,
                " tokens but the file holds ", (f.size() - sizeof header) / sizeof(token_t), " (truncated?)");
  TokenData d;
  d.vocab_size = vocab_size;
  d.tokens.resize(count);
  if (count) f.read_at(sizeof header, d.tokens.data(), count * sizeof(token_t));
  for (std::size_t i = 0; i < count; ++i)
    TRELLIS_CHECK(d.tokens[i] < vocab_size, path, ": token ", d.tokens[i], " at position ", i,
                  " is outside the vocabulary of ", vocab_size);
  return d;
}

// Several shards (e.g. a tokenized corpus split into train_000.bin, train_001.bin, ...), in the
// given order, as one token stream.
inline TokenData load_llmc_shards(const std::vector<std::filesystem::path>& paths, int vocab_size = 50257) {
  TRELLIS_CHECK(!paths.empty(), "load_llmc_shards: no files given");
  TokenData all;
  all.vocab_size = vocab_size;
  for (const auto& p : paths) {
    TokenData part = load_llmc_tokens(p, vocab_size);
    all.tokens.insert(all.tokens.end(), part.tokens.begin(), part.tokens.end());
  }
  return all;
}

// The last `val_fraction` of the tokens become validation data (a contiguous tail, so no
// window straddles both).
inline std::pair<TokenData, TokenData> train_val_split(const TokenData& all, double val_fraction) {
  TRELLIS_CHECK(val_fraction > 0.0 && val_fraction < 1.0, "val_fraction ", val_fraction, " not in (0, 1)");
  const auto n_val = static_cast<std::size_t>(std::llround(static_cast<double>(all.tokens.size()) * val_fraction));
  const std::size_t n_train = all.tokens.size() - n_val;
  TokenData train{{all.tokens.begin(), all.tokens.begin() + static_cast<std::ptrdiff_t>(n_train)}, all.vocab_size};
  TokenData val{{all.tokens.begin() + static_cast<std::ptrdiff_t>(n_train), all.tokens.end()}, all.vocab_size};
  return {std::move(train), std::move(val)};
}

// Entropy (nats/token) of the tokens' own unigram distribution: the loss of the best model that
// ignores context, measured on the data it was fitted to.
inline double unigram_entropy(std::span<const token_t> tokens, int vocab_size) {
  TRELLIS_CHECK(!tokens.empty(), "unigram_entropy of no tokens");
  std::vector<double> count(static_cast<std::size_t>(vocab_size), 0.0);
  for (token_t t : tokens) {
    TRELLIS_CHECK(t < vocab_size, "token ", t, " outside the vocabulary of ", vocab_size);
    count[t] += 1.0;
  }
  const double n = static_cast<double>(tokens.size());
  double h = 0.0;
  for (double c : count)
    if (c > 0) h -= (c / n) * std::log(c / n);
  return h;
}

// Cross-entropy (nats/token) on `eval` of the unigram model fitted to `train` with add-one
// smoothing: the "validation loss well below unigram baseline" reference for a trained model.
inline double unigram_cross_entropy(std::span<const token_t> train, std::span<const token_t> eval, int vocab_size) {
  TRELLIS_CHECK(!eval.empty(), "unigram_cross_entropy on no tokens");
  std::vector<double> count(static_cast<std::size_t>(vocab_size), 1.0);
  for (token_t t : train) {
    TRELLIS_CHECK(t < vocab_size, "token ", t, " outside the vocabulary of ", vocab_size);
    count[t] += 1.0;
  }
  const double total = static_cast<double>(train.size()) + vocab_size;
  double loss = 0.0;
  for (token_t t : eval) {
    TRELLIS_CHECK(t < vocab_size, "token ", t, " outside the vocabulary of ", vocab_size);
    loss -= std::log(count[t] / total);
  }
  return loss / static_cast<double>(eval.size());
}

// This rank's rows of one global batch: inputs and targets, each (rows, T) row-major.
struct Batch {
  std::vector<std::int32_t> inputs;   // (rows, T)
  std::vector<std::int32_t> targets;  // (rows, T); < 0: no target (padding), ignored by the loss
  std::vector<std::int32_t> segments;  // (rows, T) packed documents' ids (nn::TokenShape); empty: not packed
  index_t rows = 0;
  index_t seq_len = 0;
  index_t first_row = 0;  // index of this rank's first row within the global batch
  View<const std::int32_t, 2> input_view() const { return {inputs.data(), dextents<2>(rows, seq_len)}; }
  View<const std::int32_t, 2> target_view() const { return {targets.data(), dextents<2>(rows, seq_len)}; }
  bool packed() const { return !segments.empty(); }
};

// The position of a loader: restoring it resumes the exact batch sequence.
struct DataState {
  // next_batch is a global batch index; the loader's window arithmetic is signed 64-bit.
  static constexpr std::uint64_t max_next_batch = static_cast<std::uint64_t>(std::numeric_limits<index_t>::max());
  std::uint64_t seed = 0;
  std::uint64_t next_batch = 0;
  std::string to_string() const {
    return "seed=" + std::to_string(seed) + ";next_batch=" + std::to_string(next_batch);
  }
  // "seed=<n>;next_batch=<n>", both plain decimal, next_batch <= max_next_batch; errors start
  // with `what` (say which file and field).
  static DataState parse(std::string_view text, std::string_view what = "data position") {
    constexpr std::string_view seed_key = "seed=", batch_key = ";next_batch=";
    const auto sep = text.find(batch_key);
    TRELLIS_CHECK(text.starts_with(seed_key) && sep != std::string_view::npos, what, ": \"", text,
                  "\" is not \"seed=<n>;next_batch=<n>\"");
    const std::string where(what);
    DataState s;
    s.seed = io::parse_integer<std::uint64_t>(text.substr(seed_key.size(), sep - seed_key.size()), 0,
                                              std::numeric_limits<std::uint64_t>::max(), where + ", seed");
    s.next_batch = io::parse_integer<std::uint64_t>(text.substr(sep + batch_key.size()), 0, max_next_batch,
                                                    where + ", next_batch");
    return s;
  }
  bool operator==(const DataState&) const = default;
};

class DataLoader {
 public:
  struct Options {
    index_t batch_rows = 8;  // B: rows of the GLOBAL batch (over all dp ranks)
    index_t seq_len = 64;    // T
    std::uint64_t seed = 0;
    bool shuffle = true;
    int dp_rank = 0;
    int dp_size = 1;
    std::int64_t pack_separator = -1;  // >= 0: pack documents split before this token; -1: fixed windows
    // Unequal dp shares (TrainerConfig::dp_rows): rows of the global batch per dp rank; empty: even.
    std::vector<index_t> dp_rows{};
  };

  // `tokens` is referenced, not copied: keep it alive while the loader is used.
  DataLoader(std::span<const token_t> tokens, Options options) : tokens_(tokens), o_(options) {
    TRELLIS_CHECK(o_.batch_rows > 0 && o_.seq_len > 0, "DataLoader: batch ", o_.batch_rows, " x ", o_.seq_len);
    TRELLIS_CHECK(o_.dp_size > 0 && o_.dp_rank >= 0 && o_.dp_rank < o_.dp_size, "DataLoader: dp rank ",
                  o_.dp_rank, " of ", o_.dp_size);
    if (packed()) {
      packed_ = pack_best_fit(split_documents(tokens_, o_.pack_separator, o_.seq_len), o_.seq_len);
      windows_ = static_cast<index_t>(packed_.rows.size());
      TRELLIS_CHECK(windows_ >= o_.batch_rows, "DataLoader: ", tokens_.size(), " tokens pack into ", windows_,
                    " rows of ", o_.seq_len, ", fewer than one batch of ", o_.batch_rows, " rows");
    } else {
      windows_ = tokens_.size() > 0 ? (static_cast<index_t>(tokens_.size()) - 1) / o_.seq_len : 0;
      TRELLIS_CHECK(windows_ >= o_.batch_rows, "DataLoader: ", tokens_.size(), " tokens give ", windows_,
                    " windows of ", o_.seq_len, " + 1 tokens, fewer than one batch of ", o_.batch_rows, " rows");
    }
    if (o_.dp_rows.empty()) {
      const shard::Chunk mine = shard::chunk(o_.batch_rows, o_.dp_size, o_.dp_rank);
      first_row_ = mine.offset;
      local_rows_ = mine.size;
    } else {
      index_t sum = 0;
      for (index_t r : o_.dp_rows) sum += r;
      TRELLIS_CHECK(static_cast<int>(o_.dp_rows.size()) == o_.dp_size && sum == o_.batch_rows, "DataLoader: ",
                    o_.dp_rows.size(), " dp shares summing to ", sum, " rows for ", o_.dp_size, " dp ranks and a batch of ",
                    o_.batch_rows, " rows");
      for (int d = 0; d < o_.dp_rank; ++d) first_row_ += o_.dp_rows[static_cast<std::size_t>(d)];
      local_rows_ = o_.dp_rows[static_cast<std::size_t>(o_.dp_rank)];
    }
  }

  index_t windows() const { return windows_; }
  index_t batches_per_epoch() const { return windows_ / o_.batch_rows; }
  index_t local_rows() const { return local_rows_; }
  const Options& options() const { return o_; }
  bool packed() const { return o_.pack_separator >= 0; }
  // Packed mode: real tokens / capacity over all packed rows (1 = no padding).
  double packing_efficiency() const { return packed() ? packed_.efficiency() : 1.0; }
  // Keys a token attends to in MFU's convention: T, or packed the documents' mean span.
  double attention_span() const { return packed() ? packed_.attention_span() : static_cast<double>(o_.seq_len); }

  // The next global batch's rows for this dp rank.
  Batch next() {
    Batch b;
    next(b);
    return b;
  }
  void next(Batch& b) {
    TRELLIS_CHECK(next_batch_ <= DataState::max_next_batch, "DataLoader: position ", next_batch_, " is past ",
                  DataState::max_next_batch);
    const auto per_epoch = static_cast<std::uint64_t>(batches_per_epoch());
    const std::uint64_t epoch = next_batch_ / per_epoch;
    const auto in_epoch = static_cast<index_t>(next_batch_ % per_epoch);
    const index_t T = o_.seq_len;
    b.rows = local_rows_;
    b.seq_len = T;
    b.first_row = first_row_;
    b.inputs.resize(static_cast<std::size_t>(local_rows_ * T));
    b.targets.resize(static_cast<std::size_t>(local_rows_ * T));
    b.segments.resize(packed() ? static_cast<std::size_t>(local_rows_ * T) : 0);
    for (index_t r = 0; r < local_rows_; ++r) {
      const index_t window = window_of(epoch, in_epoch * o_.batch_rows + first_row_ + r);
      if (packed()) {
        fill_packed_row(tokens_, packed_.rows[static_cast<std::size_t>(window)], T, o_.pack_separator,
                        b.inputs.data() + r * T, b.targets.data() + r * T, b.segments.data() + r * T);
        continue;
      }
      const token_t* src = tokens_.data() + window * T;
      for (index_t t = 0; t < T; ++t) {
        b.inputs[static_cast<std::size_t>(r * T + t)] = src[t];
        b.targets[static_cast<std::size_t>(r * T + t)] = src[t + 1];
      }
    }
    ++next_batch_;
  }

  DataState state() const { return {o_.seed, next_batch_}; }
  void restore(const DataState& s) {
    TRELLIS_CHECK(s.seed == o_.seed, "DataLoader: the saved position is for data seed ", s.seed, ", this loader uses ",
                  o_.seed, ": resume with the seed the run was saved with");
    TRELLIS_CHECK(s.next_batch <= DataState::max_next_batch, "DataLoader: saved next_batch ", s.next_batch,
                  " is out of range [0, ", DataState::max_next_batch, "]");
    next_batch_ = s.next_batch;
  }
  void reset() { next_batch_ = 0; }

 private:
  // The window at position `slot` of epoch `epoch`'s order.
  index_t window_of(std::uint64_t epoch, index_t slot) {
    if (!o_.shuffle) return slot;
    if (order_.empty() || order_epoch_ != epoch) {
      order_.resize(static_cast<std::size_t>(windows_));
      for (index_t i = 0; i < windows_; ++i) order_[static_cast<std::size_t>(i)] = i;
      Rng rng(o_.seed, epoch);
      for (index_t i = windows_ - 1; i > 0; --i) {  // Fisher-Yates
        auto j = static_cast<index_t>(rng.uniform_int(static_cast<std::uint64_t>(i + 1)));
        std::swap(order_[static_cast<std::size_t>(i)], order_[static_cast<std::size_t>(j)]);
      }
      order_epoch_ = epoch;
    }
    return order_[static_cast<std::size_t>(slot)];
  }

  std::span<const token_t> tokens_;
  Options o_;
  index_t windows_ = 0;
  index_t first_row_ = 0;
  index_t local_rows_ = 0;
  std::uint64_t next_batch_ = 0;
  std::vector<index_t> order_;
  std::uint64_t order_epoch_ = 0;
  PackedRows packed_;  // packed mode: the rows (fixed at construction)
};

}  // namespace trellis::train
