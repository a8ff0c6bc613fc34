// Fuzz target `checkpoint_index`: the input is a checkpoint's index.json. It is written into a
// temporary step directory and opened with train::Checkpoint twice: as it is (the checksum checks),
// and resealed with train::reseal_checkpoint_index so that mutations get past the checksums to the
// index validation (versions, world size, metadata, tensor shapes and shard tiling). Shard files
// named by the index do not exist, so an index that validates fails at opening its first shard.
#include <filesystem>
#include <fstream>

#include "harness.hpp"
#include "trellis/io/json.hpp"
#include "trellis/train/checkpoint.hpp"

namespace {
namespace fs = std::filesystem;

// One temporary directory per process, removed at exit.
const fs::path& step_dir() {
  static const fs::path dir = [] {
    std::string pattern = (fs::temp_directory_path() / "trellis-fuzz-ckpt-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) {
      std::perror("mkdtemp");
      std::abort();
    }
    std::atexit([] { std::error_code ec; fs::remove_all(step_dir(), ec); });
    return fs::path(pattern);
  }();
  return dir;
}

void write_index(std::string_view text) {
  std::ofstream out(step_dir() / "index.json", std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  if (!out) std::abort();
}
}  // namespace

TRELLIS_FUZZ_TARGET(checkpoint_index) {
  const std::string_view input = trellis::fuzz::text(data, size);
  // Only JSON objects go to disk: anything else fails in the parser (the `json` target's job).
  bool is_object = false;
  trellis::fuzz::guarded([&] { is_object = trellis::io::json::parse(input, "fuzz input").is_object(); });
  if (!is_object) return 0;
  write_index(input);
  trellis::fuzz::guarded([&] { trellis::train::Checkpoint c(step_dir()); });
  if (!trellis::fuzz::guarded([&] { trellis::train::reseal_checkpoint_index(step_dir() / "index.json"); }))
    return 0;
  trellis::fuzz::guarded([&] { trellis::train::Checkpoint c(step_dir()); });
  return 0;
}
