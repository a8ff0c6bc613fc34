// Every tensor-parallel layer: tp=1 against central finite differences, and tp=2/4 on thread
// ranks against tp=1 (forward output, input gradient and every parameter gradient), with and
// without sequence parallelism and with and without chunked overlap; deferred/reordered
// B and W passes against immediate ones.
//
// Loss used throughout: L = sum(y * R) for a fixed global tensor R, so dL/dy = R.
// Tolerances: parallel vs serial 2e-5 of the tensor's max magnitude (only the summation order of
// the tp reductions differs); finite differences in fp32 with step 1e-2: |fd - analytic| <=
// 2e-3 + 2e-2 |analytic| (truncation O(h^2) and fp32 rounding of L / h).
#include <catch2/catch.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <numeric>
#include <span>
#include <type_traits>

#include "support.hpp"
#include "trellis/nn.hpp"

using namespace trellis;
using namespace trellis::nn;
using nn_test::Collector;
using nn_test::global_value;
using nn_test::rel_error;
using Comm = comm::ThreadComm;

namespace {

struct Geometry {
  TokenShape shape{2, 8};
  index_t in = 0, out = 0;  // global feature widths of the input and output
  bool in_norm_rows = true;   // input rows are norm-region rows (sharded under sp)
  bool out_norm_rows = true;  // output rows are norm-region rows
};

// Column maps of a layer's local input/output to global columns.
using ColumnMap = std::vector<index_t>;

ColumnMap identity_map(index_t n) {
  ColumnMap m(static_cast<std::size_t>(n));
  std::iota(m.begin(), m.end(), index_t{0});
  return m;
}
template <class L>
ColumnMap column_output_map(L& layer) {
  const auto& cfg = layer.config();
  const index_t groups = cfg.groups, local = layer.local_out_features() / groups, group_width = cfg.out / groups;
  const index_t off = layer.weight().shard_offsets[groups == 1 ? 1 : 2];
  ColumnMap m;
  for (index_t g = 0; g < groups; ++g)
    for (index_t c = 0; c < local; ++c) m.push_back(g * group_width + off + c);
  return m;
}
template <class L>
ColumnMap row_input_map(L& layer) {
  ColumnMap m;
  for (index_t c = 0; c < layer.local_in_features(); ++c) m.push_back(layer.weight().shard_offsets[0] + c);
  return m;
}

// A layer under test: how to build it and which columns it consumes/produces.
struct Case {
  std::string label;
  Geometry geo;
  // Builds the layer and returns forward/backward entry points bound to it.
  struct Bound {
    // x / y (and dy / dx) at fp32, whatever the layer's activation type.
    std::function<void(int, const TokenShape&, std::span<const float>, std::span<float>)> forward, backward_input;
    std::function<void(int)> backward_weight;
    std::function<void(const std::function<void(Parameter&)>&)> for_each_parameter;
    ColumnMap in_cols, out_cols;
    std::shared_ptr<void> keep;
  };
  // Builds the layer on backend::Host<float> (bf16 = false) or on backend::Host<bfloat16>.
  std::function<Bound(TensorParallel<Comm>, bool bf16)> make;
  bool has_bf16 = true;  // false: the layer does not take a backend yet
};

// Runs f(x', y') with x' the input in the layer's activation type T and y' an output buffer of T
// copied back to y (at T = float, x and y themselves).
template <class T, class F>
void in_act(std::span<const float> x, std::span<float> y, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    f(x.data(), y.data());
  } else {
    std::vector<T> xa(x.begin(), x.end()), ya(y.size());
    f(xa.data(), ya.data());
    for (std::size_t i = 0; i < ya.size(); ++i) y[i] = static_cast<float>(ya[i]);
  }
}

// A layer's activation type (float for layers that do not take a backend yet).
template <class L>
auto act_type() {
  if constexpr (requires { typename L::act_t; }) return typename L::act_t{};
  else return float{};
}

template <class L>
Case::Bound bind(std::shared_ptr<L> layer, ColumnMap in_cols, ColumnMap out_cols) {
  using T = decltype(act_type<L>());
  Case::Bound b;
  b.forward = [layer](int mb, const TokenShape& s, std::span<const float> x, std::span<float> y) {
    in_act<T>(x, y, [&](const T* xa, T* ya) { layer->forward(mb, s, xa, ya); });
  };
  b.backward_input = [layer](int mb, const TokenShape& s, std::span<const float> dy, std::span<float> dx) {
    in_act<T>(dy, dx, [&](const T* dya, T* dxa) { layer->backward_input(mb, s, dya, dxa); });
  };
  b.backward_weight = [layer](int mb) { layer->backward_weight(mb); };
  b.for_each_parameter = [layer](const std::function<void(Parameter&)>& f) { layer->for_each_parameter(f); };
  b.in_cols = std::move(in_cols);
  b.out_cols = std::move(out_cols);
  b.keep = layer;
  return b;
}

// f(backend) with backend::Host<float> or backend::Host<bfloat16>.
template <class F>
Case::Bound with_backend(bool bf16, F&& f) {
  if (bf16) return f(backend::Host<bfloat16>{});
  return f(backend::Host<float>{});
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  {
    Case c{"column (uneven 18 over tp)", {{2, 8}, 12, 18, true, false}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<ColumnParallelLinear<Comm, decltype(be)>>("col", LinearConfig{12, 18, true}, tp, be);
        return bind(l, identity_map(12), column_output_map(*l));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"column + fused GELU", {{2, 8}, 12, 20, true, false}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<ColumnParallelLinear<Comm, decltype(be)>>("fc", LinearConfig{12, 20, true, 1, 1, Activation::gelu_tanh}, tp, be);
        return bind(l, identity_map(12), column_output_map(*l));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"column grouped q/k/v (3 x 4 heads of 8)", {{2, 8}, 16, 96, true, false}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<ColumnParallelLinear<Comm, decltype(be)>>("qkv", LinearConfig{16, 96, true, 8, 3}, tp, be);
        return bind(l, identity_map(16), column_output_map(*l));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"column with an empty shard at tp=4 (3 outputs)", {{2, 8}, 6, 3, true, false}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<ColumnParallelLinear<Comm, decltype(be)>>("narrow", LinearConfig{6, 3, true}, tp, be);
        return bind(l, identity_map(6), column_output_map(*l));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"row (uneven 18 over tp)", {{2, 8}, 18, 12, false, true}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<RowParallelLinear<Comm, decltype(be)>>("row", LinearConfig{18, 12, true}, tp, be);
        return bind(l, row_input_map(*l), identity_map(12));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"row with an empty shard at tp=4 (3 inputs)", {{2, 8}, 3, 6, false, true}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<RowParallelLinear<Comm, decltype(be)>>("narrow_row", LinearConfig{3, 6, true}, tp, be);
        return bind(l, row_input_map(*l), identity_map(6));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"layernorm", {{2, 8}, 24, 24, true, true}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<LayerNorm<Comm, decltype(be)>>("h.0.ln_1", 24, tp, 1e-5f, be);
        return bind(l, identity_map(24), identity_map(24));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"attention (4 heads of 8)", {{2, 8}, 32, 32, true, true}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<CausalSelfAttention<Comm, decltype(be)>>("h.0.attn", 32, 4, tp, be);
        return bind(l, identity_map(32), identity_map(32));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"attention with uneven heads (6 of 8: 3+3 / 2+2+1+1)", {{1, 8}, 48, 48, true, true}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<CausalSelfAttention<Comm, decltype(be)>>("h.1.attn", 48, 6, tp, be);
        return bind(l, identity_map(48), identity_map(48));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"mlp", {{2, 8}, 16, 16, true, true}, {}};
    c.make = [](TensorParallel<Comm> tp, bool bf16) {
      return with_backend(bf16, [&](auto be) {
        auto l = std::make_shared<Mlp<Comm, decltype(be)>>("h.0.mlp", 16, 64, tp, be);
        return bind(l, identity_map(16), identity_map(16));
      });
    };
    cases.push_back(c);
  }
  {
    Case c{"transformer block", {{2, 8}, 32, 32, true, true}, {}};
    c.has_bf16 = false;
    c.make = [](TensorParallel<Comm> tp, bool) {
      auto l = std::make_shared<TransformerBlock<Comm>>("h.0", BlockConfig{32, 4, 0}, tp);
      return bind(l, identity_map(32), identity_map(32));
    };
    cases.push_back(c);
  }
  {
    Case c{"transformer block with recompute", {{2, 8}, 32, 32, true, true}, {}};
    c.has_bf16 = false;
    c.make = [](TensorParallel<Comm> tp, bool) {
      auto l = std::make_shared<TransformerBlock<Comm>>("h.0", BlockConfig{32, 4, 0, 1e-5f, true}, tp);
      return bind(l, identity_map(32), identity_map(32));
    };
    cases.push_back(c);
  }
  {
    Case c{"transformer block with dropout 0.2 and recompute", {{2, 8, 99}, 32, 32, true, true}, {}};
    c.has_bf16 = false;
    c.make = [](TensorParallel<Comm> tp, bool) {
      BlockConfig bc{32, 4, 0, 1e-5f, true, 0.2f};
      auto l = std::make_shared<TransformerBlock<Comm>>("h.0", bc, tp);
      return bind(l, identity_map(32), identity_map(32));
    };
    cases.push_back(c);
  }
  return cases;
}

struct RunOptions {
  int tp = 1;
  bool sp = false;
  int chunks = 1;
  int microbatches = 1;       // each with its own input; gradients accumulate
  bool deferred_w = false;    // F0 F1 .. B(n-1) .. B0, then W0 .. W(n-1), instead of F B W per microbatch
  bool bf16 = false;          // the layer on backend::Host<bfloat16>
};

// Global input / output-gradient of microbatch mb.
std::string tensor_name(char kind, int mb) {
  std::string name(1, kind);
  name += std::to_string(mb);
  return name;
}
float x_at(const Case& c, int mb, index_t row, index_t col) {
  return global_value(tensor_name('x', mb), row * c.geo.in + col, 0.8f);
}
float r_at(const Case& c, int mb, index_t row, index_t col) {
  return global_value(tensor_name('r', mb), row * c.geo.out + col, 1.0f);
}

// Runs the case; collects y / dx (per microbatch, keys "y0", "dx0", ...) and parameter gradients.
void run_case(const Case& c, const RunOptions& o, Collector& out) {
  nn_test::run_ranks(o.tp, [&](Comm& comm) {
    TensorParallel<Comm> tp{&comm, o.sp, o.chunks};
    auto layer = c.make(tp, o.bf16);
    layer.for_each_parameter([](Parameter& p) { nn_test::randomize(p, 0.3f); });
    const TokenShape shape = c.geo.shape;
    const index_t full = shape.rows(), local = tp.local_rows(shape);
    auto rows_of = [&](bool norm_rows) { return norm_rows ? local : full; };
    auto first_row = [&](bool norm_rows) { return norm_rows && o.sp ? comm.rank() * local : index_t{0}; };
    const index_t in_rows = rows_of(c.geo.in_norm_rows), out_rows = rows_of(c.geo.out_norm_rows);
    const index_t in0 = first_row(c.geo.in_norm_rows), out0 = first_row(c.geo.out_norm_rows);
    const index_t in_w = static_cast<index_t>(layer.in_cols.size()), out_w = static_cast<index_t>(layer.out_cols.size());
    std::vector<std::vector<float>> xs, ys, dys, dxs;
    for (int mb = 0; mb < o.microbatches; ++mb) {
      std::vector<float> x(in_rows * in_w), dy(out_rows * out_w);
      for (index_t i = 0; i < in_rows; ++i)
        for (index_t j = 0; j < in_w; ++j) x[i * in_w + j] = x_at(c, mb, in0 + i, layer.in_cols[j]);
      for (index_t i = 0; i < out_rows; ++i)
        for (index_t j = 0; j < out_w; ++j) dy[i * out_w + j] = r_at(c, mb, out0 + i, layer.out_cols[j]);
      xs.push_back(x), dys.push_back(dy);
      ys.emplace_back(out_rows * out_w), dxs.emplace_back(in_rows * in_w);
    }
    if (o.deferred_w) {
      for (int mb = 0; mb < o.microbatches; ++mb) layer.forward(mb, shape, xs[mb], ys[mb]);
      for (int mb = o.microbatches - 1; mb >= 0; --mb) layer.backward_input(mb, shape, dys[mb], dxs[mb]);
      for (int mb = 0; mb < o.microbatches; ++mb) layer.backward_weight(mb);
    } else {
      for (int mb = 0; mb < o.microbatches; ++mb) {
        layer.forward(mb, shape, xs[mb], ys[mb]);
        layer.backward_input(mb, shape, dys[mb], dxs[mb]);
        layer.backward_weight(mb);
      }
    }
    std::vector<Parameter*> params;  // LayerNorm's gradients under sp are Partial over tp: summed once
    layer.for_each_parameter([&](Parameter& p) { params.push_back(&p); });
    reduce_tp_partial_grads(comm, params);
    for (int mb = 0; mb < o.microbatches; ++mb) {
      const std::string s = std::to_string(mb);
      for (index_t i = 0; i < out_rows; ++i)
        for (index_t j = 0; j < out_w; ++j)
          out.put("y" + s, full * c.geo.out, (out0 + i) * c.geo.out + layer.out_cols[j], ys[mb][i * out_w + j]);
      for (index_t i = 0; i < in_rows; ++i)
        for (index_t j = 0; j < in_w; ++j)
          out.put("dx" + s, full * c.geo.in, (in0 + i) * c.geo.in + layer.in_cols[j], dxs[mb][i * in_w + j]);
    }
    layer.for_each_parameter([&](Parameter& p) { out.put_grad(p); });
  });
}

// L = sum(y * R) at tp = 1 for the given parameter perturbation (or input perturbation).
double loss_tp1(const Case& c, const std::string& param, index_t param_index, index_t x_index, float delta) {
  double loss = 0.0;
  nn_test::run_ranks(1, [&](Comm& comm) {
    TensorParallel<Comm> tp{&comm, false, 1};
    auto layer = c.make(tp, false);
    layer.for_each_parameter([&](Parameter& p) {
      nn_test::randomize(p, 0.3f);
      if (p.name == param) p.value[param_index] += delta;
    });
    const index_t rows = c.geo.shape.rows();
    std::vector<float> x(rows * c.geo.in), y(rows * c.geo.out);
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < c.geo.in; ++j) x[i * c.geo.in + j] = x_at(c, 0, i, j);
    if (x_index >= 0) x[x_index] += delta;
    layer.forward(0, c.geo.shape, x, y);
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < c.geo.out; ++j) loss += static_cast<double>(y[i * c.geo.out + j]) * r_at(c, 0, i, j);
  });
  return loss;
}

void check_fd(double fd, double analytic, const std::string& what) {
  INFO(what << ": finite difference " << fd << " analytic " << analytic);
  CHECK(std::fabs(fd - analytic) <= 2e-3 + 2e-2 * std::fabs(analytic));
}

}  // namespace

TEST_CASE("tp=1 layers match central finite differences", "[nn][fd]") {
  constexpr float h = 1e-2f;
  for (const Case& c : all_cases()) {
    SECTION(c.label) {
      Collector analytic;
      run_case(c, {}, analytic);
      // Input gradient at a few positions.
      const auto dx = analytic.get("dx0");
      for (index_t k : {index_t{0}, static_cast<index_t>(dx.size() / 3), static_cast<index_t>(dx.size() - 1)}) {
        const double fd = (loss_tp1(c, "", 0, k, h) - loss_tp1(c, "", 0, k, -h)) / (2.0 * h);
        check_fd(fd, dx[k], c.label + " dx[" + std::to_string(k) + "]");
      }
      // Two elements of every parameter (global index == local index at tp = 1).
      for (const std::string& name : analytic.keys()) {
        if (name.rfind("y", 0) == 0 || name.rfind("dx", 0) == 0) continue;
        const auto g = analytic.get(name);
        for (index_t k : {index_t{1} % static_cast<index_t>(g.size()), static_cast<index_t>(g.size() * 2 / 3)}) {
          const double fd = (loss_tp1(c, name, k, -1, h) - loss_tp1(c, name, k, -1, -h)) / (2.0 * h);
          check_fd(fd, g[k], name + "[" + std::to_string(k) + "]");
        }
      }
    }
  }
}

TEST_CASE("tp=2 and tp=4 layers equal tp=1 (with/without sp and overlap)", "[nn][tp]") {
  for (const Case& c : all_cases()) {
    Collector ref;
    run_case(c, {}, ref);
    for (int tp : {2, 4}) {
      for (bool sp : {false, true})
        for (int chunks : {1, 3}) {
          Collector got;
          run_case(c, {tp, sp, chunks}, got);
          INFO(c.label << " tp=" << tp << " sp=" << sp << " chunks=" << chunks);
          CHECK(got.replica_diff() <= 1e-6f);
          for (const std::string& key : ref.keys()) {
            INFO(key);
            REQUIRE(got.complete(key));
            CHECK(rel_error(got.get(key), ref.get(key)) <= 2e-5);
          }
        }
    }
  }
}

// Host bf16 (the CUDA rounding points: bf16 activations and GEMM operands, fp32 accumulation,
// weights, statistics and gradients): each layer against its fp32 run, and tp2 (with and without
// sp) against the one-rank bf16 run. Both differ by bf16 rounding only: inputs, weights and
// outputs are rounded to 8 bits of mantissa (2^-9 relative), a tp reduction rounds its sum once.
// Tolerance 3e-2 of the tensor's largest element (measured: see the printed maxima).
TEST_CASE("layers on backend::Host<bfloat16> track fp32; tp layouts track one bf16 rank", "[nn][bf16]") {
  constexpr double tolerance = 3e-2;
  double worst_precision = 0, worst_layout = 0;
  for (const Case& c : all_cases()) {
    if (!c.has_bf16) continue;
    Collector fp32, bf16;
    run_case(c, {}, fp32);
    RunOptions one;
    one.bf16 = true;
    run_case(c, one, bf16);
    for (const std::string& key : fp32.keys()) {
      INFO(c.label << " bf16 vs fp32: " << key);
      const double e = rel_error(bf16.get(key), fp32.get(key));
      worst_precision = std::max(worst_precision, e);
      CHECK(e <= tolerance);
      CHECK(e > 0.0);  // the bf16 run really rounded
    }
    for (bool sp : {false, true}) {
      RunOptions o{2, sp, 1};
      o.bf16 = true;
      Collector got;
      run_case(c, o, got);
      for (const std::string& key : bf16.keys()) {
        INFO(c.label << " bf16 tp2 sp=" << sp << " vs bf16 tp1: " << key);
        REQUIRE(got.complete(key));
        const double e = rel_error(got.get(key), bf16.get(key));
        worst_layout = std::max(worst_layout, e);
        CHECK(e <= tolerance);
      }
    }
  }
  WARN("host bf16 layers: largest error vs fp32 " << worst_precision << ", tp2 vs one bf16 rank " << worst_layout);
}

TEST_CASE("deferred, reordered backward_weight equals immediate F-B-W per microbatch", "[nn][bw]") {
  for (const Case& c : all_cases()) {
    for (int tp : {1, 2}) {
      Collector immediate, deferred;
      run_case(c, {tp, tp == 2, 2, 3, false}, immediate);
      run_case(c, {tp, tp == 2, 2, 3, true}, deferred);
      INFO(c.label << " tp=" << tp);
      for (const std::string& key : immediate.keys()) {
        INFO(key);
        CHECK(rel_error(deferred.get(key), immediate.get(key)) <= 1e-6);
      }
    }
  }
}

TEST_CASE("layers reject bad configurations with trellis::Error", "[nn][errors]") {
  nn_test::run_ranks(2, [&](Comm& comm) {
    TensorParallel<Comm> tp{&comm, true, 1};
    LayerNorm<Comm> ln("ln", 8, tp);
    std::vector<float> x(3 * 8), y(3 * 8);
    // seq 3 does not split over tp = 2 under sequence parallelism.
    RANK_CHECK_THROWS_AS(ln.forward(0, TokenShape{1, 3}, x.data(), y.data()), Error);
    RANK_CHECK_THROWS_AS(ln.backward_weight(5), Error);  // no forward for microbatch 5
    RANK_CHECK_THROWS_AS(CausalSelfAttention<Comm>("attn", 12, 5, tp), Error);  // 12 not a multiple of 5
    RANK_CHECK_THROWS_AS(CausalSelfAttention<Comm>("attn", 8, 1, tp), Error);   // 1 head over 2 ranks
    RANK_CHECK_THROWS_AS((ColumnParallelLinear<Comm>("c", LinearConfig{4, 10, true, 4, 1}, tp)), Error);
  });
}

// ---- overlap is real: a Communicator wrapper that logs each collective ----------------------
namespace {
// Forwards every operation to a ThreadComm and appends its name to a per-rank log, so a test
// can see which collectives a layer issues and whether they were asynchronous.
class LoggingComm {
 public:
  using request_type = comm::ThreadComm::request_type;
  using space = Host;
  LoggingComm(Comm& inner, std::vector<std::string>& log) : inner_(&inner), log_(&log) {}
  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  void set_timeout(std::chrono::milliseconds t) { inner_->set_timeout(t); }
#define NN_TEST_FORWARD(name)                                \
  template <class... A>                                      \
  decltype(auto) name(A&&... a) {                            \
    log_->push_back(#name);                                  \
    return inner_->name(std::forward<A>(a)...);              \
  }
  NN_TEST_FORWARD(all_reduce)
  NN_TEST_FORWARD(reduce)
  NN_TEST_FORWARD(broadcast)
  NN_TEST_FORWARD(all_gather)
  NN_TEST_FORWARD(reduce_scatter)
  NN_TEST_FORWARD(all_to_all)
  NN_TEST_FORWARD(all_to_allv)
  NN_TEST_FORWARD(send)
  NN_TEST_FORWARD(recv)
  NN_TEST_FORWARD(barrier)
  NN_TEST_FORWARD(all_reduce_async)
  NN_TEST_FORWARD(all_gather_async)
  NN_TEST_FORWARD(reduce_scatter_async)
  NN_TEST_FORWARD(isend)
  NN_TEST_FORWARD(irecv)
  NN_TEST_FORWARD(batch)
#undef NN_TEST_FORWARD
  LoggingComm split(int, int) { throw Error("LoggingComm::split is not needed by the layers"); }

 private:
  Comm* inner_;
  std::vector<std::string>* log_;
};
static_assert(comm::Communicator<LoggingComm>);

std::map<std::string, int> tally(const std::vector<std::string>& log) {
  std::map<std::string, int> t;
  for (const auto& s : log) ++t[s];
  return t;
}
}  // namespace

TEST_CASE("overlap splits each tp collective into async chunks", "[nn][overlap]") {
  const TokenShape shape{2, 8};  // 16 rows; sp: 8 per rank
  nn_test::run_ranks(2, [&](Comm& inner) {
    for (bool sp : {false, true}) {
      std::vector<std::string> log;
      LoggingComm comm(inner, log);
      TensorParallel<LoggingComm> tp{&comm, sp, 4};
      ColumnParallelLinear<LoggingComm> col("c", LinearConfig{8, 12, true}, tp);
      RowParallelLinear<LoggingComm> row("r", LinearConfig{12, 8, true}, tp);
      const index_t local = tp.local_rows(shape);
      std::vector<float> x(local * 8, 0.5f), h(16 * 6), y(local * 8), dh(16 * 6), dx(local * 8);
      col.forward(0, shape, x.data(), h.data());
      auto fwd_col = tally(log);
      log.clear();
      row.forward(0, shape, h.data(), y.data());
      auto fwd_row = tally(log);
      log.clear();
      row.backward_input(0, shape, y.data(), dh.data());
      auto bwd_row = tally(log);
      log.clear();
      col.backward_input(0, shape, dh.data(), dx.data());
      auto bwd_col = tally(log);
      if (sp) {
        // 4 chunks of each rank's 8 rows: 4 async gathers in, 4 async reduce-scatters out.
        RANK_CHECK(fwd_col == std::map<std::string, int>{{"all_gather_async", 4}});
        RANK_CHECK(fwd_row == std::map<std::string, int>{{"reduce_scatter_async", 4}});
        RANK_CHECK(bwd_row == std::map<std::string, int>{{"all_gather_async", 4}});
        // + the re-gather of the saved input shard (Megatron), also asynchronous.
        RANK_CHECK(bwd_col == std::map<std::string, int>{{"all_gather_async", 1}, {"reduce_scatter_async", 4}});
      } else {
        RANK_CHECK(fwd_col.empty());
        RANK_CHECK(fwd_row == std::map<std::string, int>{{"all_reduce_async", 4}});
        RANK_CHECK(bwd_row.empty());
        RANK_CHECK(bwd_col == std::map<std::string, int>{{"all_reduce_async", 4}});
      }
      col.backward_weight(0);
      row.backward_weight(0);
    }
  });
}

TEST_CASE("parameters say their sharding as placements; boxes follow from them", "[nn][placement]") {
  const shard::PlacementCode R = shard::replicate_code(), P = shard::partial_code(comm::ReduceOp::sum);
  nn_test::run_ranks(2, [&](Comm& comm) {
    const int r = comm.rank();
    for (bool sp : {false, true}) {
      TensorParallel<Comm> tp{&comm, sp, 1};
      // fused q/k/v: 3 groups of 12 columns in units of 4 (3 heads): rank 0 holds 2 heads, rank 1 one.
      ColumnParallelLinear<Comm> qkv("c_attn", LinearConfig{8, 36, true, 4, 3}, tp);
      const Parameter& w = qkv.weight();
      RANK_CHECK((w.sharding.value == ParamPlacements{R, shard::shard_code(2)}));
      RANK_CHECK((w.sharding.grad == ParamPlacements{P, shard::shard_code(2)}));
      RANK_CHECK((w.sharded_shape == std::vector<index_t>{8, 3, 12}));
      RANK_CHECK((w.shard_offsets == std::vector<index_t>{0, 0, r == 0 ? 0 : 8}));
      RANK_CHECK((w.shard_shape == std::vector<index_t>{8, 3, r == 0 ? 8 : 4}));
      RANK_CHECK(qkv.bias().shard_offsets == std::vector<index_t>({0, r == 0 ? 0 : 8}));
      // row-parallel: input rows in units of 4; the bias whole, its gradient too (full dy on every rank)
      RowParallelLinear<Comm> proj("c_proj", LinearConfig{12, 8, true, 4}, tp);
      RANK_CHECK((proj.weight().shard_offsets == std::vector<index_t>{r == 0 ? 0 : 8, 0}));
      RANK_CHECK((proj.weight().shard_shape == std::vector<index_t>{r == 0 ? 8 : 4, 8}));
      RANK_CHECK((proj.bias().sharding.grad == ParamPlacements{P, R}));
      RANK_CHECK((proj.bias().replicated() && !proj.bias().tp_partial_grad()));
      // LayerNorm: whole; under sp each rank's gradient is a term of the sum over tp
      LayerNorm<Comm> ln("ln_1", 8, tp);
      RANK_CHECK(ln.weight().replicated());
      RANK_CHECK((ln.weight().sharding.grad == ParamPlacements{P, sp ? P : R}));
      RANK_CHECK(ln.bias().tp_partial_grad() == sp);
      // vocab-parallel embedding: rows of wte over tp (10 over 2: 5 and 5), wpe whole
      VocabParallelEmbedding<Comm> emb(10, 4, 8, tp);
      RANK_CHECK((emb.wte().sharding.value == ParamPlacements{R, shard::shard_code(0)}));
      RANK_CHECK((emb.wte().shard_offsets == std::vector<index_t>{r * 5, 0}));
      RANK_CHECK((emb.vocab_range() == shard::Chunk{r * 5, 5}));
    }
  });
}

TEST_CASE("LayerNorm under sp leaves Partial(sum) gradients over tp; one reduction gives tp=1's", "[nn][placement]") {
  constexpr index_t kDim = 16;
  const TokenShape shape{2, 4};  // 8 rows; sp: 4 per rank
  auto input = [&](index_t row, index_t col) { return global_value("x", row * kDim + col, 0.8f); };
  auto dout = [&](index_t row, index_t col) { return global_value("r", row * kDim + col, 1.0f); };
  // Gradients (weight then bias) per rank, and the tp collectives issued per rank.
  auto run = [&](int tp_size, bool sp, bool reduce, bool pack, std::vector<std::vector<float>>& grads,
                 std::vector<std::map<std::string, int>>& calls) {
    grads.assign(static_cast<std::size_t>(tp_size), {});
    calls.assign(static_cast<std::size_t>(tp_size), {});
    nn_test::run_ranks(tp_size, [&](Comm& inner) {
      std::vector<std::string> log;
      LoggingComm comm(inner, log);
      TensorParallel<LoggingComm> tp{&comm, sp, 1};
      LayerNorm<LoggingComm> ln("ln", kDim, tp);
      ln.for_each_parameter([](Parameter& p) { nn_test::randomize(p, 0.3f); });
      std::vector<Parameter*> ps{&ln.weight(), &ln.bias()};
      ParameterBuffer<backend::Host<float>> packed;
      if (pack) packed = ParameterBuffer<backend::Host<float>>(std::span<Parameter* const>(ps));
      const index_t rows = tp.local_rows(shape), first = sp ? comm.rank() * rows : 0;
      std::vector<float> x(rows * kDim), y(rows * kDim), dy(rows * kDim), dx(rows * kDim);
      for (index_t i = 0; i < rows; ++i)
        for (index_t j = 0; j < kDim; ++j) x[i * kDim + j] = input(first + i, j), dy[i * kDim + j] = dout(first + i, j);
      ln.forward(0, shape, x.data(), y.data());
      ln.backward_input(0, shape, dy.data(), dx.data());
      ln.backward_weight(0);
      if (reduce) reduce_tp_partial_grads(comm, ps);
      std::vector<float> g(ln.weight().grad.begin(), ln.weight().grad.end());
      g.insert(g.end(), ln.bias().grad.begin(), ln.bias().grad.end());
      grads[static_cast<std::size_t>(comm.rank())] = g;
      calls[static_cast<std::size_t>(comm.rank())] = tally(log);
    });
  };
  std::vector<std::vector<float>> serial, partial, reduced, reduced_packed;
  std::vector<std::map<std::string, int>> c0, c1, c2, c3;
  run(1, false, true, false, serial, c0);
  run(2, true, false, false, partial, c1);
  run(2, true, true, false, reduced, c2);
  run(2, true, true, true, reduced_packed, c3);
  const std::vector<float>& want = serial[0];
  std::vector<float> sum(want.size());
  for (std::size_t i = 0; i < want.size(); ++i) sum[i] = partial[0][i] + partial[1][i];
  CHECK(rel_error(sum, want) <= 1e-6);        // the terms add up to the whole gradient
  CHECK(rel_error(partial[0], want) > 1e-2);   // and each alone is not it
  for (const auto& g : reduced) CHECK(rel_error(g, want) <= 1e-6);
  for (const auto& g : reduced_packed) CHECK(rel_error(g, want) <= 1e-6);
  // The layer itself communicates nothing; the reduction is one all-reduce per gradient, or one
  // for both when they are packed next to each other.
  for (int r = 0; r < 2; ++r) {
    CHECK(c1[r].empty());
    CHECK(c2[r] == std::map<std::string, int>{{"all_reduce_async", 2}});
    CHECK(c3[r] == std::map<std::string, int>{{"all_reduce_async", 1}});
  }
}
