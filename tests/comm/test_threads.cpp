// The thread backend against the conformance suite (1..8 ranks, odd counts included), plus
// what only shared memory can check directly: barrier ordering, determinism, oversubscription.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "comm/conformance.hpp"
#include "trellis/comm/threads.hpp"

using trellis::comm::ReduceOp;
using trellis::comm::ThreadComm;
using trellis::comm::ThreadWorld;
namespace conformance = trellis::comm::conformance;

static_assert(trellis::comm::Communicator<ThreadComm>);

TEST_CASE("thread backend passes the conformance suite on 1..8 ranks", "[comm][threads]") {
  for (int ranks = 1; ranks <= 8; ++ranks) {
    DYNAMIC_SECTION("ranks=" << ranks) {
      conformance::Options options;
      if (ranks > 4) options.large_count = (std::size_t{1} << 19) + 3;  // keep the run short
      std::mutex mutex;
      std::vector<std::string> failures;
      std::size_t checks = 0;
      ThreadWorld world(ranks);
      world.run([&](ThreadComm& comm) {
        conformance::Report report;
        conformance::run_all(comm, options, report);
        std::lock_guard lock(mutex);
        failures.insert(failures.end(), report.failures.begin(), report.failures.end());
        checks += report.checks;
      });
      INFO("checks: " << checks);
      for (std::size_t i = 0; i < failures.size() && i < 20; ++i) UNSCOPED_INFO(failures[i]);
      CHECK(failures.empty());
      CHECK(checks > 1000);
    }
  }
}

TEST_CASE("barrier: nobody leaves before everybody arrived", "[comm][threads]") {
  for (int ranks : {2, 3, 8}) {
    std::atomic<int> arrived{0};
    std::atomic<int> early{0};
    ThreadWorld(ranks).run([&](ThreadComm& comm) {
      for (int round = 1; round <= 50; ++round) {
        arrived.fetch_add(1);
        comm.barrier();
        if (arrived.load() < round * ranks) early.fetch_add(1);
        comm.barrier();
      }
    });
    CHECK(early.load() == 0);
    CHECK(arrived.load() == 50 * ranks);
  }
}

TEST_CASE("all_reduce is deterministic and equals the serial rank-order sum", "[comm][threads]") {
  const int ranks = 7;
  const std::size_t count = 300007;
  // Inputs are tabulated first: computing them inside the serial sum would let the compiler fuse
  // "value * 1e3f + acc" into an FMA (-march=native), which is not the sum being checked.
  std::vector<std::vector<float>> inputs(ranks, std::vector<float>(count));
  for (int r = 0; r < ranks; ++r) {
    for (std::size_t i = 0; i < count; ++i) {
      std::uint64_t h = (i * 0x9E3779B97F4A7C15ull) ^ (static_cast<std::uint64_t>(r + 1) * 0xBF58476D1CE4E5B9ull);
      h ^= h >> 29;
      inputs[r][i] = static_cast<float>(static_cast<double>(h % 2000001) / 1000000.0 - 1.0) * 1e3f;
    }
  }
  auto value = [&](int rank, std::size_t i) { return inputs[rank][i]; };
  auto run_once = [&] {
    std::vector<std::vector<float>> results(ranks);
    ThreadWorld(ranks).run([&](ThreadComm& comm) {
      std::vector<float> x(count);
      for (std::size_t i = 0; i < count; ++i) x[i] = value(comm.rank(), i);
      comm.all_reduce(x.data(), x.data(), count, ReduceOp::sum);
      results[comm.rank()] = std::move(x);
    });
    return results;
  };
  auto first = run_once();
  auto second = run_once();
  std::vector<float> serial(count);
  for (std::size_t i = 0; i < count; ++i) {
    float acc = value(0, i);
    for (int k = 1; k < ranks; ++k) acc += value(k, i);
    serial[i] = acc;
  }
  for (int r = 0; r < ranks; ++r) {
    std::size_t first_wrong = 0;
    while (first_wrong < count && first[r][first_wrong] == serial[first_wrong]) ++first_wrong;
    INFO("rank " << r << " first difference with the serial sum at " << first_wrong);
    CHECK(std::memcmp(first[r].data(), second[r].data(), count * sizeof(float)) == 0);
    CHECK(std::memcmp(first[r].data(), serial.data(), count * sizeof(float)) == 0);
  }
  // A different order would have given other bits for some elements: the test can fail.
  std::size_t differs = 0;
  for (std::size_t i = 0; i < count; ++i) {
    float reversed = value(ranks - 1, i);
    for (int k = ranks - 2; k >= 0; --k) reversed += value(k, i);
    differs += reversed != serial[i];
  }
  CHECK(differs > 0);
}

TEST_CASE("8 ranks on 2 cores stay fast (no starving spin)", "[comm][threads]") {
  const int ranks = 8, rounds = 2000;
  std::atomic<bool> wrong{false};
  auto start = std::chrono::steady_clock::now();
  ThreadWorld(ranks).run([&](ThreadComm& comm) {
    float x = 1.0f, y = 0.0f;
    for (int i = 0; i < rounds; ++i) {
      comm.all_reduce(&x, &y, 1, ReduceOp::sum);
      if (y != static_cast<float>(ranks)) wrong = true;
    }
  });
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO("2000 small all_reduce on 8 ranks: " << seconds << " s (" << seconds / rounds * 1e6 << " us each)");
  CHECK_FALSE(wrong.load());
  CHECK(seconds < 10.0);  // a spinning implementation takes minutes here
}

TEST_CASE("collectives on split communicators run concurrently and independently", "[comm][threads]") {
  std::atomic<int> wrong{0};
  ThreadWorld(6).run([&](ThreadComm& comm) {
    auto rows = comm.split(comm.rank() / 3, comm.rank());  // {0,1,2} {3,4,5}
    auto cols = comm.split(comm.rank() % 3, comm.rank());  // {0,3} {1,4} {2,5}
    for (int i = 0; i < 200; ++i) {
      int v = comm.rank() + i, row_sum = 0, col_sum = 0;
      rows.all_reduce(&v, &row_sum, 1, ReduceOp::sum);
      cols.all_reduce(&v, &col_sum, 1, ReduceOp::sum);
      const int row = comm.rank() / 3, col = comm.rank() % 3;
      if (row_sum != 3 * row + 3 * row + 1 + 3 * row + 2 + 3 * i) ++wrong;
      if (col_sum != col + col + 3 + 2 * i) ++wrong;
    }
  });
  CHECK(wrong.load() == 0);
}
