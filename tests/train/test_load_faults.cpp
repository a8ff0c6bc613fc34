// A tensor whose bytes in a checkpoint are corrupt (a flipped byte: its CRC32C fails) is found only
// by the ranks that read that shard. Trainer::load must still make EVERY rank throw the same error,
// naming the checkpoint, the tensor, the file and the rank that found it, with every failing rank
// listed; before, the other ranks loaded on and waited in the next collective. dp2 x tp2 on 4
// ranks: thread ranks (train.load_faults) and, built with the MPI test main, 4 MPI processes
// (train.load_faults_mpi.np4). Which ranks must fail follows from the layout alone: shard-<w> is
// written by world rank w (a dp-0 rank) and holds its tp part of each tp-split tensor, which every
// rank with the same tp coordinate reads; a replicated tensor (ln_f) is written once, by rank 0,
// and read by all.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "temp_dir.hpp"
#include "test_trainer_support.hpp"
#include "trellis/io/safetensors.hpp"
#include "trellis/train/checkpoint.hpp"
#if defined(TRELLIS_MPI_TEST)
#include <mpi.h>

#include "trellis/comm/mpi.hpp"
#endif

using namespace trainer_test;
namespace fs = std::filesystem;

namespace {

const Layout kLayout{.dp = 2, .tp = 2};

// Flips one byte in the middle of the data of tensor `name`'s shard in `file` (the header and the
// index stay intact: only reading the tensor can notice).
void corrupt_tensor(const fs::path& step_dir, const std::string& file, const std::string& name) {
  const trellis::train::Checkpoint ck(step_dir);
  std::string key;
  for (const auto& s : ck.tensor(name).shards)
    if (s.file == file) key = s.key;
  REQUIRE(!key.empty());
  const fs::path path = step_dir / file;
  const trellis::io::SafetensorsFile shard(path);  // alive while `entry` points into it
  const auto* entry = shard.find(key);
  REQUIRE(entry != nullptr);
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  unsigned char header[8] = {};
  f.read(reinterpret_cast<char*>(header), 8);  // safetensors: u64 little-endian header length
  std::uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | header[i];
  const auto at = static_cast<std::streamoff>(8 + header_bytes + entry->begin + entry->bytes() / 2);
  f.seekg(at);
  const char old = static_cast<char>(f.get());
  f.seekp(at);
  f.put(static_cast<char>(old ^ 0x5a));
  REQUIRE(f.good());
}

// What every rank's message must hold when ranks `failing` (ascending) read the corrupt shard.
void check_message(const std::string& e, const fs::path& step, const std::string& file, const std::string& tensor,
                   const std::string& failing_list, int lowest) {
  INFO(e);
  CHECK(e.find("checkpoint " + step.string() + ": rank " + std::to_string(lowest) + " could not read its tensors: ") ==
        0);
  // The file (quoted, as a path prints) and the shard's key: the tensor's name, then its piece.
  CHECK(e.find((step / file).string() + "\": checksum mismatch for tensor \"" + tensor) != std::string::npos);
  CHECK(e.find("(failed on " + failing_list + " of 4)") != std::string::npos);
}

}  // namespace

#if !defined(TRELLIS_MPI_TEST)

std::string load_error_of(trellis::train::Trainer<ThreadComm>& t, const fs::path& step) {
  try {
    t.load(step);
  } catch (const trellis::Error& e) {
    return e.message();
  }
  return {};
}

TEST_CASE("a corrupt tensor shard: every rank throws the same error naming the checkpoint, tensor and rank",
          "[train][trainer][checkpoint][fault]") {
  TempDir dir("load-faults");
  {
    nn_test::Collector w;
    RunResult r;
    train(with_layout(tiny_config(), kLayout), 1, r, w, {}, dir.path);
  }
  const fs::path step = dir.path / "step-00000001";
  std::vector<int> tp_of(4);
  const auto load_everywhere = [&] {
    std::vector<std::string> errors(4);
    nn_test::run_ranks(4, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, with_layout(tiny_config(), kLayout));
      tp_of[static_cast<std::size_t>(comm.rank())] = t.mesh().coord<trellis::tp>();
      errors[static_cast<std::size_t>(comm.rank())] = load_error_of(t, step);
    });
    return errors;
  };
  REQUIRE(load_everywhere() == std::vector<std::string>(4));  // intact: loads everywhere

  SECTION("a tp-split tensor: found by the ranks of one tp coordinate, thrown by all") {
    corrupt_tensor(step, "shard-1.safetensors", "h.0.attn.c_attn.weight");
    const auto errors = load_everywhere();
    std::vector<int> failing;
    for (int r = 0; r < 4; ++r)
      if (tp_of[static_cast<std::size_t>(r)] == tp_of[1]) failing.push_back(r);
    REQUIRE(failing.size() == 2);  // dp2: one rank per dp replica
    for (const auto& e : errors) {
      CHECK(e == errors[0]);
      check_message(e, step, "shard-1.safetensors", "h.0.attn.c_attn.weight",
                    "ranks " + std::to_string(failing[0]) + ", " + std::to_string(failing[1]), failing[0]);
    }
  }
  SECTION("a replicated tensor: every rank finds it, the message names rank 0 and all ranks") {
    corrupt_tensor(step, "shard-0.safetensors", "ln_f.weight");
    const auto errors = load_everywhere();
    for (const auto& e : errors) {
      CHECK(e == errors[0]);
      check_message(e, step, "shard-0.safetensors", "ln_f.weight", "ranks 0-3", 0);
    }
  }
  SECTION("an optimizer moment") {
    corrupt_tensor(step, "optim-1.safetensors", "optimizer.v.h.0.mlp.c_fc.weight");
    const auto errors = load_everywhere();
    for (const auto& e : errors) {
      CHECK(e == errors[0]);
      CHECK(e.find("optim-1.safetensors\": checksum mismatch for tensor \"optimizer.v.h.0.mlp.c_fc.weight") !=
            std::string::npos);
      CHECK(e.find("(failed on ranks ") != std::string::npos);
    }
  }
}

#else  // 4 MPI processes: the same corrupt shard, the status exchange over MpiComm

TEST_CASE("MPI: a corrupt tensor shard makes every process throw the same error", "[train][trainer][mpi][fault]") {
  trellis::comm::MpiWorld world;  // MPI belongs to the test main
  world.run([&](trellis::comm::MpiComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(30000));
    REQUIRE(comm.size() == 4);
    // One directory for all processes: rank 0 names it.
    std::string root;
    std::unique_ptr<TempDir> dir;
    if (comm.rank() == 0) {
      dir = std::make_unique<TempDir>("load-faults-mpi");
      root = dir->path.string();
    }
    std::uint64_t length = root.size();
    comm.broadcast(&length, 1, 0);
    root.resize(length);
    comm.broadcast(reinterpret_cast<std::uint8_t*>(root.data()), length, 0);
    const auto cfg = with_layout(tiny_config(), kLayout);
    trellis::train::Trainer<trellis::comm::MpiComm> t(comm, cfg);
    {
      const int dp_rank = t.mesh().coord<trellis::dp>();
      trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, dp_rank, cfg.dp});
      t.step(loader.next());
      t.save(root, loader.state());
    }
    const fs::path step = fs::path(root) / "step-00000001";
    if (comm.rank() == 0) corrupt_tensor(step, "shard-1.safetensors", "h.0.attn.c_attn.weight");
    comm.barrier();
    std::string error;
    try {
      trellis::train::Trainer<trellis::comm::MpiComm> fresh(comm, cfg);
      fresh.load(step);
    } catch (const trellis::Error& e) {
      error = e.message();
    }
    // Which ranks read shard-1's part: those with world rank 1's tp coordinate.
    const int my_tp = t.mesh().coord<trellis::tp>();
    std::vector<int> tps(4);
    comm.all_gather(&my_tp, tps.data(), 1);
    std::vector<int> failing;
    for (int r = 0; r < 4; ++r)
      if (tps[static_cast<std::size_t>(r)] == tps[1]) failing.push_back(r);
    REQUIRE(failing.size() == 2);
    check_message(error, step, "shard-1.safetensors", "h.0.attn.c_attn.weight",
                  "ranks " + std::to_string(failing[0]) + ", " + std::to_string(failing[1]), failing[0]);
    // The same message everywhere: rank 0 compares every process's text with its own.
    std::uint64_t mine = error.size(), longest = 0;
    comm.all_reduce(&mine, &longest, 1, trellis::comm::ReduceOp::max);
    std::vector<std::uint8_t> padded(longest), all(longest * 4);
    std::copy(error.begin(), error.end(), padded.begin());
    comm.all_gather(padded.data(), all.data(), longest);
    const auto width = static_cast<long>(longest);
    for (long r = 0; r < 4; ++r)
      CHECK(std::string(all.begin() + r * width, all.begin() + (r + 1) * width) ==
            std::string(padded.begin(), padded.end()));
    comm.barrier();  // rank 0 removes the directory after everyone is done with it
  });
}

#endif
