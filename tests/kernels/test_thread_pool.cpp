// The kernels' thread pool: every index runs exactly once, exceptions reach the caller, nested and
// concurrent callers run inline instead of deadlocking, and kernels give the same bits whoever
// runs them (main thread or several threads at once, as ranks of a ThreadWorld do).
#include <catch2/catch.hpp>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/reference.hpp"
#include "trellis/kernels/attention_host.hpp"
#include "trellis/kernels/thread_pool.hpp"

using namespace trellis;
using namespace trellis::kernels;

TEST_CASE("parallel_for runs each index once and rethrows task exceptions", "[kernels][thread_pool]") {
  host::ThreadPool pool(3);
  for (std::int64_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
    pool.parallel_for(n, [&](std::int64_t i) { hits[i].fetch_add(1); });
    for (auto& h : hits) REQUIRE(h.load() == 1);
  }
  REQUIRE_THROWS_AS(pool.parallel_for(100,
                                      [](std::int64_t i) {
                                        if (i == 37) throw std::runtime_error("task 37");
                                      }),
                    std::runtime_error);
  // The pool still works after an exception.
  std::atomic<int> count{0};
  pool.parallel_for(50, [&](std::int64_t) { count.fetch_add(1); });
  REQUIRE(count.load() == 50);
}

TEST_CASE("nested and concurrent parallel_for calls complete", "[kernels][thread_pool]") {
  host::ThreadPool pool(2);
  std::atomic<int> count{0};
  pool.parallel_for(8, [&](std::int64_t) { pool.parallel_for(8, [&](std::int64_t) { count.fetch_add(1); }); });
  REQUIRE(count.load() == 64);
  count = 0;
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t)
    callers.emplace_back([&] {
      for (int r = 0; r < 20; ++r) pool.parallel_for(10, [&](std::int64_t) { count.fetch_add(1); });
    });
  for (auto& c : callers) c.join();
  REQUIRE(count.load() == 4 * 20 * 10);
}

TEST_CASE("attention backward gives identical bits from concurrent callers", "[kernels][thread_pool]") {
  AttentionArgs a;
  a.batch = 1, a.q_heads = 2, a.kv_heads = 1, a.q_len = 150, a.kv_len = 150, a.head_dim = 32, a.causal = true;
  auto q = trellis_test::random_vector<float>(a.q_elements(), 1), k = trellis_test::random_vector<float>(a.kv_elements(), 2),
       v = trellis_test::random_vector<float>(a.kv_elements(), 3), d_o = trellis_test::random_vector<float>(a.q_elements(), 4);
  std::vector<float> o(q.size()), lse(a.lse_elements());
  host::attention_forward(a, q.data(), k.data(), v.data(), o.data(), lse.data());
  auto backward = [&](std::vector<float>& dq, std::vector<float>& dk) {
    dq.assign(q.size(), 0.0f);
    dk.assign(k.size(), 0.0f);
    std::vector<float> dv(v.size());
    host::attention_backward(a, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(), dk.data(),
                             dv.data());
  };
  std::vector<float> dq0, dk0;
  backward(dq0, dk0);  // on the pool
  std::vector<std::vector<float>> dq(3), dk(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r) ranks.emplace_back([&, r] { backward(dq[r], dk[r]); });  // mostly inline
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) {
    REQUIRE(dq[r] == dq0);
    REQUIRE(dk[r] == dk0);
  }
}
