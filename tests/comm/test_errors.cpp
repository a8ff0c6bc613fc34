// Error paths of the thread backend: every one must end in a trellis::Error that names the rank,
// on every rank involved, within the timeout -- never a hang.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "trellis/comm/threads.hpp"

using trellis::Error;
using trellis::comm::ReduceOp;
using trellis::comm::ThreadComm;
using trellis::comm::ThreadWorld;
using namespace std::chrono_literals;

namespace {
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Per-rank outcome of a body run on every rank: the error message (empty: no error), its rank.
struct Outcome {
  std::string what;
  int error_rank = -2;
};

template <class Body>
std::vector<Outcome> run_catching(int ranks, Body body) {
  std::vector<Outcome> out(static_cast<std::size_t>(ranks));
  ThreadWorld(ranks).run([&](ThreadComm& comm) {
    comm.set_timeout(3000ms);
    try {
      body(comm);
    } catch (const Error& e) {
      out[comm.rank()] = {e.what(), e.rank()};
    }
  });
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_CASE("mismatched collectives raise on every rank, naming the odd rank and both calls", "[comm][errors]") {
  SECTION("other operation") {
    auto out = run_catching(4, [](ThreadComm& comm) {
      std::vector<float> x(16, 1.0f);
      if (comm.rank() == 2) comm.broadcast(x.data(), 16, 0);
      else comm.all_reduce(x.data(), x.data(), 16, ReduceOp::sum);
    });
    for (int r = 0; r < 4; ++r) {
      INFO(out[r].what);
      CHECK(out[r].error_rank == r);
      CHECK(contains(out[r].what, "rank 2 called #0 broadcast(float, count=16, root=0)"));
      CHECK(contains(out[r].what, "rank 0 (and 2 other ranks) called #0 all_reduce(float, count=16, op=sum)"));
    }
  }
  SECTION("count, dtype, root, reduce op") {
    auto out = run_catching(3, [](ThreadComm& comm) {
      std::vector<double> d(8, 1.0);
      std::vector<float> f(8, 1.0f);
      const bool odd = comm.rank() == 1;
      try {
        comm.all_reduce(d.data(), d.data(), odd ? 7 : 8, ReduceOp::sum);
      } catch (const Error& e) {
        if (!contains(e.what(), "rank 1 called #0 all_reduce(double, count=7")) throw;
      }
      try {
        if (odd) comm.all_gather(f.data(), f.data(), 2);
        else comm.all_gather(d.data(), d.data(), 2);
      } catch (const Error& e) {
        if (!contains(e.what(), "rank 1 called #1 all_gather(float, count=2)")) throw;
      }
      try {
        comm.broadcast(f.data(), 8, odd ? 2 : 0);
      } catch (const Error& e) {
        if (!contains(e.what(), "rank 1 called #2 broadcast(float, count=8, root=2)")) throw;
      }
      comm.reduce_scatter(f.data(), f.data(), 2, odd ? ReduceOp::max : ReduceOp::min);
    });
    for (int r = 0; r < 3; ++r) {
      INFO(out[r].what);
      CHECK(contains(out[r].what, "rank 1 called #3 reduce_scatter(float, count=2, op=max)"));
      CHECK(contains(out[r].what, "called #3 reduce_scatter(float, count=2, op=min)"));
    }
  }
  SECTION("async collective mismatch surfaces at wait()") {
    auto out = run_catching(2, [](ThreadComm& comm) {
      std::vector<float> x(4, 1.0f), y(8);
      auto request = comm.rank() == 0 ? comm.all_reduce_async(x.data(), y.data(), 4)
                                      : comm.all_gather_async(x.data(), y.data(), 4);
      request.wait();
    });
    for (int r = 0; r < 2; ++r) {
      INFO(out[r].what);
      CHECK(contains(out[r].what, "rank 1 called #0 all_gather(float, count=4) but rank 0 called #0 all_reduce"));
    }
  }
}

TEST_CASE("a rank that never joins: the others time out naming it", "[comm][errors]") {
  std::atomic<int> finished{0};
  std::vector<Outcome> out(4);
  std::vector<double> waited(4, 0.0);
  ThreadWorld(4).run([&](ThreadComm& comm) {
    comm.set_timeout(300ms);
    const int r = comm.rank();
    std::vector<float> x(100, 1.0f);
    comm.all_reduce(x.data(), x.data(), 100);  // everybody joins #0
    if (r == 3) {  // alive, but never calls #1
      while (finished.load() < 3) std::this_thread::sleep_for(1ms);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      comm.all_reduce(x.data(), x.data(), 100);
    } catch (const Error& e) {
      out[r] = {e.what(), e.rank()};
    }
    waited[r] = seconds_since(t0);
    // The communicator is unusable afterwards, with a clear message.
    try {
      comm.barrier();
      out[r].what += " | barrier after the timeout did not throw";
    } catch (const Error& e) {
      if (!contains(e.what(), "unusable after an earlier failure")) out[r].what += " | unexpected: " + std::string(e.what());
    }
    finished.fetch_add(1);
  });
  for (int r = 0; r < 3; ++r) {
    INFO(out[r].what);
    CHECK(out[r].error_rank == r);
    CHECK(contains(out[r].what, "timeout after 300 ms in #1 all_reduce(float, count=100, op=sum)"));
    CHECK(contains(out[r].what, "rank(s) 3 [has entered 1 collectives] never joined"));
    CHECK(contains(out[r].what, "flight recorder of communicator 'world'"));
    CHECK(contains(out[r].what, "test_errors.cpp"));
    CHECK_FALSE(contains(out[r].what, "unexpected"));
    CHECK_FALSE(contains(out[r].what, "did not throw"));
    CHECK(waited[r] < 3.0);
  }
  // The first rank to give up waited the whole timeout (the others may fail a little earlier,
  // through the communicator it marked broken).
  CHECK(*std::max_element(waited.begin(), waited.begin() + 3) >= 0.29);
}

TEST_CASE("a rank that returned without joining is named at once", "[comm][errors]") {
  std::vector<Outcome> out(3);
  const auto t0 = std::chrono::steady_clock::now();
  ThreadWorld(3).run([&](ThreadComm& comm) {
    comm.set_timeout(20000ms);  // far longer than the test may take
    if (comm.rank() == 0) return;
    try {
      comm.barrier();
    } catch (const Error& e) {
      out[comm.rank()] = {e.what(), e.rank()};
    }
  });
  CHECK(seconds_since(t0) < 5.0);
  for (int r = 1; r < 3; ++r) {
    INFO(out[r].what);
    CHECK(contains(out[r].what, "rank(s) 0 of communicator 'world' returned without joining #0 barrier()"));
  }
}

TEST_CASE("a rank that throws makes the others fail at once, and run() names it", "[comm][errors]") {
  for (bool in_p2p : {false, true}) {
    std::vector<std::string> seen(3);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      ThreadWorld(3).run([&](ThreadComm& comm) {  // default timeout: 60 s
        const int r = comm.rank();
        if (r == 1) {
          std::this_thread::sleep_for(50ms);
          throw std::runtime_error("boom in user code");
        }
        std::vector<float> x(1000, 1.0f);
        try {
          if (in_p2p) comm.recv(x.data(), x.size(), 1, 0);
          else comm.all_reduce(x.data(), x.data(), x.size());
        } catch (const Error& e) {
          seen[r] = e.what();
          throw;
        }
      });
      FAIL("run() did not throw");
    } catch (const Error& e) {
      CHECK(e.rank() == 1);
      CHECK(contains(e.what(), "rank 1 failed: boom in user code"));
    }
    CHECK(seconds_since(t0) < 5.0);
    for (int r : {0, 2}) {
      INFO(seen[r]);
      CHECK(contains(seen[r], "rank 1 failed: boom in user code"));
    }
  }
}

TEST_CASE("run() rethrows the failing rank's own trellis::Error", "[comm][errors]") {
  try {
    ThreadWorld(2).run([&](ThreadComm& comm) {
      if (comm.rank() == 1) TRELLIS_THROW("bad shard ", 7);
      comm.barrier();
    });
    FAIL("run() did not throw");
  } catch (const Error& e) {
    CHECK(e.rank() == 1);
    CHECK(e.message() == "bad shard 7");
  }
}

TEST_CASE("inconsistent all_to_allv counts raise on every rank naming the ranks", "[comm][errors]") {
  auto out = run_catching(3, [](ThreadComm& comm) {
    const int r = comm.rank();
    std::vector<std::size_t> send_counts{2, 2, 2}, displs{0, 2, 4}, recv_counts{2, 2, 2};
    if (r == 2) recv_counts[0] = 3;  // rank 0 sends 2 to rank 2, rank 2 expects 3
    std::vector<float> in(6, 1.0f), out(9);
    comm.all_to_allv(in.data(), std::span<const std::size_t>(send_counts), std::span<const std::size_t>(displs),
                     out.data(), std::span<const std::size_t>(recv_counts), std::span<const std::size_t>(displs));
  });
  for (int r = 0; r < 3; ++r) {
    INFO(out[r].what);
    CHECK(out[r].error_rank == r);
    CHECK(contains(out[r].what, "rank 0 sends 2 elements to rank 2 but rank 2 expects 3 from rank 0"));
  }
}

TEST_CASE("invalid roots, peers, counts and buffers are Errors naming the rank", "[comm][errors]") {
  auto out = run_catching(4, [](ThreadComm& comm) {
    std::vector<float> x(8, 1.0f);
    std::vector<std::string> problems;
    auto expect_error = [&](auto&& call, const std::string& part) {
      try {
        call();
        problems.push_back("no error for: " + part);
      } catch (const Error& e) {
        if (!contains(e.what(), part) || e.rank() != comm.rank()) problems.push_back(std::string("wrong error: ") + e.what());
      }
    };
    expect_error([&] { comm.broadcast(x.data(), 8, 4); }, "broadcast: invalid root 4 for communicator 'world' of size 4");
    expect_error([&] { comm.reduce(x.data(), x.data(), 8, ReduceOp::sum, -1); }, "reduce: invalid root -1");
    expect_error([&] { comm.send(x.data(), 8, 9, 0); }, "invalid peer 9");
    expect_error([&] { (void)comm.irecv(x.data(), 8, -2, 0); }, "invalid peer -2");
    expect_error([&] { comm.all_reduce(x.data(), x.data(), static_cast<std::size_t>(-1)); }, "is negative or too large");
    expect_error([&] { comm.all_gather(x.data(), x.data(), std::size_t{1} << 61); }, "is negative or too large");
    expect_error([&] { comm.all_reduce(static_cast<const float*>(nullptr), x.data(), 8); }, "null input buffer");
    expect_error([&] {
      std::vector<std::size_t> three(3, 0);
      comm.all_to_allv(x.data(), std::span<const std::size_t>(three), std::span<const std::size_t>(three), x.data(),
                       std::span<const std::size_t>(three), std::span<const std::size_t>(three));
    }, "need size() = 4 entries");
    expect_error([&] { comm.set_timeout(0ms); }, "timeout must be positive");
    expect_error([&] { (void)comm.split(-1, 0); }, "split: color must be >= 0 (got -1); use split_or_none()");
    // Nothing above started a collective: the communicator still works.
    comm.all_reduce(x.data(), x.data(), 8);
    if (x[0] != 4.0f) problems.push_back("all_reduce after the rejected calls gave " + std::to_string(x[0]));
    if (!problems.empty()) {
      std::string all;
      for (auto& p : problems) all += p + "; ";
      TRELLIS_THROW("problems: ", all);
    }
  });
  for (int r = 0; r < 4; ++r) {
    INFO(out[r].what);
    CHECK(out[r].what.empty());
  }
}

TEST_CASE("point-to-point size mismatch and unmatched receive", "[comm][errors]") {
  auto out = run_catching(2, [](ThreadComm& comm) {
    std::vector<float> x(100000, 1.0f);  // above the eager limit: the sender learns it too
    if (comm.rank() == 0) comm.send(x.data(), 100000, 1, 4);
    else comm.recv(x.data(), 99999, 0, 4);
  });
  for (int r = 0; r < 2; ++r) {
    INFO(out[r].what);
    CHECK(out[r].error_rank == r);
    CHECK(contains(out[r].what, "rank 0 sent 100000 float to rank 1 (tag 4) but rank 1 posted a receive of 99999 float"));
  }
  std::vector<Outcome> timeouts(2);
  ThreadWorld(2).run([&](ThreadComm& comm) {
    comm.set_timeout(comm.rank() == 1 ? 200ms : 5000ms);
    float v = 0;
    if (comm.rank() == 1) {
      try {
        comm.recv(&v, 1, 0, 9);  // rank 0 never sends
      } catch (const Error& e) {
        timeouts[1] = {e.what(), e.rank()};
      }
    }
    comm.barrier();
    // The withdrawn receive must not capture a later message with the same tag.
    if (comm.rank() == 0) {
      float w = 42.0f;
      comm.send(&w, 1, 1, 9);
    } else {
      comm.recv(&v, 1, 0, 9);
      if (v != 42.0f) timeouts[1].what += " | later message lost";
    }
  });
  INFO(timeouts[1].what);
  CHECK(timeouts[1].error_rank == 1);
  CHECK(contains(timeouts[1].what, "timeout after 200 ms: recv of 1 float from rank 0 (tag 9)"));
  CHECK(contains(timeouts[1].what, "was never matched"));
  CHECK_FALSE(contains(timeouts[1].what, "later message lost"));
}

TEST_CASE("TRELLIS_COMM_TIMEOUT_MS and TRELLIS_COMM_DEBUG set the defaults", "[comm][errors]") {
  ::setenv("TRELLIS_COMM_TIMEOUT_MS", "1234", 1);
  ::setenv("TRELLIS_COMM_DEBUG", "1", 1);
  std::atomic<int> right{0};
  ThreadWorld(2).run([&](ThreadComm& comm) {
    if (comm.timeout() == 1234ms && comm.debug()) ++right;
    auto sub = comm.split(0, 0);
    if (sub.timeout() == 1234ms && sub.debug()) ++right;
  });
  ::unsetenv("TRELLIS_COMM_TIMEOUT_MS");
  ::unsetenv("TRELLIS_COMM_DEBUG");
  CHECK(right.load() == 4);
  ThreadWorld(1).run([&](ThreadComm& comm) { CHECK(comm.timeout() == 60000ms); });
}

TEST_CASE("async collectives: a failing rank reaches waiters; unwaited requests finish at destruction", "[comm][errors]") {
  std::vector<std::string> seen(3);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ThreadWorld(3).run([&](ThreadComm& comm) {
      const int r = comm.rank();
      if (r == 2) {
        std::this_thread::sleep_for(50ms);
        throw std::runtime_error("rank two gives up");
      }
      std::vector<float> x(5000, 1.0f), y(5000);
      auto request = comm.all_reduce_async(x.data(), y.data(), x.size());
      try {
        request.wait();
      } catch (const Error& e) {
        seen[r] = e.what();
        throw;
      }
    });
    FAIL("run() did not throw");
  } catch (const Error& e) {
    CHECK(e.rank() == 2);
    CHECK(contains(e.what(), "rank two gives up"));
  }
  CHECK(seconds_since(t0) < 5.0);
  for (int r : {0, 1}) {
    INFO(seen[r]);
    CHECK(contains(seen[r], "rank 2 failed: rank two gives up"));
  }

  // Requests that are never waited: the communicator's destructor lets them complete.
  std::vector<float> results(4, 0.0f);
  ThreadWorld(4).run([&](ThreadComm& comm) {
    std::vector<float> x(1, static_cast<float>(comm.rank())), y(1);
    {
      auto sub = comm.split(0, comm.rank());
      auto request = sub.all_reduce_async(x.data(), y.data(), 1);
      (void)request;  // destroyed unwaited; sub's progress thread still runs the collective
    }
    results[comm.rank()] = y[0];
  });
  for (float v : results) CHECK(v == 6.0f);
}
