// The safetensors file format, read and written by our own code:
//   [u64 little-endian N][N bytes of JSON header, space-padded to a multiple of 8][data]
// The header maps each tensor name to {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}
// (byte offsets into the data section), plus an optional "__metadata__" map of string -> string.
// Tensors are stored row-major, little-endian, and tile the data section without gaps (as the
// reference implementation requires). We add one CRC32C per tensor to __metadata__ under
// "crc32c.<name>" (8 hex digits) and verify it on every read; other readers ignore it.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/io/atomic_file.hpp"
#include "trellis/io/checksum.hpp"
#include "trellis/io/json.hpp"

namespace trellis::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; big-endian hosts would need byte swaps");

using Shape = std::vector<index_t>;
using Metadata = std::map<std::string, std::string, std::less<>>;

inline const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::i8: return "I8";
    case DType::u8: return "U8";
    case DType::i32: return "I32";
    case DType::u32: return "U32";
    case DType::i64: return "I64";
    case DType::u64: return "U64";
  }
  return "?";
}

inline DType parse_safetensors_dtype(std::string_view s, std::string_view what) {
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::u8,
                  DType::i32, DType::u32, DType::i64, DType::u64})
    if (s == safetensors_dtype(t)) return t;
  TRELLIS_THROW(what, ": unsupported dtype \"", s, "\"");
}

inline std::string shape_string(std::span<const index_t> shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// Number of elements; throws on a negative extent or a count past 2^56 (shapes come from files).
inline index_t shape_elements(std::span<const index_t> shape) {
  index_t n = 1;
  for (index_t d : shape) {
    TRELLIS_CHECK(d >= 0, "negative extent in shape ", shape_string(shape));
    TRELLIS_CHECK(!__builtin_mul_overflow(n, d, &n) && n <= (index_t{1} << 56), "shape ", shape_string(shape),
                  " has too many elements");
  }
  return n;
}

inline std::string crc_hex(std::uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

inline constexpr std::string_view safetensors_crc_prefix = "crc32c.";

// One tensor of a safetensors file.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::size_t begin = 0;  // byte offsets in the data section
  std::size_t end = 0;
  std::size_t bytes() const { return end - begin; }
};

// Collects tensors (by reference: the memory must stay valid until write()) and metadata, then
// writes one file atomically.
class SafetensorsWriter {
 public:
  void add(std::string name, DType dtype, Shape shape, const void* data) {
    TRELLIS_CHECK(!name.empty() && name != "__metadata__", "safetensors: bad tensor name \"", name, "\"");
    for (index_t d : shape) TRELLIS_CHECK(d >= 0, "safetensors: tensor ", name, " has negative extent");
    for (const auto& t : tensors_)
      TRELLIS_CHECK(t.name != name, "safetensors: tensor \"", name, "\" added twice");
    std::size_t bytes = static_cast<std::size_t>(shape_elements(shape)) * dtype_size(dtype);
    TRELLIS_CHECK(bytes == 0 || data != nullptr, "safetensors: tensor ", name, " has no data");
    tensors_.push_back({std::move(name), dtype, std::move(shape), static_cast<const std::byte*>(data), bytes});
  }
  template <class T, class E>
  void add(std::string name, TensorView<T, E, Host> view) {
    TRELLIS_CHECK(view.is_contiguous(), "safetensors: tensor ", name, " must be contiguous");
    auto ext = view.extents().array();
    add(std::move(name), dtype_v<std::remove_const_t<T>>, Shape(ext.begin(), ext.end()), view.data());
  }
  void set_metadata(std::string key, std::string value) {
    TRELLIS_CHECK(!key.starts_with(safetensors_crc_prefix), "metadata key ", key, " is reserved");
    metadata_[std::move(key)] = std::move(value);
  }
  std::size_t tensor_count() const { return tensors_.size(); }

  // The CRC32C of each tensor, in add() order, valid after write().
  const std::vector<std::uint32_t>& checksums() const { return crcs_; }

  // Writes `path` via a temporary file + fsync + rename.
  void write(const std::filesystem::path& path) {
    crcs_.clear();
    json::Object header;
    json::Object meta;
    for (const auto& [k, v] : metadata_) meta[k] = json::Value(v);
    std::size_t offset = 0;
    for (const auto& t : tensors_) {
      std::uint32_t crc = crc32c(t.data, t.bytes);
      crcs_.push_back(crc);
      meta[std::string(safetensors_crc_prefix) + t.name] = json::Value(crc_hex(crc));
      json::Array shape;
      for (index_t d : t.shape) shape.emplace_back(d);
      json::Object entry;
      entry["dtype"] = json::Value(safetensors_dtype(t.dtype));
      entry["shape"] = json::Value(std::move(shape));
      entry["data_offsets"] = json::Value(json::Array{json::Value(offset), json::Value(offset + t.bytes)});
      header[t.name] = json::Value(std::move(entry));
      offset += t.bytes;
    }
    header["__metadata__"] = json::Value(std::move(meta));
    std::string text = json::dump(json::Value(std::move(header)));
    text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
    std::uint64_t n = text.size();
    AtomicFileWriter out(path);
    out.write(&n, sizeof n);
    out.write(text);
    for (const auto& t : tensors_) out.write(t.data, t.bytes);
    out.commit();
  }

 private:
  struct Pending {
    std::string name;
    DType dtype;
    Shape shape;
    const std::byte* data;
    std::size_t bytes;
  };
  std::vector<Pending> tensors_;
  Metadata metadata_;
  std::vector<std::uint32_t> crcs_;
};

// An opened safetensors file: header parsed and validated against the file size at open; tensor
// bytes read (and checksum-verified, when a checksum is stored) on demand.
class SafetensorsFile {
 public:
  static constexpr std::uint64_t max_header_bytes = 100u << 20;  // as the reference reader

  explicit SafetensorsFile(const std::filesystem::path& path) : file_(path) {
    const std::string what = "safetensors header of " + path.string();
    TRELLIS_CHECK(file_.size() >= 8, path, " is too short to be a safetensors file (", file_.size(),
                  " bytes): truncated?");
    std::uint64_t n = 0;
    file_.read_at(0, &n, 8);
    TRELLIS_CHECK(n <= max_header_bytes && n <= file_.size() - 8, path, ": header length ", n,
                  " does not fit in the file (", file_.size(), " bytes): truncated or not safetensors");
    std::string text(n, '\0');
    file_.read_at(8, text.data(), n);
    data_start_ = 8 + n;
    json::Value header = json::parse(text, what);
    for (const auto& [key, value] : header.as_object(what)) {
      if (key == "__metadata__") {
        for (const auto& [mk, mv] : value.as_object(what + " __metadata__"))
          metadata_[mk] = mv.as_string(what + " __metadata__." + mk);
        continue;
      }
      std::string where = what + ", tensor \"" + key + "\"";
      SafetensorsEntry e;
      e.name = key;
      e.dtype = parse_safetensors_dtype(value.at("dtype", where).as_string(where + " dtype"), where);
      for (const auto& d : value.at("shape", where).as_array(where + " shape")) {
        e.shape.push_back(d.as_int(where + " shape"));
        TRELLIS_CHECK(e.shape.back() >= 0, where, ": negative extent");
      }
      const auto& offs = value.at("data_offsets", where).as_array(where + " data_offsets");
      TRELLIS_CHECK(offs.size() == 2, where, ": data_offsets must have two entries");
      std::int64_t b = offs[0].as_int(where), en = offs[1].as_int(where);
      TRELLIS_CHECK(0 <= b && b <= en, where, ": bad data_offsets [", b, ", ", en, "]");
      e.begin = static_cast<std::size_t>(b);
      e.end = static_cast<std::size_t>(en);
      std::size_t expect = static_cast<std::size_t>(shape_elements(e.shape)) * dtype_size(e.dtype);
      TRELLIS_CHECK(e.bytes() == expect, where, ": data_offsets span ", e.bytes(), " bytes but shape ",
                    shape_string(e.shape), " of ", safetensors_dtype(e.dtype), " needs ", expect);
      entries_.push_back(std::move(e));
    }
    // The tensors must tile the data section [0, data size) exactly.
    std::vector<const SafetensorsEntry*> sorted;
    for (const auto& e : entries_) sorted.push_back(&e);
    std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    std::size_t cursor = 0;
    for (const auto* e : sorted) {
      TRELLIS_CHECK(e->begin == cursor, path, ": tensor \"", e->name, "\" starts at byte ", e->begin,
                    " of the data section, expected ", cursor, " (overlap or gap)");
      cursor = e->end;
    }
    std::size_t data_size = file_.size() - data_start_;
    TRELLIS_CHECK(cursor == data_size, path, ": header describes ", cursor,
                  " bytes of tensor data but the file holds ", data_size, cursor > data_size ? " (truncated)" : "");
  }

  const std::filesystem::path& path() const { return file_.path(); }
  // These return references into the file object: on a temporary they would dangle (a test once
  // read a freed entry this way and failed only on another machine), so they are refused there.
  const std::vector<SafetensorsEntry>& entries() const& { return entries_; }
  const std::vector<SafetensorsEntry>& entries() const&& = delete;
  const Metadata& metadata() const& { return metadata_; }
  const Metadata& metadata() const&& = delete;

  const SafetensorsEntry* find(std::string_view name) const& {
    for (const auto& e : entries_)
      if (e.name == name) return &e;
    return nullptr;
  }
  const SafetensorsEntry* find(std::string_view name) const&& = delete;
  const SafetensorsEntry& entry(std::string_view name) const& {
    const auto* e = find(name);
    if (!e) TRELLIS_THROW(path(), ": no tensor \"", name, "\"");
    return *e;
  }
  const SafetensorsEntry& entry(std::string_view name) const&& = delete;

  // Reads the whole tensor into `out` (entry.bytes() bytes) and verifies its CRC32C if stored.
  void read(std::string_view name, void* out) const {
    const auto& e = entry(name);
    file_.read_at(data_start_ + e.begin, out, e.bytes());
    auto it = metadata_.find(std::string(safetensors_crc_prefix) + e.name);
    if (it != metadata_.end()) {
      std::string got = crc_hex(crc32c(out, e.bytes()));
      if (got != it->second)
        TRELLIS_THROW(path(), ": checksum mismatch for tensor \"", e.name, "\" (stored ", it->second, ", computed ",
                      got, "): the file is corrupt");
    }
  }
  std::vector<std::byte> read(std::string_view name) const {
    std::vector<std::byte> out(entry(name).bytes());
    read(name, out.data());
    return out;
  }
  // Typed read with a dtype check.
  template <class T>
  std::vector<T> read_as(std::string_view name) const {
    const auto& e = entry(name);
    TRELLIS_CHECK(e.dtype == dtype_v<T>, path(), ": tensor \"", name, "\" is ", safetensors_dtype(e.dtype),
                  ", not ", safetensors_dtype(dtype_v<T>));
    std::vector<T> out(e.bytes() / sizeof(T));
    read(name, out.data());
    return out;
  }

 private:
  ReadOnlyFile file_;
  std::size_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  Metadata metadata_;
};

}  // namespace trellis::io
