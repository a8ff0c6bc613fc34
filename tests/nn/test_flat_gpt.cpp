// nn::FlatGpt (the one-device GPT-2 the CUDA backend runs) against nn::GptModel on one thread rank
// (the reference model, itself checked against a double-precision reference in test_gpt.cpp):
//  - the same config and seed give bit-identical initial parameters (names, shapes, values);
//  - backend::Host<float>: loss within 1e-5 relative, every gradient within 1e-4 (norm-relative) —
//    only the summation orders differ (batch-major rows here, sequence-major there);
//  - backend::Host<bfloat16>: the CUDA path's rounding points (bf16 activations and GEMM operands, fp32
//    accumulation, statistics and gradients) on the host: loss within 2e-3 relative, gradients
//    within 3e-2 norm-relative (measured: 1e-5 and 0.5-0.8%). These are the tolerances the GPU test (tests/gpu/test_flat_gpt_cuda.cu)
//    uses for backend::Cuda, so they are shown here to hold for bf16 rounding alone;
//  - microbatches accumulate: two halves equal the whole batch;
//  - bad tokens, shapes and options are refused with a message.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "nn/support.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/nn/flat_gpt.hpp"
#include "trellis/nn/gpt.hpp"

using trellis::bfloat16;
using trellis::index_t;
using trellis::comm::ThreadComm;
using trellis::nn::FlatGpt;
using trellis::nn::FlatShape;
using trellis::nn::GptConfig;
using trellis::nn::GptModel;
using trellis::nn::GptOptions;
namespace backend = trellis::backend;

using nn_test::norm_relative;

namespace {

GptConfig tiny() {
  GptConfig c;
  c.vocab = 96;
  c.positions = 16;
  c.layers = 2;
  c.heads = 4;
  c.width = 32;
  return c;
}

std::vector<std::int32_t> ids(const std::string& name, index_t n, index_t vocab) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) {
    const float u = trellis::nn::counter_normal(5, name, i);
    out[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(static_cast<index_t>(std::fabs(u) * 1000.0f) % vocab);
  }
  return out;
}

struct Reference {
  double loss = 0;
  std::map<std::string, std::vector<float>> values, grads;
};

// One forward + backward of the single-rank GptModel (loss = mean over all tokens).
Reference reference(const GptConfig& cfg, const GptOptions& opt, index_t batch, index_t seq,
                    const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets) {
  Reference ref;
  nn_test::run_ranks(1, [&](ThreadComm& comm) {
    GptModel<ThreadComm> model(cfg, comm, opt);
    trellis::nn::TokenShape shape{batch, seq, 0};
    trellis::nn::StageInput in{tokens.data(), nullptr, targets.data(), static_cast<double>(batch * seq)};
    ref.loss = model.forward(0, shape, in, nullptr);
    model.backward_input(0, shape, nullptr, nullptr);
    model.backward_weight(0);
    for (auto* p : model.parameters()) {
      ref.values[p->name].assign(p->value.begin(), p->value.end());
      ref.grads[p->name].assign(p->grad.begin(), p->grad.end());
    }
  });
  return ref;
}

template <class Ops>
void compare_with_reference(double loss_tol, double grad_tol) {
  const GptConfig cfg = tiny();
  const GptOptions opt{};
  const index_t B = 3, T = 16;
  const auto tokens = ids("tokens", B * T, cfg.vocab), targets = ids("targets", B * T, cfg.vocab);
  const Reference ref = reference(cfg, opt, B, T, tokens, targets);

  FlatGpt<Ops> flat(cfg, opt);
  REQUIRE(flat.tensors().size() == ref.values.size());
  for (const auto& t : flat.tensors()) {
    INFO(t.name);
    REQUIRE(ref.values.count(t.name) == 1);
    CHECK(flat.value(t.name) == ref.values.at(t.name));  // bit-identical init
  }
  flat.zero_grad();
  const double loss = flat.forward_backward({B, T}, tokens.data(), targets.data(), static_cast<double>(B * T));
  INFO("flat loss " << loss << " reference " << ref.loss);
  CHECK(std::fabs(loss - ref.loss) <= loss_tol * std::fabs(ref.loss));
  for (const auto& t : flat.tensors()) {
    const double err = norm_relative(flat.grad(t.name), ref.grads.at(t.name));
    INFO(t.name << ": norm-relative gradient error " << err);
    CHECK(err <= grad_tol);
  }
}

}  // namespace

TEST_CASE("FlatGpt fp32 on the host equals the single-rank GptModel", "[nn][flat_gpt]") {
  compare_with_reference<backend::Host<float>>(1e-5, 1e-4);
}

TEST_CASE("FlatGpt with bf16 activations stays within bf16 tolerance of the fp32 model", "[nn][flat_gpt][bf16]") {
  compare_with_reference<backend::Host<bfloat16>>(2e-3, 3e-2);
}

TEST_CASE("FlatGpt accumulates microbatches: two halves equal the whole batch", "[nn][flat_gpt]") {
  const GptConfig cfg = tiny();
  const index_t B = 4, T = 8;
  const auto tokens = ids("tokens", B * T, cfg.vocab);
  auto targets = ids("targets", B * T, cfg.vocab);
  targets[3] = -1;  // an ignored position: excluded from the loss and the token count
  const double count = B * T - 1;
  FlatGpt<backend::Host<float>> whole(cfg), halves(cfg);
  whole.zero_grad(), halves.zero_grad();
  const double l_whole = whole.forward_backward({B, T}, tokens.data(), targets.data(), count);
  const double l_halves = halves.forward_backward({B / 2, T}, tokens.data(), targets.data(), count) +
                          halves.forward_backward({B / 2, T}, tokens.data() + B / 2 * T, targets.data() + B / 2 * T, count);
  CHECK(std::fabs(l_whole - l_halves) <= 1e-6 * std::fabs(l_whole));
  for (const auto& t : whole.tensors()) {
    INFO(t.name);
    CHECK(norm_relative(halves.grad(t.name), whole.grad(t.name)) <= 1e-5);
  }
  // evaluate() is the forward of forward_backward
  FlatGpt<backend::Host<float>> fresh(cfg);
  CHECK(std::fabs(fresh.evaluate({B, T}, tokens.data(), targets.data(), count) - l_whole) <= 1e-6 * l_whole);
}

TEST_CASE("FlatGpt refuses bad input with a message", "[nn][flat_gpt][errors]") {
  const GptConfig cfg = tiny();
  FlatGpt<backend::Host<float>> flat(cfg);
  std::vector<std::int32_t> tokens(16, 1), targets(16, 2);
  tokens[5] = 96;
  CHECK_THROWS_WITH(flat.forward_backward({1, 16}, tokens.data(), targets.data(), 16),
                    Catch::Contains("token 96 at position 5 outside the vocabulary"));
  tokens[5] = 1;
  CHECK_THROWS_WITH(flat.forward_backward({1, 17}, tokens.data(), targets.data(), 16),
                    Catch::Contains("sequence must be in 1..16"));
  GptOptions drop;
  drop.dropout = 0.1f;
  CHECK_THROWS_WITH(FlatGpt<backend::Host<float>>(cfg, drop), Catch::Contains("dropout is not supported"));
  CHECK_THROWS_WITH(flat.value("h.9.ln_1.weight"), Catch::Contains("no parameter named 'h.9.ln_1.weight'"));
}
