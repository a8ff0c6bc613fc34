// Checkpoint I/O throughput, side by side with the Python `safetensors` package (the reference
// implementation, Rust core) on the same tensors in the same run, plus CRC32C speed.
//   bench_checkpoint [--mb 64] [--iters 3] [--json FILE]
// Rows: save = write + fsync of one safetensors file (the peer: save_file then os.fsync, so both
// reach the disk); load = read every tensor into memory (ours also verifies each CRC32C);
// sharded = a 4-rank checkpoint (4 files + index, commit) written and read back whole.
// Reads come from the page cache for both sides: the figures compare software overhead, not disks.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "support/report.hpp"
#include "trellis/io/checksum.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/rng.hpp"

using namespace trellis;
using namespace trellis::io;
using namespace trellis::train;


int main(int argc, char** argv) {
  const double mb = trellis::bench::double_flag(argc, argv, "--mb", 64);
  const int iters = static_cast<int>(trellis::bench::int_flag(argc, argv, "--iters", 3));
  const auto dir = std::filesystem::temp_directory_path() / ("trellis-bench-ckpt-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);

  // GPT-like tensors: 8 matrices of (rows, 1024) and 8 vectors, ~mb megabytes in all.
  const index_t cols = 1024;
  const index_t rows = std::max<index_t>(1, static_cast<index_t>(mb * 1e6 / 4 / cols / 8));
  std::vector<std::vector<float>> data;
  std::vector<std::pair<std::string, Shape>> specs;
  Rng rng(1);
  for (int i = 0; i < 8; ++i) {
    specs.push_back({"h." + std::to_string(i) + ".mlp.c_fc.weight", {rows, cols}});
    specs.push_back({"h." + std::to_string(i) + ".ln_1.weight", {cols}});
  }
  double bytes = 0;
  for (const auto& [name, shape] : specs) {
    data.emplace_back(static_cast<std::size_t>(shape_elements(shape)));
    for (auto& x : data.back()) x = rng.uniform_float();
    bytes += 4.0 * static_cast<double>(data.back().size());
  }
  const double gb = bytes / 1e9;
  const auto file = dir / "ours.safetensors";

  auto save = [&] {
    SafetensorsWriter w;
    for (std::size_t i = 0; i < specs.size(); ++i) w.add(specs[i].first, DType::f32, specs[i].second, data[i].data());
    w.write(file);
  };
  std::vector<float> sink;
  auto load = [&] {
    SafetensorsFile f(file);
    for (const auto& e : f.entries()) {
      sink.resize(e.bytes() / 4);
      f.read(e.name, sink.data());
    }
  };
  const int ranks = 4;
  int step = 0;
  auto sharded_save = [&] {
    ++step;
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        CheckpointWriter w(dir / "ckpt", step, r, ranks);
        for (std::size_t i = 0; i < specs.size(); ++i) {
          const Shape& s = specs[i].second;
          if (s.size() == 1) {
            if (r == 0) w.add(specs[i].first, DType::f32, s, full_box(s), data[i].data());
            continue;
          }
          Box b = split_box(s, 0, ranks, r);
          w.add(specs[i].first, DType::f32, s, b, data[i].data() + b.offsets[0] * cols);
        }
        w.finish();
      });
    for (auto& t : threads) t.join();
    commit_checkpoint(dir / "ckpt", step, ranks);
    prune_checkpoints(dir / "ckpt", 1);
  };
  auto sharded_load = [&] {
    Checkpoint ck(dir / "ckpt");
    for (const auto& [name, shape] : specs) {
      sink.resize(static_cast<std::size_t>(shape_elements(shape)));
      ck.read(name, DType::f32, full_box(shape), sink.data());
    }
  };

  auto [save_s, save_med] = bench::time_min_median(save, 1, iters);
  auto [load_s, load_med] = bench::time_min_median(load, 1, iters);
  auto [ssave_s, ssave_med] = bench::time_min_median(sharded_save, 1, iters);
  auto [sload_s, sload_med] = bench::time_min_median(sharded_load, 1, iters);

  // The peer, same data (read from our file by the peer itself), same machine, same run.
  double peer_save = -1, peer_load = -1;
  if (std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0) {
    const auto script = dir / "peer.py";
    const auto out = dir / "peer.txt";
    std::ofstream(script) << "import os, time\n"
                             "from safetensors.numpy import load_file, save_file\n"
                             "src, dst, iters = '" << file.string() << "', '" << (dir / "peer.safetensors").string() << "', " << iters << "\n"
                             "t = load_file(src)\n"
                             "def save():\n"
                             "    save_file(t, dst)\n"
                             "    fd = os.open(dst, os.O_RDONLY); os.fsync(fd); os.close(fd)\n"
                             "def load():\n"
                             "    load_file(dst)\n"
                             "def best(fn):\n"
                             "    fn(); ts = []\n"
                             "    for _ in range(iters):\n"
                             "        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)\n"
                             "    return min(ts)\n"
                             "open('" << out.string() << "', 'w').write('%r %r' % (best(save), best(load)))\n";
    if (std::system(("python3 " + script.string()).c_str()) == 0) {
      std::ifstream in(out);
      in >> peer_save >> peer_load;
    }
  }

  // CRC32C: the hardware instruction path vs the portable table path.
  const auto& big = data[0];
  const std::size_t crc_bytes = big.size() * 4;
  volatile std::uint32_t keep = 0;
  auto [crc_hw, crc_hw_med] = bench::time_min_median([&] { keep = keep + crc32c(big.data(), crc_bytes); }, 1, iters);
  auto [crc_tab, crc_tab_med] = bench::time_min_median([&] { keep = keep + crc32c_portable(big.data(), crc_bytes); }, 1, iters);

  bench::JsonReport report("checkpoint");
  std::printf("# checkpoint I/O, %.1f MB in %zu tensors, best of %d, page cache; peer: Python safetensors%s\n",
              bytes / 1e6, specs.size(), iters, peer_save >= 0 ? "" : " (NOT AVAILABLE: pip install safetensors numpy)");
  std::printf("%-34s %10s %10s %12s %12s %8s\n", "operation", "trellis_s", "trellis_GB/s", "peer_s", "peer_GB/s", "speedup");
  auto row = [&](const char* op, double ours, double peer, double op_gb) {
    std::printf("%-34s %10.4f %10.2f", op, ours, op_gb / ours);
    if (peer > 0) std::printf(" %12.4f %12.2f %7.2fx\n", peer, op_gb / peer, peer / ours);
    else std::printf(" %12s %12s %8s\n", "-", "-", "-");
    bench::Row r;
    r.add_text("operation", op).add("gigabytes", op_gb, "%.4f").add("trellis_s", ours, "%.5f").add("trellis_GBps", op_gb / ours);
    if (peer > 0) r.add("peer_s", peer, "%.5f").add("peer_GBps", op_gb / peer).add("speedup", peer / ours);
    report.add(r);
  };
  row("save 1 file (+fsync)", save_s, peer_save, gb);
  row("load 1 file (+crc verify)", load_s, peer_load, gb);
  row("save 4 shards + index + commit", ssave_s, -1, gb);
  row("load whole from 4 shards", sload_s, -1, gb);
  row("crc32c sse4.2", crc_hw, -1, static_cast<double>(crc_bytes) / 1e9);
  row("crc32c table (portable)", crc_tab, -1, static_cast<double>(crc_bytes) / 1e9);
  report.write(bench::json_path(argc, argv));
  std::filesystem::remove_all(dir);
  return 0;
}
