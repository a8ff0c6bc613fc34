// Flat buffers between placements (shard/flat.hpp) on 3 thread ranks, against sums and blocks
// written out serially: P(sum) -> R, P(sum/max) -> S(0), S(0) -> R (in place, as ZeRO-1 uses it),
// the empty transition, and the refusals (R -> S is a slice, not a collective; an uneven scatter).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "trellis/comm/threads.hpp"
#include "trellis/shard/flat.hpp"

using namespace trellis;
using namespace trellis::shard;

namespace {
constexpr int kRanks = 3;
constexpr std::size_t kN = 12;  // 4 per rank
float term(int rank, std::size_t i) { return static_cast<float>((rank + 1) * 100 + static_cast<int>(i) * (rank % 2 ? -1 : 1)); }
}  // namespace

TEST_CASE("flat redistribution steps are the planner's and match serial sums", "[shard][flat]") {
  STATIC_REQUIRE(flat_plan(partial_code(ReduceOp::sum), replicate_code()).steps[0].kind == StepKind::all_reduce);
  STATIC_REQUIRE(flat_plan(partial_code(ReduceOp::sum), shard_code(0)).steps[0].kind == StepKind::reduce_scatter);
  STATIC_REQUIRE(flat_plan(shard_code(0), replicate_code()).steps[0].kind == StepKind::all_gather);
  STATIC_REQUIRE(flat_plan(replicate_code(), replicate_code()).count == 0);
  std::atomic<int> failures{0};
  comm::ThreadWorld(kRanks).run([&](auto& c) {
    const int r = c.rank();
    auto fail_unless = [&](bool ok) { failures += ok ? 0 : 1; };
    std::vector<float> full(kN), part(kN / kRanks);
    // P(sum) -> R: every element the sum of the three terms.
    for (std::size_t i = 0; i < kN; ++i) full[i] = term(r, i);
    auto req = start_flat_redistribute(c, partial_code(ReduceOp::sum), replicate_code(), full.data(), part.data(), kN);
    fail_unless(req.has_value());
    if (req) req->wait();
    for (std::size_t i = 0; i < kN; ++i) fail_unless(full[i] == term(0, i) + term(1, i) + term(2, i));
    // P(max) -> S(0): rank r's block r of the element-wise max.
    for (std::size_t i = 0; i < kN; ++i) full[i] = term(r, i);
    req = start_flat_redistribute(c, partial_code(ReduceOp::max), shard_code(0), full.data(), part.data(), kN);
    if (req) req->wait();
    for (std::size_t j = 0; j < part.size(); ++j) {
      const std::size_t i = static_cast<std::size_t>(r) * part.size() + j;
      fail_unless(part[j] == std::max({term(0, i), term(1, i), term(2, i)}));
    }
    // S(0) -> R in place: each rank's block already sits at its offset of `full`.
    for (std::size_t i = 0; i < kN; ++i) full[i] = i / part.size() == static_cast<std::size_t>(r) ? term(r, i) : -1.0f;
    req = start_flat_redistribute(c, shard_code(0), replicate_code(), full.data(), full.data() + r * part.size(), kN);
    if (req) req->wait();
    for (std::size_t i = 0; i < kN; ++i) fail_unless(full[i] == term(static_cast<int>(i / part.size()), i));
    // Nothing to do: no request, the buffer untouched.
    fail_unless(!start_flat_redistribute(c, shard_code(0), shard_code(0), full.data(), part.data(), kN).has_value());
    // Refused: a slice is not a collective; 10 elements do not scatter over 3 ranks.
    try {
      (void)start_flat_redistribute(c, replicate_code(), shard_code(0), full.data(), part.data(), kN);
      fail_unless(false);
    } catch (const Error& e) {
      fail_unless(std::string(e.what()).find("R -> S(0)") != std::string::npos);
    }
    try {
      (void)start_flat_redistribute(c, partial_code(ReduceOp::sum), shard_code(0), full.data(), part.data(), 10);
      fail_unless(false);
    } catch (const Error& e) {
      fail_unless(std::string(e.what()).find("do not split evenly over 3 ranks") != std::string::npos);
    }
  });
  REQUIRE(failures == 0);
}
