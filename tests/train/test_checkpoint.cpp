// Checkpoints: bitwise round trips, resharding between layouts (every read compared with the
// same slice of the full tensor, computed directly), ZeRO-1 flat ranges, crash safety (the
// previous checkpoint survives every failure) and clear errors for bad files.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "train/temp_dir.hpp"
#include "trellis/io/atomic_file.hpp"
#include "trellis/io/json.hpp"
#include "trellis/io/safetensors.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/train_state.hpp"

#if __has_include("trellis/comm/threads.hpp")
#include "trellis/comm/threads.hpp"
#define TRELLIS_TEST_HAVE_THREADS 1
#endif

using namespace trellis;
using namespace trellis::io;
using namespace trellis::train;

namespace {
// The value of element `flat` of a test tensor: distinct per tensor and element, exact in float.
float value_at(int tensor_id, index_t flat) { return static_cast<float>(tensor_id * 100000 + flat) * 0.5f; }

std::vector<float> full_tensor(int tensor_id, const Shape& shape) {
  std::vector<float> v(static_cast<std::size_t>(shape_elements(shape)));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value_at(tensor_id, static_cast<index_t>(i));
  return v;
}

// Box `b` of a full row-major tensor, computed element by element (the reference for reads).
std::vector<float> slice_of(const std::vector<float>& full, const Shape& shape, const Box& b) {
  std::vector<float> out;
  const int rank = static_cast<int>(shape.size());
  Shape idx(rank, 0);
  index_t n = shape_elements(b.shape);
  for (index_t k = 0; k < n; ++k) {
    index_t rem = k, flat = 0;
    for (int d = rank - 1; d >= 0; --d) {
      idx[d] = rem % b.shape[d];
      rem /= b.shape[d];
    }
    for (int d = 0; d < rank; ++d) flat = flat * shape[d] + b.offsets[d] + idx[d];
    out.push_back(full[static_cast<std::size_t>(flat)]);
  }
  return out;
}

struct TestTensor {
  std::string name;
  Shape shape;
  int id;
};
const std::vector<TestTensor> gpt_like = {
    {"wte.weight", {50, 16}, 1},          {"wpe.weight", {12, 16}, 2},
    {"h.0.ln_1.weight", {16}, 3},         {"h.0.attn.c_attn.weight", {16, 48}, 4},
    {"h.0.attn.c_attn.bias", {48}, 5},    {"h.0.mlp.c_fc.weight", {16, 64}, 6},
    {"ln_f.weight", {16}, 7},             {"scale", {}, 8},
    {"cube", {5, 6, 7}, 9},
};

// Writes every test tensor split into `parts` pieces along `dim` (1-D and scalar tensors: rank 0
// writes them whole), from `parts` threads, without committing. `version` shifts every value
// (full_tensor(t.id + version_shift * version, ...)), so two saves of one step differ.
constexpr int version_shift = 50;
void stage_split(const std::filesystem::path& root, std::int64_t step, int dim, int parts,
                 const std::map<std::string, std::string>& meta = {}, int version = 0) {
  std::vector<std::vector<float>> fulls;
  for (const auto& t : gpt_like) fulls.push_back(full_tensor(t.id + version_shift * version, t.shape));
  std::vector<std::thread> ranks;
  for (int r = 0; r < parts; ++r) {
    ranks.emplace_back([&, r] {
      CheckpointWriter w(root, step, r, parts);
      std::vector<std::vector<float>> locals;
      locals.reserve(gpt_like.size());
      for (std::size_t i = 0; i < gpt_like.size(); ++i) {
        const auto& t = gpt_like[i];
        Box b = static_cast<int>(t.shape.size()) > dim ? split_box(t.shape, dim, parts, r) : full_box(t.shape);
        if (static_cast<int>(t.shape.size()) <= dim && r != 0) continue;
        locals.push_back(slice_of(fulls[i], t.shape, b));
        w.add(t.name, DType::f32, t.shape, b, locals.back().data());
      }
      for (const auto& [k, v] : meta) w.set_metadata(k, v);
      w.set_metadata("who", "rank " + std::to_string(r));
      w.finish();
    });
  }
  for (auto& t : ranks) t.join();
}
// stage_split, then commit.
void write_split(const std::filesystem::path& root, std::int64_t step, int dim, int parts,
                 const std::map<std::string, std::string>& meta = {}, int version = 0) {
  stage_split(root, step, dim, parts, meta, version);
  commit_checkpoint(root, step, parts);
}
}  // namespace

TEST_CASE("flat ranges decompose into boxes in order", "[checkpoint]") {
  const Shape shape = {3, 4, 5};
  const auto full = full_tensor(0, shape);
  std::mt19937 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    index_t a = static_cast<index_t>(gen() % 61), b = static_cast<index_t>(gen() % 61);
    if (a > b) std::swap(a, b);
    auto boxes = flat_range_boxes(shape, a, b);
    REQUIRE(boxes.size() <= 5);
    std::vector<float> got;
    for (const auto& box : boxes) {
      auto s = slice_of(full, shape, box);
      got.insert(got.end(), s.begin(), s.end());
    }
    REQUIRE(got == std::vector<float>(full.begin() + a, full.begin() + b));
  }
  REQUIRE(flat_range_boxes(shape, 0, 60) == std::vector<Box>{full_box(shape)});
  REQUIRE_THROWS_AS(flat_range_boxes(shape, 5, 61), Error);
}

TEST_CASE("split_extent: first n % parts parts get one more", "[checkpoint]") {
  REQUIRE(split_extent(10, 4, 0) == std::pair<index_t, index_t>{0, 3});
  REQUIRE(split_extent(10, 4, 1) == std::pair<index_t, index_t>{3, 3});
  REQUIRE(split_extent(10, 4, 2) == std::pair<index_t, index_t>{6, 2});
  REQUIRE(split_extent(10, 4, 3) == std::pair<index_t, index_t>{8, 2});
  REQUIRE(split_extent(2, 4, 3) == std::pair<index_t, index_t>{2, 0});
  REQUIRE_THROWS_AS(split_extent(2, 4, 4), Error);
}

TEST_CASE("single-rank checkpoint round trip is bitwise, with metadata", "[checkpoint]") {
  TempDir dir("ckpt-rt");
  write_split(dir.path, 100, 0, 1, {{"rng", "0123456789abcdef"}, {"data", "{\"next_batch\":7}"}});
  Checkpoint ck(dir.path);
  REQUIRE(ck.directory() == dir.path / "step-00000100");
  REQUIRE(ck.step() == 100);
  REQUIRE(ck.world_size() == 1);
  REQUIRE(ck.metadata("rng") == "0123456789abcdef");
  REQUIRE(ck.metadata("data") == "{\"next_batch\":7}");
  REQUIRE_THROWS_WITH(ck.metadata("nope"), Catch::Contains("no metadata \"nope\""));
  REQUIRE(ck.tensor_names().size() == gpt_like.size());
  for (const auto& t : gpt_like) {
    auto got = ck.read_whole<float>(t.name);
    auto want = full_tensor(t.id, t.shape);
    REQUIRE(std::memcmp(got.data(), want.data(), want.size() * 4) == 0);
    ck.expect(t.name, DType::f32, t.shape);
  }
  ck.verify();
  REQUIRE_THROWS_WITH(ck.expect("wte.weight", DType::f32, {50, 17}), Catch::Contains("wte.weight") && Catch::Contains("(50, 16)"));
  REQUIRE_THROWS_WITH(ck.expect("wte.weight", DType::bf16, {50, 16}), Catch::Contains("expected BF16"));
  REQUIRE_THROWS_WITH(ck.tensor("h.1.ln_1.weight"), Catch::Contains("no tensor \"h.1.ln_1.weight\""));
  std::vector<float> out(10);
  REQUIRE_THROWS_WITH(ck.read("ln_f.weight", DType::f32, Box{{10}, {10}}, out.data()), Catch::Contains("outside"));
}

TEST_CASE("reshard: 4 shards along dim 0 read as 3 shards along dim 1 and arbitrary boxes", "[checkpoint]") {
  TempDir dir("ckpt-reshard");
  write_split(dir.path, 5, 0, 4);
  Checkpoint ck(dir.path);
  REQUIRE(ck.world_size() == 4);
  REQUIRE(ck.tensor("wte.weight").shards.size() == 4);
  REQUIRE(ck.metadata("who") == "rank 0");
  for (int r = 0; r < 4; ++r) REQUIRE(ck.rank_metadata(r).at("who") == "rank " + std::to_string(r));
  REQUIRE_THROWS_AS(ck.rank_metadata(4), Error);
  for (const auto& t : gpt_like) {
    const auto full = full_tensor(t.id, t.shape);
    if (t.shape.size() >= 2) {
      for (int part = 0; part < 3; ++part) {  // the tp=3 column layout
        Box b = split_box(t.shape, 1, 3, part);
        std::vector<float> got(static_cast<std::size_t>(shape_elements(b.shape)));
        ck.read(t.name, DType::f32, b, got.data());
        REQUIRE(got == slice_of(full, t.shape, b));
      }
    }
    REQUIRE(ck.read_whole<float>(t.name) == full);
  }
  // Random boxes of the 3-D tensor, through the typed View interface.
  std::mt19937 gen(11);
  const Shape cube = {5, 6, 7};
  const auto full = full_tensor(9, cube);
  for (int trial = 0; trial < 100; ++trial) {
    Box b;
    for (index_t n : cube) {
      index_t lo = static_cast<index_t>(gen() % n), hi = lo + 1 + static_cast<index_t>(gen() % (n - lo));
      b.offsets.push_back(lo);
      b.shape.push_back(hi - lo);
    }
    Tensor<float, 3> out({b.shape[0], b.shape[1], b.shape[2]});
    ck.read("cube", b.offsets, out.view());
    REQUIRE(std::vector<float>(out.data(), out.data() + out.size()) == slice_of(full, cube, b));
  }
}

TEST_CASE("ZeRO-1 flat partitions save and load across dp sizes", "[checkpoint]") {
  // Optimizer state of "cube" held as a flat buffer split over dp=3 ranks (uneven), with the
  // parameter itself tp-split in 2 along dim 1: each (tp, dp) rank owns a flat range of its
  // tp block. Reload with tp=1, dp=4.
  TempDir dir("ckpt-zero");
  const Shape cube = {5, 6, 7};
  const auto full = full_tensor(9, cube);
  const int tp = 2, dp = 3;
  std::vector<std::vector<float>> locals;
  std::vector<std::thread> ranks;
  for (int r = 0; r < tp * dp; ++r) {
    ranks.emplace_back([&, r] {
      int t = r / dp, d = r % dp;
      Box tp_block = split_box(cube, 1, tp, t);
      auto block = slice_of(full, cube, tp_block);
      auto [begin, size] = split_extent(static_cast<index_t>(block.size()), dp, d);
      std::vector<float> mine(block.begin() + begin, block.begin() + begin + size);
      CheckpointWriter w(dir.path, 3, r, tp * dp);
      w.add_flat_range<float>("optimizer.m.cube", cube, tp_block, begin, mine);
      w.finish();
    });
  }
  for (auto& t : ranks) t.join();
  commit_checkpoint(dir.path, 3, tp * dp);
  Checkpoint ck(dir.path);
  REQUIRE(ck.read_whole<float>("optimizer.m.cube") == full);
  for (int d = 0; d < 4; ++d) {
    auto [begin, size] = split_extent(shape_elements(cube), 4, d);
    std::vector<float> got(static_cast<std::size_t>(size));
    ck.read_flat_range<float>("optimizer.m.cube", full_box(cube), begin, got);
    REQUIRE(got == std::vector<float>(full.begin() + begin, full.begin() + begin + size));
  }
}

TEST_CASE("a failed or corrupt save never replaces the previous checkpoint", "[checkpoint]") {
  TempDir dir("ckpt-safe");
  write_split(dir.path, 1, 0, 2);
  auto expect_step1_intact = [&] {
    Checkpoint ck(dir.path);
    REQUIRE(ck.step() == 1);
    ck.verify();
    for (const auto& t : gpt_like) REQUIRE(ck.read_whole<float>(t.name) == full_tensor(t.id, t.shape));
  };

  SECTION("a rank never finished: commit refuses, latest unchanged") {
    std::vector<float> w(16, 1.0f);
    CheckpointWriter only(dir.path, 2, 0, 2);
    only.add_whole<float>("ln_f.weight", w, {16});
    only.finish();
    REQUIRE_THROWS_WITH(commit_checkpoint(dir.path, 2, 2), Catch::Contains("shard-1.safetensors") && Catch::Contains("missing"));
    expect_step1_intact();
  }
  SECTION("shards that do not cover a tensor: commit names it") {
    std::vector<float> half_rows(8 * 16, 1.0f);
    for (int r = 0; r < 2; ++r) {
      CheckpointWriter w(dir.path, 2, r, 2);
      if (r == 0) w.add("wte.weight", DType::f32, {50, 16}, Box{{0, 0}, {8, 16}}, half_rows.data());
      w.finish();
    }
    REQUIRE_THROWS_WITH(commit_checkpoint(dir.path, 2, 2), Catch::Contains("wte.weight") && Catch::Contains("cover 128 of 800"));
    expect_step1_intact();
  }
  SECTION("overlapping shards: commit names both files") {
    std::vector<float> rows(10 * 16, 1.0f);
    for (int r = 0; r < 2; ++r) {
      CheckpointWriter w(dir.path, 2, r, 2);
      w.add("wte.weight", DType::f32, {50, 16}, Box{{r * 5, 0}, {10, 16}}, rows.data());
      w.finish();
    }
    REQUIRE_THROWS_WITH(commit_checkpoint(dir.path, 2, 2), Catch::Contains("overlap"));
    expect_step1_intact();
  }
  SECTION("a committed checkpoint corrupted afterwards: errors name the file; older one loads") {
    write_split(dir.path, 2, 0, 2);
    REQUIRE(Checkpoint(dir.path).step() == 2);
    const auto shard1 = dir.path / "step-00000002" / "shard-1.safetensors";
    const auto size = std::filesystem::file_size(shard1);
    SECTION("bit flip") {
      std::fstream f(shard1, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(size - 3));
      f.put('\x7f');
      f.close();
      Checkpoint ck(dir.path);  // headers are intact
      REQUIRE_THROWS_WITH(ck.verify(), Catch::Contains("shard-1.safetensors") && Catch::Contains("checksum mismatch"));
    }
    SECTION("truncation") {
      std::filesystem::resize_file(shard1, size - 100);
      REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("shard-1.safetensors") && Catch::Contains("truncated"));
    }
    SECTION("shape in index disagrees with the file") {
      auto index_path = dir.path / "step-00000002" / "index.json";
      json::Value index = json::parse(read_whole_file(index_path));
      json::Value& shape = index.as_object().at("tensors").as_object().at("wte.weight").as_object().at("shape");
      REQUIRE(json::dump(shape) == "[50,16]");
      shape = json::Value(json::Array{51, 16});
      std::ofstream(index_path) << json::dump(index, 1);
      REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("index.json is corrupt"));
      reseal_checkpoint_index(index_path);  // as if written so: the tiling check must catch it
      REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("index.json") && Catch::Contains("wte.weight") &&
                                                    Catch::Contains("cover") && Catch::Contains("corrupt"));
    }
    SECTION("two tensors of one shape swapped in the index, resealed: the shard headers disagree") {
      auto index_path = dir.path / "step-00000002" / "index.json";
      json::Value index = json::parse(read_whole_file(index_path));
      json::Object& tensors = index.as_object().at("tensors").as_object();
      std::swap(tensors.at("h.0.ln_1.weight"), tensors.at("ln_f.weight"));
      write_file_atomically(index_path, json::dump(index, 1));
      reseal_checkpoint_index(index_path);
      REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("shard-0.safetensors") && Catch::Contains("holds \"ln_f.weight\"") &&
                                                    Catch::Contains("lists it as \"h.0.ln_1.weight\""));
    }
    SECTION("missing tensor in a shard file") {
      auto index_path = dir.path / "step-00000002" / "index.json";
      auto index = read_whole_file(index_path);
      auto pos = index.find("\"key\": \"wpe.weight\"");
      REQUIRE(pos != std::string::npos);
      index.replace(pos, 19, "\"key\": \"wpe.weighX\"");
      std::ofstream(index_path) << index;
      reseal_checkpoint_index(index_path);
      REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("wpe.weighX") && Catch::Contains("missing"));
    }
    // The previous step is untouched and loads by its directory.
    Checkpoint older(dir.path / "step-00000001");
    older.verify();
    REQUIRE(older.read_whole<float>("cube") == full_tensor(9, {5, 6, 7}));
  }
}

// Before index_crc32c a flipped bit in index.json went unnoticed wherever it still parsed: in a
// rank's metadata (its data position, its Rng) one dp group silently trained on other batches.
TEST_CASE("index.json is checksummed: any flipped bit is an error naming the index and what is corrupt",
          "[checkpoint][errors]") {
  TempDir dir("ckpt-index-crc");
  const std::vector<float> x = {1, 2, 3};
  for (int r = 0; r < 3; ++r) {  // small, so that every byte can be flipped in turn
    CheckpointWriter w(dir.path, 2, r, 3);
    w.add("x", DType::f32, {3}, Box{{r}, {1}}, &x[static_cast<std::size_t>(r)]);
    w.set_metadata("train.data", "seed=1;next_batch=2");
    w.set_metadata("who", "rank " + std::to_string(r));
    w.finish();
  }
  commit_checkpoint(dir.path, 2, 3);
  const auto index_path = dir.path / "step-00000002" / "index.json";
  const std::string index = read_whole_file(index_path);
  REQUIRE(Checkpoint(dir.path).rank_metadata(1).at("who") == "rank 1");

  // One bit of every byte (bit i % 8 of byte i): nothing loads.
  std::size_t loaded = 0;
  for (std::size_t i = 0; i < index.size(); ++i) {
    std::string flipped = index;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    std::ofstream(index_path, std::ios::binary | std::ios::trunc) << flipped;  // no fsync: thousands
    try {
      Checkpoint ck(dir.path);
      ++loaded;
      UNSCOPED_INFO("byte " << i << " ('" << index[i] << "') flipped, and the checkpoint opened");
    } catch (const Error& e) {
      REQUIRE_THAT(e.message(), Catch::Contains(index_path.string()));
    }
  }
  CHECK(loaded == 0);

  // Flips inside rank 1's metadata value (bit 0 keeps every character printable and the JSON
  // valid, even "rank 1" -> "rank 0", rank 0's value): blamed on rank 1.
  const std::size_t value = index.find("\"rank 1\"");
  REQUIRE(value != std::string::npos);
  for (std::size_t i = value + 1; i < value + 7; ++i) {
    std::string flipped = index;
    flipped[i] = static_cast<char>(flipped[i] ^ 1);
    write_file_atomically(index_path, flipped);
    REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains(index_path.string()) && Catch::Contains("is corrupt") &&
                                                  Catch::Contains("the metadata of rank 1 does not match"));
  }
  // Outside the metadata (the step): the error says so.
  std::string step_changed = index;
  step_changed.replace(step_changed.find("\"step\": 2"), 9, "\"step\": 3");
  write_file_atomically(index_path, step_changed);
  REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("is corrupt") && Catch::Contains("outside the per-rank metadata"));
  // The checksum removed, or the version turned back to 2 (one bit: '3' -> '2'): still refused.
  json::Object o = json::parse(index).as_object();
  o.erase("index_crc32c");
  write_file_atomically(index_path, json::dump(json::Value(o), 1));
  REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("no \"index_crc32c\""));
  std::string old_version = index;
  old_version.replace(old_version.find("\"version\": 3"), 12, "\"version\": 2");
  write_file_atomically(index_path, old_version);
  REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("is corrupt"));
  // A deliberate edit, resealed, loads as edited; "metadata" must stay rank 0's copy.
  std::string edited = index;
  edited.replace(edited.find("\"rank 2\""), 8, "\"rank X\"");
  write_file_atomically(index_path, edited);
  reseal_checkpoint_index(index_path);
  REQUIRE(Checkpoint(dir.path).rank_metadata(2).at("who") == "rank X");
  edited = index;
  edited.replace(edited.find("\"who\": \"rank 0\""), 15, "\"who\": \"rank Y\"");  // the first: "metadata"
  write_file_atomically(index_path, edited);
  reseal_checkpoint_index(index_path);
  REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains("not a copy of rank 0's"));
  write_file_atomically(index_path, index);
  REQUIRE(Checkpoint(dir.path).rank_metadata(1).at("who") == "rank 1");
  // An index without rank_metadata cannot be resealed: a trellis::Error naming the key (it was
  // std::out_of_range from std::map::at; found by fuzz/checkpoint_index.cpp)
  write_file_atomically(index_path, "{\"format\": \"trellis-checkpoint\"}");
  REQUIRE_THROWS_WITH(reseal_checkpoint_index(index_path), Catch::Contains("missing key \"rank_metadata\""));
}

TEST_CASE("a rank's metadata corrupted in its shard header before the commit: the commit names the file",
          "[checkpoint][errors]") {
  TempDir dir("ckpt-meta-crc");
  stage_split(dir.path, 4, 0, 2);
  const auto shard1 = dir.path / "step-00000004.partial" / "shard-1.safetensors";
  std::string bytes = read_whole_file(shard1);
  const auto pos = bytes.find("\"rank 1\"");
  REQUIRE(pos != std::string::npos);
  bytes[pos + 6] = '7';  // same length: the header still parses
  write_file_atomically(shard1, bytes);
  REQUIRE_THROWS_WITH(commit_checkpoint(dir.path, 4, 2),
                      Catch::Contains("shard-1.safetensors") && Catch::Contains("does not match the checksum"));
  REQUIRE_FALSE(latest_checkpoint(dir.path).has_value());
}

TEST_CASE("re-saving a step replaces it; pruning keeps the newest", "[checkpoint]") {
  TempDir dir("ckpt-prune");
  for (int step : {10, 20, 30}) write_split(dir.path, step, 0, 1, {{"tag", "first"}});
  write_split(dir.path, 30, 1, 3, {{"tag", "second"}});  // same step, other layout
  Checkpoint ck(dir.path);
  REQUIRE(ck.world_size() == 3);
  REQUIRE(ck.metadata("tag") == "second");
  REQUIRE(!std::filesystem::exists(dir.path / "step-00000030.old"));
  prune_checkpoints(dir.path, 2);
  REQUIRE(!std::filesystem::exists(dir.path / "step-00000010"));
  REQUIRE(std::filesystem::exists(dir.path / "step-00000020"));
  REQUIRE(Checkpoint(dir.path).step() == 30);
}

namespace {
// The crash-point test's reference: the checkpoint under `root` holds version `version` of every
// test tensor (and its metadata tag says so) and every CRC32C checks.
void expect_version(const std::filesystem::path& root, std::int64_t step, int version) {
  Checkpoint ck(root);
  REQUIRE(ck.step() == step);
  REQUIRE(ck.metadata("tag") == "version " + std::to_string(version));
  ck.verify();
  for (const auto& t : gpt_like)
    REQUIRE(ck.read_whole<float>(t.name) == full_tensor(t.id + version_shift * version, t.shape));
}
std::vector<std::string> leftovers(const std::filesystem::path& root) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    const std::string f = e.path().filename().string();
    if (f.ends_with(".old") || f.ends_with(".partial") || f.find(".tmp.") != std::string::npos) out.push_back(f);
  }
  return out;
}
struct StopHere {};
}  // namespace

// Every point of a commit (before and after each rename and fsync, recorded from a real commit),
// two ways of stopping there: an exception (an error: destructors run) and the end of a forked
// process (_exit: a kill, nothing runs after it). After the stop, the checkpoint `latest` leads
// to must load with every checksum right and hold either the previous commit or the new save, as
// the protocol promises (docs/checkpoint.md): the new one from the rename that publishes step-N
// (re-saving the step `latest` names) or from the rename of `latest` (a new step). Then a retry
// of the save and a save of the next step must succeed and leave no .old/.partial/temp behind.
TEST_CASE("a save stopped at any point of its commit leaves a checkpoint that loads", "[checkpoint][crash]") {
  enum class Scenario { resave_latest, new_step };
  for (Scenario scenario : {Scenario::resave_latest, Scenario::new_step}) {
    const bool resave = scenario == Scenario::resave_latest;
    // Before the save under test: step 1 (version 1) and, re-saving, step 2 (version 2), committed.
    // The save under test: step 2, version 3, another layout (3 ranks along dim 1).
    auto prepare = [&](const std::filesystem::path& root) {
      write_split(root, 1, 0, 2, {{"tag", "version 1"}}, 1);
      if (resave) write_split(root, 2, 0, 2, {{"tag", "version 2"}}, 2);
      stage_split(root, 2, 1, 3, {{"tag", "version 3"}}, 3);
    };
    std::vector<std::string> points;
    {
      TempDir dir("ckpt-points");
      prepare(dir.path);
      commit_checkpoint(dir.path, 2, 3, [&](std::string_view p) { points.emplace_back(p); });
      expect_version(dir.path, 2, 3);
    }
    // The points this protocol must stop at: every rename and fsync, before and after.
    const std::string publish = "after rename step.partial -> step";
    const std::string latest_renamed = "latest: after rename";
    for (const char* must : {"index.json: before fsync", "index.json: after rename", "before rename step.partial -> step",
                             publish.c_str(), "latest: before rename", latest_renamed.c_str(),
                             "latest: after directory fsync"})
      REQUIRE(std::find(points.begin(), points.end(), must) != points.end());
    if (resave) {
      REQUIRE(std::find(points.begin(), points.end(), "before rename step -> step.old") != points.end());
      REQUIRE(std::find(points.begin(), points.end(), "after rename step -> step.old") != points.end());
    }
    const auto new_from = std::find(points.begin(), points.end(), resave ? publish : latest_renamed) - points.begin();

    for (std::size_t i = 0; i < points.size(); ++i) {
      for (const bool kill : {false, true}) {
        INFO((resave ? "re-saving the latest step" : "saving a new step") << ", stopped at \"" << points[i]
                                                                          << "\" by " << (kill ? "_exit" : "an exception"));
        TempDir dir("ckpt-crash");
        prepare(dir.path);
        auto hook = [&](std::string_view p) {
          if (p != points[i]) return;
          if (kill) ::_exit(0);
          throw StopHere{};
        };
        if (kill) {
          std::fflush(nullptr);
          const pid_t child = ::fork();
          REQUIRE(child >= 0);
          if (child == 0) {
            try {
              commit_checkpoint(dir.path, 2, 3, hook);
            } catch (...) {
              ::_exit(2);
            }
            ::_exit(3);  // the point was never reached
          }
          int status = 0;
          REQUIRE(::waitpid(child, &status, 0) == child);
          REQUIRE(WIFEXITED(status));
          REQUIRE(WEXITSTATUS(status) == 0);
        } else {
          REQUIRE_THROWS_AS(commit_checkpoint(dir.path, 2, 3, hook), StopHere);
        }
        // What resume finds.
        REQUIRE(latest_checkpoint(dir.path).has_value());
        const bool is_new = static_cast<std::ptrdiff_t>(i) >= new_from;
        if (is_new)
          expect_version(dir.path, 2, 3);
        else if (resave)
          expect_version(dir.path, 2, 2);
        else
          expect_version(dir.path, 1, 1);
        // The save is retried, then the next step saved: both commit and clean up.
        write_split(dir.path, 2, 0, 1, {{"tag", "version 4"}}, 4);
        expect_version(dir.path, 2, 4);
        write_split(dir.path, 3, 0, 2, {{"tag", "version 5"}}, 5);
        expect_version(dir.path, 3, 5);
        CHECK(leftovers(dir.path).empty());
        expect_version(dir.path / "step-00000002", 2, 4);
        expect_version(dir.path / "step-00000001", 1, 1);
      }
    }
  }
}

TEST_CASE("recovery: a missing step with no whole copy is an error naming all three; crashed saves are cleaned",
          "[checkpoint][crash]") {
  TempDir dir("ckpt-recover");
  write_split(dir.path, 1, 0, 1, {{"tag", "version 1"}}, 1);
  write_split(dir.path, 2, 0, 2, {{"tag", "version 2"}}, 2);
  namespace fs = std::filesystem;
  SECTION("step-N.old corrupt, step-N.partial incomplete: no silent fallback") {
    fs::rename(dir.path / "step-00000002", dir.path / "step-00000002.old");
    const auto shard = dir.path / "step-00000002.old" / "shard-1.safetensors";
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(shard) - 3));
    f.put('\x7f');
    f.close();
    stage_split(dir.path, 2, 0, 2, {{"tag", "version 3"}}, 3);  // shards, but no index.json
    REQUIRE_THROWS_WITH(latest_checkpoint(dir.path),
                        Catch::Contains("names step-00000002, which is missing") && Catch::Contains("step-00000002.old") &&
                            Catch::Contains("checksum mismatch") && Catch::Contains("step-00000002.partial"));
  }
  SECTION("step-N.old whole: resume reads it, the next save renames it back and cleans up") {
    fs::rename(dir.path / "step-00000002", dir.path / "step-00000002.old");
    REQUIRE(latest_checkpoint(dir.path) == dir.path / "step-00000002.old");
    expect_version(dir.path, 2, 2);
    stage_split(dir.path, 7, 0, 1, {{"tag", "version 7"}}, 7);  // a save that crashed, never retried
    write_split(dir.path, 3, 0, 1, {{"tag", "version 3"}}, 3);
    CHECK(leftovers(dir.path).empty());
    expect_version(dir.path / "step-00000002", 2, 2);
    expect_version(dir.path, 3, 3);
  }
}

TEST_CASE("Python's safetensors opens a checkpoint shard", "[checkpoint][python]") {
  if (std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") != 0) {
    WARN("SKIPPED: python3 with safetensors + numpy is not importable (pip install safetensors numpy)");
    return;
  }
  TempDir dir("ckpt-python");
  write_split(dir.path, 7, 0, 2);
  // Rank 1 holds rows 25..49 of wte.weight; values are (1 * 100000 + flat) * 0.5.
  std::string cmd =
      "python3 -c \"import numpy as np; from safetensors.numpy import load_file; "
      "t = load_file('" + (dir.path / "step-00000007" / "shard-1.safetensors").string() + "'); "
      "ref = ((100000 + np.arange(25 * 16, 50 * 16)) * 0.5).astype(np.float32).reshape(25, 16); "
      "assert np.array_equal(t['wte.weight'], ref), t['wte.weight']\"";
  REQUIRE(std::system(cmd.c_str()) == 0);

  // index.json is enough for another tool to reassemble a resharded tensor: numpy does it here
  // for the 4-shard layout, element values from the same formula.
  TempDir four("ckpt-python4");
  write_split(four.path, 8, 1, 4);
  const auto script = four.path / "assemble.py";
  std::ofstream(script) << "import json, numpy as np\n"
                           "from safetensors.numpy import load_file\n"
                           "d = '" << (four.path / "step-00000008").string() << "'\n"
                           "index = json.load(open(d + '/index.json'))\n"
                           "files = {}\n"
                           "for name, ref_id in [('cube', 9), ('h.0.attn.c_attn.weight', 4), ('scale', 8)]:\n"
                           "    t = index['tensors'][name]\n"
                           "    out = np.zeros(t['shape'], dtype=np.float32)\n"
                           "    for s in t['shards']:\n"
                           "        f = files.setdefault(s['file'], load_file(d + '/' + s['file']))\n"
                           "        sl = tuple(slice(o, o + n) for o, n in zip(s['offsets'], s['shape']))\n"
                           "        out[sl] = f[s['key']]\n"
                           "    ref = ((ref_id * 100000 + np.arange(out.size)) * 0.5).astype(np.float32).reshape(t['shape'])\n"
                           "    assert np.array_equal(out, ref), name\n"
                           "    assert len(t['shards']) == (1 if name == 'scale' else 4), name\n";
  REQUIRE(std::system(("python3 " + script.string()).c_str()) == 0);
}

TEST_CASE("a 2x3 mesh layout from shard::local_box loads as one tensor", "[checkpoint]") {
  // Placements<Shard<0>, Shard<1>> on a (2, 3) mesh: uneven in both dimensions.
  TempDir dir("ckpt-mesh");
  const std::array<index_t, 2> global = {7, 11};
  const Shape shape = {7, 11};
  const auto full = full_tensor(4, shape);
  const std::array<shard::PlacementCode, 2> codes = {shard::shard_code(0), shard::shard_code(1)};
  std::vector<std::vector<float>> locals(6);
  for (int r = 0; r < 6; ++r) {
    Box b = box_from_chunks(shard::local_box<2>(global, codes, {2, 3}, {r / 3, r % 3}));
    locals[r] = slice_of(full, shape, b);
    CheckpointWriter w(dir.path, 1, r, 6);
    w.add("h.0.mlp.c_proj.weight", DType::f32, shape, b, locals[r].data());
    w.finish();
  }
  commit_checkpoint(dir.path, 1, 6);
  Checkpoint ck(dir.path);
  REQUIRE(ck.tensor("h.0.mlp.c_proj.weight").shards.size() == 6);
  REQUIRE(ck.read_whole<float>("h.0.mlp.c_proj.weight") == full);
}

#ifdef TRELLIS_TEST_HAVE_THREADS
TEST_CASE("save_collectively over thread ranks: commits once, and a failure reaches every rank", "[checkpoint][comm]") {
  TempDir dir("ckpt-comm");
  const Shape shape = {10, 6};
  const auto full = full_tensor(1, shape);
  comm::ThreadWorld world(4);
  world.run([&](auto& c) {
    Box b = split_box(shape, 0, c.size(), c.rank());
    auto mine = slice_of(full, shape, b);
    CheckpointWriter w(dir.path, 1, c.rank(), c.size());
    w.add("wte.weight", DType::f32, shape, b, mine.data());
    save_collectively(w, c);
  });
  REQUIRE(Checkpoint(dir.path).read_whole<float>("wte.weight") == full);

  // Rank 2 writes a box that overlaps rank 1's: the commit on rank 0 fails, every rank throws.
  std::vector<std::string> errors(4);
  REQUIRE_THROWS_WITH(world.run([&](auto& c) {
    Box b = split_box(shape, 0, c.size(), c.rank());
    if (c.rank() == 2) b.offsets[0] -= 1;
    auto mine = slice_of(full, shape, b);
    CheckpointWriter w(dir.path, 2, c.rank(), c.size());
    w.add("wte.weight", DType::f32, shape, b, mine.data());
    try {
      save_collectively(w, c);
    } catch (const Error& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
      throw;
    }
  }), Catch::Contains("overlap") || Catch::Contains("commit failed"));
  REQUIRE_THAT(errors[0], Catch::Contains("overlap"));
  for (int r = 1; r < 4; ++r) REQUIRE_THAT(errors[static_cast<std::size_t>(r)], Catch::Contains("commit failed on rank 0"));
  REQUIRE(Checkpoint(dir.path).step() == 1);  // the previous checkpoint is still the latest

  // A rank whose write fails (its box lies outside the tensor): nobody commits.
  REQUIRE_THROWS(world.run([&](auto& c) {
    CheckpointWriter w(dir.path, 3, c.rank(), c.size());
    std::vector<float> v(6, 0.0f);
    if (c.rank() == 3) std::filesystem::create_directories(dir.path / "step-00000003.partial" / "shard-3.safetensors");
    w.add("x", DType::f32, {4, 6}, Box{{c.rank(), 0}, {1, 6}}, v.data());
    save_collectively(w, c);
  }));
  REQUIRE(Checkpoint(dir.path).step() == 1);
  REQUIRE(!std::filesystem::exists(dir.path / "step-00000003"));
}
#endif

#ifdef TRELLIS_TEST_HAVE_THREADS
namespace {
// A 3-rank checkpoint of step 6 whose ranks saved `states[r]`.
void write_states(const std::filesystem::path& root, const std::vector<TrainState>& states) {
  std::vector<float> x = {1, 2, 3};
  const int n = static_cast<int>(states.size());
  for (int r = 0; r < n; ++r) {
    CheckpointWriter w(root, 6, r, n);
    if (r == 0) w.add_whole<float>("x", x, {3});
    save_train_state(w, states[static_cast<std::size_t>(r)]);
    w.finish();
  }
  commit_checkpoint(root, 6, n);
}
// Each rank's error message from agree_on_train_state ("" when it passed); `edit` may change
// what rank r passes.
std::vector<std::string> agreement_errors(const std::vector<std::filesystem::path>& dirs,
                                          const std::function<void(int, TrainState&)>& edit = {}) {
  std::vector<std::string> errors(dirs.size());
  comm::ThreadWorld(static_cast<int>(dirs.size())).run([&](auto& c) {
    c.set_timeout(std::chrono::milliseconds(20000));
    Checkpoint ck(dirs[static_cast<std::size_t>(c.rank())]);
    TrainState mine = load_train_state(ck, c.rank());
    if (edit) edit(c.rank(), mine);
    try {
      agree_on_train_state(ck, mine, c);
    } catch (const Error& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.message();
    }
  });
  return errors;
}
}  // namespace

TEST_CASE("agree_on_train_state: any disagreement throws the same error, naming the checkpoint, on every rank",
          "[checkpoint][comm][errors]") {
  TempDir dir("ckpt-agree");
  std::vector<TrainState> states;
  for (int r = 0; r < 3; ++r) states.push_back({.step = 6, .rng = Rng(5, r), .data = {.seed = 5, .next_batch = 6}});
  write_states(dir.path / "good", states);
  const auto good = *latest_checkpoint(dir.path / "good");
  const std::vector<std::filesystem::path> same(3, good);
  for (const auto& e : agreement_errors(same)) REQUIRE(e.empty());

  auto all_equal_and_contain = [](const std::vector<std::string>& errors, std::vector<std::string> parts) {
    for (const auto& e : errors) {
      INFO(e);
      REQUIRE(e == errors[0]);
      for (const auto& p : parts) REQUIRE_THAT(e, Catch::Contains(p));
    }
  };
  // What each rank passes in (as if one rank read other files): compared across the ranks.
  all_equal_and_contain(agreement_errors(same, [](int r, TrainState& s) { s.data.next_batch += r == 2; }),
                        {good.string(), "different data positions", "ranks 0-1: seed=5;next_batch=6",
                         "rank 2: seed=5;next_batch=7"});
  all_equal_and_contain(agreement_errors(same, [](int r, TrainState& s) { s.step -= r == 1; }),
                        {good.string(), "different steps", "rank 1: 5"});
  all_equal_and_contain(agreement_errors(same, [](int r, TrainState& s) { if (r == 2) s.rng = Rng(5, 0); }),
                        {good.string(), "ranks 0 and 2 hold the same Rng state"});

  // Saved inconsistently (each variant is one rank's metadata, checksums intact): every rank
  // finds it in the index; the same message everywhere.
  struct Bad {
    std::function<void(std::vector<TrainState>&)> edit;
    std::string says;
  };
  for (const Bad& bad : {Bad{[](auto& s) { s[1].data.next_batch = 7; }, "rank 1: seed=5;next_batch=7"},
                         Bad{[](auto& s) { s[2].step = 5; }, "rank 2 saved train.step 5 in a checkpoint of step 6"},
                         Bad{[](auto& s) { s[1].rng = s[0].rng; }, "ranks 0 and 1 saved the same Rng state"}}) {
    auto bad_states = states;
    bad.edit(bad_states);
    std::filesystem::remove_all(dir.path / "bad");
    write_states(dir.path / "bad", bad_states);
    const auto bad_dir = *latest_checkpoint(dir.path / "bad");
    all_equal_and_contain(agreement_errors({bad_dir, bad_dir, bad_dir}), {bad_dir.string(), bad.says});
    // Only rank 1 opened that one: the others still throw its error, and nobody waits forever.
    all_equal_and_contain(agreement_errors({good, bad_dir, good}), {bad_dir.string(), bad.says, "(on rank(s) 1 of 3)"});
  }
  // Two consistent checkpoints of the same step, e.g. node-local copies that differ.
  auto other = states;
  for (auto& s : other) s.data.next_batch = 9;
  write_states(dir.path / "other", other);
  const auto other_dir = *latest_checkpoint(dir.path / "other");
  all_equal_and_contain(agreement_errors({good, good, other_dir}),
                        {"did not load the same checkpoint", "ranks 0-1: " + good.string(), "rank 2: " + other_dir.string()});

  // Opening collectively: a rank that cannot open its path, or ranks that opened different
  // checkpoints, fail every rank with the same message before anything else is read.
  auto open_errors = [](const std::vector<std::filesystem::path>& dirs) {
    std::vector<std::string> errors(dirs.size());
    comm::ThreadWorld(static_cast<int>(dirs.size())).run([&](auto& c) {
      c.set_timeout(std::chrono::milliseconds(20000));
      try {
        Checkpoint ck = open_checkpoint_collectively(dirs[static_cast<std::size_t>(c.rank())], c);
        REQUIRE(ck.step() == 6);
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(c.rank())] = e.message();
      }
    });
    return errors;
  };
  for (const auto& e : open_errors(same)) REQUIRE(e.empty());
  const auto missing = dir.path / "missing";
  all_equal_and_contain(open_errors({good, good, missing}), {"no checkpoint at", missing.string(), "(on rank(s) 2 of 3)"});
  all_equal_and_contain(open_errors({other_dir, good, good}),
                        {"did not open the same checkpoint", "rank 0: " + other_dir.string(), "ranks 1-2: " + good.string()});
}
#endif

TEST_CASE("floating tensors convert on read; other dtype changes are refused", "[checkpoint]") {
  TempDir dir("ckpt-convert");
  std::vector<float> w = {1.0f, -2.5f, 3.14159265f, 1e-3f, 65504.0f, 1e-8f};
  std::vector<bfloat16> wb;
  for (float x : w) wb.push_back(bfloat16(x));
  std::vector<std::int32_t> ids = {1, 2, 3};
  CheckpointWriter cw(dir.path, 1, 0, 1);
  cw.add_whole<float>("master", w, {6});
  cw.add_whole<bfloat16>("model", wb, {6});
  cw.add_whole<std::int32_t>("ids", ids, {3});
  cw.finish();
  commit_checkpoint(dir.path, 1, 1);
  Checkpoint ck(dir.path);
  std::vector<bfloat16> as_bf16(6);
  ck.read("master", DType::bf16, full_box({6}), as_bf16.data());
  std::vector<half> as_half(6);
  ck.read("master", DType::f16, full_box({6}), as_half.data());
  std::vector<double> as_double(6);
  ck.read("master", DType::f64, full_box({6}), as_double.data());
  std::vector<float> from_bf16(6);
  ck.read("model", DType::f32, full_box({6}), from_bf16.data());
  for (int i = 0; i < 6; ++i) {
    REQUIRE(as_bf16[i].bits == bfloat16(w[i]).bits);
    REQUIRE(as_half[i].bits == half(w[i]).bits);
    REQUIRE(as_double[i] == static_cast<double>(w[i]));
    REQUIRE(from_bf16[i] == static_cast<float>(wb[i]));
  }
  std::vector<float> f(3);
  REQUIRE_THROWS_WITH(ck.read("ids", DType::f32, full_box({3}), f.data()), Catch::Contains("I32 and cannot be read as F32"));
}

TEST_CASE("a rank's boxes of one tensor become one tensor when they tile a box; optimizer tensors go to optim-<rank>",
          "[checkpoint]") {
  TempDir dir("ckpt-merge");
  const Shape s = {4, 12};
  const auto full = full_tensor(1, s), moments = full_tensor(2, s);
  // A crashed attempt at this step left an optim file of rank 1, which now has no optimizer tensors.
  std::filesystem::create_directories(dir.path / "step-00000003.partial");
  std::ofstream(dir.path / "step-00000003.partial" / "optim-1.safetensors") << "stale";
  std::vector<std::vector<float>> keep;
  {
    CheckpointWriter w0(dir.path, 3, 0, 2);
    for (index_t col : {8, 0, 4}) {  // q, k, v blocks of "c", out of order: one (4, 12) tensor
      keep.push_back(slice_of(full, s, Box{{0, col}, {4, 4}}));
      w0.add("c", DType::f32, s, Box{{0, col}, {4, 4}}, keep.back().data());
    }
    for (index_t col : {0, 8}) {  // columns 0..3 and 8..11 of "d" do not tile a box: two keys
      keep.push_back(slice_of(full, s, Box{{0, col}, {4, 4}}));
      w0.add("d", DType::f32, s, Box{{0, col}, {4, 4}}, keep.back().data());
    }
    w0.add("optimizer.m.c", DType::f32, s, full_box(s), moments.data(), CheckpointFile::optimizer);
    w0.finish();
    CheckpointWriter w1(dir.path, 3, 1, 2);
    keep.push_back(slice_of(full, s, Box{{0, 4}, {4, 4}}));
    w1.add("d", DType::f32, s, Box{{0, 4}, {4, 4}}, keep.back().data());
    w1.finish();
  }
  commit_checkpoint(dir.path, 3, 2);
  const auto step = dir.path / "step-00000003";
  SafetensorsFile shard0(step / "shard-0.safetensors");
  std::vector<std::string> keys;
  for (const auto& e : shard0.entries()) keys.push_back(e.name);
  std::sort(keys.begin(), keys.end());
  REQUIRE(keys == std::vector<std::string>{"c", "d#0", "d#1"});
  REQUIRE(shard0.entry("c").shape == s);
  REQUIRE(shard0.read_as<float>("c") == full);
  REQUIRE(shard0.metadata().at("format") == "pt");
  SafetensorsFile optim0(step / "optim-0.safetensors");
  REQUIRE(optim0.entries().size() == 1);
  REQUIRE(optim0.read_as<float>("optimizer.m.c") == moments);
  REQUIRE_FALSE(std::filesystem::exists(step / "optim-1.safetensors"));
  Checkpoint ck(dir.path);
  REQUIRE(ck.read_whole<float>("c") == full);
  REQUIRE(ck.read_whole<float>("d") == full);
  REQUIRE(ck.read_whole<float>("optimizer.m.c") == moments);
  REQUIRE(ck.tensor("optimizer.m.c").shards.at(0).file == "optim-0.safetensors");
}

TEST_CASE("a version-1 checkpoint (everything in shard-<rank>, a key per box) still loads", "[checkpoint]") {
  // Written by hand as version 1 wrote it: one file, "c#0".."c#2" for the three column blocks,
  // the moments beside the weights, index.json version 1.
  TempDir dir("ckpt-v1");
  const Shape s = {4, 12};
  const auto full = full_tensor(1, s), moments = full_tensor(2, s);
  const auto step = dir.path / "step-00000007";
  std::filesystem::create_directories(step);
  SafetensorsWriter w;
  std::vector<std::vector<float>> blocks;
  json::Array shards_c;
  for (int k = 0; k < 3; ++k) {
    blocks.push_back(slice_of(full, s, Box{{0, 4 * k}, {4, 4}}));
    w.add("c#" + std::to_string(k), DType::f32, {4, 4}, blocks.back().data());
  }
  w.add("optimizer.m.c", DType::f32, s, moments.data());
  w.set_metadata("train.step", "7");
  w.write(step / "shard-0.safetensors");
  for (int k = 0; k < 3; ++k) {
    json::Object o;
    o["file"] = json::Value("shard-0.safetensors");
    o["key"] = json::Value("c#" + std::to_string(k));
    o["offsets"] = json::Value(json::Array{json::Value(0), json::Value(4 * k)});
    o["shape"] = json::Value(json::Array{json::Value(4), json::Value(4)});
    o["crc32c"] = json::Value(crc_hex(w.checksums()[static_cast<std::size_t>(k)]));
    shards_c.emplace_back(std::move(o));
  }
  json::Object m;
  m["file"] = json::Value("shard-0.safetensors");
  m["key"] = json::Value("optimizer.m.c");
  m["offsets"] = json::Value(json::Array{json::Value(0), json::Value(0)});
  m["shape"] = json::Value(json::Array{json::Value(4), json::Value(12)});
  m["crc32c"] = json::Value(crc_hex(w.checksums()[3]));
  auto tensor = [&](json::Array shards) {
    json::Object t;
    t["dtype"] = json::Value("F32");
    t["shape"] = json::Value(json::Array{json::Value(4), json::Value(12)});
    t["shards"] = json::Value(std::move(shards));
    return json::Value(std::move(t));
  };
  json::Object tensors;
  tensors["c"] = tensor(std::move(shards_c));
  tensors["optimizer.m.c"] = tensor(json::Array{json::Value(std::move(m))});
  json::Object meta;
  meta["train.step"] = json::Value("7");
  json::Object index;
  index["format"] = json::Value("trellis-checkpoint");
  index["version"] = json::Value(1);
  index["step"] = json::Value(7);
  index["world_size"] = json::Value(1);
  index["metadata"] = json::Value(meta);
  index["rank_metadata"] = json::Value(json::Array{json::Value(meta)});
  index["tensors"] = json::Value(std::move(tensors));
  write_file_atomically(step / "index.json", json::dump(json::Value(std::move(index)), 1));
  write_file_atomically(dir.path / "latest", "step-00000007\n");

  Checkpoint ck(dir.path);
  REQUIRE(ck.step() == 7);
  REQUIRE(ck.metadata("train.step") == "7");
  REQUIRE(ck.read_whole<float>("c") == full);
  REQUIRE(ck.read_whole<float>("optimizer.m.c") == moments);
  std::vector<float> mid(8);  // columns 3..4 straddle the first two boxes
  ck.read("c", DType::f32, Box{{0, 3}, {4, 2}}, mid.data());
  REQUIRE(mid == slice_of(full, s, Box{{0, 3}, {4, 2}}));
}

TEST_CASE("a `latest` holding another file is refused quoting only its start", "[checkpoint]") {
  TempDir dir("ckpt-latest-garbage");
  std::string big = "{\"format\": \"trellis-checkpoint\"" + std::string(20000, ' ') + "}\n";
  big[40] = '\0';
  write_file_atomically(dir.path / "latest", big);
  try {
    (void)latest_checkpoint(dir.path);
    FAIL("no error");
  } catch (const Error& e) {
    const std::string m = e.message();
    CHECK_THAT(m, Catch::Contains("latest") && Catch::Contains("not a step directory name") &&
                      Catch::Contains("(" + std::to_string(big.size() - 1) + " bytes)") && Catch::Contains("{\"format\""));
    CHECK(m.size() < 400);  // not the whole file
  }
}
