// Softmax cross-entropy against log-sum-exp / softmax written out in double, finite differences of
// that loss, and the vocab-parallel pieces (3 uneven shards, collectives done here serially)
// against the unsharded kernel. Tolerances: 1e-5 abs + 1e-5 rel in fp32.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/reference.hpp"
#include "trellis/kernels/xent_host.hpp"

using namespace trellis;
using namespace trellis::kernels;
using trellis_test::random_vector;
using trellis_test::require_close;

namespace {

struct XentRef {
  std::vector<double> loss, grad;
};

template <class T>
XentRef xent_ref(std::int64_t rows, std::int64_t vocab, std::int64_t ld, const std::vector<T>& logits,
                 const std::vector<std::int32_t>& targets, double grad_scale) {
  XentRef r;
  r.grad.assign(rows * vocab, 0.0);
  for (std::int64_t i = 0; i < rows; ++i) {
    double mx = -1e300;
    for (std::int64_t j = 0; j < vocab; ++j) mx = std::max(mx, double(float(logits[i * ld + j])));
    double s = 0;
    for (std::int64_t j = 0; j < vocab; ++j) s += std::exp(double(float(logits[i * ld + j])) - mx);
    const double lse = mx + std::log(s);
    const int t = targets[i];
    r.loss.push_back(t < 0 ? 0.0 : lse - double(float(logits[i * ld + t])));
    if (t < 0) continue;
    for (std::int64_t j = 0; j < vocab; ++j)
      r.grad[i * vocab + j] = grad_scale * (std::exp(double(float(logits[i * ld + j])) - lse) - (j == t ? 1.0 : 0.0));
  }
  return r;
}

std::vector<std::int32_t> make_targets(std::int64_t rows, std::int64_t vocab) {
  std::vector<std::int32_t> t(rows);
  for (std::int64_t i = 0; i < rows; ++i) t[i] = static_cast<std::int32_t>((i * 7919 + 13) % vocab);
  t[3] = -1;  // ignored row
  t[5] = static_cast<std::int32_t>(vocab - 1);
  return t;
}

template <class V>
std::vector<float> unpad(const V& g, std::int64_t rows, std::int64_t vocab, std::int64_t ld) {
  std::vector<float> out;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < vocab; ++j) out.push_back(static_cast<float>(g[i * ld + j]));
  return out;
}

}  // namespace

TEST_CASE("softmax cross-entropy forward, backward and fused in place vs double", "[kernels][xent]") {
  const std::int64_t rows = 13, vocab = 3001, ld = 3008;  // several 1024-column chunks, padded rows
  auto logits = random_vector<float>(rows * ld, 1, -8.0f, 8.0f);
  auto targets = make_targets(rows, vocab);
  const float scale = 1.0f / 12.0f;
  const XentRef ref = xent_ref(rows, vocab, ld, logits, targets, scale);

  std::vector<float> loss(rows), lse(rows);
  host::softmax_xent_forward(rows, vocab, ld, logits.data(), targets.data(), loss.data(), lse.data());
  require_close(loss, ref.loss, 1e-5, 1e-5, "loss");

  std::vector<float> grad(rows * vocab);
  host::softmax_xent_backward(rows, vocab, ld, logits.data(), targets.data(), lse.data(), scale, grad.data(), vocab);
  require_close(grad, ref.grad, 1e-7, 1e-5, "dlogits");

  // Fused, in place (dlogits overwrite the logits; padding columns untouched).
  auto inplace = logits;
  std::vector<float> loss2(rows);
  host::softmax_xent_forward_backward(rows, vocab, ld, inplace.data(), targets.data(), loss2.data(), scale,
                                      inplace.data(), ld);
  require_close(loss2, ref.loss, 1e-5, 1e-5, "fused loss");
  require_close(unpad(inplace, rows, vocab, ld), ref.grad, 1e-7, 1e-5, "fused in-place dlogits");
  REQUIRE(inplace[vocab] == logits[vocab]);  // padding column of row 0
}

TEST_CASE("cross-entropy gradient matches finite differences of the loss", "[kernels][xent]") {
  const std::int64_t rows = 3, vocab = 40;
  auto logits = random_vector<float>(rows * vocab, 2, -3.0f, 3.0f);
  std::vector<std::int32_t> targets = {4, 39, 0};
  std::vector<float> loss(rows), grad(rows * vocab);
  host::softmax_xent_forward_backward(rows, vocab, vocab, logits.data(), targets.data(), loss.data(), 1.0f,
                                      grad.data(), vocab);
  std::vector<double> x(logits.begin(), logits.end());
  auto total = [&]() {
    double s = 0;
    for (std::int64_t i = 0; i < rows; ++i) {
      double mx = -1e300, se = 0;
      for (std::int64_t j = 0; j < vocab; ++j) mx = std::max(mx, x[i * vocab + j]);
      for (std::int64_t j = 0; j < vocab; ++j) se += std::exp(x[i * vocab + j] - mx);
      s += mx + std::log(se) - x[i * vocab + targets[i]];
    }
    return s;
  };
  for (std::size_t e = 0; e < x.size(); ++e) {
    const double keep = x[e], h = 1e-6;
    x[e] = keep + h;
    const double up = total();
    x[e] = keep - h;
    const double down = total();
    x[e] = keep;
    REQUIRE(std::fabs(grad[e] - (up - down) / (2 * h)) <= 1e-5);
  }
}

TEST_CASE("vocab-parallel cross-entropy over uneven shards equals the unsharded kernel", "[kernels][xent]") {
  const std::int64_t rows = 9, vocab = 1000;
  auto logits = random_vector<float>(rows * vocab, 3, -6.0f, 6.0f);
  auto targets = make_targets(rows, vocab);
  const float scale = 0.25f;
  std::vector<float> loss(rows), lse(rows), grad(rows * vocab);
  host::softmax_xent_forward_backward(rows, vocab, vocab, logits.data(), targets.data(), loss.data(), scale,
                                      grad.data(), vocab, lse.data());

  const std::vector<std::int64_t> starts = {0, 334, 667, vocab};  // 3 ranks, uneven slices
  // Each rank's slice is a view into the full row (ld = vocab), as it would be after a column split.
  const int ranks = 3;
  std::vector<std::vector<float>> part(ranks, std::vector<float>(rows));
  std::vector<float> gmax(rows, -std::numeric_limits<float>::infinity()), gsum(rows, 0.0f), gtarget(rows, 0.0f);
  for (int r = 0; r < ranks; ++r) {  // local max -> all_reduce(max)
    host::xent_partial_max(rows, starts[r + 1] - starts[r], vocab, logits.data() + starts[r], part[r].data());
    for (std::int64_t i = 0; i < rows; ++i) gmax[i] = std::max(gmax[i], part[r][i]);
  }
  for (int r = 0; r < ranks; ++r) {  // local sum exp -> all_reduce(sum)
    host::xent_partial_sumexp(rows, starts[r + 1] - starts[r], vocab, logits.data() + starts[r], gmax.data(),
                              part[r].data());
    for (std::int64_t i = 0; i < rows; ++i) gsum[i] += part[r][i];
  }
  for (int r = 0; r < ranks; ++r) {  // target logit on its owner -> all_reduce(sum)
    host::xent_partial_target(rows, starts[r + 1] - starts[r], vocab, logits.data() + starts[r], targets.data(),
                              starts[r], part[r].data());
    for (std::int64_t i = 0; i < rows; ++i) gtarget[i] += part[r][i];
  }
  std::vector<float> sloss(rows), slse(rows);
  host::xent_finish(rows, gmax.data(), gsum.data(), gtarget.data(), targets.data(), sloss.data(), slse.data());
  require_close(sloss, std::vector<double>(loss.begin(), loss.end()), 1e-5, 1e-5, "sharded loss");
  require_close(slse, std::vector<double>(lse.begin(), lse.end()), 1e-5, 1e-6, "sharded lse");
  std::vector<float> sgrad(rows * vocab, 99.0f);
  for (int r = 0; r < ranks; ++r)
    host::xent_backward_sharded(rows, starts[r + 1] - starts[r], vocab, logits.data() + starts[r], targets.data(),
                                starts[r], slse.data(), scale, sgrad.data() + starts[r], vocab);
  require_close(sgrad, std::vector<double>(grad.begin(), grad.end()), 1e-7, 1e-5, "sharded dlogits");
}

TEST_CASE("cross-entropy with bfloat16 logits and gradients", "[kernels][xent]") {
  const std::int64_t rows = 6, vocab = 500;
  auto logits = random_vector<bfloat16>(rows * vocab, 4, -5.0f, 5.0f);
  auto targets = make_targets(rows, vocab);
  const XentRef ref = xent_ref(rows, vocab, vocab, logits, targets, 1.0);
  std::vector<float> loss(rows);
  std::vector<bfloat16> grad(rows * vocab);
  host::softmax_xent_forward_backward(rows, vocab, vocab, logits.data(), targets.data(), loss.data(), 1.0f,
                                      grad.data(), vocab);
  require_close(loss, ref.loss, 1e-5, 1e-5, "loss");
  require_close(grad, ref.grad, 1e-6, 8e-3, "bf16 dlogits");
}

TEST_CASE("cross-entropy rejects targets outside the vocabulary", "[kernels][xent]") {
  std::vector<float> logits(20), loss(2);
  std::vector<std::int32_t> targets = {1, 10};
  REQUIRE_THROWS_AS(host::softmax_xent_forward(2, 10, 10, logits.data(), targets.data(), loss.data()), Error);
}
