// backend::HostCopyQueue (backend/copy_queue.hpp), checked against what the test itself does:
//  - jobs run one at a time in the order enqueued (each appends its index; one blocked job
//    holds the rest), and a ticket is not done before its job ran;
//  - wait(t) returns only once job t ran (a job blocked on the test's promise);
//  - an exception in a job is rethrown at the wait of its ticket, or of a later one if nobody
//    waited for it, once; the jobs after it still run;
//  - the destructor runs every pending job (one of them throwing) and returns;
//  - copies (enqueue_copy, and to_host / to_device through Host<float>'s and DeviceChecked's
//    download / upload) move the bytes, DeviceChecked's refusal of a swapped side surfaces at wait;
//  - the SIMULATED link holds a copy for latency + bytes / bandwidth from its start (records).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include "trellis/backend/copy_queue.hpp"
#include "trellis/backend/device_checked.hpp"
#include "trellis/backend/host.hpp"

using trellis::backend::HostCopyQueue;
using trellis::backend::SimulatedCopyLink;

TEST_CASE("copy queue: FIFO order, a ticket is done only after its job", "[backend][copy_queue]") {
  HostCopyQueue q;
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  std::vector<int> order;  // written by the worker only, read after the waits
  const auto first = q.enqueue([gate, &order] {
    gate.wait();
    order.push_back(0);
  });
  std::vector<HostCopyQueue::ticket> tickets{first};
  for (int i = 1; i < 50; ++i) tickets.push_back(q.enqueue([i, &order] { order.push_back(i); }));
  CHECK(tickets.back() == first + 49);
  CHECK_FALSE(q.done(first));
  CHECK_FALSE(q.done(tickets.back()));
  go.set_value();
  q.wait(tickets[10]);
  CHECK(q.done(tickets[10]));
  q.wait(tickets.back());
  std::vector<int> expected(50);
  std::iota(expected.begin(), expected.end(), 0);
  CHECK(order == expected);
  q.wait(0);  // ticket 0: no copy
  CHECK_THROWS_WITH(q.wait(tickets.back() + 1), Catch::Contains("issued"));
}

TEST_CASE("copy queue: wait blocks until the job ran", "[backend][copy_queue]") {
  HostCopyQueue q;
  std::atomic<bool> ran{false};
  const auto t = q.enqueue([&ran] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    ran = true;
  });
  q.wait(t);
  CHECK(ran.load());
  CHECK(q.done(t));
}

TEST_CASE("copy queue: an exception in a job surfaces at wait, once, and the queue goes on",
          "[backend][copy_queue]") {
  HostCopyQueue q;
  const auto bad = q.enqueue([] { throw std::runtime_error("disk on fire"); });
  int after = 0;
  const auto good = q.enqueue([&after] { after = 7; });
  CHECK_THROWS_WITH(q.wait(bad), Catch::Contains("disk on fire"));
  q.wait(good);  // already rethrown: nothing left to report
  CHECK(after == 7);
  // an error nobody waited for surfaces at the next wait of a later ticket
  q.enqueue([] { throw std::runtime_error("lost copy"); });
  const auto later = q.enqueue([] {});
  CHECK_THROWS_WITH(q.wait(later), Catch::Contains("lost copy"));
  q.drain();
}

TEST_CASE("copy queue: the destructor runs the pending jobs and returns", "[backend][copy_queue]") {
  std::atomic<int> ran{0};
  const auto t0 = std::chrono::steady_clock::now();
  {
    HostCopyQueue q;
    for (int i = 0; i < 40; ++i)
      q.enqueue([&ran, i] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++ran;
        if (i == 5) throw std::runtime_error("dropped at destruction");
      });
  }
  CHECK(ran.load() == 40);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE("copy queue: copies move the bytes; DeviceChecked's refusals surface at wait", "[backend][copy_queue]") {
  HostCopyQueue q;
  std::vector<std::uint8_t> a(1000), b(1000, 0);
  std::iota(a.begin(), a.end(), std::uint8_t{0});
  q.wait(q.enqueue_copy(b.data(), a.data(), a.size()));
  CHECK(a == b);

  const trellis::backend::Host<float> host;
  std::vector<std::uint8_t> c(1000, 0);
  q.wait(host, q.to_host(host, c.data(), b.data(), b.size()));
  CHECK(c == a);

  const trellis::backend::DeviceChecked<> checked;
  auto dev = checked.allocate<std::uint8_t>(1000);
  std::vector<std::uint8_t> back(1000, 0);
  q.wait(checked, q.to_device(checked, dev.data(), a.data(), a.size()));
  q.wait(checked, q.to_host(checked, back.data(), dev.data(), back.size()));
  CHECK(back == a);
  const auto swapped = q.to_host(checked, dev.data(), back.data(), back.size());  // host and device swapped
  CHECK_THROWS_WITH(q.wait(checked, swapped), Catch::Contains("download"));
}

TEST_CASE("copy queue: a SIMULATED link holds each copy for latency + bytes / bandwidth", "[backend][copy_queue]") {
  HostCopyQueue q(SimulatedCopyLink{.bandwidth = 1e8, .latency = 2e-3});  // 100 MB/s, 2 ms
  q.set_recording(true);
  std::vector<std::uint8_t> a(1'000'000, 3), b(1'000'000, 0);  // 10 ms at 100 MB/s
  const auto t1 = q.enqueue_copy(b.data(), a.data(), a.size());
  const auto t2 = q.enqueue_copy(a.data(), b.data(), 0);  // latency only
  q.wait(t2);
  CHECK(b == a);
  const auto r = q.records();
  REQUIRE(r.size() == 2);
  CHECK(r[0].ticket == t1);
  CHECK(r[0].bytes == a.size());
  CHECK(r[0].end - r[0].start >= 0.012 - 1e-4);
  CHECK(r[1].end - r[1].start >= 0.002 - 1e-4);
  CHECK(r[1].start >= r[0].end);  // one at a time
  CHECK_THROWS_WITH(HostCopyQueue(SimulatedCopyLink{.bandwidth = -1}), Catch::Contains("bandwidth >= 0"));
}
