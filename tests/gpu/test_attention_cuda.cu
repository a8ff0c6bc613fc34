// CUDA flash attention (kernels/attention_cuda.cuh) against the host flash attention
// (kernels/attention_host.hpp) on the same 16-bit inputs: forward o and lse, backward dq, dk, dv,
// for bf16 and fp16, head dims 64 and 128, causal and not, MHA / GQA / MQA, q_len == kv_len
// (not a multiple of the 64-row tile), q_len < kv_len (bottom-right causal), q_len > kv_len
// (rows that see nothing: lse -inf, o 0), accumulate, explicit causal offsets (ring attention
// chunks) and packed documents (segment ids, with and without an offset). The host computes in fp32 and rounds
// once; the GPU also rounds P and dS to the input type before the tensor-core products, so
// tolerances are relative to the largest reference value: bf16 2.5e-2 * max|ref|, fp16 5e-3 * max|ref|
// (o, dq, dk, dv), lse 2e-3 absolute.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "support/gpu_test.hpp"
#include "trellis/kernels/attention_cuda.cuh"
#include "trellis/kernels/attention_host.hpp"

namespace k = trellis::kernels;
using trellis::bfloat16;
using thalf = trellis::half;  // cuda_fp16.h declares a global `half`
using trellis_gpu_test::Stream;
using trellis_gpu_test::random_vector;
using trellis_gpu_test::require_close;
using trellis_gpu_test::to_device;
using trellis_gpu_test::to_host;

namespace {

template <class T>
constexpr double fraction() {
  return std::is_same_v<T, bfloat16> ? 2.5e-2 : 5e-3;
}

template <class A, class B>
void require_close_scaled(const A& got, const B& want, double frac, const char* what) {
  double peak = 0.0;
  for (const auto& w : want) peak = std::max(peak, std::fabs(static_cast<double>(static_cast<float>(w))));
  require_close(got, want, frac * std::max(peak, 1e-3), 0.0, what);
}

// Segment ids of packed documents, [batch, q_len] and [batch, kv_len], as the host holds them.
struct Segments {
  std::vector<std::int32_t> q, kv;
};

// Ids for documents of the given lengths, one list of lengths per sequence, counting from
// `first_id` in every sequence.
std::vector<std::int32_t> packed_ids(const std::vector<std::vector<std::int32_t>>& lengths, std::int32_t first_id = 0) {
  std::vector<std::int32_t> ids;
  for (const auto& sequence : lengths) {
    std::int32_t id = first_id;
    for (std::int32_t length : sequence) {
      ids.insert(ids.end(), static_cast<std::size_t>(length), id);
      ++id;
    }
  }
  return ids;
}

template <class T>
void compare(const k::AttentionArgs& args, std::uint32_t seed, bool accumulate = false,
             const Segments* segments = nullptr) {
  Stream stream;
  // The host reads host ids, the kernels device copies of them.
  k::AttentionArgs host_args = args, device_args = args;
  trellis::Buffer<std::int32_t, trellis::Cuda> q_ids, kv_ids;
  if (segments) {
    REQUIRE(segments->q.size() == static_cast<std::size_t>(args.batch * args.q_len));
    REQUIRE(segments->kv.size() == static_cast<std::size_t>(args.batch * args.kv_len));
    host_args.q_segments = segments->q.data(), host_args.kv_segments = segments->kv.data();
    q_ids = to_device(segments->q, stream), kv_ids = to_device(segments->kv, stream);
    device_args.q_segments = q_ids.data(), device_args.kv_segments = kv_ids.data();
  }
  const std::size_t nq = static_cast<std::size_t>(args.q_elements());
  const std::size_t nkv = static_cast<std::size_t>(args.kv_elements());
  const std::size_t nl = static_cast<std::size_t>(args.lse_elements());
  auto q = random_vector<T>(nq, seed), kk = random_vector<T>(nkv, seed + 1), v = random_vector<T>(nkv, seed + 2);
  auto d_o = random_vector<T>(nq, seed + 3);

  std::vector<T> o(nq), dq(nq), dk(nkv), dv(nkv);
  std::vector<float> lse(nl);
  if (accumulate) {
    dq = random_vector<T>(nq, seed + 4), dk = random_vector<T>(nkv, seed + 5), dv = random_vector<T>(nkv, seed + 6);
  }
  auto dq0 = dq, dk0 = dk, dv0 = dv;
  k::host::attention_forward(host_args, q.data(), kk.data(), v.data(), o.data(), lse.data());
  k::host::attention_backward(host_args, q.data(), kk.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(),
                              dk.data(), dv.data(), accumulate);

  auto gq = to_device(q, stream), gk = to_device(kk, stream), gv = to_device(v, stream), gdo = to_device(d_o, stream);
  trellis::Buffer<T, trellis::Cuda> go(nq, stream);
  trellis::Buffer<float, trellis::Cuda> glse(nl, stream);
  k::cuda::attention_forward(device_args, gq.data(), gk.data(), gv.data(), go.data(), glse.data(), stream);
  auto o_gpu = to_host(go);
  auto lse_gpu = to_host(glse);
  require_close_scaled(o_gpu, o, fraction<T>(), "o");
  require_close(lse_gpu, lse, 2e-3, 0.0, "lse");

  // Backward from the GPU's own forward outputs (as in training).
  auto gdq = to_device(dq0, stream), gdk = to_device(dk0, stream), gdv = to_device(dv0, stream);
  const std::size_t ws_bytes = k::cuda::attention_backward_workspace_bytes(device_args);
  trellis::Buffer<char, trellis::Cuda> ws(ws_bytes, stream, false);
  k::cuda::attention_backward(device_args, gq.data(), gk.data(), gv.data(), go.data(), gdo.data(), glse.data(), gdq.data(),
                              gdk.data(), gdv.data(), ws.data(), ws_bytes, stream, accumulate);
  require_close_scaled(to_host(gdq), dq, fraction<T>(), "dq");
  require_close_scaled(to_host(gdk), dk, fraction<T>(), "dk");
  require_close_scaled(to_host(gdv), dv, fraction<T>(), "dv");
}

k::AttentionArgs make_args(std::int64_t batch, std::int64_t hq, std::int64_t hkv, std::int64_t tq, std::int64_t tkv,
                           std::int64_t d, bool causal) {
  k::AttentionArgs a;
  a.batch = batch, a.q_heads = hq, a.kv_heads = hkv, a.q_len = tq, a.kv_len = tkv, a.head_dim = d, a.causal = causal;
  return a;
}

}  // namespace

TEMPLATE_TEST_CASE("CUDA attention matches the host attention", "[gpu][attention]", bfloat16, thalf) {
  for (std::int64_t d : {64, 128}) {
    for (bool causal : {false, true}) {
      DYNAMIC_SECTION("d=" << d << " causal=" << causal) {
        compare<TestType>(make_args(2, 4, 4, 131, 131, d, causal), 100);   // MHA, partial last tile
        compare<TestType>(make_args(1, 6, 2, 200, 200, d, causal), 200);   // GQA, group of 3
        compare<TestType>(make_args(2, 4, 1, 64, 64, d, causal), 300);     // MQA, one exact tile
        compare<TestType>(make_args(1, 2, 2, 70, 190, d, causal), 400);    // q_len < kv_len
        compare<TestType>(make_args(1, 2, 1, 150, 40, d, causal), 500);    // q_len > kv_len
      }
    }
  }
}

TEMPLATE_TEST_CASE("CUDA attention honours an explicit causal offset (ring attention chunks)", "[gpu][attention]",
                   bfloat16, thalf) {
  for (std::int64_t d : {64, 128}) {
    DYNAMIC_SECTION("d=" << d) {
      auto args = make_args(2, 4, 2, 64, 64, d, true);  // GQA
      args.causal_offset = 0;  // one chunk against itself: the usual j <= i
      compare<TestType>(args, 1100);
      args.causal_offset = 64;  // a later query chunk against an earlier key chunk: everything visible
      compare<TestType>(args, 1200);
      args.causal_offset = -32;  // an earlier query chunk against a later key chunk: rows 0..31 see nothing
      compare<TestType>(args, 1300);
      auto wide = make_args(1, 2, 2, 100, 150, d, true);
      wide.causal_offset = 20;  // neither aligned top-left nor bottom-right
      compare<TestType>(wide, 1400);
      wide.causal_offset = 200;  // past the last key: everything visible
      compare<TestType>(wide, 1500);
      wide.causal_offset = -150;  // before the first key: nothing visible anywhere
      compare<TestType>(wide, 1600);
    }
  }
}

TEMPLATE_TEST_CASE("CUDA attention masks packed documents (segment ids)", "[gpu][attention]", bfloat16, thalf) {
  // Sequence 0 packs four documents (one of a single token), sequence 1 holds one; the boundaries
  // fall inside 64- and 128-row tiles.
  Segments packed{packed_ids({{37, 64, 1, 48}, {150}}), {}};
  packed.kv = packed.q;
  for (std::int64_t d : {64, 128}) {
    for (bool causal : {false, true}) {
      DYNAMIC_SECTION("d=" << d << " causal=" << causal) {
        compare<TestType>(make_args(2, 4, 4, 150, 150, d, causal), 2100, false, &packed);  // MHA
        compare<TestType>(make_args(2, 6, 2, 150, 150, d, causal), 2200, false, &packed);  // GQA, group of 3
        compare<TestType>(make_args(2, 4, 1, 150, 150, d, causal), 2300, false, &packed);  // MQA
      }
    }
  }
  // Long documents: tiles wholly inside one document (no element mask) beside straddling ones,
  // and key tiles skipped before and after a block's documents.
  Segments long_docs{packed_ids({{300, 200, 13}}), {}};
  long_docs.kv = long_docs.q;
  compare<TestType>(make_args(1, 2, 2, 513, 513, 128, true), 2400, false, &long_docs);
  compare<TestType>(make_args(1, 2, 2, 513, 513, 64, false), 2500, false, &long_docs);
}

TEMPLATE_TEST_CASE("CUDA attention: packed documents split into ring chunks", "[gpu][attention]", bfloat16, thalf) {
  // Keys: positions 0..149 of both sequences (the documents above). Queries: positions 150..249,
  // where document 3 of sequence 0 goes on for 30 tokens and document 4 follows (no key of it in
  // this chunk: those rows see nothing); sequence 1 continues its one document.
  Segments ring{packed_ids({{30, 70}}, 3), packed_ids({{37, 64, 1, 48}, {150}})};
  ring.q.insert(ring.q.end(), 100, 0);
  for (std::int64_t d : {64, 128}) {
    for (bool causal : {false, true}) {
      DYNAMIC_SECTION("d=" << d << " causal=" << causal) {
        auto args = make_args(2, 4, 2, 100, 150, d, causal);
        args.causal_offset = 150;  // query row 0 is position 150, key 0 position 0
        compare<TestType>(args, 3100, false, &ring);
        compare<TestType>(args, 3200, true, &ring);  // a ring adds every chunk's gradients
        // The same queries against their own chunk's keys (positions 150..249).
        Segments own{ring.q, ring.q};
        auto self = make_args(2, 4, 2, 100, 100, d, causal);
        self.causal_offset = 0;
        compare<TestType>(self, 3300, false, &own);
      }
    }
  }
}

TEST_CASE("CUDA attention FLOP counter: causal bound, or the documents from host ids", "[gpu][attention]") {
  const std::vector<std::int32_t> ids = packed_ids({{37, 64, 1, 48}});
  auto args = make_args(1, 2, 2, 150, 150, 64, false);
  const double per_key = 4.0 * 2 * 64;  // two GEMMs, 2 flops per multiply-add, 2 heads, d = 64
  CHECK(k::cuda::attention_forward_flops(args) == per_key * 150 * 150);
  CHECK(k::cuda::attention_forward_flops(args, ids.data(), ids.data()) == per_key * (37 * 37 + 64 * 64 + 1 + 48 * 48));
  args.causal = true;
  CHECK(k::cuda::attention_forward_flops(args) == per_key * 150 * 151 / 2);
  CHECK(k::cuda::attention_forward_flops(args, ids.data(), ids.data()) ==
        per_key * (37 * 38 / 2 + 64 * 65 / 2 + 1 + 48 * 49 / 2));
  args.causal_offset = -100;  // rows 100.. see keys 0..i - 100: 1 + ... + 50
  CHECK(k::cuda::attention_forward_flops(args) == per_key * 50 * 51 / 2);
}

TEST_CASE("CUDA attention backward accumulates into dq, dk, dv when asked", "[gpu][attention]") {
  compare<bfloat16>(make_args(1, 4, 2, 96, 96, 64, true), 600, true);
}

TEST_CASE("CUDA attention: a row that sees no key has lse -inf and output 0", "[gpu][attention]") {
  Stream stream;
  auto args = make_args(1, 1, 1, 80, 16, 64, true);  // rows 0..63 see nothing (j <= i - 64)
  auto q = random_vector<bfloat16>(args.q_elements(), 7), kv = random_vector<bfloat16>(args.kv_elements(), 8);
  auto gq = to_device(q, stream), gk = to_device(kv, stream);
  trellis::Buffer<bfloat16, trellis::Cuda> go(args.q_elements(), stream);
  trellis::Buffer<float, trellis::Cuda> glse(args.lse_elements(), stream);
  k::cuda::attention_forward(args, gq.data(), gk.data(), gk.data(), go.data(), glse.data(), stream);
  auto o = to_host(go);
  auto lse = to_host(glse);
  for (std::int64_t i = 0; i < 64; ++i) {
    INFO("row " << i);
    REQUIRE(std::isinf(lse[i]));
    REQUIRE(lse[i] < 0);
    for (std::int64_t p = 0; p < 64; ++p) REQUIRE(static_cast<float>(o[i * 64 + p]) == 0.0f);
  }
  REQUIRE(std::isfinite(lse[64]));
}

TEST_CASE("CUDA attention refuses unsupported arguments with trellis::Error", "[gpu][attention]") {
  Stream stream;
  trellis::Buffer<bfloat16, trellis::Cuda> buf(1 << 16, stream);
  trellis::Buffer<float, trellis::Cuda> lse(1 << 10, stream);
  auto args = make_args(1, 2, 2, 64, 64, 80, false);  // head_dim 80 unsupported
  REQUIRE_THROWS_AS(k::cuda::attention_forward(args, buf.data(), buf.data(), buf.data(), buf.data(), lse.data(), stream),
                    trellis::Error);
  args.head_dim = 64;
  args.kv_heads = 3;  // does not divide q_heads
  REQUIRE_THROWS_AS(k::cuda::attention_forward(args, buf.data(), buf.data(), buf.data(), buf.data(), lse.data(), stream),
                    trellis::Error);
  args.kv_heads = 2;
  REQUIRE_THROWS_AS(
      k::cuda::attention_forward(args, buf.data() + 1, buf.data(), buf.data(), buf.data(), lse.data(), stream),
      trellis::Error);  // misaligned q
  REQUIRE_THROWS_AS(k::cuda::attention_backward(args, buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                                                lse.data(), buf.data(), buf.data(), buf.data(), lse.data(), 16, stream),
                    trellis::Error);  // workspace too small
  trellis::Buffer<std::int32_t, trellis::Cuda> ids(64, stream);
  args.q_segments = ids.data();  // without kv_segments
  REQUIRE_THROWS_AS(k::cuda::attention_forward(args, buf.data(), buf.data(), buf.data(), buf.data(), lse.data(), stream),
                    trellis::Error);
  args.q_segments = nullptr, args.kv_segments = ids.data();  // without q_segments
  REQUIRE_THROWS_AS(k::cuda::attention_forward(args, buf.data(), buf.data(), buf.data(), buf.data(), lse.data(), stream),
                    trellis::Error);
}
