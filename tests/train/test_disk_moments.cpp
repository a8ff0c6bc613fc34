// The optimizer disk tier's stream (train/disk_moments.hpp, DiskMoments::stream) at several
// read-ahead depths D (TrainerConfig::offload_disk_readahead):
//  - the same moments at every depth: two streams over chunks of four tensors (chunks of at most
//    200 elements, ten in all), each chunk's update a function of the moments it read, against
//    the same updates on arrays in memory, bitwise, for D = 0 (synchronous), 1, 2, 4 and 12 (more
//    than the chunks); the host buffers are D + 1 chunks of m and v (one synchronous);
//  - the read-ahead, measured on a SIMULATED slow disk (the probe sleeps 20 ms before each read):
//    eight chunks, the first chunk's update takes 250 ms and the others none. Reading D chunks
//    ahead, reads 1 .. D are submitted before update 0 starts and run on the I/O thread while it
//    does, so exactly min(D, 7) reads end inside update 0's interval (read D + 1 is queued only
//    after update 0); synchronous reads run on the updating thread between updates: none do. The
//    intervals are timed (steady_clock) by the probe and the update, not counted by the stream.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "temp_dir.hpp"
#include "trellis/train/disk_moments.hpp"

namespace {

using trellis::index_t;
using trellis::train::DiskChunk;
using trellis::train::DiskEvent;
using trellis::train::DiskMoments;

// Each tensor cut into chunks of at most `cap` elements.
std::vector<DiskChunk> chunks_of(const std::vector<index_t>& sizes, std::size_t cap) {
  std::vector<DiskChunk> out;
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t at = 0; at < static_cast<std::size_t>(sizes[t]); at += cap)
      out.push_back({t, at, std::min(cap, static_cast<std::size_t>(sizes[t]) - at), 1});
  return out;
}

// The update both sides run: new moments from the old ones, the pass and the element.
void update(float* m, float* v, std::size_t n, std::size_t first, int pass) {
  for (std::size_t i = 0; i < n; ++i) {
    const float g = static_cast<float>((first + i) % 97) * 0.01f + static_cast<float>(pass);
    m[i] = 0.9f * m[i] + 0.1f * g;
    v[i] = 0.99f * v[i] + 0.01f * g * g;
  }
}

double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("disk tier: the same moments at every read-ahead depth, in (D + 1) chunks of buffers",
          "[train][offload][disk][readahead]") {
  TempDir dir("disk-readahead");
  const std::vector<index_t> sizes{1000, 37, 500, 3};
  const auto chunks = chunks_of(sizes, 200);
  REQUIRE(chunks.size() == 10);
  std::size_t total = 0;
  for (index_t n : sizes) total += static_cast<std::size_t>(n);
  // the reference: the same updates on arrays in memory (m then v, the file's order)
  std::vector<float> ref_m(total, 0.0f), ref_v(total, 0.0f);
  for (int pass = 0; pass < 2; ++pass)
    for (const DiskChunk& c : chunks) {
      std::size_t first = c.at;
      for (std::size_t t = 0; t < c.tensor; ++t) first += static_cast<std::size_t>(sizes[t]);
      update(ref_m.data() + first, ref_v.data() + first, c.n, first, pass);
    }
  for (std::size_t depth : {0u, 1u, 2u, 4u, 12u}) {
    INFO("read-ahead " << depth);
    DiskMoments disk(dir.path, sizes, 0);
    for (int pass = 0; pass < 2; ++pass)
      disk.stream(chunks, depth, [&](std::size_t j, float* m, float* v) {
        update(m, v, chunks[j].n, disk.offset(chunks[j].tensor) + chunks[j].at, pass);
      });
    std::vector<float> m(total), v(total);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      disk.read(t, true, 0, disk.size(t), m.data() + disk.offset(t));
      disk.read(t, false, 0, disk.size(t), v.data() + disk.offset(t));
    }
    CHECK(m == ref_m);
    CHECK(v == ref_v);
    CHECK(disk.buffer_bytes() == (depth + 1) * 2 * 200 * sizeof(float));
  }
}

TEST_CASE("disk tier: D chunks are read while a chunk updates (a simulated slow disk)",
          "[train][offload][disk][readahead][overlap]") {
  TempDir dir("disk-readahead-overlap");
  const std::vector<index_t> sizes{800};
  const auto chunks = chunks_of(sizes, 100);
  REQUIRE(chunks.size() == 8);
  const auto read_time = std::chrono::milliseconds(20), first_update = std::chrono::milliseconds(250);
  for (std::size_t depth : {0u, 1u, 2u, 4u}) {
    INFO("read-ahead " << depth);
    DiskMoments disk(dir.path, sizes, 0);
    std::mutex mutex;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::pair<double, double>> reads;  // each read's interval (s since t0), in order
    double update0_start = 0, update0_end = 0;
    disk.set_probe([&](const DiskEvent& e) {
      if (e.kind != DiskEvent::Kind::read) return 0;
      const double s = seconds(t0);
      std::this_thread::sleep_for(read_time);  // the SIMULATED slow read
      std::lock_guard lock(mutex);
      reads.emplace_back(s, seconds(t0));
      return 0;
    });
    disk.stream(chunks, depth, [&](std::size_t j, float* m, float*) {
      if (j != 0) return;
      {
        std::lock_guard lock(mutex);
        update0_start = seconds(t0);
      }
      std::this_thread::sleep_for(first_update);
      m[0] += 1.0f;
      std::lock_guard lock(mutex);
      update0_end = seconds(t0);
    });
    const double elapsed = seconds(t0);
    std::lock_guard lock(mutex);
    REQUIRE(reads.size() == chunks.size());
    int ended_inside = 0;
    double read_total = 0, read_inside = 0;
    for (auto [s, e] : reads) {
      ended_inside += e > update0_start && e < update0_end;
      read_total += e - s;
      read_inside += std::max(0.0, std::min(e, update0_end) - std::max(s, update0_start));
    }
    std::printf("disk read-ahead %zu: %d reads ended inside the first update, %.0f of %.0f ms of (simulated) reads "
                "inside it, stream %.0f ms\n",
                depth, ended_inside, read_inside * 1e3, read_total * 1e3, elapsed * 1e3);
    CHECK(ended_inside == static_cast<int>(std::min<std::size_t>(depth, chunks.size() - 1)));
  }
}
