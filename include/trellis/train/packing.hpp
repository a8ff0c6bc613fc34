// Packing variable-length documents into fixed-length rows (FlashAttention varlen / Megatron-style
// packed sequences), for the DataLoader's packed mode.
//
// Documents: the token stream is cut before every separator token, so each document starts with
// its separator (llm.c's shards put <|endoftext|> = 50256 before every document; for byte text any
// byte, e.g. '\n'). A document longer than a row is cut into pieces of at most T tokens. Only the
// first N - 1 tokens are inputs: input i's target is token i + 1, so a document's last token
// predicts the next document's separator (the end of the document), never a token it cannot see.
//
// Rows: best-fit decreasing (each piece, longest first, goes to the open row with the least room
// that still fits it; a new row when none does). The result depends on the tokens and T only; the
// loader shuffles the rows per epoch. Padding (the rest of a row) has the separator as input, no
// target (-1: ignored by the loss) and a document id of its own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"

namespace trellis::train {

// Tokens [start, start + length) of the stream: one document or a piece of one.
struct DocumentPiece {
  index_t start = 0;
  index_t length = 0;
};

// The pieces of the documents of `tokens` (inputs only: tokens [0, N - 1)), in stream order.
template <class Token>
std::vector<DocumentPiece> split_documents(std::span<const Token> tokens, std::int64_t separator, index_t max_length) {
  TRELLIS_CHECK(max_length > 0, "split_documents: pieces of at most ", max_length, " tokens");
  std::vector<DocumentPiece> out;
  const auto inputs = static_cast<index_t>(tokens.size()) - 1;
  index_t begin = 0;
  auto emit = [&](index_t end) {  // document [begin, end), in pieces of max_length
    for (index_t s = begin; s < end; s += max_length) out.push_back({s, std::min(max_length, end - s)});
  };
  for (index_t i = 1; i < inputs; ++i)
    if (static_cast<std::int64_t>(tokens[static_cast<std::size_t>(i)]) == separator) {
      emit(i);
      begin = i;
    }
  if (inputs > 0) emit(inputs);
  return out;
}

struct PackedRows {
  std::vector<std::vector<DocumentPiece>> rows;  // each row's pieces, in placement order
  index_t row_length = 0;
  index_t tokens = 0;  // real (non-padding) tokens over all rows
  // Real tokens / row capacity: 1 means no padding.
  double efficiency() const {
    return rows.empty() ? 0.0 : static_cast<double>(tokens) / (static_cast<double>(rows.size()) * row_length);
  }
  // Keys a real token attends to, in the dense formula's convention (a token of a document of n
  // tokens counts n): sum of n^2 / sum of n, what MFU's attention term uses instead of T.
  double attention_span() const {
    double sq = 0;
    for (const auto& row : rows)
      for (const DocumentPiece& p : row) sq += static_cast<double>(p.length) * static_cast<double>(p.length);
    return tokens > 0 ? sq / static_cast<double>(tokens) : 0.0;
  }
};

// Best-fit decreasing packing of `pieces` (each at most row_length long) into rows of row_length.
inline PackedRows pack_best_fit(std::vector<DocumentPiece> pieces, index_t row_length) {
  TRELLIS_CHECK(row_length > 0, "pack_best_fit: rows of ", row_length, " tokens");
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const DocumentPiece& a, const DocumentPiece& b) { return a.length > b.length; });
  PackedRows out;
  out.row_length = row_length;
  std::multimap<index_t, std::size_t> open;  // room left -> row (rows with room > 0)
  for (const DocumentPiece& p : pieces) {
    TRELLIS_CHECK(p.length > 0 && p.length <= row_length, "pack_best_fit: a piece of ", p.length,
                  " tokens for rows of ", row_length);
    std::size_t row;
    index_t room;
    if (auto it = open.lower_bound(p.length); it != open.end()) {
      row = it->second;
      room = it->first;
      open.erase(it);
    } else {
      row = out.rows.size();
      room = row_length;
      out.rows.emplace_back();
    }
    out.rows[row].push_back(p);
    out.tokens += p.length;
    if (room > p.length) open.emplace(room - p.length, row);
  }
  return out;
}

// Writes packed row `pieces` into inputs, targets and document ids (each row_length long).
template <class Token>
void fill_packed_row(std::span<const Token> tokens, const std::vector<DocumentPiece>& pieces, index_t row_length,
                     std::int64_t separator, std::int32_t* inputs, std::int32_t* targets, std::int32_t* segments) {
  index_t t = 0;
  std::int32_t id = 0;
  for (const DocumentPiece& p : pieces) {
    for (index_t i = 0; i < p.length; ++i, ++t) {
      inputs[t] = static_cast<std::int32_t>(tokens[static_cast<std::size_t>(p.start + i)]);
      targets[t] = static_cast<std::int32_t>(tokens[static_cast<std::size_t>(p.start + i + 1)]);
      segments[t] = id;
    }
    ++id;
  }
  for (; t < row_length; ++t) {
    inputs[t] = static_cast<std::int32_t>(separator);
    targets[t] = -1;
    segments[t] = id;
  }
}

}  // namespace trellis::train
