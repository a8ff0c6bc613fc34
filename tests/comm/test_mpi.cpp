// MpiComm under mpiexec (3 and 4 ranks): the shared conformance suite (tests/comm/conformance.hpp:
// every op, dtype and reduce op against a serial reference) in each execution mode; split labels,
// MpiWorld; then the safety layer: debug-mode mismatch, a missing rank with a short
// timeout (debug mode names it; without, the call and the timeout are named), invalid roots and
// peers, short receives. Every error test ends with all ranks back in step (world barrier).
#include <catch2/catch.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/conformance.hpp"
#include "trellis/comm/mpi.hpp"

using trellis::comm::MpiComm;
using trellis::comm::ReduceOp;
using namespace std::chrono_literals;
namespace conformance = trellis::comm::conformance;

static_assert(trellis::comm::Communicator<MpiComm>);


// The shared conformance suite (every op, dtype, reduce op, in place, sizes 0..MiB, p2p, async,
// split) in the three ways MpiComm runs: nonblocking + test loop (a timeout set, the default),
// MPI's blocking calls (timeout off), and debug mode (fingerprints exchanged before each call).
TEST_CASE("MpiComm passes the conformance suite", "[mpi][conformance]") {
  struct Mode {
    const char* name;
    std::chrono::milliseconds timeout;
    bool debug;
  };
  for (Mode mode : {Mode{"nonblocking with timeout", 60s, false}, Mode{"blocking MPI calls (timeout off)", 0ms, false},
                    Mode{"debug fingerprints", 60s, true}}) {
    DYNAMIC_SECTION(mode.name) {
      MpiComm comm(MPI_COMM_WORLD, "conformance");
      comm.set_timeout(mode.timeout);
      comm.set_debug(mode.debug);
      conformance::Options options;
      options.fixed_order = false;  // MPI picks its own reduction order
      if (mode.debug || mode.timeout.count() == 0) options.large_count = (std::size_t{1} << 16) + 3;
      conformance::Report report;
      conformance::run_all(comm, options, report);
      INFO(report.summary());
      CHECK(report.failures.empty());
      CHECK(report.checks > 1000);
    }
  }
}

TEST_CASE("MpiComm split orders by key and reduces within the group", "[mpi]") {
  MpiComm comm(MPI_COMM_WORLD, "test");
  const int rank = comm.rank(), size = comm.size();
  // Two colors (even/odd), keys reversing the order.
  MpiComm sub = comm.split(rank % 2, -rank);
  std::vector<int> members;
  for (int r = 0; r < size; ++r)
    if (r % 2 == rank % 2) members.push_back(r);
  REQUIRE(sub.size() == static_cast<int>(members.size()));
  const int expected_rank = static_cast<int>(members.size()) - 1 -
                            static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  REQUIRE(sub.rank() == expected_rank);
  REQUIRE(sub.label() == "test/split(" + std::to_string(rank % 2) + ")");
  std::int64_t mine = rank, sum = 0, want = 0;
  for (int m : members) want += m;
  sub.all_reduce(&mine, &sum, 1, ReduceOp::sum);
  REQUIRE(sum == want);
  // The parent is still usable, and split again from the child works.
  MpiComm single = sub.split(sub.rank(), 0);
  REQUIRE(single.size() == 1);
  float x = 3.5f, y = 0;
  single.all_reduce(&x, &y, 1, ReduceOp::avg);
  REQUIRE(y == 3.5f);
  comm.barrier();
}

TEST_CASE("MpiRequest: destruction waits, moves transfer, finished requests stay finished", "[mpi]") {
  MpiComm comm(MPI_COMM_WORLD, "requests");
  const int size = comm.size();
  std::vector<trellis::half> in(513, trellis::half(1.5f)), out(513);
  {
    auto dropped = comm.all_reduce_async(in.data(), out.data(), in.size(), ReduceOp::avg);
    REQUIRE(dropped.pending());
  }  // destroyed unwaited: completes (and narrows) before the buffers go away
  for (const auto& v : out) REQUIRE(static_cast<float>(v) == 1.5f);
  std::vector<double> a(64, 2.0), b(64 * static_cast<std::size_t>(size));
  trellis::comm::MpiRequest moved;
  REQUIRE_FALSE(moved.pending());
  moved = comm.all_gather_async(a.data(), b.data(), a.size());
  trellis::comm::MpiRequest other = std::move(moved);
  REQUIRE_FALSE(moved.pending());
  other.wait();
  REQUIRE_FALSE(other.pending());
  REQUIRE(other.test());
  other.wait();
  for (double v : b) REQUIRE(v == 2.0);
  REQUIRE(comm.recorder().last()->state == trellis::comm::FlightRecorder::State::completed);
}

TEST_CASE("MpiWorld run gives the world communicator with the rank set", "[mpi]") {
  trellis::comm::MpiWorld world;  // MPI already initialised by the test main: does not own it
  REQUIRE_FALSE(world.owns_mpi());
  REQUIRE(world.thread_level() == MPI_THREAD_MULTIPLE);
  int seen = world.run([&](MpiComm& comm) {
    REQUIRE(trellis::current_rank() == world.rank());
    REQUIRE(comm.size() == world.size());
    int one = 1, count = 0;
    comm.all_reduce(&one, &count, 1, ReduceOp::sum);
    return count;
  });
  REQUIRE(seen == world.size());
  REQUIRE(trellis::current_rank() == -1);
}

// ---- the safety layer ---------------------------------------------------------------------------

TEST_CASE("debug mode: a mismatched collective raises on every rank naming the odd rank", "[mpi][errors]") {
  MpiComm comm(MPI_COMM_WORLD, "debug");
  comm.set_debug(true);
  comm.set_timeout(20s);
  const int rank = comm.rank(), size = comm.size();
  const int odd = size - 1;
  std::vector<float> a(8, 1.0f), b(8 * static_cast<std::size_t>(size));
  comm.all_reduce(a.data(), b.data(), 8, ReduceOp::sum);  // agreeing calls pass
  REQUIRE(b[0] == static_cast<float>(size));
  try {
    if (rank == odd) {
      comm.all_gather(a.data(), b.data(), 8);
    } else {
      comm.all_reduce(a.data(), b.data(), 8, ReduceOp::sum);
    }
    FAIL("mismatch not detected");
  } catch (const trellis::Error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.rank() == -1);  // outside MpiWorld::run: no RankScope
    CHECK(what.find("collective mismatch: rank " + std::to_string(odd) + " called #1 all_gather(float, count=8)") != std::string::npos);
    CHECK(what.find("all_reduce(float, count=8, op=sum)") != std::string::npos);
  }
  // Count mismatch, with the rank named through RankScope.
  trellis::RankScope scope(rank);
  try {
    comm.broadcast(a.data(), rank == 0 ? 4 : 8, 0);
    FAIL("mismatch not detected");
  } catch (const trellis::Error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.rank() == rank);
    CHECK(what.find("[rank " + std::to_string(rank) + "]") != std::string::npos);
    CHECK(what.find("rank 0 called #2 broadcast(float, count=4, root=0)") != std::string::npos);
  }
  // The communicator is still in step after a detected mismatch.
  comm.all_reduce(a.data(), b.data(), 8, ReduceOp::max);
  REQUIRE(b[0] == 1.0f);
}

TEST_CASE("debug mode: disagreeing all_to_allv counts raise on every rank naming both sides", "[mpi][errors]") {
  MpiComm comm(MPI_COMM_WORLD, "a2av");
  comm.set_debug(true);
  comm.set_timeout(20s);
  const int rank = comm.rank(), size = comm.size();
  const auto n = static_cast<std::size_t>(size);
  // Everyone sends 2 elements to everyone, except that rank 0 sends 3 to rank 1.
  std::vector<std::size_t> sc(n, 2), sd(n), rc(n, 2), rd(n);
  if (rank == 0) sc[1] = 3;
  for (std::size_t j = 0; j < n; ++j) sd[j] = 3 * j, rd[j] = 3 * j;
  std::vector<float> in(3 * n, 1.0f), out(3 * n, 0.0f);
  const std::span<const std::size_t> s_c(sc), s_d(sd), r_c(rc), r_d(rd);
  CHECK_THROWS_WITH(comm.all_to_allv(in.data(), s_c, s_d, out.data(), r_c, r_d),
                    Catch::Contains("send and receive counts disagree: rank 1 expects 2 elements from rank 0, which sends 3"));
  // Nothing was exchanged; with agreeing counts the call goes through.
  if (rank == 0) sc[1] = 2;
  comm.all_to_allv(in.data(), s_c, s_d, out.data(), r_c, r_d);
  for (std::size_t j = 0; j < n; ++j) {
    CHECK(out[3 * j] == 1.0f);
    CHECK(out[3 * j + 2] == 0.0f);  // gaps untouched
  }
}

TEST_CASE("debug mode: a rank that never arrives is named within the timeout", "[mpi][errors]") {
  MpiComm comm(MPI_COMM_WORLD, "missing");
  comm.set_debug(true);
  comm.set_timeout(300ms);
  const int rank = comm.rank(), size = comm.size();
  const int missing = 1;
  std::vector<double> a(16, 2.0), b(16);
  if (rank != missing) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      comm.all_reduce(a.data(), b.data(), 16, ReduceOp::sum);
      FAIL("missing rank not detected");
    } catch (const trellis::Error& e) {
      const auto elapsed = std::chrono::steady_clock::now() - t0;
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("#0 all_reduce(double, count=16, op=sum) timed out after 300 ms") != std::string::npos);
      CHECK(what.find("rank " + std::to_string(missing) + " did not arrive") != std::string::npos);
      CHECK(elapsed >= 300ms);
      CHECK(elapsed < 10s);
    }
    // Unusable afterwards, and says why.
    try {
      comm.barrier();
      FAIL("poisoned communicator still usable");
    } catch (const trellis::Error& e) {
      CHECK(std::string(e.what()).find("unusable after an earlier failure") != std::string::npos);
    }
  }
  (void)size;
  MPI_Barrier(MPI_COMM_WORLD);  // all ranks in step again

  // In a sub-communicator the error gives the world rank too.
  MpiComm parent(MPI_COMM_WORLD, "parent");
  MpiComm sub = parent.split(rank % 2, -rank);  // reversed order: sub rank 1 is not world rank 1
  sub.set_debug(true);
  sub.set_timeout(300ms);
  if (sub.size() >= 2 && sub.rank() != 1) {
    int world_of_sub_rank_1 = -1;
    for (int r = size - 1, seen = 0; r >= 0; --r)
      if (r % 2 == rank % 2 && seen++ == 1) world_of_sub_rank_1 = r;
    int x = 1, y = 0;
    CHECK_THROWS_WITH(sub.all_reduce(&x, &y, 1, ReduceOp::sum),
                      Catch::Contains("rank 1 (world rank " + std::to_string(world_of_sub_rank_1) + ") did not arrive"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("without debug mode a missing rank times out naming the call and the rank; a late rank completes it",
          "[mpi][errors]") {
  MpiComm comm(MPI_COMM_WORLD, "late");
  comm.set_debug(false);
  const int rank = comm.rank();
  const int late = comm.size() - 1;
  std::vector<std::int32_t> a(4, 1), b(4, 0);
  if (rank != late) {
    // 800 ms: the arrival query's grace period (timeout/4 = 200 ms) must cover a loaded CI machine.
    comm.set_timeout(800ms);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      comm.all_reduce(a.data(), b.data(), 4, ReduceOp::sum);
      FAIL("missing rank not detected");
    } catch (const trellis::Error& e) {
      const auto elapsed = std::chrono::steady_clock::now() - t0;
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("#0 all_reduce(int32, count=4, op=sum) timed out after 800 ms") != std::string::npos);
      // The late rank sits in MPI_Barrier (not in a collective of this communicator): named.
      CHECK(what.find("rank " + std::to_string(late) + " did not arrive (no answer to an arrival query") !=
            std::string::npos);
      for (int r = 0; r < late; ++r) CHECK(what.find("rank " + std::to_string(r) + " did not") == std::string::npos);
      CHECK(what.find("flight recorder of communicator 'late'") != std::string::npos);
      CHECK(elapsed >= 800ms);
      CHECK(elapsed < 10s);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    comm.set_timeout(30s);
    MPI_Barrier(MPI_COMM_WORLD);
    // Joins late: the others' abandoned operation completes with this one.
    comm.all_reduce(a.data(), b.data(), 4, ReduceOp::sum);
    CHECK(b[0] == comm.size());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("invalid roots, peers and short receives raise Error naming the problem", "[mpi][errors]") {
  MpiComm comm(MPI_COMM_WORLD, "args");
  comm.set_timeout(20s);
  const int rank = comm.rank(), size = comm.size();
  trellis::RankScope scope(rank);
  float x[8] = {};
  CHECK_THROWS_WITH(comm.broadcast(x, 8, size), Catch::Contains("broadcast: root " + std::to_string(size) + " is not a rank") &&
                                                    Catch::Contains("[rank " + std::to_string(rank) + "]"));
  CHECK_THROWS_WITH(comm.reduce(x, x, 8, ReduceOp::sum, -1), Catch::Contains("reduce: root -1 is not a rank"));
  CHECK_THROWS_WITH(comm.send(x, 8, size, 0), Catch::Contains("send: peer " + std::to_string(size) + " is not a rank"));
  CHECK_THROWS_WITH(comm.irecv(x, 8, -2, 0), Catch::Contains("recv: peer -2 is not a rank"));
  CHECK_THROWS_WITH(comm.isend(x, 8, 0, -5), Catch::Contains("tag -5 is negative"));
  // A receive expecting more than the message holds: the receiver names the peer and both counts.
  if (rank == 0) {
    comm.send(x, 5, 1, 9);
  } else if (rank == 1) {
    CHECK_THROWS_WITH(comm.recv(x, 6, 0, 9), Catch::Contains("recv from rank 0: expected 6 float elements, the message held 5"));
  }
  // A message longer than the receive buffer: MPI's truncation error, with the call named.
  if (rank == 0) {
    comm.send(x, 5, 1, 10);
  } else if (rank == 1) {
    CHECK_THROWS_WITH(comm.recv(x, 4, 0, 10), Catch::Contains("recv(float, count=4, peer=0) failed on rank 1") &&
                                                  Catch::Contains("MPI_ERR_TRUNCATE"));
  }
  // Still usable (argument errors are raised before any MPI call).
  int one = 1, total = 0;
  comm.all_reduce(&one, &total, 1, ReduceOp::sum);
  REQUIRE(total == size);
}
