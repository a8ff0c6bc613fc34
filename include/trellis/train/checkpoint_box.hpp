// Boxes of a global tensor, the geometry under checkpoints: which elements a rank holds (Box),
// the boxes a split or a flat range covers, intersections, tiling checks and the strided copy of
// one box's region into another's. No files here: train/checkpoint.hpp stores and reads boxes.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/io/safetensors.hpp"
#include "trellis/shard/layout.hpp"

namespace trellis::train {

// The checkpoint API speaks the safetensors vocabulary: global shapes and string metadata.
using io::Metadata;
using io::Shape;

// The elements [offsets[d], offsets[d] + shape[d]) in every dimension d of a tensor.
struct Box {
  Shape offsets;
  Shape shape;
  bool operator==(const Box&) const = default;
};

inline std::string box_string(const Box& b) {
  return "offsets " + io::shape_string(b.offsets) + " shape " + io::shape_string(b.shape);
}

// A whole tensor as a box.
inline Box full_box(const Shape& shape) { return {Shape(shape.size(), 0), shape}; }

// `n` items split into `parts`: {offset, size} of part `index`, by the project's one uneven
// rule (shard::chunk: the first n % parts parts get one extra).
inline std::pair<index_t, index_t> split_extent(index_t n, int parts, int index) {
  TRELLIS_CHECK(parts > 0 && index >= 0 && index < parts, "split_extent: part ", index, " of ", parts);
  TRELLIS_CHECK(n >= 0, "split_extent: negative extent ", n);
  const shard::Chunk c = shard::chunk(n, parts, index);
  return {c.offset, c.size};
}

// A rank's box from shard::local_box (its per-dimension chunks of the global tensor).
template <std::size_t R>
Box box_from_chunks(const std::array<shard::Chunk, R>& chunks) {
  Box b;
  for (const auto& c : chunks) {
    b.offsets.push_back(c.offset);
    b.shape.push_back(c.size);
  }
  return b;
}

// Part `index` of `parts` of a tensor split along `dim` (the rest whole).
inline Box split_box(const Shape& global_shape, int dim, int parts, int index) {
  TRELLIS_CHECK(dim >= 0 && dim < static_cast<int>(global_shape.size()), "split_box: dimension ", dim,
                " of a rank-", global_shape.size(), " tensor");
  Box b = full_box(global_shape);
  auto [offset, size] = split_extent(global_shape[dim], parts, index);
  b.offsets[dim] = offset;
  b.shape[dim] = size;
  return b;
}

// The flat (row-major) element range [begin, end) of a tensor with `shape`, as boxes in order
// (at most 2 * rank - 1 of them). ZeRO-1 partitions of flat buffers are saved this way.
inline std::vector<Box> flat_range_boxes(const Shape& shape, index_t begin, index_t end) {
  index_t total = io::shape_elements(shape);
  TRELLIS_CHECK(0 <= begin && begin <= end && end <= total, "flat range [", begin, ", ", end,
                ") outside a tensor of ", total, " elements");
  std::vector<Box> out;
  const int rank = static_cast<int>(shape.size());
  if (begin == end) return out;
  if (rank == 0) {
    out.push_back({{}, {}});
    return out;
  }
  // Recursive over dimensions; `prefix` fixes the indices of the outer dimensions (size 1).
  auto recurse = [&](auto& self, int dim, Shape prefix, index_t b, index_t e) -> void {
    if (b == e) return;
    index_t inner = 1;
    for (int d = dim + 1; d < rank; ++d) inner *= shape[d];
    auto emit = [&](index_t lo, index_t hi) {  // whole slices [lo, hi) along `dim`
      Box box;
      box.offsets = prefix;
      box.shape = Shape(prefix.size(), 1);
      box.offsets.push_back(lo);
      box.shape.push_back(hi - lo);
      for (int d = dim + 1; d < rank; ++d) {
        box.offsets.push_back(0);
        box.shape.push_back(shape[d]);
      }
      out.push_back(std::move(box));
    };
    auto into = [&](index_t i) {
      Shape p = prefix;
      p.push_back(i);
      return p;
    };
    index_t first = b / inner, last = e / inner;  // slices containing b and e
    if (first == last) {
      self(self, dim + 1, into(first), b % inner, e % inner);
      return;
    }
    if (b % inner != 0) {
      self(self, dim + 1, into(first), b % inner, inner);
      ++first;
    }
    if (last > first) emit(first, last);
    if (e % inner != 0) self(self, dim + 1, into(last), 0, e % inner);
  };
  recurse(recurse, 0, Shape{}, begin, end);
  return out;
}

namespace detail {
inline void check_box_in(const Shape& global, const Box& box, const std::string& what) {
  TRELLIS_CHECK(box.offsets.size() == global.size() && box.shape.size() == global.size(), what, ": ",
                box_string(box), " has the wrong rank for global shape ", io::shape_string(global));
  for (std::size_t d = 0; d < global.size(); ++d)
    TRELLIS_CHECK(box.offsets[d] >= 0 && box.shape[d] >= 0 && box.offsets[d] <= global[d] &&
                      box.shape[d] <= global[d] - box.offsets[d],
                  what, ": ", box_string(box), " lies outside global shape ", io::shape_string(global));
}
// The intersection of two boxes, or nullopt when it is empty.
inline std::optional<Box> intersect(const Box& a, const Box& b) {
  Box r;
  for (std::size_t d = 0; d < a.offsets.size(); ++d) {
    index_t lo = std::max(a.offsets[d], b.offsets[d]);
    index_t hi = std::min(a.offsets[d] + a.shape[d], b.offsets[d] + b.shape[d]);
    if (hi <= lo) return std::nullopt;
    r.offsets.push_back(lo);
    r.shape.push_back(hi - lo);
  }
  return r;
}
// The smallest box holding every box of `boxes` (not empty, all of one rank).
inline Box bounding_box(const std::vector<Box>& boxes) {
  Box r = boxes.front();
  for (const Box& b : boxes)
    for (std::size_t d = 0; d < r.offsets.size(); ++d) {
      const index_t hi = std::max(r.offsets[d] + r.shape[d], b.offsets[d] + b.shape[d]);
      r.offsets[d] = std::min(r.offsets[d], b.offsets[d]);
      r.shape[d] = hi - r.offsets[d];
    }
  return r;
}
// Whether `boxes` cover their bounding box exactly once (pairwise disjoint, no gap).
inline bool tiles_bounding_box(const std::vector<Box>& boxes) {
  index_t covered = 0;
  for (std::size_t i = 0; i < boxes.size(); ++i) {
    covered += io::shape_elements(boxes[i].shape);
    for (std::size_t j = 0; j < i; ++j)
      if (intersect(boxes[i], boxes[j])) return false;
  }
  return covered == io::shape_elements(bounding_box(boxes).shape);
}
// Copies the region `region` (global coordinates) from a row-major block `src` laid out as box
// `src_box` into a row-major block `dst` laid out as box `dst_box`; elements of `elem` bytes.
inline void copy_region(const Box& region, const std::byte* src, const Box& src_box, std::byte* dst,
                        const Box& dst_box, std::size_t elem) {
  const int rank = static_cast<int>(region.shape.size());
  if (rank == 0) {
    std::memcpy(dst, src, elem);
    return;
  }
  auto strides = [&](const Shape& shape) {
    Shape s(shape.size(), 1);
    for (int d = rank - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
    return s;
  };
  Shape ss = strides(src_box.shape), ds = strides(dst_box.shape);
  const std::size_t run = static_cast<std::size_t>(region.shape[rank - 1]) * elem;
  Shape idx(rank, 0);  // index within region, last dimension fixed at 0
  index_t rows = 1;
  for (int d = 0; d < rank - 1; ++d) rows *= region.shape[d];
  for (index_t r = 0; r < rows; ++r) {
    index_t so = 0, doff = 0;
    for (int d = 0; d < rank; ++d) {
      index_t g = region.offsets[d] + idx[d];
      so += (g - src_box.offsets[d]) * ss[d];
      doff += (g - dst_box.offsets[d]) * ds[d];
    }
    std::memcpy(dst + doff * static_cast<index_t>(elem), src + so * static_cast<index_t>(elem), run);
    for (int d = rank - 2; d >= 0; --d) {  // odometer over the outer dimensions
      if (++idx[d] < region.shape[d]) break;
      idx[d] = 0;
    }
  }
}
}  // namespace detail

}  // namespace trellis::train
