// Shared by comm_bench (thread ranks) and comm_bench_mpi (OpenMPI): command line, nccl-tests
// size conventions and bus-bandwidth factors, table rows, single-thread memcpy bandwidth and the
// ideal-traffic reference.
#pragma once

#include <algorithm>
#include <barrier>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "support/report.hpp"

namespace trellis::bench::comm {

// nccl-tests conventions: `bytes` is the size of the whole message (all_reduce: the buffer;
// all_gather: the gathered output; reduce_scatter: the input; all_to_all: one rank's buffer).
struct OpInfo {
  const char* name;
  double bus_factor(int n) const {
    if (std::strcmp(name, "all_reduce") == 0) return 2.0 * (n - 1) / n;
    if (std::strcmp(name, "broadcast") == 0) return 1.0;
    return static_cast<double>(n - 1) / n;  // all_gather, reduce_scatter, all_to_all
  }
  // Elements per rank-block for a message of `bytes` (all_reduce/broadcast: the whole message).
  std::size_t count(std::size_t bytes, std::size_t elem, int n) const {
    if (std::strcmp(name, "all_reduce") == 0 || std::strcmp(name, "broadcast") == 0) return bytes / elem;
    return bytes / elem / static_cast<std::size_t>(n);
  }
};

inline std::vector<std::string> parse_list(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    if (comma > start) out.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// "16M" -> 16777216, "8K" -> 8192, "100" -> 100.
inline std::size_t parse_size(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::size_t mult = 1;
  if (end && *end) {
    switch (*end) {
      case 'K': case 'k': mult = std::size_t{1} << 10; break;
      case 'M': case 'm': mult = std::size_t{1} << 20; break;
      case 'G': case 'g': mult = std::size_t{1} << 30; break;
      default: break;
    }
  }
  return static_cast<std::size_t>(v * static_cast<double>(mult));
}

using trellis::bench::flag_value;

struct Settings {
  std::vector<std::size_t> sizes;
  std::vector<std::string> ops;
  int warmup = 3;
  int min_iters = 5;
  int trials = 1;  // timed blocks of iterations; rows give the fastest block and the mean of all
  double bytes_per_trial = 1.0 * (1 << 30);  // iterations so that each size moves about 1 GiB
  std::string json;

  static Settings parse(int argc, char** argv, const char* default_ops) {
    Settings s;
    for (auto& v : parse_list(flag_value(argc, argv, "--sizes", "8K,64K,1M,16M,64M"))) s.sizes.push_back(parse_size(v));
    s.ops = parse_list(flag_value(argc, argv, "--op", default_ops));
    s.warmup = std::atoi(flag_value(argc, argv, "--warmup", "3").c_str());
    s.min_iters = std::atoi(flag_value(argc, argv, "--iters", "5").c_str());
    s.trials = std::max(1, std::atoi(flag_value(argc, argv, "--trials", "1").c_str()));
    s.json = json_path(argc, argv);
    return s;
  }
  int iterations(std::size_t bytes) const {
    const double want = bytes_per_trial / trials / static_cast<double>(std::max<std::size_t>(bytes, 1));
    return std::clamp(static_cast<int>(want), min_iters, 2000);
  }
};

inline void print_header(const char* backend, int ranks) {
  std::printf("# %s, %d ranks\n", backend, ranks);
  std::printf("# %-15s %12s %12s %7s %6s | %11s %11s %11s %7s | %11s\n", "op", "size(B)", "count", "type", "redop",
              "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "busbw(mean)");
  std::printf("# time/algbw/busbw: fastest timed block (--trials); busbw(mean): all timed iterations\n");
}

inline Row print_row(const char* backend, const char* op, int ranks, std::size_t bytes, std::size_t count,
                     const char* type, const char* redop, double seconds, double bus_factor, long long wrong,
                     double mean_seconds = -1.0) {
  if (mean_seconds <= 0) mean_seconds = seconds;
  const double algbw = static_cast<double>(bytes) / seconds / 1e9;
  const double busbw = algbw * bus_factor;
  const double busbw_mean = static_cast<double>(bytes) / mean_seconds / 1e9 * bus_factor;
  std::printf("  %-15s %12zu %12zu %7s %6s | %11.1f %11.2f %11.2f %7lld | %11.2f\n", op, bytes, count, type, redop,
              seconds * 1e6, algbw, busbw, wrong, busbw_mean);
  std::fflush(stdout);
  Row row;
  row.add_text("backend", backend).add_text("op", op).add("ranks", static_cast<long long>(ranks))
      .add("bytes", static_cast<long long>(bytes)).add("count", static_cast<long long>(count)).add_text("type", type)
      .add_text("redop", redop).add("time_us", seconds * 1e6).add("algbw", algbw).add("busbw", busbw)
      .add("wrong", wrong).add("time_us_mean", mean_seconds * 1e6).add("busbw_mean", busbw_mean);
  return row;
}

// Single-thread memcpy bandwidth (bytes copied per second) for buffers of `bytes`, warm, timed
// like the collectives: {fastest block of iterations, mean of all}.
inline std::pair<double, double> memcpy_bandwidth(std::size_t bytes, int iters, int trials) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (int i = 0; i < 2; ++i) std::memcpy(b.data(), a.data(), bytes);
  double best = 1e30, total = 0;
  for (int t = 0; t < trials; ++t) {
    const double t0 = now_seconds();
    for (int i = 0; i < iters; ++i) std::memcpy(b.data(), a.data(), bytes);
    const double block = (now_seconds() - t0) / iters;
    best = std::min(best, block);
    total += block;
  }
  if (b[bytes / 2] != 1) std::printf("memcpy check failed\n");
  return {static_cast<double>(bytes) / best / 1e9, static_cast<double>(bytes) / (total / trials) / 1e9};
}

// The op's memory traffic and nothing else, as a reference for what this machine allows: every
// hardware thread takes a contiguous share of `stream_bytes`, and for each 64-byte line sums it
// over `reads` input streams and stores the sum into `writes` output streams (streaming stores),
// with no synchronisation between the threads. A shared-memory collective must read every input
// and write every output at least once, so it cannot beat this by much: all_gather is 1 read
// stream of `size` and `ranks` write streams; reduce_scatter `ranks` reads and 1 write; all_reduce
// `ranks` of each (the thread backend's own traffic, see comm/threads.hpp). Returns the fastest
// block's seconds per call, timed like the collectives.
inline double ideal_traffic_seconds(int reads, int writes, std::size_t stream_bytes, int iters, int trials) {
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::size_t floats = std::max<std::size_t>(stream_bytes / sizeof(float) / 64 * 64, 64);
  std::vector<float*> in(static_cast<std::size_t>(reads)), out(static_cast<std::size_t>(writes));
  for (auto& p : in) {
    p = static_cast<float*>(std::aligned_alloc(64, floats * sizeof(float)));
    std::fill(p, p + floats, 1.0f);
  }
  for (auto& p : out) {
    p = static_cast<float*>(std::aligned_alloc(64, floats * sizeof(float)));
    std::fill(p, p + floats, 0.0f);
  }
  auto lines = [&](std::size_t lo, std::size_t hi) {
    const float* const* src = in.data();
    float* const* dst = out.data();
    for (std::size_t i = lo; i < hi; i += 16) {
#if defined(__AVX512F__)
      __m512 sum = _mm512_load_ps(src[0] + i);
      for (int k = 1; k < reads; ++k) sum = _mm512_add_ps(sum, _mm512_load_ps(src[k] + i));
      for (int o = 0; o < writes; ++o) _mm512_stream_ps(dst[o] + i, sum);
#else
      alignas(64) float sum[16];
      for (int j = 0; j < 16; ++j) sum[j] = src[0][i + j];
      for (int k = 1; k < reads; ++k)
        for (int j = 0; j < 16; ++j) sum[j] += src[k][i + j];
      for (int o = 0; o < writes; ++o) {
#if defined(__AVX__)
        _mm256_stream_ps(dst[o] + i, _mm256_load_ps(sum));
        _mm256_stream_ps(dst[o] + i + 8, _mm256_load_ps(sum + 8));
#elif defined(__SSE2__)
        for (int j = 0; j < 16; j += 4) _mm_stream_ps(dst[o] + i + j, _mm_load_ps(sum + j));
#else
        std::memcpy(dst[o] + i, sum, sizeof sum);
#endif
      }
#endif
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
  };
  double best = 1e30;
  std::barrier sync(threads);
  auto body = [&](int t) {
    const std::size_t lo = floats / 16 * t / threads * 16, hi = floats / 16 * (t + 1) / threads * 16;
    for (int trial = -1; trial < trials; ++trial) {  // trial -1: warm-up
      sync.arrive_and_wait();
      const double t0 = now_seconds();
      for (int i = 0; i < iters; ++i) lines(lo, hi);
      sync.arrive_and_wait();
      if (t == 0 && trial >= 0) best = std::min(best, (now_seconds() - t0) / iters);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
  if (out[0][floats / 2] != static_cast<float>(reads)) std::printf("ideal traffic check failed\n");
  for (auto* p : in) std::free(p);
  for (auto* p : out) std::free(p);
  return best;
}

// Read and write streams of the thread backend's op (see ideal_traffic_seconds), and the bytes of
// each stream, for an op of nccl-tests size `bytes` on `ranks` ranks; {0, 0, 0} for other ops.
struct Traffic {
  int reads = 0, writes = 0;
  std::size_t stream_bytes = 0;
};
inline Traffic op_traffic(const std::string& op, std::size_t bytes, int ranks) {
  if (op == "all_gather") return {1, ranks, bytes};
  if (op == "reduce_scatter") return {ranks, 1, bytes};
  if (op == "all_reduce") return {ranks, ranks, bytes};
  return {};
}

// Elements of `out` (out_count of them, on rank r of n) that differ from the closed form the
// benchmarks' inputs produce (rank q sends q + 1 + (global index % 7); reductions are sums).
inline long long count_wrong(const std::string& op, const float* out, std::size_t out_count, std::size_t count,
                             int r, int n) {
  const float rank_sum = static_cast<float>(n * (n + 1) / 2);
  if (op == "broadcast" && r == 0) return 0;  // the root's own buffer is the source
  long long bad = 0;
  for (std::size_t i = 0; i < out_count; ++i) {
    float expected;
    if (op == "all_reduce") expected = rank_sum + static_cast<float>(n * static_cast<int>(i % 7));
    else if (op == "reduce_scatter") expected = rank_sum + static_cast<float>(n * static_cast<int>((r * count + i) % 7));
    else if (op == "all_gather") expected = static_cast<float>(static_cast<int>(i / count) + 1 + static_cast<int>((i % count) % 7));
    else if (op == "all_to_all") expected = static_cast<float>(static_cast<int>(i / count) + 1 + static_cast<int>((r * count + i % count) % 7));
    else expected = static_cast<float>(1 + static_cast<int>(i % 7));
    bad += out[i] != expected;
  }
  return bad;
}

}  // namespace trellis::bench::comm
