// Reshardable, crash-safe checkpoints (format and protocol: docs/checkpoint.md).
//
//   <root>/step-00000100/shard-<rank>.safetensors   each rank's pieces ("boxes") of its model
//                                                    tensors (one rank: a plain GPT-2 file)
//   <root>/step-00000100/optim-<rank>.safetensors   ... of its optimizer tensors (AdamW moments)
//   <root>/step-00000100/index.json                  per tensor: dtype, GLOBAL shape, and per
//                                                    shard: file, key, offsets, shape, crc32c;
//                                                    every rank's metadata; CRC32C of it all
//   <root>/latest                                    "step-00000100": the newest complete one
//
// Saving, on every rank:                     then, after a barrier, on one rank:
//   CheckpointWriter w(root, step, rank, n);   commit_checkpoint(root, step, n);
//   w.add("h.0.attn.c_attn.weight", view, global_shape, offsets); ...
//   w.finish();
// Ranks write into <root>/step-N.partial/; commit checks that the shards tile every tensor,
// writes index.json, renames the directory to step-N and only then points `latest` at it, so
// the previous checkpoint stays the loadable one until the new one is complete. A stop between
// the two renames of a re-save (step-N -> step-N.old, step-N.partial -> step-N) is read through
// by latest_checkpoint and repaired by the next commit (docs/checkpoint.md has the whole table).
//
// Loading: Checkpoint ck(root); ck.read(name, offsets, out_view) reads any box of the global
// tensor from whichever shards overlap it, so any layout (dp/tp/pp/ZeRO-1) loads any other.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/io/atomic_file.hpp"
#include "trellis/io/json.hpp"
#include "trellis/io/safetensors.hpp"
#include "trellis/train/checkpoint_box.hpp"
#include "trellis/shard/layout.hpp"

namespace trellis::train {

// "step-00000100": the directory name of a step's checkpoint.
inline std::string step_directory_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}
inline std::string shard_file_name(int rank) { return "shard-" + std::to_string(rank) + ".safetensors"; }
inline std::string optimizer_file_name(int rank) { return "optim-" + std::to_string(rank) + ".safetensors"; }

// Which of a rank's two files a tensor goes to: the model file holds what a model loader wants
// (so a one-rank shard-0.safetensors is a plain GPT-2 file); the optimizer file everything else
// a resume needs (AdamW moments). Both are listed in index.json, so reading is the same.
enum class CheckpointFile { model, optimizer };

namespace detail {
inline constexpr std::string_view ckpt_shard_prefix = "trellis.shard.";
inline const char* ckpt_step_key = "trellis.step";
inline const char* ckpt_rank_key = "trellis.rank";
inline const char* ckpt_world_key = "trellis.world_size";
inline const char* ckpt_format_key = "format";
inline const char* ckpt_metadata_crc_key = "trellis.metadata_crc32c";
// 3: index_crc32c and rank_metadata_crc32c; 2: optimizer files, boxes merged per rank; 1 and 2 still load
inline constexpr int ckpt_version = 3;
inline constexpr std::string_view index_crc_member = "index_crc32c";
inline constexpr std::string_view rank_metadata_crc_member = "rank_metadata_crc32c";

inline io::json::Value shape_json(const Shape& s) {
  io::json::Array a;
  for (index_t d : s) a.emplace_back(d);
  return io::json::Value(std::move(a));
}
inline Shape shape_from_json(const io::json::Value& v, const std::string& what) {
  Shape s;
  for (const auto& d : v.as_array(what)) s.push_back(d.as_int(what));
  return s;
}
inline bool is_reserved_metadata(std::string_view key) {
  return key == ckpt_format_key || key.starts_with("trellis.") || key.starts_with(io::safetensors_crc_prefix);
}
inline io::json::Value metadata_json(const Metadata& m) {
  io::json::Object o;
  for (const auto& [k, v] : m) o[k] = io::json::Value(v);
  return io::json::Value(std::move(o));
}
// Checksums of JSON content are taken over its compact form (sorted keys, no spaces), so they
// do not depend on the pretty-printing of index.json.
inline std::string json_crc(const io::json::Value& v) {
  const std::string text = io::json::dump(v);
  return io::crc_hex(io::crc32c(text.data(), text.size()));
}
// A rank's metadata, as it set it: computed by the rank at finish(), checked at the commit and
// at every load, so a flipped bit on the way is found and blamed on that rank.
inline std::string metadata_crc(const Metadata& m) { return json_crc(metadata_json(m)); }
inline bool is_float_dtype(DType t) {
  return t == DType::f64 || t == DType::f32 || t == DType::f16 || t == DType::bf16;
}
// Converts n floating-point values between dtypes (through float; f64 -> f64 never comes here).
inline void convert_floats(const std::byte* src, DType from, void* dst, DType to, std::size_t n) {
  auto load = [&](std::size_t i) -> double {
    switch (from) {
      case DType::f64: { double v; std::memcpy(&v, src + i * 8, 8); return v; }
      case DType::f32: { float v; std::memcpy(&v, src + i * 4, 4); return v; }
      case DType::f16: { half v; std::memcpy(&v, src + i * 2, 2); return static_cast<float>(v); }
      case DType::bf16: { bfloat16 v; std::memcpy(&v, src + i * 2, 2); return static_cast<float>(v); }
      default: TRELLIS_THROW("convert_floats: ", io::safetensors_dtype(from), " is not a floating type");
    }
  };
  auto* out = static_cast<std::byte*>(dst);
  for (std::size_t i = 0; i < n; ++i) {
    const double x = load(i);
    switch (to) {
      case DType::f64: std::memcpy(out + i * 8, &x, 8); break;
      case DType::f32: { float v = static_cast<float>(x); std::memcpy(out + i * 4, &v, 4); break; }
      case DType::f16: { half v(static_cast<float>(x)); std::memcpy(out + i * 2, &v, 2); break; }
      case DType::bf16: { bfloat16 v(static_cast<float>(x)); std::memcpy(out + i * 2, &v, 2); break; }
      default: TRELLIS_THROW("convert_floats: ", io::safetensors_dtype(to), " is not a floating type");
    }
  }
}
inline std::filesystem::path staging_directory(const std::filesystem::path& root, std::int64_t step) {
  return root / (step_directory_name(step) + ".partial");
}
}  // namespace detail

// One rank's part of a checkpoint. Tensor memory is referenced, not copied: keep it unchanged
// until finish() returns.
class CheckpointWriter {
 public:
  CheckpointWriter(std::filesystem::path root, std::int64_t step, int rank, int world_size)
      : root_(std::move(root)), step_(step), rank_(rank), world_size_(world_size) {
    TRELLIS_CHECK(world_size > 0 && rank >= 0 && rank < world_size, "checkpoint rank ", rank,
                  " of world size ", world_size);
    TRELLIS_CHECK(step >= 0, "checkpoint step ", step, " is negative");
  }

  // This rank's box of tensor `name` (row-major bytes of box.shape at `data`), into the model
  // file (shard-<rank>) or the optimizer file (optim-<rank>).
  void add(std::string_view name, DType dtype, const Shape& global_shape, const Box& box, const void* data,
           CheckpointFile file = CheckpointFile::model) {
    std::string what = "checkpoint tensor \"" + std::string(name) + "\"";
    TRELLIS_CHECK(!name.empty() && name.find('#') == std::string_view::npos, what,
                  ": names must be non-empty and may not contain '#'");
    detail::check_box_in(global_shape, box, what);
    for (const auto& p : pieces_)
      TRELLIS_CHECK(p.name != name || (p.dtype == dtype && p.global_shape == global_shape && p.file == file), what,
                    ": added again with another dtype, global shape or file");
    pieces_.push_back({std::string(name), dtype, global_shape, box, data, file});
  }
  template <class T, class E>
  void add(std::string_view name, TensorView<T, E, Host> local, const Shape& global_shape, const Shape& offsets) {
    TRELLIS_CHECK(local.is_contiguous(), "checkpoint tensor \"", name, "\": the local view must be contiguous");
    auto ext = local.extents().array();
    add(name, dtype_v<std::remove_const_t<T>>, global_shape, Box{offsets, Shape(ext.begin(), ext.end())}, local.data());
  }
  // A whole (unsharded) tensor.
  template <class T>
  void add_whole(std::string_view name, std::span<const T> data, const Shape& shape) {
    TRELLIS_CHECK(static_cast<index_t>(data.size()) == io::shape_elements(shape), "checkpoint tensor \"",
                  name, "\": ", data.size(), " elements for shape ", io::shape_string(shape));
    add(name, dtype_v<T>, shape, full_box(shape), data.data());
  }
  // ZeRO-1: `data` holds the flat elements [flat_begin, flat_begin + data.size()) of this rank's
  // local block `local_box` of the global tensor (row-major within the block).
  template <class T>
  void add_flat_range(std::string_view name, const Shape& global_shape, const Box& local_box,
                      index_t flat_begin, std::span<const T> data, CheckpointFile file = CheckpointFile::model) {
    detail::check_box_in(global_shape, local_box, "checkpoint tensor \"" + std::string(name) + "\"");
    const T* p = data.data();
    for (Box b : flat_range_boxes(local_box.shape, flat_begin, flat_begin + static_cast<index_t>(data.size()))) {
      for (std::size_t d = 0; d < b.offsets.size(); ++d) b.offsets[d] += local_box.offsets[d];
      add(name, dtype_v<T>, global_shape, b, p, file);
      p += io::shape_elements(b.shape);
    }
  }

  // Free-form metadata (RNG state, data position, config...). index.json keeps every rank's
  // ("rank_metadata") and rank 0's also as "metadata".
  void set_metadata(std::string key, std::string value) {
    TRELLIS_CHECK(!detail::is_reserved_metadata(key), "checkpoint metadata key \"", key, "\" is reserved");
    metadata_[std::move(key)] = std::move(value);
  }

  const std::filesystem::path& root() const { return root_; }
  std::int64_t step() const { return step_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Writes <root>/step-N.partial/optim-<rank>.safetensors (when this rank added optimizer
  // tensors), then shard-<rank>.safetensors (temporary name, fsync, rename each): a shard file
  // that exists means the rank finished.
  void finish() {
    namespace fs = std::filesystem;
    auto staging = detail::staging_directory(root_, step_);
    std::error_code ec;  // several ranks may create it at once: only its absence afterwards is an error
    fs::create_directories(staging, ec);
    TRELLIS_CHECK(fs::is_directory(staging), "cannot create checkpoint directory ", staging, ": ", ec.message());
    // An index.json here is from an earlier attempt at this step that crashed after writing it:
    // with it gone, the directory is no longer "complete" while this attempt rewrites the files.
    fs::remove(staging / "index.json", ec);
    std::vector<std::vector<std::byte>> assembled;  // merged boxes, alive until written
    io::SafetensorsWriter model, optimizer;
    for (const auto& e : entries(assembled)) {
      io::SafetensorsWriter& w = e.file == CheckpointFile::model ? model : optimizer;
      w.add(e.key, e.dtype, e.box.shape, e.data);
      io::json::Object info;
      info["tensor"] = io::json::Value(e.name);
      info["global_shape"] = detail::shape_json(e.global_shape);
      info["offsets"] = detail::shape_json(e.box.offsets);
      w.set_metadata(std::string(detail::ckpt_shard_prefix) + e.key, io::json::dump(io::json::Value(std::move(info))));
    }
    for (const auto& [k, v] : metadata_) model.set_metadata(k, v);
    model.set_metadata(detail::ckpt_metadata_crc_key, detail::metadata_crc(metadata_));
    for (io::SafetensorsWriter* w : {&model, &optimizer}) {
      w->set_metadata(detail::ckpt_format_key, "pt");  // what Hugging Face's loaders require
      w->set_metadata(detail::ckpt_step_key, std::to_string(step_));
      w->set_metadata(detail::ckpt_rank_key, std::to_string(rank_));
      w->set_metadata(detail::ckpt_world_key, std::to_string(world_size_));
    }
    if (optimizer.tensor_count() > 0)
      optimizer.write(staging / optimizer_file_name(rank_));
    else  // left by a crashed attempt at this step in another layout
      fs::remove(staging / optimizer_file_name(rank_), ec);
    model.write(staging / shard_file_name(rank_));
    io::fsync_directory(staging);
  }

 private:
  struct Piece {
    std::string name;
    DType dtype;
    Shape global_shape;
    Box box;
    const void* data;
    CheckpointFile file;
  };
  struct Entry : Piece {
    std::string key;  // in the file: the name, or "<name>#<k>" for the k-th of several boxes
  };

  // One entry per tensor whose boxes on this rank tile their bounding box (copied together into
  // `assembled`), so a one-rank checkpoint holds whole tensors under their plain names; otherwise
  // one entry per box.
  std::vector<Entry> entries(std::vector<std::vector<std::byte>>& assembled) const {
    std::vector<Entry> out;
    std::vector<bool> done(pieces_.size(), false);
    for (std::size_t i = 0; i < pieces_.size(); ++i) {
      if (done[i]) continue;
      std::vector<const Piece*> same;
      for (std::size_t j = i; j < pieces_.size(); ++j)
        if (pieces_[j].name == pieces_[i].name) {
          same.push_back(&pieces_[j]);
          done[j] = true;
        }
      std::vector<Box> boxes;
      for (const Piece* p : same) boxes.push_back(p->box);
      if (same.size() == 1 || !detail::tiles_bounding_box(boxes)) {
        for (std::size_t k = 0; k < same.size(); ++k)
          out.push_back({*same[k], same.size() == 1 ? same[k]->name : same[k]->name + "#" + std::to_string(k)});
        continue;
      }
      const Box whole = detail::bounding_box(boxes);
      const std::size_t elem = dtype_size(same[0]->dtype);
      auto& buffer = assembled.emplace_back(static_cast<std::size_t>(io::shape_elements(whole.shape)) * elem);
      for (const Piece* p : same)
        detail::copy_region(p->box, static_cast<const std::byte*>(p->data), p->box, buffer.data(), whole, elem);
      Entry e{*same[0], same[0]->name};
      e.box = whole;
      e.data = buffer.data();
      out.push_back(std::move(e));
    }
    return out;
  }

  std::filesystem::path root_;
  std::int64_t step_;
  int rank_, world_size_;
  std::vector<Piece> pieces_;
  Metadata metadata_;
};

// Where one shard of a tensor lives.
struct ShardInfo {
  std::string file;  // relative to the checkpoint directory
  std::string key;   // tensor name inside that file
  Box box;           // in global coordinates
  std::string crc32c;
};
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;  // global
  std::vector<ShardInfo> shards;
};

namespace detail {
// Every element of the global tensor covered exactly once. `source`: where the tiling comes from
// (the index being read, or the step being committed); `hint`: the likely cause of a gap.
inline void check_tiling(const TensorInfo& t, std::string_view source, std::string_view hint) {
  const std::string what = std::string(source) + ": tensor \"" + t.name + "\"";
  auto elements = [&](const Shape& shape) {  // a shape from a file: its error names the tensor too
    try {
      return io::shape_elements(shape);
    } catch (const Error& e) {
      TRELLIS_THROW(what, ": ", e.message());
    }
  };
  const index_t total = elements(t.shape);
  index_t covered = 0;
  for (std::size_t i = 0; i < t.shards.size(); ++i) {
    check_box_in(t.shape, t.shards[i].box, what + " in " + t.shards[i].file);
    covered += elements(t.shards[i].box.shape);
    for (std::size_t j = 0; j < i; ++j) {
      auto overlap = intersect(t.shards[i].box, t.shards[j].box);
      TRELLIS_CHECK(!overlap || io::shape_elements(overlap->shape) == 0, what, ": shards in ", t.shards[j].file,
                    " (", box_string(t.shards[j].box), ") and ", t.shards[i].file, " (",
                    box_string(t.shards[i].box), ") overlap");
    }
  }
  TRELLIS_CHECK(covered == total, what, ": shards cover ", covered, " of ", total, " elements of global shape ",
                io::shape_string(t.shape), " (", hint, ")");
}

inline io::json::Value index_json(std::int64_t step, int world_size, const std::map<std::string, TensorInfo>& tensors,
                              const std::vector<Metadata>& rank_metadata) {
  io::json::Object root;
  root["format"] = io::json::Value("trellis-checkpoint");
  root["version"] = io::json::Value(ckpt_version);
  root["step"] = io::json::Value(step);
  root["world_size"] = io::json::Value(world_size);
  root["metadata"] = metadata_json(rank_metadata.at(0));
  io::json::Array ranks, crcs;
  for (const auto& m : rank_metadata) {
    ranks.push_back(metadata_json(m));
    crcs.emplace_back(metadata_crc(m));
  }
  root["rank_metadata"] = io::json::Value(std::move(ranks));
  root[std::string(rank_metadata_crc_member)] = io::json::Value(std::move(crcs));
  io::json::Object ts;
  for (const auto& [name, t] : tensors) {
    io::json::Object o;
    o["dtype"] = io::json::Value(io::safetensors_dtype(t.dtype));
    o["shape"] = shape_json(t.shape);
    io::json::Array shards;
    for (const auto& s : t.shards) {
      io::json::Object so;
      so["file"] = io::json::Value(s.file);
      so["key"] = io::json::Value(s.key);
      so["offsets"] = shape_json(s.box.offsets);
      so["shape"] = shape_json(s.box.shape);
      so["crc32c"] = io::json::Value(s.crc32c);
      shards.emplace_back(std::move(so));
    }
    o["shards"] = io::json::Value(std::move(shards));
    ts[name] = io::json::Value(std::move(o));
  }
  root["tensors"] = io::json::Value(std::move(ts));
  const std::string crc = json_crc(io::json::Value(root));
  root[std::string(index_crc_member)] = io::json::Value(crc);
  return io::json::Value(std::move(root));
}

// Checks index_crc32c (the CRC32C of the index without that member) and each rank's
// rank_metadata_crc32c before anything in the index is used; required from version 3 and
// checked whenever present (a flipped version digit does not turn the check off). Returns the
// checksum of the content (computed the same way for older versions: ranks compare it).
inline std::uint32_t check_index_checksums(const io::json::Value& index, const std::string& what) {
  io::json::Object body = index.as_object(what);
  const auto stored_it = body.find(index_crc_member);
  const auto version_it = body.find("version");
  const bool old_version = version_it != body.end() && version_it->second.is_int() && version_it->second.as_int() <= 2;
  std::optional<std::string> stored;
  if (stored_it != body.end()) {
    stored = stored_it->second.as_string(what + " index_crc32c");
    body.erase(stored_it);
  }
  const std::string text = io::json::dump(io::json::Value(body));
  const std::uint32_t crc = io::crc32c(text.data(), text.size());
  if (!stored && !old_version)
    TRELLIS_THROW(what, " has no \"index_crc32c\" (required from version 3): the index is corrupt");
  if (!stored) return crc;
  // Which rank's metadata disagrees with the checksum its rank computed, if any.
  std::string rank_problem;
  const auto ranks_it = body.find("rank_metadata");
  const auto crcs_it = body.find(rank_metadata_crc_member);
  if (ranks_it == body.end() || crcs_it == body.end() || !ranks_it->second.is_array() || !crcs_it->second.is_array() ||
      ranks_it->second.as_array().size() != crcs_it->second.as_array().size()) {
    rank_problem = "rank_metadata and rank_metadata_crc32c are missing or of different lengths";
  } else {
    const auto& ranks = ranks_it->second.as_array();
    const auto& crcs = crcs_it->second.as_array();
    for (std::size_t r = 0; r < ranks.size() && rank_problem.empty(); ++r) {
      if (!ranks[r].is_object() || !crcs[r].is_string() || json_crc(ranks[r]) != crcs[r].as_string())
        rank_problem = "the metadata of rank " + std::to_string(r) + " does not match the checksum rank " +
                       std::to_string(r) + " computed when saving";
    }
  }
  const std::string computed = io::crc_hex(crc);
  if (computed != *stored || !rank_problem.empty())
    TRELLIS_THROW(what, " is corrupt: ",
                  computed == *stored ? ""
                                      : "its content has CRC32C " + computed + " but index_crc32c says " + *stored + "; ",
                  rank_problem.empty()
                      ? "the change is outside the per-rank metadata (step, world size, tensor list or a checksum)"
                      : rank_problem,
                  " (a flipped bit or an edit after the save; use another checkpoint, or after a deliberate edit "
                  "reseal it with train::reseal_checkpoint_index)");
  return crc;
}
}  // namespace detail

// Recomputes the checksums of an index.json edited by hand (each rank's metadata's, then the
// whole index's) and rewrites it atomically: whatever the file now says becomes authoritative,
// so only for deliberate edits (tests, repairs).
inline void reseal_checkpoint_index(const std::filesystem::path& index_path) {
  const std::string what = index_path.string();
  io::json::Object index = io::json::parse(io::read_whole_file(index_path), what).as_object(what);
  if (auto it = index.find(detail::index_crc_member); it != index.end()) index.erase(it);
  io::json::Array crcs;
  const auto ranks = index.find("rank_metadata");
  TRELLIS_CHECK(ranks != index.end(), what, ": missing key \"rank_metadata\"");
  for (const auto& m : ranks->second.as_array(what + " rank_metadata"))
    crcs.emplace_back(detail::json_crc(m));
  index[std::string(detail::rank_metadata_crc_member)] = io::json::Value(std::move(crcs));
  const std::string crc = detail::json_crc(io::json::Value(index));
  index[std::string(detail::index_crc_member)] = io::json::Value(crc);
  io::write_file_atomically(index_path, io::json::dump(io::json::Value(std::move(index)), 1) + "\n");
}

// The newest committed checkpoint directory under `root`, if any (defined after Checkpoint).
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

// Run by commit_checkpoint (one rank) before it changes anything: finishes what an interrupted
// commit left half done, so nothing committed is lost and nothing stale stays.
//  - step-X.old without step-X (stopped between the two renames of a re-save): step-X.old is
//    the committed checkpoint of step X and is renamed back to step-X;
//  - `latest` naming a step whose directory is still missing (only by hand: the protocol never
//    leaves that after the first rule): its complete, verified copy is renamed to step-X;
//  - then removed: step-X.old next to a step-X (stopped after publishing the new step-X),
//    step-Y.partial of every step Y but `current_step` (saves that crashed), temporary files.
// Every change is a rename or a removal of something no reader is pointed at.
inline void recover_interrupted_commits(const std::filesystem::path& root, std::int64_t current_step) {
  namespace fs = std::filesystem;
  auto entries = [&] {
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(root)) out.push_back(e.path());
    std::sort(out.begin(), out.end());
    return out;
  };
  bool changed = false;
  for (const fs::path& p : entries()) {
    const std::string f = p.filename().string();
    if (!f.starts_with("step-") || !f.ends_with(".old")) continue;
    const fs::path base = root / f.substr(0, f.size() - 4);
    if (!fs::exists(base)) {
      fs::rename(p, base);
      changed = true;
    }
  }
  if (changed) io::fsync_directory(root);
  const std::string current = step_directory_name(current_step) + ".partial";
  if (fs::exists(root / "latest")) {
    std::string name = io::read_whole_file(root / "latest");
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (name.starts_with("step-") && name.find_first_of("/.") == std::string::npos && !fs::exists(root / name)) {
      std::optional<fs::path> found;
      try {
        found = latest_checkpoint(root);
      } catch (const Error&) {  // no complete copy: nothing to keep; this commit rewrites latest
      }
      if (found && *found != root / name && found->filename() != current) {
        fs::rename(*found, root / name);
        io::fsync_directory(root);
      }
    }
  }
  for (const fs::path& p : entries()) {
    const std::string f = p.filename().string();
    const bool stale_old = f.starts_with("step-") && f.ends_with(".old");  // its step-X exists (above)
    const bool stale_partial = f.starts_with("step-") && f.ends_with(".partial") && f != current;
    const bool temp = f.starts_with("latest.tmp.");
    if (stale_old || stale_partial || temp) fs::remove_all(p);
  }
}

// After every rank's finish(): validates the shard files, writes index.json, publishes the
// directory as <root>/step-N and points <root>/latest at it. Call on exactly one rank.
// Protocol and what a crash at each point leaves: docs/checkpoint.md. `hook` (tests) is called
// at named points between the steps (before and after each rename and fsync).
inline void commit_checkpoint(const std::filesystem::path& root, std::int64_t step, int world_size,
                              const io::StepHook& hook = {}) {
  namespace fs = std::filesystem;
  const fs::path staging = detail::staging_directory(root, step);
  TRELLIS_CHECK(world_size > 0, "commit_checkpoint: world size ", world_size);
  std::map<std::string, TensorInfo> tensors;
  std::vector<Metadata> rank_metadata(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    TRELLIS_CHECK(fs::exists(staging / shard_file_name(r)), "checkpoint step ", step, ": ",
                  staging / shard_file_name(r), " is missing (rank ", r, " did not finish?)");
    for (const std::string& name : {shard_file_name(r), optimizer_file_name(r)}) {
      const fs::path path = staging / name;
      if (name != shard_file_name(r) && !fs::exists(path)) continue;  // no optimizer tensors on rank r
      io::SafetensorsFile file(path);
      const auto& meta = file.metadata();
      auto get = [&](const std::string& key) -> const std::string& {
        auto it = meta.find(key);
        if (it == meta.end()) TRELLIS_THROW(path, ": metadata key ", key, " missing");
        return it->second;
      };
      TRELLIS_CHECK(get(detail::ckpt_step_key) == std::to_string(step), path, " belongs to step ",
                    get(detail::ckpt_step_key), ", not ", step);
      TRELLIS_CHECK(get(detail::ckpt_world_key) == std::to_string(world_size), path,
                    " was written for world size ", get(detail::ckpt_world_key), ", not ", world_size);
      TRELLIS_CHECK(get(detail::ckpt_rank_key) == std::to_string(r), path, " was written by rank ",
                    get(detail::ckpt_rank_key), ", not ", r);
      if (name == shard_file_name(r)) {
        Metadata& mine = rank_metadata[static_cast<std::size_t>(r)];
        for (const auto& [k, v] : meta)
          if (!detail::is_reserved_metadata(k)) mine[k] = v;
        if (get(detail::ckpt_metadata_crc_key) != detail::metadata_crc(mine))
          TRELLIS_THROW(path, ": the rank's metadata does not match the checksum it computed when writing (corrupt header)");
      }
      for (const auto& e : file.entries()) {
        std::string what = path.string() + ", tensor \"" + e.name + "\"";
        io::json::Value info = io::json::parse(get(std::string(detail::ckpt_shard_prefix) + e.name), what);
        std::string tensor = info.at("tensor", what).as_string(what);
        Shape global = detail::shape_from_json(info.at("global_shape", what), what);
        Box box{detail::shape_from_json(info.at("offsets", what), what), e.shape};
        auto [it, inserted] = tensors.try_emplace(tensor);
        TensorInfo& t = it->second;
        if (inserted) {
          t.name = tensor;
          t.dtype = e.dtype;
          t.shape = global;
        }
        TRELLIS_CHECK(t.dtype == e.dtype && t.shape == global, what, ": ", io::safetensors_dtype(e.dtype),
                      io::shape_string(global), " disagrees with another shard's ", io::safetensors_dtype(t.dtype),
                      io::shape_string(t.shape), " for tensor \"", tensor, "\"");
        t.shards.push_back({name, e.name, std::move(box), get(std::string(io::safetensors_crc_prefix) + e.name)});
      }
    }
  }
  for (const auto& [name, t] : tensors)
    detail::check_tiling(t, "checkpoint step " + std::to_string(step) + " in " + staging.string(),
                         "a rank did not write its part?");

  // Files of a larger, crashed attempt at this step do not belong to this checkpoint.
  for (const auto& entry : fs::directory_iterator(staging)) {
    std::string f = entry.path().filename().string();
    bool ours = f == "index.json";
    for (int r = 0; r < world_size && !ours; ++r) ours = f == shard_file_name(r) || f == optimizer_file_name(r);
    if (!ours) fs::remove_all(entry.path());
  }
  auto at = [&](std::string_view point) {
    if (hook) hook(point);
  };
  auto prefixed = [&](std::string prefix) -> io::StepHook {
    if (!hook) return {};
    return [&hook, prefix](std::string_view point) { hook(prefix + std::string(point)); };
  };
  at("begin");
  recover_interrupted_commits(root, step);
  at("after recovery");
  io::write_file_atomically(staging / "index.json", io::json::dump(detail::index_json(step, world_size, tensors, rank_metadata), 1) + "\n",
                            prefixed("index.json: "));

  const fs::path final_dir = root / step_directory_name(step);
  const fs::path old_dir = root / (step_directory_name(step) + ".old");
  if (fs::exists(final_dir)) {  // re-saving a step: keep the old one aside until the swap is done
    at("before rename step -> step.old");
    fs::rename(final_dir, old_dir);  // recover_interrupted_commits removed any older step-N.old
    at("after rename step -> step.old");
    io::fsync_directory(root);
    at("after fsync of the root (step.old)");
  }
  at("before rename step.partial -> step");
  fs::rename(staging, final_dir);
  at("after rename step.partial -> step");
  io::fsync_directory(root);
  at("after fsync of the root");
  io::write_file_atomically(root / "latest", step_directory_name(step) + "\n", prefixed("latest: "));
  at("before removing step.old");
  fs::remove_all(old_dir);
  at("end");
}

// The whole save on every rank of `comm` (which must be the writer's world, same rank order):
// finish() here, then commit on rank 0; every rank learns the outcome, so a failure anywhere
// (a rank's write, the commit's checks) throws on every rank and nothing waits forever.
template <class C>
void save_collectively(CheckpointWriter& writer, C& comm) {
  TRELLIS_CHECK(comm.size() == writer.world_size() && comm.rank() == writer.rank(), "save_collectively: writer is rank ",
                writer.rank(), " of ", writer.world_size(), " but the communicator is rank ", comm.rank(), " of ", comm.size());
  std::exception_ptr mine;
  std::int32_t failed = 0, any_failed = 0;
  try {
    writer.finish();
  } catch (...) {
    mine = std::current_exception();
    failed = 1;
  }
  comm.all_reduce(&failed, &any_failed, 1, comm::ReduceOp::max);
  if (mine) std::rethrow_exception(mine);
  if (any_failed) TRELLIS_THROW("checkpoint step ", writer.step(), ": another rank failed to write its shard; not committed");
  std::int32_t commit_failed = 0;
  if (comm.rank() == 0) {
    try {
      commit_checkpoint(writer.root(), writer.step(), writer.world_size());
    } catch (...) {
      mine = std::current_exception();
      commit_failed = 1;
    }
  }
  comm.broadcast(&commit_failed, 1, 0);
  if (mine) std::rethrow_exception(mine);
  if (commit_failed) TRELLIS_THROW("checkpoint step ", writer.step(), ": the commit failed on rank 0 (see its error)");
}

// Removes committed step directories older than the newest `keep` (never the one `latest` names).
inline void prune_checkpoints(const std::filesystem::path& root, int keep) {
  namespace fs = std::filesystem;
  TRELLIS_CHECK(keep >= 1, "prune_checkpoints: keep ", keep, " < 1");
  auto latest = latest_checkpoint(root);
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root)) {
    std::string f = e.path().filename().string();
    if (e.is_directory() && f.starts_with("step-") && f.find('.') == std::string::npos) dirs.push_back(e.path());
  }
  std::sort(dirs.begin(), dirs.end());  // zero-padded names sort by step
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < dirs.size(); ++i)
    if (!latest || dirs[i] != *latest) fs::remove_all(dirs[i]);
}

// A committed checkpoint, opened for reading. Opening checks the index's checksums (a flipped bit
// in it or in a rank's metadata is an error naming index.json and, where it lies there, the
// rank), then validates the index and every shard file's header against it (a truncated file or
// a shape that disagrees fails here, naming the file and tensor); reading verifies each shard's
// CRC32C.
class Checkpoint {
 public:
  // `path` is a step directory (holding index.json) or a root holding `latest`.
  explicit Checkpoint(const std::filesystem::path& path) {
    namespace fs = std::filesystem;
    if (fs::exists(path / "index.json")) {
      dir_ = path;
    } else {
      auto latest = latest_checkpoint(path);
      TRELLIS_CHECK(latest.has_value(), "no checkpoint at ", path, " (neither index.json nor latest)");
      dir_ = *latest;
    }
    const fs::path index_path = dir_ / "index.json";
    const std::string what = index_path.string();
    io::json::Value index = io::json::parse(io::read_whole_file(index_path), what);
    TRELLIS_CHECK(index.at("format", what).as_string(what) == "trellis-checkpoint", what, " is not a trellis checkpoint index");
    index_crc_ = detail::check_index_checksums(index, "checkpoint index " + what);
    const auto version = index.at("version", what).as_int(what);
    TRELLIS_CHECK(version >= 1 && version <= detail::ckpt_version, what, ": unsupported version ", version,
                  " (this build reads 1..", detail::ckpt_version, ")");
    step_ = index.at("step", what).as_int(what + " step");
    TRELLIS_CHECK(step_ >= 0, what, ": \"step\" ", step_, " is negative");
    const std::int64_t world = index.at("world_size", what).as_int(what + " world_size");
    TRELLIS_CHECK(world >= 1 && world <= std::numeric_limits<int>::max(), what, ": \"world_size\" ", world,
                  " is out of range [1, ", std::numeric_limits<int>::max(), "]");
    world_size_ = static_cast<int>(world);
    for (const auto& [k, v] : index.at("metadata", what).as_object(what)) metadata_[k] = v.as_string(what + " metadata");
    for (const auto& m : index.at("rank_metadata", what).as_array(what)) {
      rank_metadata_.emplace_back();
      for (const auto& [k, v] : m.as_object(what + " rank_metadata")) rank_metadata_.back()[k] = v.as_string(what);
    }
    TRELLIS_CHECK(static_cast<int>(rank_metadata_.size()) == world_size_, what, ": rank_metadata has ",
                  rank_metadata_.size(), " entries for world size ", world_size_);
    if (metadata_ != rank_metadata_[0]) TRELLIS_THROW(what, ": \"metadata\" is not a copy of rank 0's rank_metadata");
    for (const auto& [name, t] : index.at("tensors", what).as_object(what)) {
      std::string where = what + ", tensor \"" + name + "\"";
      TensorInfo info;
      info.name = name;
      info.dtype = io::parse_safetensors_dtype(t.at("dtype", where).as_string(where), where);
      info.shape = detail::shape_from_json(t.at("shape", where), where);
      for (const auto& s : t.at("shards", where).as_array(where)) {
        ShardInfo si;
        si.file = s.at("file", where).as_string(where);
        TRELLIS_CHECK(si.file.find('/') == std::string::npos, where, ": shard file \"", si.file, "\" is not a plain name");
        si.key = s.at("key", where).as_string(where);
        si.box = {detail::shape_from_json(s.at("offsets", where), where), detail::shape_from_json(s.at("shape", where), where)};
        si.crc32c = s.at("crc32c", where).as_string(where);
        info.shards.push_back(std::move(si));
      }
      detail::check_tiling(info, what, "the index or its shard files are corrupt");
      tensors_.emplace(name, std::move(info));
    }
    // Every shard file's header must agree with the index.
    for (const auto& [name, t] : tensors_) {
      for (const auto& s : t.shards) {
        const io::SafetensorsFile& f = file(s.file);
        const auto* e = f.find(s.key);
        TRELLIS_CHECK(e != nullptr, f.path(), ": tensor \"", s.key, "\" (of \"", name, "\") listed in index.json is missing");
        TRELLIS_CHECK(e->dtype == t.dtype && e->shape == s.box.shape, f.path(), ": tensor \"", s.key,
                      "\" is ", io::safetensors_dtype(e->dtype), io::shape_string(e->shape), " but index.json says ",
                      io::safetensors_dtype(t.dtype), io::shape_string(s.box.shape));
        auto crc = f.metadata().find(std::string(io::safetensors_crc_prefix) + s.key);
        TRELLIS_CHECK(crc != f.metadata().end() && crc->second == s.crc32c, f.path(), ": checksum of tensor \"",
                      s.key, "\" disagrees with index.json");
        // The writer's own record of the entry (tensor and offsets), when the file has one: an
        // index edited to swap two tensors of one shape, its checksums recomputed, stops here.
        if (auto rec = f.metadata().find(std::string(detail::ckpt_shard_prefix) + s.key); rec != f.metadata().end()) {
          const std::string what = f.path().string() + ", tensor \"" + s.key + "\"";
          const io::json::Value info = io::json::parse(rec->second, what);
          const std::string& holds = info.at("tensor", what).as_string(what);
          const Shape offsets = detail::shape_from_json(info.at("offsets", what), what);
          TRELLIS_CHECK(holds == name && offsets == s.box.offsets, what, " holds \"", holds, "\" at offsets ",
                        io::shape_string(offsets), ", but index.json lists it as \"", name, "\" at ",
                        io::shape_string(s.box.offsets), " (the index does not describe this file)");
        }
      }
    }
  }

  const std::filesystem::path& directory() const { return dir_; }
  // CRC32C of the index's content (see detail::check_index_checksums): equal on two ranks when
  // they opened the same checkpoint.
  std::uint32_t index_checksum() const { return index_crc_; }
  std::int64_t step() const { return step_; }
  int world_size() const { return world_size_; }
  const Metadata& metadata() const { return metadata_; }
  const std::string& metadata(std::string_view key) const {
    auto it = metadata_.find(key);
    if (it == metadata_.end()) TRELLIS_THROW("checkpoint ", dir_, ": no metadata \"", key, "\"");
    return it->second;
  }
  // The metadata rank `rank` set when saving (same layout resumes: per-rank RNG streams etc.).
  const Metadata& rank_metadata(int rank) const {
    TRELLIS_CHECK(rank >= 0 && rank < world_size_, "checkpoint ", dir_, " has ranks 0..", world_size_ - 1, ", not ", rank);
    return rank_metadata_[static_cast<std::size_t>(rank)];
  }
  bool contains(std::string_view name) const { return tensors_.find(std::string(name)) != tensors_.end(); }
  std::vector<std::string> tensor_names() const {
    std::vector<std::string> names;
    for (const auto& [n, t] : tensors_) names.push_back(n);
    return names;
  }
  const TensorInfo& tensor(std::string_view name) const {
    auto it = tensors_.find(std::string(name));
    if (it == tensors_.end()) TRELLIS_THROW("checkpoint ", dir_, ": no tensor \"", name, "\"");
    return it->second;
  }
  // Throws unless tensor `name` exists with this dtype and global shape.
  void expect(std::string_view name, DType dtype, const Shape& global_shape) const {
    const auto& t = tensor(name);
    TRELLIS_CHECK(t.dtype == dtype && t.shape == global_shape, "checkpoint ", dir_, ": tensor \"", name,
                  "\" is ", io::safetensors_dtype(t.dtype), io::shape_string(t.shape), ", expected ",
                  io::safetensors_dtype(dtype), io::shape_string(global_shape));
  }

  // Reads box `want` of the global tensor into `out` (row-major, want.shape), from every shard
  // that overlaps it. A `dtype` other than the stored one is allowed between floating types
  // (f64, f32, f16, bf16): values convert through float (double for f64 -> f64 only), rounding
  // to nearest even; e.g. a bf16 model loads fp32 master weights.
  void read(std::string_view name, DType dtype, const Box& want, void* out) const {
    read_impl(name, dtype, want, out, nullptr);
  }
  // Typed: the box at `offsets` with the shape of `out` (contiguous).
  template <class T, class E>
    requires(!std::is_const_v<T>)
  void read(std::string_view name, const Shape& offsets, TensorView<T, E, Host> out) const {
    TRELLIS_CHECK(out.is_contiguous(), "checkpoint read of \"", name, "\": the output view must be contiguous");
    auto ext = out.extents().array();
    read(name, dtype_v<T>, Box{offsets, Shape(ext.begin(), ext.end())}, out.data());
  }
  template <class T>
  std::vector<T> read_whole(std::string_view name) const {
    const auto& t = tensor(name);
    std::vector<T> out(static_cast<std::size_t>(io::shape_elements(t.shape)));
    read(name, dtype_v<T>, full_box(t.shape), out.data());
    return out;
  }
  // ZeRO-1: the flat elements [flat_begin, flat_begin + out.size()) of block `local_box`.
  template <class T>
  void read_flat_range(std::string_view name, const Box& local_box, index_t flat_begin, std::span<T> out) const {
    T* p = out.data();
    BlockCache cache;  // consecutive boxes usually come from the same shard: read it once
    for (Box b : flat_range_boxes(local_box.shape, flat_begin, flat_begin + static_cast<index_t>(out.size()))) {
      for (std::size_t d = 0; d < b.offsets.size(); ++d) b.offsets[d] += local_box.offsets[d];
      read_impl(name, dtype_v<T>, b, p, &cache);
      p += io::shape_elements(b.shape);
    }
  }

  // Reads every shard and checks its CRC32C.
  void verify() const {
    std::vector<std::byte> block;
    for (const auto& [name, t] : tensors_)
      for (const auto& s : t.shards) {
        block.resize(static_cast<std::size_t>(io::shape_elements(s.box.shape)) * dtype_size(t.dtype));
        file(s.file).read(s.key, block.data());
      }
  }

 private:
  struct BlockCache {
    const ShardInfo* shard = nullptr;
    std::vector<std::byte> bytes;
  };

  void read_impl(std::string_view name, DType dtype, const Box& want, void* out, BlockCache* cache) const {
    const auto& t = tensor(name);
    std::string what = "checkpoint " + dir_.string() + ": tensor \"" + std::string(name) + "\"";
    const bool convert = t.dtype != dtype;
    TRELLIS_CHECK(!convert || (detail::is_float_dtype(t.dtype) && detail::is_float_dtype(dtype)), what, " is ",
                  io::safetensors_dtype(t.dtype), " and cannot be read as ", io::safetensors_dtype(dtype));
    detail::check_box_in(t.shape, want, what + " read");
    const std::size_t elem = dtype_size(t.dtype);
    const index_t count = io::shape_elements(want.shape);
    std::vector<std::byte> staged(convert ? static_cast<std::size_t>(count) * elem : 0);
    std::byte* dst = convert ? staged.data() : static_cast<std::byte*>(out);
    index_t copied = 0;
    BlockCache local;
    BlockCache& c = cache ? *cache : local;
    for (const auto& s : t.shards) {
      std::optional<Box> region = t.shape.empty() ? std::optional<Box>(Box{}) : detail::intersect(want, s.box);
      if (!region) continue;
      if (c.shard != &s) {
        c.bytes.resize(static_cast<std::size_t>(io::shape_elements(s.box.shape)) * elem);
        file(s.file).read(s.key, c.bytes.data());  // verifies the CRC32C
        c.shard = &s;
      }
      detail::copy_region(*region, c.bytes.data(), s.box, dst, want, elem);
      copied += io::shape_elements(region->shape);
    }
    TRELLIS_CHECK(copied == count, what, ": shards cover ", copied, " of the ", count, " elements requested");
    if (convert) detail::convert_floats(staged.data(), t.dtype, out, dtype, static_cast<std::size_t>(count));
  }

  const io::SafetensorsFile& file(const std::string& name) const {
    auto it = files_.find(name);
    if (it == files_.end()) it = files_.emplace(name, std::make_unique<io::SafetensorsFile>(dir_ / name)).first;
    return *it->second;
  }

  std::filesystem::path dir_;
  std::int64_t step_ = 0;
  std::uint32_t index_crc_ = 0;
  int world_size_ = 0;
  Metadata metadata_;
  std::vector<Metadata> rank_metadata_;
  std::map<std::string, TensorInfo> tensors_;
  mutable std::map<std::string, std::unique_ptr<io::SafetensorsFile>> files_;
};

// The step directory `latest` names. Read only, so every rank may call it. When that directory is
// missing because a commit was interrupted between its renames, the same step's committed copy
// step-N.old, or else a complete step-N.partial (its index.json written), is returned instead,
// after opening it and verifying every checksum; when neither is whole, the error names all three.
inline std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  const auto pointer = root / "latest";
  if (!fs::exists(pointer)) return std::nullopt;
  std::string name = io::read_whole_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!name.starts_with("step-") || name.find_first_of("/.") != std::string::npos) {
    std::string shown;  // the first bytes only, unprintable ones as '?' (it may hold any file)
    for (char c : std::string_view(name).substr(0, 64)) shown += (c >= 0x20 && c < 0x7f) ? c : '?';
    TRELLIS_THROW(pointer, " holds \"", shown, name.size() > 64 ? "...\" (" + std::to_string(name.size()) + " bytes)" : "\"",
                  ", not a step directory name");
  }
  const fs::path named = root / name;
  if (fs::exists(named)) return named;
  std::string tried;
  for (const char* suffix : {".old", ".partial"}) {
    const fs::path copy = root / (name + suffix);
    try {
      TRELLIS_CHECK(fs::exists(copy / "index.json"), copy / "index.json", " does not exist");
      Checkpoint(copy).verify();
      return copy;
    } catch (const Error& e) {
      tried += "\n  - " + e.message();
    }
  }
  TRELLIS_THROW(pointer, " names ", name, ", which is missing (a save was interrupted), and neither ", name,
                ".old nor ", name, ".partial is a complete checkpoint:", tried);
}

}  // namespace trellis::train
