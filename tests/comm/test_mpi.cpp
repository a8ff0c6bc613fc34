// MpiComm under mpiexec (3 and 4 ranks): every collective, dtype and reduce op against a serial
// reference computed from every rank's (deterministic) input; point-to-point, batches, async
// handles and split; then the safety layer: debug-mode mismatch, a missing rank with a short
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

#include "trellis/comm/mpi.hpp"

using trellis::bfloat16;
using trellis::half;
using trellis::comm::MpiComm;
using trellis::comm::P2POp;
using trellis::comm::ReduceOp;
using namespace std::chrono_literals;

namespace {

// Small integers, exact in every type (half and bfloat16 too), so sums and products of up to 4
// ranks are exact and the reference must match bit for bit. Signed types get negatives too.
template <class T>
T input_value(int rank, std::size_t i, ReduceOp op) {
  int v;
  if (op == ReduceOp::prod) {
    v = static_cast<int>((static_cast<std::size_t>(rank) + i) % 3);  // 0, 1, 2
    if constexpr (std::is_signed_v<T> || std::is_floating_point_v<T> || std::is_same_v<T, half> ||
                  std::is_same_v<T, bfloat16>)
      v -= 1;  // -1, 0, 1
    else
      v += 1;  // 1, 2, 3
  } else {
    v = static_cast<int>((static_cast<std::size_t>(rank) * 7 + i * 3) % 11);  // 0..10
    if constexpr (!std::is_unsigned_v<T>) v -= 5;                              // -5..5
  }
  return static_cast<T>(static_cast<float>(v));
}

// The serial reference: reduces every rank's input in rank order in the accumulation type, then
// (avg) divides by size and converts once.
template <class T>
std::vector<T> reference(int size, std::size_t n, ReduceOp op, std::size_t offset = 0) {
  using A = trellis::accumulate_t<T>;
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    A acc = static_cast<A>(input_value<T>(0, offset + i, op));
    for (int r = 1; r < size; ++r) {
      A x = static_cast<A>(input_value<T>(r, offset + i, op));
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc = static_cast<A>(acc + x); break;
        case ReduceOp::prod: acc = static_cast<A>(acc * x); break;
        case ReduceOp::min: acc = x < acc ? x : acc; break;
        case ReduceOp::max: acc = x > acc ? x : acc; break;
      }
    }
    if (op == ReduceOp::avg) acc = static_cast<A>(acc / static_cast<A>(size));
    out[i] = static_cast<T>(acc);
  }
  return out;
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
void require_equal(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!same_bits(got[i], want[i])) {
      FAIL(what << ": element " << i << " got " << static_cast<double>(static_cast<trellis::accumulate_t<T>>(got[i]))
                << " want " << static_cast<double>(static_cast<trellis::accumulate_t<T>>(want[i])));
    }
  }
}

constexpr ReduceOp all_ops[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod};

}  // namespace

TEMPLATE_TEST_CASE("MpiComm reductions match the serial reference", "[mpi]", float, double, half,
                   bfloat16, std::int8_t, std::uint8_t, std::int32_t, std::uint32_t, std::int64_t,
                   std::uint64_t) {
  using T = TestType;
  MpiComm comm(MPI_COMM_WORLD, "test");
  const int rank = comm.rank(), size = comm.size();
  const std::size_t n = 37;
  for (ReduceOp op : all_ops) {
    INFO("op " << trellis::comm::reduce_op_name(op));
    std::vector<T> in(n), out(n);
    for (std::size_t i = 0; i < n; ++i) in[i] = input_value<T>(rank, i, op);
    const auto want = reference<T>(size, n, op);

    comm.all_reduce(in.data(), out.data(), n, op);
    require_equal(out, want, "all_reduce");

    std::vector<T> inplace = in;
    comm.all_reduce(inplace.data(), inplace.data(), n, op);
    require_equal(inplace, want, "all_reduce in place");

    std::vector<T> async_out(n);
    auto request = comm.all_reduce_async(in.data(), async_out.data(), n, op);
    request.wait();
    require_equal(async_out, want, "all_reduce_async");

    for (int root = 0; root < size; ++root) {
      std::vector<T> rout(n, T{});
      comm.reduce(in.data(), rout.data(), n, op, root);
      if (rank == root) require_equal(rout, want, "reduce");
    }

    // reduce_scatter: rank r gets block r of the reduction of size*n elements.
    std::vector<T> full(n * static_cast<std::size_t>(size)), block(n);
    for (std::size_t i = 0; i < full.size(); ++i) full[i] = input_value<T>(rank, i, op);
    const auto want_block = reference<T>(size, n, op, n * static_cast<std::size_t>(rank));
    comm.reduce_scatter(full.data(), block.data(), n, op);
    require_equal(block, want_block, "reduce_scatter");
    std::vector<T> block_async(n);
    auto rs = comm.reduce_scatter_async(full.data(), block_async.data(), n, op);
    while (!rs.test()) std::this_thread::yield();
    require_equal(block_async, want_block, "reduce_scatter_async (test loop)");
  }
}

TEMPLATE_TEST_CASE("MpiComm data movement matches the serial reference", "[mpi]", float, half,
                   bfloat16, std::int8_t, std::uint64_t) {
  using T = TestType;
  MpiComm comm(MPI_COMM_WORLD, "test");
  const int rank = comm.rank(), size = comm.size();
  const auto us = static_cast<std::size_t>(size);
  const std::size_t n = 23;
  auto value = [](int r, std::size_t i) { return static_cast<T>(static_cast<float>((r * 13 + static_cast<int>(i)) % 50)); };

  // broadcast from every root
  for (int root = 0; root < size; ++root) {
    std::vector<T> buf(n);
    for (std::size_t i = 0; i < n; ++i) buf[i] = value(rank, i);
    comm.broadcast(buf.data(), n, root);
    for (std::size_t i = 0; i < n; ++i) REQUIRE(same_bits(buf[i], value(root, i)));
  }

  // all_gather, out of place, in place and async
  std::vector<T> mine(n), gathered(n * us), want(n * us);
  for (std::size_t i = 0; i < n; ++i) mine[i] = value(rank, i);
  for (int r = 0; r < size; ++r)
    for (std::size_t i = 0; i < n; ++i) want[static_cast<std::size_t>(r) * n + i] = value(r, i);
  comm.all_gather(mine.data(), gathered.data(), n);
  require_equal(gathered, want, "all_gather");
  std::vector<T> inplace(n * us);
  std::copy(mine.begin(), mine.end(), inplace.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(rank)));
  comm.all_gather(inplace.data() + n * static_cast<std::size_t>(rank), inplace.data(), n);
  require_equal(inplace, want, "all_gather in place");
  std::vector<T> gathered_async(n * us);
  comm.all_gather_async(mine.data(), gathered_async.data(), n).wait();
  require_equal(gathered_async, want, "all_gather_async");

  // all_to_all: block j of rank r's input goes to rank j's block r.
  auto a2a = [&](int r, int j, std::size_t i) { return static_cast<T>(static_cast<float>((r * 5 + j * 3 + static_cast<int>(i)) % 60)); };
  std::vector<T> send(n * us), recv(n * us), want_a2a(n * us);
  for (int j = 0; j < size; ++j)
    for (std::size_t i = 0; i < n; ++i) {
      send[static_cast<std::size_t>(j) * n + i] = a2a(rank, j, i);
      want_a2a[static_cast<std::size_t>(j) * n + i] = a2a(j, rank, i);
    }
  comm.all_to_all(send.data(), recv.data(), n);
  require_equal(recv, want_a2a, "all_to_all");
  std::vector<T> same = send;
  comm.all_to_all(same.data(), same.data(), n);
  require_equal(same, want_a2a, "all_to_all in place");

  // all_to_allv: rank r sends (r + j) % 3 + 1 elements to rank j.
  auto cnt = [](int from, int to) { return static_cast<std::size_t>((from + to) % 3 + 1); };
  std::vector<std::size_t> sc(us), sd(us), rc(us), rd(us);
  std::size_t stotal = 0, rtotal = 0;
  for (int j = 0; j < size; ++j) {
    sc[j] = cnt(rank, j), sd[j] = stotal, stotal += sc[j];
    rc[j] = cnt(j, rank), rd[j] = rtotal, rtotal += rc[j];
  }
  std::vector<T> vsend(stotal), vrecv(rtotal), vwant(rtotal);
  for (int j = 0; j < size; ++j) {
    for (std::size_t i = 0; i < sc[j]; ++i) vsend[sd[j] + i] = a2a(rank, j, i);
    for (std::size_t i = 0; i < rc[j]; ++i) vwant[rd[j] + i] = a2a(j, rank, i);
  }
  comm.all_to_allv(vsend.data(), std::span<const std::size_t>(sc), std::span<const std::size_t>(sd), vrecv.data(),
                   std::span<const std::size_t>(rc), std::span<const std::size_t>(rd));
  require_equal(vrecv, vwant, "all_to_allv");
}

TEST_CASE("MpiComm point to point, batches and barrier", "[mpi]") {
  MpiComm comm(MPI_COMM_WORLD, "test");
  const int rank = comm.rank(), size = comm.size();
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  const std::size_t n = 1000;

  // Ring with blocking calls: even ranks send first (no deadlock for any size).
  std::vector<double> out(n), in(n, -1.0);
  for (std::size_t i = 0; i < n; ++i) out[i] = rank * 1000.0 + static_cast<double>(i);
  if (rank % 2 == 0) {
    comm.send(out.data(), n, next, 7);
    comm.recv(in.data(), n, prev, 7);
  } else {
    comm.recv(in.data(), n, prev, 7);
    comm.send(out.data(), n, next, 7);
  }
  for (std::size_t i = 0; i < n; ++i) REQUIRE(in[i] == prev * 1000.0 + static_cast<double>(i));

  // The same ring with isend/irecv, then with one batch in both directions.
  std::vector<double> in2(n, -1.0);
  auto r = comm.irecv(in2.data(), n, prev, 3);
  auto s = comm.isend(out.data(), n, next, 3);
  s.wait();
  r.wait();
  REQUIRE(in2 == in);

  std::vector<std::int32_t> to_next(5, rank), to_prev(5, -rank), from_prev(5, 99), from_next(5, 99);
  std::vector<P2POp> ops = {
      {P2POp::Kind::recv, from_prev.data(), 5, trellis::DType::i32, prev, 1},
      {P2POp::Kind::recv, from_next.data(), 5, trellis::DType::i32, next, 2},
      {P2POp::Kind::send, to_next.data(), 5, trellis::DType::i32, next, 1},
      {P2POp::Kind::send, to_prev.data(), 5, trellis::DType::i32, prev, 2},
  };
  comm.batch(ops).wait();
  REQUIRE(from_prev == std::vector<std::int32_t>(5, prev));
  REQUIRE(from_next == std::vector<std::int32_t>(5, -next));

  comm.barrier();
  REQUIRE(comm.recorder().calls() > 0);
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
}

TEST_CASE("without debug mode a missing rank times out naming the call; a late rank completes it", "[mpi][errors]") {
  MpiComm comm(MPI_COMM_WORLD, "late");
  comm.set_debug(false);
  const int rank = comm.rank();
  const int late = comm.size() - 1;
  std::vector<std::int32_t> a(4, 1), b(4, 0);
  if (rank != late) {
    comm.set_timeout(250ms);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      comm.all_reduce(a.data(), b.data(), 4, ReduceOp::sum);
      FAIL("missing rank not detected");
    } catch (const trellis::Error& e) {
      const auto elapsed = std::chrono::steady_clock::now() - t0;
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("#0 all_reduce(int32, count=4, op=sum) timed out after 250 ms") != std::string::npos);
      CHECK(what.find("only known in debug mode") != std::string::npos);
      CHECK(what.find("flight recorder of communicator 'late'") != std::string::npos);
      CHECK(elapsed >= 250ms);
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
  // Still usable (argument errors are raised before any MPI call).
  int one = 1, total = 0;
  comm.all_reduce(&one, &total, 1, ReduceOp::sum);
  REQUIRE(total == size);
}
