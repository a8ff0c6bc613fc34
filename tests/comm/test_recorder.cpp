// Flight recorder and fingerprint comparison: the backend-neutral safety layer.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "trellis/comm/recorder.hpp"

using trellis::DType;
using trellis::comm::FlightRecorder;
using trellis::comm::OpFingerprint;
using trellis::comm::OpKind;
using trellis::comm::ReduceOp;
using trellis::comm::find_fingerprint_mismatch;

namespace {
OpFingerprint fp(std::uint64_t seq, OpKind kind, DType dtype, std::size_t count, int root = -1,
                 ReduceOp op = ReduceOp::sum) {
  OpFingerprint f;
  f.seq = seq;
  f.kind = kind;
  f.dtype = dtype;
  f.count = count;
  f.root = root;
  f.op = op;
  return f;
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("fingerprint describe names every relevant field", "[comm][recorder]") {
  CHECK(fp(3, OpKind::all_reduce, DType::f32, 10, -1, ReduceOp::max).describe() ==
        "#3 all_reduce(float, count=10, op=max)");
  CHECK(fp(0, OpKind::broadcast, DType::bf16, 7, 2).describe() == "#0 broadcast(bfloat16, count=7, root=2)");
  CHECK(fp(1, OpKind::barrier, DType::f32, 0).describe() == "#1 barrier()");
  CHECK(fp(4, OpKind::send, DType::i32, 5, 1).describe() == "#4 send(int32, count=5, peer=1)");
}

TEST_CASE("agreeing fingerprints give no mismatch; irrelevant fields are ignored", "[comm][recorder]") {
  std::vector<OpFingerprint> all(4, fp(5, OpKind::all_reduce, DType::f32, 100));
  CHECK_FALSE(find_fingerprint_mismatch(all));
  // root is irrelevant for all_reduce, reduce op for broadcast, counts for all_to_allv
  all[2].root = 3;
  CHECK_FALSE(find_fingerprint_mismatch(all));
  std::vector<OpFingerprint> b(3, fp(1, OpKind::broadcast, DType::f64, 8, 0));
  b[1].op = ReduceOp::prod;
  CHECK_FALSE(find_fingerprint_mismatch(b));
  std::vector<OpFingerprint> v{fp(2, OpKind::all_to_allv, DType::u8, 1), fp(2, OpKind::all_to_allv, DType::u8, 9)};
  CHECK_FALSE(find_fingerprint_mismatch(v));
  CHECK_FALSE(find_fingerprint_mismatch(std::span<const OpFingerprint>(all.data(), 1)));
}

TEST_CASE("the odd rank is found by majority and both calls are named", "[comm][recorder]") {
  std::vector<OpFingerprint> all(4, fp(7, OpKind::all_reduce, DType::f32, 100));
  all[2] = fp(7, OpKind::broadcast, DType::f32, 100, 0);
  auto msg = find_fingerprint_mismatch(all);
  REQUIRE(msg);
  CHECK(contains(*msg, "rank 2 called #7 broadcast(float, count=100, root=0)"));
  CHECK(contains(*msg, "rank 0 (and 2 other ranks) called #7 all_reduce(float, count=100, op=sum)"));

  // rank 0 is the odd one: the majority still wins
  all.assign(3, fp(1, OpKind::all_gather, DType::f16, 4));
  all[0].count = 5;
  msg = find_fingerprint_mismatch(all);
  REQUIRE(msg);
  CHECK(contains(*msg, "rank 0 called #1 all_gather(half, count=5)"));
  CHECK(contains(*msg, "but rank 1 (and 1 other rank) called #1 all_gather(half, count=4)"));

  // each field that matters is compared: dtype, root, op, seq
  for (int field = 0; field < 4; ++field) {
    std::vector<OpFingerprint> r(3, fp(9, OpKind::reduce, DType::i64, 3, 1, ReduceOp::min));
    if (field == 0) r[1].dtype = DType::u64;
    if (field == 1) r[1].root = 0;
    if (field == 2) r[1].op = ReduceOp::max;
    if (field == 3) r[1].seq = 10;
    auto m = find_fingerprint_mismatch(r);
    REQUIRE(m);
    CHECK(contains(*m, "rank 1 called"));
  }
}

TEST_CASE("a tie is resolved by comparing with rank 0", "[comm][recorder]") {
  std::vector<OpFingerprint> all{fp(0, OpKind::all_reduce, DType::f32, 1), fp(0, OpKind::all_reduce, DType::f32, 2)};
  auto msg = find_fingerprint_mismatch(all);
  REQUIRE(msg);
  CHECK(contains(*msg, "rank 1 called #0 all_reduce(float, count=2, op=sum) but rank 0 called"));
  // 2 vs 2: rank 0's side is the expected one, ranks 1 and 3 are named
  std::vector<OpFingerprint> four{fp(0, OpKind::barrier, DType::f32, 0), fp(0, OpKind::all_gather, DType::f32, 1),
                                  fp(0, OpKind::barrier, DType::f32, 0), fp(0, OpKind::all_gather, DType::f32, 1)};
  msg = find_fingerprint_mismatch(four);
  REQUIRE(msg);
  CHECK(contains(*msg, "rank 1 called #0 all_gather"));
  CHECK(contains(*msg, "ranks that differ: 1, 3"));
}

TEST_CASE("flight recorder keeps the last calls with their call sites", "[comm][recorder]") {
  FlightRecorder rec("world", 2, 4);
  CHECK_FALSE(rec.last());
  for (std::size_t i = 0; i < FlightRecorder::depth + 5; ++i) {
    auto f = rec.record(OpKind::all_reduce, DType::f32, i, -1, ReduceOp::sum);
    CHECK(f.seq == i);
    if (i % 2 == 0) rec.completed(f.seq);
  }
  auto f = rec.record(OpKind::broadcast, DType::f64, 3, 1, ReduceOp::sum);  // line recorded below
  const int line = __LINE__ - 1;
  rec.failed(f.seq);
  rec.completed(0);  // long gone from the ring: ignored
  REQUIRE(rec.last());
  CHECK(rec.last()->state == FlightRecorder::State::failed);
  CHECK(rec.calls() == FlightRecorder::depth + 6);
  std::string dump = rec.dump();
  CHECK(contains(dump, "communicator 'world' (rank 2 of 4)"));
  CHECK(contains(dump, "broadcast(double, count=3, root=1) at "));
  CHECK(contains(dump, "test_recorder.cpp:" + std::to_string(line) + " [failed]"));
  CHECK_FALSE(contains(dump, "count=5, op=sum)"));  // #5 fell out of the ring
  CHECK(contains(dump, "#6 all_reduce(float, count=6, op=sum)"));
  std::string short_dump = rec.dump(2);
  CHECK(contains(short_dump, "last 2 of"));
  std::string third_last = std::to_string(FlightRecorder::depth + 3);
  third_last.insert(third_last.begin(), '#');
  CHECK_FALSE(contains(short_dump, third_last + " "));
}
