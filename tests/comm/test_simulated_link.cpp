// comm::SimulatedLink over thread ranks:
//  - forwarding: the conformance suite (minus split_or_none) passes through the wrapper on 1..4
//    ranks with a fast link, so results are the inner communicator's;
//  - the cost formula (ring bytes, nccl-tests factors) against hand-computed values;
//  - timing against the formula: a blocking all_reduce takes >= the modelled time and not much
//    more; an async all_reduce followed by compute (a sleep) of T takes ~max(T, modelled), not
//    T + modelled -- and the same code with LinkModel::synchronous (a link that cannot overlap)
//    does take T + modelled, so the measurement detects a collective that runs synchronously;
//  - serialisation: two transfers started together end one after the other; a group of one rank
//    costs nothing.
// Margins are generous: this runs on a loaded 2-core VM where ranks are threads. Lower bounds
// are exact (sleep_until never returns early); upper bounds allow 60-120 ms of scheduling noise.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/conformance.hpp"
#include "trellis/comm/simulated_link.hpp"
#include "trellis/comm/threads.hpp"

using trellis::comm::LinkModel;
using trellis::comm::ReduceOp;
using trellis::comm::ThreadComm;
using trellis::comm::ThreadWorld;
using Link = trellis::comm::SimulatedLink<ThreadComm>;
namespace conformance = trellis::comm::conformance;
namespace wire = trellis::comm::wire;

static_assert(trellis::comm::Communicator<Link>);
static_assert(trellis::comm::Communicator<trellis::comm::SimulatedLink<Link>>);

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Runs fn(link) on n thread ranks, the link wrapping a split of the world (all ranks).
template <class F>
void run_linked(int n, LinkModel model, F&& fn) {
  ThreadWorld(n).run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(30000));
    Link link(comm.split(0, comm.rank()), model);
    fn(link);
  });
}

// Per-rank measurements, checked on the main thread (Catch2 is not thread-safe).
struct Samples {
  std::mutex mutex;
  std::vector<double> values;
  void add(double v) {
    std::lock_guard lock(mutex);
    values.push_back(v);
  }
  double min() const { return *std::min_element(values.begin(), values.end()); }
  double max() const { return *std::max_element(values.begin(), values.end()); }
};

}  // namespace

TEST_CASE("SimulatedLink forwards every operation: conformance through the wrapper", "[comm][simlink]") {
  for (int ranks = 1; ranks <= 4; ++ranks) {
    DYNAMIC_SECTION("ranks=" << ranks) {
      conformance::Options opt;
      opt.large_count = (std::size_t{1} << 16) + 3;
      std::mutex mutex;
      std::vector<std::string> failures;
      std::size_t checks = 0;
      run_linked(ranks, {.bandwidth = 1e12, .latency = 0}, [&](Link& link) {
        conformance::Report report;
        report.rank = link.rank();
        conformance::for_each_dtype([&](auto tag) {
          using T = decltype(tag);
          for (std::size_t count : opt.small_counts) {
            for (ReduceOp op : conformance::all_reduce_ops) {
              conformance::check_all_reduce<T>(link, opt, report, count, op);
              conformance::check_reduce_scatter<T>(link, opt, report, count, op);
            }
            conformance::check_broadcast<T>(link, opt, report, count);
            conformance::check_all_gather<T>(link, opt, report, count);
            conformance::check_all_to_all<T>(link, opt, report, count);
          }
          conformance::check_reduce<T>(link, opt, report, 31, ReduceOp::sum);
          conformance::check_all_to_allv<T>(link, opt, report, 3);
          conformance::check_point_to_point<T>(link, opt, report, 5);
        });
        for (std::size_t count : opt.p2p_counts) conformance::check_point_to_point<float>(link, opt, report, count);
        conformance::check_async(link, opt, report, 1009);
        conformance::check_async(link, opt, report, opt.large_count);
        conformance::check_split(link, opt, report);  // split() gives a SimulatedLink
        link.barrier();
        std::lock_guard lock(mutex);
        failures.insert(failures.end(), report.failures.begin(), report.failures.end());
        checks += report.checks;
      });
      for (std::size_t i = 0; i < failures.size() && i < 20; ++i) UNSCOPED_INFO(failures[i]);
      CHECK(failures.empty());
      CHECK(checks > 500);
    }
  }
}

TEST_CASE("SimulatedLink cost: ring bytes with the nccl-tests factors", "[comm][simlink]") {
  // S = 1 MB per rank.
  CHECK(wire::all_reduce(1e6, 2) == Approx(1e6));        // 2(n-1)/n = 1
  CHECK(wire::all_reduce(1e6, 4) == Approx(1.5e6));      // 2 * 3/4
  CHECK(wire::all_gather(4e6, 4) == Approx(3e6));        // (n-1)/n of the gathered 4 MB
  CHECK(wire::reduce_scatter(8e6, 8) == Approx(7e6));    // (n-1)/n of the 8 MB input
  CHECK(wire::rooted(1e6, 3) == Approx(1e6));
  CHECK(wire::all_reduce(1e6, 1) == 0.0);
  const LinkModel m{.bandwidth = 1e9, .latency = 1e-5};
  CHECK(m.seconds(1e6, 2) == Approx(1e-5 + 1e-3));
  CHECK(m.seconds(1e6, 1) == 0.0);  // a group of one rank costs nothing, latency included
  CHECK(m.seconds(0, 2) == Approx(1e-5));

  // The link books what the formula says: one all_reduce, one all_gather, one p2p pair.
  run_linked(4, {.bandwidth = 1e10, .latency = 1e-6}, [&](Link& link) {
    std::vector<float> a(1000, 1.0f), g(4000);
    link.all_reduce(a.data(), a.data(), a.size());
    link.all_gather(a.data(), g.data(), a.size());
    const double expect = 2 * 1e-6 + (1.5 * 4000 + 0.75 * 16000) / 1e10;
    if (std::abs(link.modelled_seconds() - expect) > 1e-12) throw trellis::Error("booked " + std::to_string(link.modelled_seconds()));
  });
}

TEST_CASE("SimulatedLink: a blocking all_reduce takes the modelled time", "[comm][simlink][timing]") {
  // 256 Ki floats = 1 MiB per rank at 10 MB/s: 2 ranks 0.105 s, 4 ranks 0.157 s (+ 1 ms latency).
  const LinkModel model{.bandwidth = 10e6, .latency = 1e-3};
  const std::size_t n = std::size_t{1} << 18;
  for (int ranks : {2, 4}) {
    const double modelled = model.seconds(wire::all_reduce(4.0 * n, ranks), ranks);
    Samples took;
    std::vector<float> result(n);
    run_linked(ranks, model, [&](Link& link) {
      std::vector<float> x(n, static_cast<float>(link.rank() + 1));
      link.barrier();
      const auto t0 = clock_type::now();
      link.all_reduce(x.data(), x.data(), n);
      took.add(seconds_since(t0));
      if (link.rank() == 0) result = x;
    });
    INFO("ranks " << ranks << ": modelled " << modelled << " s, measured " << took.min() << ".." << took.max() << " s");
    CHECK(took.min() >= modelled);
    CHECK(took.max() <= modelled + 0.1);
    CHECK(result[n - 1] == static_cast<float>(ranks * (ranks + 1) / 2));  // the data moved
  }
}

TEST_CASE("SimulatedLink: an async all_reduce overlaps compute (measured, not counted)", "[comm][simlink][timing]") {
  // modelled M = 0.2 s; the caller computes (sleeps) T = 0.2 s between start and wait.
  // Overlapping link: ~max(T, M) = 0.2 s. A link that holds the caller (synchronous): T + M = 0.4 s.
  const std::size_t n = std::size_t{1} << 18;
  const double compute = 0.2;
  for (bool synchronous : {false, true}) {
    const LinkModel model{.bandwidth = 1.0 * 4 * n / 0.2, .latency = 0, .synchronous = synchronous};
    const double modelled = model.seconds(wire::all_reduce(4.0 * n, 2), 2);
    Samples took;
    Samples test_early;
    run_linked(2, model, [&](Link& link) {
      std::vector<float> x(n, 1.0f);
      link.barrier();
      const auto t0 = clock_type::now();
      auto request = link.all_reduce_async(x.data(), x.data(), n);
      test_early.add(request.test() ? 1.0 : 0.0);  // before the deadline: not complete
      std::this_thread::sleep_for(std::chrono::duration<double>(compute));
      request.wait();
      took.add(seconds_since(t0));
      if (x[0] != 2.0f) throw trellis::Error("async all_reduce: wrong result");
    });
    INFO((synchronous ? "synchronous" : "overlapping") << " link: modelled " << modelled << " s, compute " << compute
                                                       << " s, measured " << took.min() << ".." << took.max() << " s");
    REQUIRE(modelled == Approx(0.2));
    if (!synchronous) {
      CHECK(test_early.max() == 0.0);
      CHECK(took.min() >= std::max(compute, modelled));
      CHECK(took.max() < compute + modelled - 0.08);  // clearly less than the sum
    } else {
      CHECK(took.min() >= compute + modelled);  // what the overlap check above would catch
    }
  }
}

TEST_CASE("SimulatedLink serialises transfers on one link; a group of one is free", "[comm][simlink][timing]") {
  const std::size_t n = std::size_t{1} << 16;  // 256 KiB
  const LinkModel model{.bandwidth = 4.0 * n / 0.1, .latency = 0};  // all_reduce on 2 ranks: 0.1 s
  Samples both, blocking_after;
  run_linked(2, model, [&](Link& link) {
    std::vector<float> a(n, 1.0f), b(n, 2.0f);
    link.barrier();
    auto t0 = clock_type::now();
    auto ra = link.all_reduce_async(a.data(), a.data(), n);
    auto rb = link.all_reduce_async(b.data(), b.data(), n);
    if (rb.deadline() - ra.deadline() < std::chrono::milliseconds(99)) throw trellis::Error("not serialised");
    ra.wait();
    rb.wait();
    both.add(seconds_since(t0));
    // A blocking op queues behind an async one still on the link.
    t0 = clock_type::now();
    auto rc = link.all_reduce_async(a.data(), a.data(), n);
    link.all_reduce(b.data(), b.data(), n);
    blocking_after.add(seconds_since(t0));
    rc.wait();
  });
  CHECK(both.min() >= 0.2);
  CHECK(both.max() < 0.2 + 0.1);
  CHECK(blocking_after.min() >= 0.2);

  Samples alone;
  run_linked(1, {.bandwidth = 1.0, .latency = 1.0}, [&](Link& link) {  // would be hours on a wire
    std::vector<float> x(n, 1.0f);
    const auto t0 = clock_type::now();
    link.all_reduce(x.data(), x.data(), n);
    link.all_reduce_async(x.data(), x.data(), n).wait();
    alone.add(seconds_since(t0));
    if (link.modelled_seconds() != 0.0) throw trellis::Error("a group of one booked time");
  });
  CHECK(alone.max() < 0.1);
}
