// LayerNorm / RMSNorm against plain double formulas; backward against finite differences of the
// double forward (loss = sum(out * w)). Tolerances: fp32 1e-5 abs + 1e-5 rel for the forward,
// 1e-4 for gradients; 16-bit activations add their output rounding.
#include <catch2/catch.hpp>

#include <cmath>

#include "kernels/reference.hpp"
#include "trellis/kernels/norms_host.hpp"

using namespace trellis;
using namespace trellis::kernels;
using trellis_test::random_vector;
using trellis_test::require_close;

namespace {

// Double forward of one layer; rms selects RMSNorm (no mean, no bias).
std::vector<double> norm_ref(bool rms, std::int64_t rows, std::int64_t dim, const std::vector<double>& x,
                             const std::vector<double>& w, const std::vector<double>& b, double eps,
                             std::vector<double>* mean = nullptr, std::vector<double>* rstd = nullptr) {
  std::vector<double> out(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double mu = 0, var = 0;
    if (!rms) {
      for (std::int64_t j = 0; j < dim; ++j) mu += x[r * dim + j];
      mu /= dim;
    }
    for (std::int64_t j = 0; j < dim; ++j) var += (x[r * dim + j] - mu) * (x[r * dim + j] - mu);
    var /= dim;
    const double rs = 1.0 / std::sqrt(var + eps);
    for (std::int64_t j = 0; j < dim; ++j) out[r * dim + j] = (x[r * dim + j] - mu) * rs * w[j] + (rms ? 0.0 : b[j]);
    if (mean) mean->push_back(mu);
    if (rstd) rstd->push_back(rs);
  }
  return out;
}

template <class V>
std::vector<double> to_double(const V& v) {
  std::vector<double> d;
  for (auto x : v) d.push_back(static_cast<float>(x));
  return d;
}

// Gradients of loss = sum(norm(x) * g) by central differences of the double forward.
void finite_differences(bool rms, std::int64_t rows, std::int64_t dim, std::vector<double> x, std::vector<double> w,
                        std::vector<double> b, const std::vector<double>& g, double eps, std::vector<double>& dx,
                        std::vector<double>& dw, std::vector<double>& db) {
  auto loss = [&]() {
    auto out = norm_ref(rms, rows, dim, x, w, b, eps);
    double s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) s += out[i] * g[i];
    return s;
  };
  const double h = 1e-6;
  auto fd = [&](std::vector<double>& v, std::vector<double>& grad) {
    grad.assign(v.size(), 0.0);
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + h;
      const double up = loss();
      v[i] = keep - h;
      const double down = loss();
      v[i] = keep;
      grad[i] = (up - down) / (2 * h);
    }
  };
  fd(x, dx);
  fd(w, dw);
  if (!rms) fd(b, db);
}

}  // namespace

TEST_CASE("layernorm and rmsnorm forward vs double formula, with and without fused residual", "[kernels][norms]") {
  const std::int64_t rows = 70, dim = 100;
  const float eps = 1e-5f;
  auto x = random_vector<float>(rows * dim, 1, -2.0f, 3.0f), res = random_vector<float>(rows * dim, 2);
  auto w = random_vector<float>(dim, 3), b = random_vector<float>(dim, 4);
  for (bool rms : {false, true})
    for (bool residual : {false, true}) {
      INFO("rms " << rms << " residual " << residual);
      std::vector<double> in = to_double(x);
      if (residual)
        for (std::size_t i = 0; i < in.size(); ++i) in[i] += res[i];
      std::vector<double> mean, rstd;
      auto want = norm_ref(rms, rows, dim, in, to_double(w), to_double(b), eps, &mean, &rstd);
      std::vector<float> out(x.size()), sum(x.size()), m(rows), rs(rows);
      if (rms) {
        host::rmsnorm_forward(rows, dim, x.data(), w.data(), out.data(), rs.data(), eps, residual ? res.data() : nullptr,
                              residual ? sum.data() : nullptr);
      } else {
        host::layernorm_forward(rows, dim, x.data(), w.data(), b.data(), out.data(), m.data(), rs.data(), eps,
                                residual ? res.data() : nullptr, residual ? sum.data() : nullptr);
        require_close(m, mean, 1e-6, 1e-5, "mean");
      }
      require_close(out, want, 1e-5, 1e-5, "out");
      require_close(rs, rstd, 1e-6, 1e-5, "rstd");
      if (residual) require_close(sum, in, 1e-6, 1e-6, "residual sum");
    }
}

TEST_CASE("layernorm and rmsnorm backward vs finite differences", "[kernels][norms]") {
  const std::int64_t rows = 5, dim = 24;
  const float eps = 1e-5f;
  auto x = random_vector<float>(rows * dim, 5, -2.0f, 2.0f), g = random_vector<float>(rows * dim, 6);
  auto w = random_vector<float>(dim, 7), b = random_vector<float>(dim, 8);
  for (bool rms : {false, true}) {
    INFO("rms " << rms);
    std::vector<double> dx_ref, dw_ref, db_ref;
    finite_differences(rms, rows, dim, to_double(x), to_double(w), to_double(b), to_double(g), eps, dx_ref, dw_ref,
                       db_ref);
    std::vector<float> out(x.size()), m(rows), rs(rows), dx(x.size(), 0.5f);
    // Gradients accumulate into dw/db: start from known values.
    std::vector<float> dw(dim, 1.0f), db(dim, -1.0f);
    if (rms) {
      host::rmsnorm_forward(rows, dim, x.data(), w.data(), out.data(), rs.data(), eps);
      host::rmsnorm_backward(rows, dim, g.data(), x.data(), w.data(), rs.data(), dx.data(), dw.data(), true);
    } else {
      host::layernorm_forward(rows, dim, x.data(), w.data(), b.data(), out.data(), m.data(), rs.data(), eps);
      host::layernorm_backward(rows, dim, g.data(), x.data(), w.data(), m.data(), rs.data(), dx.data(), dw.data(),
                               db.data(), true);
      for (auto& v : db_ref) v -= 1.0;
      require_close(db, db_ref, 1e-4, 1e-4, "dbias");
    }
    for (auto& v : dx_ref) v += 0.5;  // accumulate_dinput
    for (auto& v : dw_ref) v += 1.0;
    require_close(dx, dx_ref, 1e-4, 1e-4, "dx");
    require_close(dw, dw_ref, 1e-4, 1e-4, "dweight");
  }
}

TEST_CASE("norms with bfloat16 activations and weights", "[kernels][norms]") {
  const std::int64_t rows = 33, dim = 64;
  auto x = random_vector<bfloat16>(rows * dim, 9, -2.0f, 2.0f);
  auto w = random_vector<bfloat16>(dim, 10), b = random_vector<bfloat16>(dim, 11);
  std::vector<bfloat16> out(x.size());
  std::vector<float> m(rows), rs(rows);
  host::layernorm_forward(rows, dim, x.data(), w.data(), b.data(), out.data(), m.data(), rs.data());
  auto want = norm_ref(false, rows, dim, to_double(x), to_double(w), to_double(b), 1e-5);
  require_close(out, want, 2e-2, 8e-3, "bf16 layernorm");
  // Backward: compare with the fp32 kernel on the same (rounded) values.
  auto g = random_vector<bfloat16>(rows * dim, 12);
  std::vector<bfloat16> dx(x.size());
  std::vector<bfloat16> dw(dim), db(dim);
  host::layernorm_backward(rows, dim, g.data(), x.data(), w.data(), m.data(), rs.data(), dx.data(), dw.data(), db.data());
  std::vector<float> xf(x.begin(), x.end()), gf(g.begin(), g.end()), wf(w.begin(), w.end()), dxf(x.size()), dwf(dim),
      dbf(dim);
  host::layernorm_backward(rows, dim, gf.data(), xf.data(), wf.data(), m.data(), rs.data(), dxf.data(), dwf.data(),
                           dbf.data());
  require_close(dx, to_double(dxf), 2e-2, 8e-3, "bf16 dx");
  require_close(dw, to_double(dwf), 2e-2, 8e-3, "bf16 dw");
  require_close(db, to_double(dbf), 2e-2, 8e-3, "bf16 db");
}

TEST_CASE("norms reject bad shapes and a residual without a destination", "[kernels][norms]") {
  std::vector<float> x(8), w(4), out(8), rs(2);
  REQUIRE_THROWS_AS(host::rmsnorm_forward(2, 0, x.data(), w.data(), out.data(), rs.data()), Error);
  REQUIRE_THROWS_AS(host::rmsnorm_forward(2, 4, x.data(), w.data(), out.data(), rs.data(), 1e-5f, x.data(),
                                          static_cast<float*>(nullptr)),
                    Error);
}
