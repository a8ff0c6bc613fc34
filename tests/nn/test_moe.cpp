// The Mixture-of-Experts MLP (nn/moe.hpp) against independent references:
//   - a per-token reference in double written out here (softmax, top-k, gates, capacity by token
//     order, each token through its chosen experts one by one): outputs, dropped copies, the
//     load-balancing loss and the z-loss against their formulas;
//   - central finite differences of L = sum(y * R) + w (aux + z) for every parameter and the input
//     (the data is checked to keep every top-k choice away from ties, so the loss is smooth);
//   - ep 2 and 4, alone and with tp 2 (with and without sp), against the one-rank block running
//     each ep rank's tokens as its own microbatch (fp32, 1e-5);
//   - edge cases: every token to one expert, capacity overflow, experts that get nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "support.hpp"
#include "trellis/nn/moe.hpp"

using namespace trellis;
using namespace trellis::nn;
using nn_test::Collector;
using nn_test::global_value;
using nn_test::rel_error;
using Comm = comm::ThreadComm;
using Moe = MoeMlp<Comm, backend::Host<float>>;

namespace {

constexpr const char* kName = "h.0.mlp";

struct Dims {
  index_t d = 16, H = 24;
};

// The block's parameters as global double arrays, from the same formula the ranks use.
struct GlobalParams {
  index_t d, H, E;
  std::vector<double> router, w1, b1, w2, b2;
};
std::vector<double> global_array(const std::string& name, index_t n, float scale) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) v[i] = global_value(name, i, scale);
  return v;
}
// Router weights get `router_scale` (larger: confident routing, far from ties), experts 0.2.
constexpr float kExpertScale = 0.2f;
GlobalParams global_params(const Dims& dims, index_t E, float router_scale) {
  const std::string n = kName;
  return {dims.d,
          dims.H,
          E,
          global_array(n + ".router.weight", dims.d * E, router_scale),
          global_array(n + ".experts.c_fc.weight", E * dims.d * dims.H, kExpertScale),
          global_array(n + ".experts.c_fc.bias", E * dims.H, kExpertScale),
          global_array(n + ".experts.c_proj.weight", E * dims.H * dims.d, kExpertScale),
          global_array(n + ".experts.c_proj.bias", E * dims.d, kExpertScale)};
}
void randomize(Moe& m, float router_scale) {
  m.for_each_parameter([&](Parameter& p) {
    const float scale = p.name.find("router") != std::string::npos ? router_scale : kExpertScale;
    for (index_t i = 0; i < p.numel(); ++i) p.value[i] = global_value(p.name, p.global_index(i), scale);
  });
}

double gelu(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}

struct Reference {
  std::vector<double> y;     // (rows, d)
  std::vector<int> choice;   // (rows, k)
  std::vector<double> gap;   // per row: logit margin between the k-th and the (k+1)-th choice
  std::int64_t dropped = 0;
  double aux = 0, z = 0;
};

// Each token through its chosen experts, one by one.
Reference reference(const GlobalParams& g, const MoeConfig& cfg, const std::vector<float>& x, index_t rows) {
  const index_t d = g.d, H = g.H, E = g.E;
  const int k = cfg.topk;
  Reference ref;
  ref.y.assign(static_cast<std::size_t>(rows * d), 0.0);
  std::vector<std::int64_t> taken(static_cast<std::size_t>(E), 0), routed(static_cast<std::size_t>(E), 0);
  std::vector<double> prob_sum(static_cast<std::size_t>(E), 0.0);
  const index_t cap = cfg.capacity_factor > 0 ? static_cast<index_t>(std::ceil(double(cfg.capacity_factor) * rows * k / E)) : rows * k;
  for (index_t r = 0; r < rows; ++r) {
    std::vector<double> z(static_cast<std::size_t>(E), 0.0);
    for (index_t e = 0; e < E; ++e)
      for (index_t i = 0; i < d; ++i) z[e] += double(x[r * d + i]) * g.router[i * E + e];
    const double mx = *std::max_element(z.begin(), z.end());
    double s = 0;
    for (double v : z) s += std::exp(v - mx);
    const double lse = mx + std::log(s);
    ref.z += lse * lse;
    std::vector<double> p(static_cast<std::size_t>(E));
    for (index_t e = 0; e < E; ++e) prob_sum[e] += (p[e] = std::exp(z[e] - lse));
    std::vector<int> order(static_cast<std::size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
    ref.gap.push_back(k < E ? z[order[k - 1]] - z[order[k]] : 1e9);
    double chosen = 0;
    for (int j = 0; j < k; ++j) chosen += p[order[j]];
    for (int j = 0; j < k; ++j) {
      const int e = order[j];
      ref.choice.push_back(e);
      ++routed[e];
      if (taken[e]++ >= cap) {
        ++ref.dropped;
        continue;
      }
      const double gate = k > 1 ? p[e] / chosen : p[e];
      for (index_t o = 0; o < d; ++o) {
        double out = g.b2[e * d + o];
        for (index_t h = 0; h < H; ++h) {
          double pre = g.b1[e * H + h];
          for (index_t i = 0; i < d; ++i) pre += double(x[r * d + i]) * g.w1[(e * d + i) * H + h];
          out += gelu(pre) * g.w2[(e * H + h) * d + o];
        }
        ref.y[r * d + o] += gate * out;
      }
    }
  }
  for (index_t e = 0; e < E; ++e) ref.aux += double(routed[e]) / (double(rows) * k) * prob_sum[e] / rows;
  ref.aux *= cfg.aux_loss_coef * E;
  ref.z *= cfg.z_loss_coef / rows;
  return ref;
}

std::vector<float> tokens(const std::string& what, index_t rows, index_t d, float scale = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(rows * d));
  for (index_t i = 0; i < rows * d; ++i) v[i] = global_value(what, i, scale);
  return v;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}
double max_abs(const std::vector<double>& b) {
  double m = 1e-30;
  for (double v : b) m = std::max(m, std::fabs(v));
  return m;
}

}  // namespace

TEST_CASE("MoE forward equals each token through its chosen experts; losses equal their formulas", "[nn][moe]") {
  const Dims dims;
  const index_t rows = 24;
  struct Setting {
    int experts, topk;
    float capacity;
  };
  for (Setting st : {Setting{4, 1, 0.0f}, Setting{4, 2, 0.0f}, Setting{8, 2, 1.0f}, Setting{4, 1, 0.5f}, Setting{6, 2, 1.25f}}) {
    DYNAMIC_SECTION("E " << st.experts << " top-" << st.topk << " capacity " << st.capacity) {
      MoeConfig cfg;
      cfg.experts = st.experts, cfg.topk = st.topk, cfg.capacity_factor = st.capacity;
      cfg.aux_loss_coef = 0.01f, cfg.z_loss_coef = 0.001f;
      nn_test::run_ranks(1, [&](Comm& c) {
        Moe m(kName, dims.d, dims.H, cfg, TensorParallel<Comm>{&c});
        randomize(m, 0.5f);
        const auto x = tokens("x", rows, dims.d);
        std::vector<float> y(x.size());
        m.forward(0, TokenShape{2, rows / 2}, x.data(), y.data());
        const Reference ref = reference(global_params(dims, st.experts, 0.5f), cfg, x, rows);
        CHECK(max_abs_diff(y, ref.y) <= 1e-5 * max_abs(ref.y));
        CHECK(m.dropped() == ref.dropped);
        if (st.capacity == 0.0f) CHECK(m.dropped() == 0);
        if (st.capacity == 0.5f) CHECK(m.dropped() > 0);  // the setting is meant to overflow
        CHECK(m.aux_loss() == Approx(ref.aux).epsilon(1e-5));
        CHECK(m.z_loss() == Approx(ref.z).epsilon(1e-5));
        std::int64_t routed = 0;
        for (auto n : m.load()) routed += n;
        CHECK(routed == rows * st.topk);
      });
    }
  }
}

namespace {

// Runs forward, backward_input (dy = R) and backward_weight of microbatch mb; returns y and dx.
struct Pass {
  std::vector<float> y, dx;
};
Pass run_pass(Moe& m, int mb, const TokenShape& shape, const std::vector<float>& x, const std::vector<float>& r) {
  Pass p{std::vector<float>(x.size()), std::vector<float>(x.size())};
  m.forward(mb, shape, x.data(), p.y.data());
  m.backward_input(mb, shape, r.data(), p.dx.data());
  m.backward_weight(mb);
  return p;
}

}  // namespace

TEST_CASE("MoE gradients of router, experts and input match central finite differences", "[nn][moe][fd]") {
  const Dims dims{8, 12};
  const index_t rows = 12;
  const double h = 1e-3, w = 0.7;  // step; the auxiliary losses' weight in L
  for (int topk : {1, 2}) {
    DYNAMIC_SECTION("top-" << topk) {
      MoeConfig cfg;
      cfg.experts = 4, cfg.topk = topk, cfg.capacity_factor = 1.0f;
      cfg.aux_loss_coef = 0.05f, cfg.z_loss_coef = 0.01f;
      auto x = tokens("fd.x", rows, dims.d);
      const auto R = tokens("fd.r", rows, dims.d);
      const TokenShape shape{1, rows};
      // No top-k choice may flip under a step of h, which makes L smooth here: a step on input
      // element (r, i) moves row r's logits by h Wr[i, :], one on router element (i, e) moves
      // logit e by h x[:, i]; either changes a margin by at most 2 h max(|x|, |Wr|).
      const GlobalParams g = global_params(dims, cfg.experts, 0.5f);
      const Reference ref = reference(g, cfg, x, rows);
      double max_x = 0, max_router = 0;
      for (float v : x) max_x = std::max(max_x, double(std::fabs(v)));
      for (double v : g.router) max_router = std::max(max_router, std::fabs(v));
      REQUIRE(*std::min_element(ref.gap.begin(), ref.gap.end()) > 2 * h * std::max(max_x, max_router));
      REQUIRE(ref.dropped > 0);  // the capacity drops copies, and the gradients still match
      nn_test::run_ranks(1, [&](Comm& c) {
        Moe m(kName, dims.d, dims.H, cfg, TensorParallel<Comm>{&c});
        randomize(m, 0.5f);
        m.set_aux_weight(static_cast<float>(w));
        const Pass base = run_pass(m, 0, shape, x, R);
        auto loss = [&]() {
          std::vector<float> y(x.size());
          m.forward(1, shape, x.data(), y.data());
          m.release(1);
          double l = 0;
          for (std::size_t i = 0; i < y.size(); ++i) l += double(y[i]) * R[i];
          return l + w * (m.aux_loss() + m.z_loss());
        };
        auto check = [&](const char* what, float& v, double analytic) {
          const float saved = v;
          v = static_cast<float>(saved + h);
          const double up = loss();
          v = static_cast<float>(saved - h);
          const double down = loss();
          v = saved;
          const double fd = (up - down) / (2 * h);
          INFO(what << ": finite difference " << fd << ", analytic " << analytic);
          CHECK(std::fabs(fd - analytic) <= 2e-3 + 2e-2 * std::fabs(analytic));
        };
        m.for_each_parameter([&](Parameter& p) {
          for (index_t i = 0; i < p.numel(); ++i) check(p.name.c_str(), p.value[i], p.grad[i]);
        });
        for (std::size_t i = 0; i < x.size(); ++i) check("input", x[i], base.dx[i]);
      });
    }
  }
}

TEST_CASE("MoE over ep 2 and 4, alone and with tp 2 (+sp), equals one rank running each ep rank's tokens", "[nn][moe][ep]") {
  const Dims dims;
  const TokenShape shape{2, 8};
  const index_t rows = shape.rows();
  struct Layout {
    int ep, tp;
    bool sp;
  };
  for (float capacity : {0.0f, 1.0f}) {
    for (Layout lay : {Layout{2, 1, false}, Layout{4, 1, false}, Layout{2, 2, false}, Layout{2, 2, true}}) {
      DYNAMIC_SECTION("ep " << lay.ep << " tp " << lay.tp << (lay.sp ? " sp" : "") << " capacity " << capacity) {
        MoeConfig cfg;
        cfg.experts = 8, cfg.topk = 2, cfg.capacity_factor = capacity;
        cfg.aux_loss_coef = 0.05f, cfg.z_loss_coef = 0.01f;
        auto x_of = [&](int q) { return tokens("ep.x." + std::to_string(q), rows, dims.d); };
        auto r_of = [&](int q) { return tokens("ep.r." + std::to_string(q), rows, dims.d); };

        // One rank: ep rank q's tokens are microbatch q.
        Collector one;
        std::vector<Pass> passes;
        std::vector<double> aux;
        std::int64_t dropped_one = 0;
        nn_test::run_ranks(1, [&](Comm& c) {
          Moe m(kName, dims.d, dims.H, cfg, TensorParallel<Comm>{&c});
          randomize(m, 0.5f);
          for (int q = 0; q < lay.ep; ++q) {
            passes.push_back(run_pass(m, q, shape, x_of(q), r_of(q)));
            aux.push_back(m.aux_loss() + m.z_loss());
          }
          m.for_each_parameter([&](Parameter& p) { one.put_grad(p); });
          dropped_one = m.dropped();
        });
        if (capacity > 0) CHECK(dropped_one > 0);

        Collector many;
        std::vector<float> router_sum(static_cast<std::size_t>(dims.d * cfg.experts), 0.0f);
        std::int64_t dropped_many = 0;
        std::mutex mu;
        nn_test::run_ranks(lay.ep * lay.tp, [&](Comm& world) {
          const int q = world.rank() / lay.tp, t = world.rank() % lay.tp;
          Comm tp = world.split(q, world.rank());
          Comm ep = world.split(t, world.rank());
          Moe m(kName, dims.d, dims.H, cfg, TensorParallel<Comm>{&tp, lay.sp}, ExpertParallel<Comm>{&ep});
          randomize(m, 0.5f);
          const index_t local = lay.sp ? rows / lay.tp : rows, first = lay.sp ? t * local : 0;
          auto slice = [&](const std::vector<float>& v) {
            return std::vector<float>(v.begin() + first * dims.d, v.begin() + (first + local) * dims.d);
          };
          const Pass p = run_pass(m, 0, shape, slice(x_of(q)), slice(r_of(q)));
          RANK_CHECK(rel_error(p.y, slice(passes[q].y)) <= 1e-5);
          RANK_CHECK(rel_error(p.dx, slice(passes[q].dx)) <= 1e-5);
          RANK_CHECK(m.aux_loss() + m.z_loss() == Approx(aux[q]).epsilon(1e-6));
          m.for_each_parameter([&](Parameter& par) {
            if (par.name.find("router") == std::string::npos) many.put_grad(par);
          });
          std::lock_guard lock(mu);
          if (t == 0) {
            for (std::size_t i = 0; i < router_sum.size(); ++i) router_sum[i] += m.router().grad[i];
            dropped_many += m.dropped();
          }
        });
        CHECK(dropped_many == dropped_one);
        CHECK(rel_error(router_sum, one.get(std::string(kName) + ".router.weight")) <= 1e-5);
        CHECK(many.replica_diff() <= 1e-6f);
        for (const std::string& key : one.keys()) {
          if (key.find("router") != std::string::npos) continue;
          INFO(key);
          CHECK(many.complete(key));
          CHECK(rel_error(many.get(key), one.get(key)) <= 1e-5);
        }
      }
    }
  }
}

TEST_CASE("MoE edge cases: one expert takes every token, capacity overflow, experts with nothing", "[nn][moe][edge]") {
  const Dims dims;
  const TokenShape shape{1, 6};
  const index_t rows = shape.rows();
  MoeConfig cfg;
  cfg.experts = 8, cfg.topk = 2, cfg.aux_loss_coef = 0.01f;
  for (float capacity : {0.0f, 0.5f}) {
    DYNAMIC_SECTION("capacity " << capacity) {
      cfg.capacity_factor = capacity;
      // Router: expert 3 far ahead for every token, expert 5 second: experts 0-2, 4, 6, 7 get
      // nothing, and on ep 4 ranks 0 and 3 hold only idle experts.
      auto bias_router = [&](Moe& m) {
        Parameter& r = m.router();
        for (index_t i = 0; i < dims.d; ++i) {
          r.value[i * cfg.experts + 3] += 5.0f;
          r.value[i * cfg.experts + 5] += 2.5f;
        }
      };
      std::vector<float> x(static_cast<std::size_t>(rows * dims.d), 0.0f);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + 0.1f * global_value("edge.x", static_cast<index_t>(i));
      const auto R = tokens("edge.r", rows, dims.d);
      Reference ref;
      GlobalParams g = global_params(dims, cfg.experts, 0.3f);
      for (index_t i = 0; i < dims.d; ++i) g.router[i * cfg.experts + 3] += 5.0, g.router[i * cfg.experts + 5] += 2.5;
      ref = reference(g, cfg, x, rows);
      for (index_t r = 0; r < rows; ++r) REQUIRE((ref.choice[r * 2] == 3 && ref.choice[r * 2 + 1] == 5));
      if (capacity > 0) CHECK(ref.dropped == 2 * rows - 2);  // capacity ceil(0.5 * 6 * 2 / 8) = 1 each
      Collector one;
      Pass serial;
      nn_test::run_ranks(1, [&](Comm& c) {
        Moe m(kName, dims.d, dims.H, cfg, TensorParallel<Comm>{&c});
        randomize(m, 0.3f);
        bias_router(m);
        serial = run_pass(m, 0, shape, x, R);
        CHECK(max_abs_diff(serial.y, ref.y) <= 1e-5 * max_abs(ref.y));
        CHECK(m.dropped() == ref.dropped);
        if (capacity > 0)  // tokens 1.. lost both copies: their output is exactly 0
          for (index_t i = dims.d; i < rows * dims.d; ++i) CHECK(serial.y[i] == 0.0f);
        m.for_each_parameter([&](Parameter& p) { one.put_grad(p); });
      });
      // ep 4, every rank with the same tokens: outputs and router gradients equal the one rank's,
      // expert gradients are 4 times its (each expert's owner gets the copies of all 4 ranks).
      Collector many;
      nn_test::run_ranks(4, [&](Comm& ep) {
        Comm self = ep.split(ep.rank(), 0);
        Moe m(kName, dims.d, dims.H, cfg, TensorParallel<Comm>{&self}, ExpertParallel<Comm>{&ep});
        randomize(m, 0.3f);
        bias_router(m);
        const Pass p = run_pass(m, 0, shape, x, R);
        RANK_CHECK(rel_error(p.y, serial.y) <= 1e-6);
        RANK_CHECK(rel_error(p.dx, serial.dx) <= 1e-6);
        RANK_CHECK(rel_error(m.router().grad, one.get(std::string(kName) + ".router.weight")) <= 1e-6);
        m.for_each_parameter([&](Parameter& par) {
          if (par.name.find("router") == std::string::npos) many.put_grad(par);
        });
      });
      for (const std::string& key : one.keys()) {
        if (key.find("router") != std::string::npos) continue;
        INFO(key);
        auto expect = one.get(key);
        for (float& v : expect) v *= 4.0f;
        CHECK(many.complete(key));
        CHECK(rel_error(many.get(key), expect) <= 1e-6);
      }
    }
  }
}
