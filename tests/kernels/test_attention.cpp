// Host flash attention against softmax(scale q k^T) v written out in double (forward, lse and
// backward), against finite differences of that double reference, and partial merges against the
// full result. Shapes cover causal and not, q_len != kv_len (bottom-right causal alignment, rows
// with nothing visible), packed documents (segment ids) against each document run alone,
// ring-chunk causal offsets, GQA and MQA, head_dim 8 / 64 / 128 and lengths that are not tile
// multiples.
// Tolerances: fp32 inputs 2e-5 abs + 2e-4 rel (fp32 online softmax vs double); 16-bit inputs are
// compared with a reference computed from the same rounded inputs, with the output rounding
// (bf16: 2^-8, half: 2^-11 relative) added.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/reference.hpp"
#include "trellis/kernels/attention_host.hpp"

using namespace trellis;
using namespace trellis::kernels;
using trellis_test::random_vector;
using trellis_test::require_close;

namespace {

struct Reference {
  std::vector<double> o, lse, dq, dk, dv;
};

// Plain attention in double; also the gradients for upstream gradient d_o when given.
template <class T>
Reference naive_attention(const AttentionArgs& a, const std::vector<T>& q, const std::vector<T>& k,
                          const std::vector<T>& v, const std::vector<T>* d_o = nullptr) {
  const std::int64_t d = a.head_dim, tq = a.q_len, tk = a.kv_len;
  const double scale = a.softmax_scale();
  Reference r;
  r.o.assign(q.size(), 0.0);
  r.lse.assign(a.lse_elements(), -std::numeric_limits<double>::infinity());
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  auto f = [](T x) {
    if constexpr (std::is_same_v<T, double>) return x;  // finite differences need full precision
    else return static_cast<double>(static_cast<float>(x));
  };
  for (std::int64_t b = 0; b < a.batch; ++b)
    for (std::int64_t h = 0; h < a.q_heads; ++h) {
      const std::int64_t qb = (b * a.q_heads + h) * tq, kb = (b * a.kv_heads + h / (a.q_heads / a.kv_heads)) * tk;
      // Written out from the definition (kernels/attention.hpp), not through AttentionArgs' helpers.
      const std::int64_t off = a.causal_offset == AttentionArgs::bottom_right ? tk - tq : a.causal_offset;
      auto hidden = [&](std::int64_t i, std::int64_t j) {
        return (a.causal && j > i + off) || (a.q_segments && a.q_segments[b * tq + i] != a.kv_segments[b * tk + j]);
      };
      for (std::int64_t i = 0; i < tq; ++i) {
        std::vector<double> p(tk, 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < tk; ++j) {
          if (hidden(i, j)) continue;
          double s = 0;
          for (std::int64_t x = 0; x < d; ++x) s += f(q[(qb + i) * d + x]) * f(k[(kb + j) * d + x]);
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0;
        for (std::int64_t j = 0; j < tk; ++j) {
          const bool vis = !hidden(i, j);
          p[j] = vis ? std::exp(p[j] - mx) : 0.0;
          sum += p[j];
        }
        r.lse[qb + i] = mx + std::log(sum);
        for (auto& x : p) x /= sum;
        for (std::int64_t j = 0; j < tk; ++j)
          for (std::int64_t x = 0; x < d; ++x) r.o[(qb + i) * d + x] += p[j] * f(v[(kb + j) * d + x]);
        if (!d_o) continue;
        // dp_j = do . v_j;  ds_j = p_j (dp_j - sum_l p_l dp_l)
        std::vector<double> dp(tk, 0.0);
        double dot = 0;
        for (std::int64_t j = 0; j < tk; ++j) {
          for (std::int64_t x = 0; x < d; ++x) dp[j] += f((*d_o)[(qb + i) * d + x]) * f(v[(kb + j) * d + x]);
          dot += p[j] * dp[j];
        }
        for (std::int64_t j = 0; j < tk; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (std::int64_t x = 0; x < d; ++x) {
            r.dv[(kb + j) * d + x] += p[j] * f((*d_o)[(qb + i) * d + x]);
            r.dq[(qb + i) * d + x] += ds * f(k[(kb + j) * d + x]);
            r.dk[(kb + j) * d + x] += ds * f(q[(qb + i) * d + x]);
          }
        }
      }
    }
  return r;
}

AttentionArgs make_args(std::int64_t batch, std::int64_t hq, std::int64_t hkv, std::int64_t tq, std::int64_t tk,
                        std::int64_t d, bool causal) {
  AttentionArgs a;
  a.batch = batch, a.q_heads = hq, a.kv_heads = hkv, a.q_len = tq, a.kv_len = tk, a.head_dim = d, a.causal = causal;
  return a;
}

template <class T>
void check_forward_backward(const AttentionArgs& a, double abs_tol, double rel_tol) {
  auto q = random_vector<T>(a.q_elements(), 11, -1.5f, 1.5f);
  auto k = random_vector<T>(a.kv_elements(), 12, -1.5f, 1.5f);
  auto v = random_vector<T>(a.kv_elements(), 13);
  auto d_o = random_vector<T>(a.q_elements(), 14);
  std::vector<T> o(a.q_elements());
  std::vector<float> lse(a.lse_elements());
  host::attention_forward(a, q.data(), k.data(), v.data(), o.data(), lse.data());
  const Reference ref = naive_attention(a, q, k, v, &d_o);
  require_close(o, ref.o, abs_tol, rel_tol, "o");
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      REQUIRE(lse[i] == -std::numeric_limits<float>::infinity());
    } else {
      REQUIRE(std::fabs(lse[i] - ref.lse[i]) <= 1e-5 + 1e-5 * std::fabs(ref.lse[i]));
    }
  }
  std::vector<T> dq(q.size()), dk(k.size()), dv(v.size());
  host::attention_backward(a, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(), dk.data(),
                           dv.data());
  // The kernel's backward uses its own (rounded) o; compare with a looser tolerance for 16-bit.
  require_close(dq, ref.dq, abs_tol * 4, rel_tol * 4, "dq");
  require_close(dk, ref.dk, abs_tol * 4, rel_tol * 4, "dk");
  require_close(dv, ref.dv, abs_tol * 4, rel_tol * 4, "dv");
}

}  // namespace

TEST_CASE("attention forward/backward vs naive, fp32, causal and not, MHA/GQA/MQA, d = 8/64/128", "[kernels][attention]") {
  for (bool causal : {false, true})
    for (std::int64_t d : {8, 64, 128})
      for (std::int64_t hkv : {4, 2, 1}) {
        INFO("causal " << causal << " d " << d << " kv_heads " << hkv);
        check_forward_backward<float>(make_args(2, 4, hkv, 70, 70, d, causal), 2e-5, 2e-4);
      }
}

TEST_CASE("attention with q_len != kv_len (bottom-right causal), rows with nothing visible", "[kernels][attention]") {
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    check_forward_backward<float>(make_args(1, 2, 1, 50, 130, 64, causal), 2e-5, 2e-4);  // queries at the end
    check_forward_backward<float>(make_args(1, 2, 2, 100, 60, 16, causal), 2e-5, 2e-4);  // first 40 rows see nothing
    check_forward_backward<float>(make_args(1, 1, 1, 1, 129, 8, causal), 2e-5, 2e-4);    // decoding a single row
  }
}

TEST_CASE("attention with half and bfloat16 inputs (fp32 math)", "[kernels][attention]") {
  check_forward_backward<bfloat16>(make_args(1, 4, 2, 67, 67, 64, true), 8e-3, 8e-3);
  check_forward_backward<half>(make_args(1, 2, 1, 67, 67, 32, false), 2e-3, 2e-3);
}

namespace {
// The kernel's gradients of L = sum(o * w) against central differences of the double reference,
// every `stride`-th element of q, k and v.
void check_finite_differences(const AttentionArgs& a, std::uint32_t seed, std::size_t stride) {
  auto q = random_vector<double>(a.q_elements(), seed), k = random_vector<double>(a.kv_elements(), seed + 1),
       v = random_vector<double>(a.kv_elements(), seed + 2), w = random_vector<double>(a.q_elements(), seed + 3);
  auto loss = [&]() {
    const Reference r = naive_attention(a, q, k, v);
    double s = 0;
    for (std::size_t i = 0; i < r.o.size(); ++i) s += r.o[i] * w[i];
    return s;
  };
  auto tof = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
  auto qf = tof(q), kf = tof(k), vf = tof(v), wf = tof(w);
  std::vector<float> o(qf.size()), lse(a.lse_elements()), dq(qf.size()), dk(kf.size()), dv(vf.size());
  host::attention_forward(a, qf.data(), kf.data(), vf.data(), o.data(), lse.data());
  host::attention_backward(a, qf.data(), kf.data(), vf.data(), o.data(), wf.data(), lse.data(), dq.data(), dk.data(),
                           dv.data());
  const double h = 1e-5;
  auto fd = [&](std::vector<double>& x, std::size_t i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    return (up - down) / (2 * h);
  };
  for (std::size_t i = 0; i < q.size(); i += stride) REQUIRE(std::fabs(dq[i] - fd(q, i)) <= 2e-5);
  for (std::size_t i = 0; i < k.size(); i += stride) REQUIRE(std::fabs(dk[i] - fd(k, i)) <= 2e-5);
  for (std::size_t i = 0; i < v.size(); i += stride) REQUIRE(std::fabs(dv[i] - fd(v, i)) <= 2e-5);
}
}  // namespace

TEST_CASE("attention backward matches finite differences of the double reference", "[kernels][attention]") {
  check_finite_differences(make_args(1, 2, 1, 9, 11, 8, true), 21, 3);
}

TEST_CASE("merging partial attention over kv parts equals full attention (ring attention)", "[kernels][attention]") {
  const std::int64_t d = 64, t = 128, half_t = 64;
  SECTION("non-causal: kv split in two arbitrary parts") {
    const auto full = make_args(1, 2, 2, t, t, d, false);
    auto q = random_vector<float>(full.q_elements(), 31), k = random_vector<float>(full.kv_elements(), 32),
         v = random_vector<float>(full.kv_elements(), 33);
    std::vector<float> o(q.size()), lse(full.lse_elements());
    host::attention_forward(full, q.data(), k.data(), v.data(), o.data(), lse.data());
    // kv rows [0, 40) and [40, 128) of each head, as separate tensors.
    auto part = [&](std::int64_t j0, std::int64_t j1, std::vector<float>& po, std::vector<float>& pl) {
      auto a = full;
      a.kv_len = j1 - j0;
      std::vector<float> pk, pv;
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t j = j0; j < j1; ++j)
          for (std::int64_t x = 0; x < d; ++x) {
            pk.push_back(k[(h * t + j) * d + x]);
            pv.push_back(v[(h * t + j) * d + x]);
          }
      po.assign(q.size(), 0.0f);
      pl.assign(full.lse_elements(), 0.0f);
      host::attention_forward(a, q.data(), pk.data(), pv.data(), po.data(), pl.data());
    };
    std::vector<float> o1, l1, o2, l2;
    part(0, 40, o1, l1);
    part(40, t, o2, l2);
    host::merge_attention_partials(full.lse_elements(), d, o1.data(), l1.data(), o2.data(), l2.data());
    require_close(o1, o, 1e-6, 1e-5, "merged o");
    require_close(l1, lse, 1e-6, 1e-6, "merged lse");
  }
  SECTION("causal: second query chunk = earlier chunk (full) merged with the diagonal chunk (causal)") {
    const auto full = make_args(1, 1, 1, half_t, t, d, true);  // queries are the last 64 positions
    auto q = random_vector<float>(full.q_elements(), 41), k = random_vector<float>(full.kv_elements(), 42),
         v = random_vector<float>(full.kv_elements(), 43);
    std::vector<float> o(q.size()), lse(full.lse_elements());
    host::attention_forward(full, q.data(), k.data(), v.data(), o.data(), lse.data());
    auto earlier = make_args(1, 1, 1, half_t, half_t, d, false);
    auto diagonal = make_args(1, 1, 1, half_t, half_t, d, true);
    std::vector<float> o1(q.size()), l1(half_t), o2(q.size()), l2(half_t);
    host::attention_forward(earlier, q.data(), k.data(), v.data(), o1.data(), l1.data());
    host::attention_forward(diagonal, q.data(), k.data() + half_t * d, v.data() + half_t * d, o2.data(), l2.data());
    host::merge_attention_partials(half_t, d, o2.data(), l2.data(), o1.data(), l1.data());
    require_close(o2, o, 1e-6, 1e-5, "merged o");
    require_close(l2, lse, 1e-6, 1e-6, "merged lse");
    // Backward over the parts with the merged o/lse, accumulated, equals the full backward.
    auto d_o = random_vector<float>(q.size(), 44);
    std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
    host::attention_backward(full, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(), dk.data(),
                             dv.data());
    std::vector<float> pdq(q.size(), 0.0f), pdk(k.size(), 0.0f), pdv(v.size(), 0.0f);
    host::attention_backward(earlier, q.data(), k.data(), v.data(), o2.data(), d_o.data(), l2.data(), pdq.data(),
                             pdk.data(), pdv.data(), true);
    host::attention_backward(diagonal, q.data(), k.data() + half_t * d, v.data() + half_t * d, o2.data(), d_o.data(),
                             l2.data(), pdq.data(), pdk.data() + half_t * d, pdv.data() + half_t * d, true);
    require_close(pdq, dq, 1e-5, 1e-4, "dq over parts");
    require_close(pdk, dk, 1e-5, 1e-4, "dk over parts");
    require_close(pdv, dv, 1e-5, 1e-4, "dv over parts");
  }
}

namespace {

// Segment ids of packed documents: row b holds documents of the given lengths, one after another.
std::vector<std::int32_t> segment_ids(const std::vector<std::vector<std::int64_t>>& docs) {
  std::vector<std::int32_t> ids;
  for (const auto& row : docs) {
    std::int32_t id = 0;
    for (std::int64_t len : row) {
      ids.insert(ids.end(), static_cast<std::size_t>(len), id);
      ++id;
    }
  }
  return ids;
}

// Rows [t0, t0 + len) of every head of sequence b of x [batch, heads, t, d], as [heads, len, d].
std::vector<float> slice_rows(const std::vector<float>& x, std::int64_t b, std::int64_t heads, std::int64_t t,
                              std::int64_t d, std::int64_t t0, std::int64_t len) {
  std::vector<float> out;
  for (std::int64_t h = 0; h < heads; ++h) {
    const float* src = x.data() + ((b * heads + h) * t + t0) * d;
    out.insert(out.end(), src, src + len * d);
  }
  return out;
}

}  // namespace

TEST_CASE("packed documents: segmented attention equals every document run alone", "[kernels][attention][varlen]") {
  // Row 0 packs four documents (one of length 1, boundaries inside and on 64-row tiles), row 1 one.
  const std::vector<std::vector<std::int64_t>> docs = {{37, 64, 1, 48}, {150}};
  const std::int64_t t = 150, d = 32, hq = 4, hkv = 2;
  const auto ids = segment_ids(docs);
  for (bool causal : {true, false}) {
    INFO("causal " << causal);
    auto a = make_args(2, hq, hkv, t, t, d, causal);
    a.q_segments = a.kv_segments = ids.data();
    auto q = random_vector<float>(a.q_elements(), 61), k = random_vector<float>(a.kv_elements(), 62),
         v = random_vector<float>(a.kv_elements(), 63), d_o = random_vector<float>(a.q_elements(), 64);
    std::vector<float> o(q.size()), lse(a.lse_elements()), dq(q.size()), dk(k.size()), dv(v.size());
    host::attention_forward(a, q.data(), k.data(), v.data(), o.data(), lse.data());
    host::attention_backward(a, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(), dk.data(),
                             dv.data());
    for (std::int64_t b = 0; b < 2; ++b) {
      std::int64_t t0 = 0;
      for (std::int64_t len : docs[static_cast<std::size_t>(b)]) {
        INFO("sequence " << b << " document at " << t0 << " of length " << len);
        const auto alone = make_args(1, hq, hkv, len, len, d, causal);
        auto q1 = slice_rows(q, b, hq, t, d, t0, len), k1 = slice_rows(k, b, hkv, t, d, t0, len),
             v1 = slice_rows(v, b, hkv, t, d, t0, len), do1 = slice_rows(d_o, b, hq, t, d, t0, len);
        std::vector<float> o1(q1.size()), l1(static_cast<std::size_t>(hq * len)), gq(q1.size()), gk(k1.size()),
            gv(v1.size());
        host::attention_forward(alone, q1.data(), k1.data(), v1.data(), o1.data(), l1.data());
        host::attention_backward(alone, q1.data(), k1.data(), v1.data(), o1.data(), do1.data(), l1.data(), gq.data(),
                                 gk.data(), gv.data());
        require_close(slice_rows(o, b, hq, t, d, t0, len), o1, 1e-6, 1e-5, "o");
        std::vector<float> lse_doc;
        for (std::int64_t h = 0; h < hq; ++h)
          for (std::int64_t i = 0; i < len; ++i)
            lse_doc.push_back(lse[static_cast<std::size_t>((b * hq + h) * t + t0 + i)]);
        require_close(lse_doc, l1, 1e-6, 1e-6, "lse");
        require_close(slice_rows(dq, b, hq, t, d, t0, len), gq, 1e-6, 1e-5, "dq");
        require_close(slice_rows(dk, b, hkv, t, d, t0, len), gk, 1e-6, 1e-5, "dk");
        require_close(slice_rows(dv, b, hkv, t, d, t0, len), gv, 1e-6, 1e-5, "dv");
        t0 += len;
      }
    }
  }
}

TEST_CASE("segments and causal offsets against the double reference, and finite differences",
          "[kernels][attention][varlen]") {
  SECTION("q_len != kv_len with segments; offsets that hide whole rows or show everything") {
    // Queries are positions [40, 100) of a 100-token packed row; keys are all 100.
    const auto kv_ids = segment_ids({{30, 25, 45}});
    const std::vector<std::int32_t> q_ids(kv_ids.begin() + 40, kv_ids.end());
    for (std::int64_t offset : {AttentionArgs::bottom_right, std::int64_t{40}, std::int64_t{-20}, std::int64_t{500}}) {
      INFO("offset " << offset);
      auto a = make_args(1, 2, 1, 60, 100, 16, true);
      a.causal_offset = offset;
      a.q_segments = q_ids.data();
      a.kv_segments = kv_ids.data();
      check_forward_backward<float>(a, 2e-5, 2e-4);
    }
  }
  SECTION("bf16 with segments") {
    const auto ids = segment_ids({{5, 70, 20}});
    auto a = make_args(1, 2, 2, 95, 95, 64, true);
    a.q_segments = a.kv_segments = ids.data();
    check_forward_backward<bfloat16>(a, 8e-3, 8e-3);
  }
  SECTION("finite differences through a segmented causal mask") {
    const auto ids = segment_ids({{4, 1, 6}});
    auto a = make_args(1, 2, 1, 11, 11, 8, true);
    a.q_segments = a.kv_segments = ids.data();
    check_finite_differences(a, 71, 1);
  }
}

TEST_CASE("ring chunks: causal offsets and segments merged over kv chunks equal the whole packed sequence",
          "[kernels][attention][varlen]") {
  // A 256-token packed row cut into 4 chunks of 64; query chunk c attends to key chunks 0..c with
  // causal_offset = 64 (c - kc), partials merged by their lse (forward), then the backward of each
  // part with the merged o and lse, accumulated (what a ring attention does per step).
  const std::int64_t t = 256, L = 64, d = 16, chunks = 4;
  const auto ids = segment_ids({{50, 100, 3, 103}});
  auto full = make_args(1, 2, 2, t, t, d, true);
  full.q_segments = full.kv_segments = ids.data();
  auto q = random_vector<float>(full.q_elements(), 81), k = random_vector<float>(full.kv_elements(), 82),
       v = random_vector<float>(full.kv_elements(), 83), d_o = random_vector<float>(full.q_elements(), 84);
  std::vector<float> o(q.size()), lse(full.lse_elements()), dq(q.size()), dk(k.size()), dv(v.size());
  host::attention_forward(full, q.data(), k.data(), v.data(), o.data(), lse.data());
  host::attention_backward(full, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(), dk.data(),
                           dv.data());
  std::vector<float> cdk(k.size(), 0.0f), cdv(v.size(), 0.0f);
  for (std::int64_t c = 0; c < chunks; ++c) {
    INFO("query chunk " << c);
    auto qc = slice_rows(q, 0, 2, t, d, c * L, L), doc = slice_rows(d_o, 0, 2, t, d, c * L, L);
    std::vector<float> acc(qc.size(), 0.0f), acc_lse(static_cast<std::size_t>(2 * L), -std::numeric_limits<float>::infinity());
    auto part_args = [&](std::int64_t kc) {
      auto a = make_args(1, 2, 2, L, L, d, true);
      a.causal_offset = (c - kc) * L;
      a.q_segments = ids.data() + c * L;
      a.kv_segments = ids.data() + kc * L;
      return a;
    };
    for (std::int64_t kc = 0; kc <= c; ++kc) {
      auto kk = slice_rows(k, 0, 2, t, d, kc * L, L), vv = slice_rows(v, 0, 2, t, d, kc * L, L);
      std::vector<float> po(qc.size()), pl(static_cast<std::size_t>(2 * L));
      host::attention_forward(part_args(kc), qc.data(), kk.data(), vv.data(), po.data(), pl.data());
      host::merge_attention_partials(2 * L, d, acc.data(), acc_lse.data(), po.data(), pl.data());
    }
    require_close(acc, slice_rows(o, 0, 2, t, d, c * L, L), 1e-6, 1e-5, "merged o");
    std::vector<float> gq(qc.size(), 0.0f);
    for (std::int64_t kc = 0; kc <= c; ++kc) {
      auto kk = slice_rows(k, 0, 2, t, d, kc * L, L), vv = slice_rows(v, 0, 2, t, d, kc * L, L);
      std::vector<float> gk(kk.size()), gv(vv.size());
      host::attention_backward(part_args(kc), qc.data(), kk.data(), vv.data(), acc.data(), doc.data(), acc_lse.data(),
                               gq.data(), gk.data(), gv.data(), true);  // gk, gv start at zero
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t e = 0; e < L * d; ++e) {
          cdk[static_cast<std::size_t>((h * t + kc * L) * d + e)] += gk[static_cast<std::size_t>(h * L * d + e)];
          cdv[static_cast<std::size_t>((h * t + kc * L) * d + e)] += gv[static_cast<std::size_t>(h * L * d + e)];
        }
    }
    require_close(gq, slice_rows(dq, 0, 2, t, d, c * L, L), 1e-5, 1e-4, "dq over chunks");
  }
  require_close(cdk, dk, 1e-5, 1e-4, "dk over chunks");
  require_close(cdv, dv, 1e-5, 1e-4, "dv over chunks");
}

TEST_CASE("attention results are reproducible bit for bit, and bad shapes are rejected", "[kernels][attention]") {
  const auto a = make_args(2, 4, 1, 200, 200, 64, true);
  auto q = random_vector<float>(a.q_elements(), 51), k = random_vector<float>(a.kv_elements(), 52),
       v = random_vector<float>(a.kv_elements(), 53), d_o = random_vector<float>(a.q_elements(), 54);
  std::vector<float> o(q.size()), lse(a.lse_elements());
  host::attention_forward(a, q.data(), k.data(), v.data(), o.data(), lse.data());
  std::vector<float> dq1(q.size()), dk1(k.size()), dv1(v.size()), dq2(q.size()), dk2(k.size()), dv2(v.size());
  host::attention_backward(a, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq1.data(), dk1.data(),
                           dv1.data());
  host::attention_backward(a, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq2.data(), dk2.data(),
                           dv2.data());
  REQUIRE(dq1 == dq2);
  REQUIRE(dk1 == dk2);
  REQUIRE(dv1 == dv2);

  auto bad = a;
  bad.head_dim = 12;
  REQUIRE_THROWS_AS(host::attention_forward(bad, q.data(), k.data(), v.data(), o.data(), lse.data()), Error);
  bad = a;
  bad.q_heads = 4, bad.kv_heads = 3;
  REQUIRE_THROWS_AS(host::attention_forward(bad, q.data(), k.data(), v.data(), o.data(), lse.data()), Error);
  // Segment ids that decrease (documents not contiguous), or only one side of them.
  std::vector<std::int32_t> ids(2 * 200, 0);
  ids[300] = 1;  // sequence 1: ..., 0, 1, 0, ...
  bad = a;
  bad.q_segments = bad.kv_segments = ids.data();
  REQUIRE_THROWS_WITH(host::attention_forward(bad, q.data(), k.data(), v.data(), o.data(), lse.data()),
                      Catch::Contains("sequence 1") && Catch::Contains("position 101"));
  bad = a;
  bad.q_segments = ids.data();
  REQUIRE_THROWS_AS(host::attention_forward(bad, q.data(), k.data(), v.data(), o.data(), lse.data()), Error);
}
