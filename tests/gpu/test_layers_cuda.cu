// Every layer of the one model stack on backend::Cuda (bf16 kernels: cuBLASLt, our attention,
// norms, GELU, dropout; NcclComm on one GPU) against the same layer on backend::Host<bfloat16>
// (the CUDA rounding points on the host, one thread rank): the same parameters (a function of
// name and global index), the same bf16 input and output gradient, one microbatch of
// forward, backward_input and backward_weight. Compared, norm-relative (||a - b|| / ||b||):
// the forward output, the input gradient and every parameter gradient, within 2e-2 (bf16 keeps 8
// bits: one rounding of a product or a sum differs by up to 2^-8 = 3.9e-3 relative, and the two
// backends round in different places inside a kernel). The whole GptModel stage (embedding,
// blocks, head, loss) is compared the same way, its loss within 5e-3 relative.
// Layers: LayerNorm, ColumnParallelLinear (fused GELU), RowParallelLinear, CausalSelfAttention,
// Mlp, TransformerBlock (with dropout), GptModel. Without a GPU the program exits 77 (skipped).
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "nn/support.hpp"
#include "trellis/backend/cuda.cuh"
#include "trellis/comm/nccl.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/core/check_cuda.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/nn/parameter_buffer.hpp"

using trellis::bfloat16;
using trellis::index_t;
using trellis::comm::NcclComm;
using trellis::comm::ThreadComm;
namespace nn = trellis::nn;
using Cuda = trellis::backend::Cuda;
using HostBf16 = trellis::backend::Host<bfloat16>;

namespace {

constexpr index_t kWidth = 128, kHeads = 2, kBatch = 4, kSeq = 64;  // head size 64: the CUDA attention's
constexpr double kTolerance = 2e-2;

std::vector<float> values(const std::string& name, index_t n, float scale) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = nn_test::global_value(name, i, scale);
  return v;
}

// What one backend computed: output, input gradient and each parameter's gradient (host fp32).
struct Result {
  std::vector<float> y, dx;
  std::map<std::string, std::vector<float>> grads;
};

template <class B>
typename B::template buffer<bfloat16> to_device(const B& be, const std::vector<float>& x) {
  std::vector<bfloat16> h(x.begin(), x.end());
  auto d = be.template allocate<bfloat16>(h.size());
  be.upload(d.data(), h.data(), h.size());
  return d;
}
template <class B>
std::vector<float> to_host(const B& be, const bfloat16* d, std::size_t n) {
  const auto h = trellis::backend::download_vector(be, d, n);
  return std::vector<float>(h.begin(), h.end());
}

// Reserves what any layer here asks for (CUB style, before its first kernel).
template <class B>
void reserve(B& be) {
  trellis::kernels::AttentionArgs a;
  a.batch = kBatch;
  a.q_heads = a.kv_heads = kHeads;
  a.q_len = a.kv_len = kSeq;
  a.head_dim = kWidth / kHeads;
  a.causal = true;
  const index_t rows = kBatch * kSeq;
  be.reserve_workspace(std::max({be.layernorm_backward_workspace(rows, 4 * kWidth),
                                 be.column_sums_workspace(rows, 4 * kWidth), be.attention_backward_workspace(a)}));
}

// Sets the layer's parameters (a function of name and global index; LayerNorm weights near 1),
// packs them into B's memory, runs F, B and W of microbatch 0 and downloads the results.
template <class Layer, class B>
Result run_layer(Layer& layer, B be, index_t in_n, index_t out_n) {
  std::vector<nn::Parameter*> params;
  layer.for_each_parameter([&](nn::Parameter& p) { params.push_back(&p); });
  for (nn::Parameter* p : params) {
    const bool norm_weight = p->name.find("ln") != std::string::npos && p->name.ends_with(".weight");
    for (index_t i = 0; i < p->numel(); ++i)
      p->value[static_cast<std::size_t>(i)] =
          (norm_weight ? 1.0f : 0.0f) + nn_test::global_value(p->name, p->global_index(i), 0.05f);
  }
  reserve(be);
  nn::ParameterBuffer<B> packed(params, nn::ParameterBuffer<B>::default_alignment, be);
  const nn::TokenShape shape{kBatch, kSeq, /*seed*/ 7, /*first_sample*/ 0};
  auto x = to_device(be, values("x", in_n, 1.0f));
  auto dy = to_device(be, values("dy", out_n, 1.0f));
  auto y = be.template allocate<bfloat16>(static_cast<std::size_t>(out_n));
  auto dx = be.template allocate<bfloat16>(static_cast<std::size_t>(in_n));
  layer.forward(0, shape, x.data(), y.data());
  layer.backward_input(0, shape, dy.data(), dx.data());
  layer.backward_weight(0);
  Result r;
  r.y = to_host(be, y.data(), y.size());
  r.dx = to_host(be, dx.data(), dx.size());
  for (nn::Parameter* p : params) r.grads[p->name] = trellis::backend::download_vector(be, p->grad.data(), p->grad.size());
  return r;
}

void compare(const Result& got, const Result& ref, const char* layer) {
  INFO(layer);
  CHECK(nn_test::norm_relative(got.y, ref.y) <= kTolerance);
  CHECK(nn_test::norm_relative(got.dx, ref.dx) <= kTolerance);
  REQUIRE(got.grads.size() == ref.grads.size());
  for (const auto& [name, g] : ref.grads) {
    INFO(name);
    REQUIRE(got.grads.count(name) == 1);
    CHECK(nn_test::norm_relative(got.grads.at(name), g) <= kTolerance);
  }
}

// make(tp, be) builds the layer over communicator type C; both backends run it.
template <class Make>
void check_layer(const char* name, index_t in_n, index_t out_n, Make&& make) {
  Result host;
  nn_test::run_ranks(1, [&](ThreadComm& comm) {
    nn::TensorParallel<ThreadComm> tp{&comm};
    auto layer = make(tp, HostBf16{});
    host = run_layer(*layer, HostBf16{}, in_n, out_n);
  });
  std::array<int, 1> devices{0};
  auto comms = NcclComm::init_all(devices, "layers");
  Cuda be(comms[0].stream());
  nn::TensorParallel<NcclComm> tp{&comms[0]};
  auto layer = make(tp, be);
  const Result cuda = run_layer(*layer, be, in_n, out_n);
  compare(cuda, host, name);
}

}  // namespace

TEST_CASE("each layer on backend::Cuda equals it on the host bf16 backend", "[gpu][layers]") {
  constexpr index_t rows = kBatch * kSeq, W = kWidth;
  check_layer("LayerNorm", rows * W, rows * W, [](auto tp, auto be) {
    using C = std::remove_pointer_t<decltype(tp.comm)>;
    return std::make_unique<nn::LayerNorm<C, decltype(be)>>("ln_1", kWidth, tp, 1e-5f, be);
  });
  check_layer("ColumnParallelLinear + GELU", rows * W, rows * 4 * W, [](auto tp, auto be) {
    using C = std::remove_pointer_t<decltype(tp.comm)>;
    const nn::LinearConfig cfg{kWidth, 4 * kWidth, true, 1, 1, nn::Activation::gelu_tanh};
    return std::make_unique<nn::ColumnParallelLinear<C, decltype(be)>>("c_fc", cfg, tp, be);
  });
  check_layer("RowParallelLinear", rows * 4 * W, rows * W, [](auto tp, auto be) {
    using C = std::remove_pointer_t<decltype(tp.comm)>;
    return std::make_unique<nn::RowParallelLinear<C, decltype(be)>>("c_proj", nn::LinearConfig{4 * kWidth, kWidth}, tp, be);
  });
  check_layer("CausalSelfAttention", rows * W, rows * W, [](auto tp, auto be) {
    using C = std::remove_pointer_t<decltype(tp.comm)>;
    return std::make_unique<nn::CausalSelfAttention<C, decltype(be)>>("attn", kWidth, kHeads, tp, be);
  });
  check_layer("Mlp", rows * W, rows * W, [](auto tp, auto be) {
    using C = std::remove_pointer_t<decltype(tp.comm)>;
    return std::make_unique<nn::Mlp<C, decltype(be)>>("mlp", kWidth, 4 * kWidth, tp, be);
  });
  check_layer("TransformerBlock (dropout 0.1)", rows * W, rows * W, [](auto tp, auto be) {
    using C = std::remove_pointer_t<decltype(tp.comm)>;
    const nn::BlockConfig cfg{kWidth, kHeads, 4 * kWidth, 1e-5f, false, 0.1f};
    return std::make_unique<nn::TransformerBlock<C, decltype(be)>>("h.0", cfg, tp, be);
  });
}

TEST_CASE("a whole GptModel stage on backend::Cuda equals it on the host bf16 backend", "[gpu][layers][gpt]") {
  nn::GptConfig cfg;
  cfg.vocab = 96;
  cfg.positions = kSeq;
  cfg.layers = 2;
  cfg.heads = kHeads;
  cfg.width = kWidth;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(kBatch * kSeq)), targets(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 7 + i / 5) % 96);
    targets[i] = static_cast<std::int32_t>((i * 11 + 3) % 96);
  }
  const double count = static_cast<double>(tokens.size());
  const nn::TokenShape shape{kBatch, kSeq, 7, 0};
  auto run = [&](auto& model, std::map<std::string, std::vector<float>>& grads) {
    model.reserve_workspace(shape);
    typename std::remove_reference_t<decltype(model)>::Input in{tokens.data(), nullptr, targets.data(), count};
    const double loss = model.forward(0, shape, in, nullptr);
    model.backward_input(0, shape, nullptr, nullptr);
    model.backward_weight(0);
    for (nn::Parameter* p : model.parameters())
      grads[p->name] = trellis::backend::download_vector(model.backend(), p->grad.data(), p->grad.size());
    return loss;
  };
  std::map<std::string, std::vector<float>> host_grads, cuda_grads;
  double host_loss = 0;
  nn_test::run_ranks(1, [&](ThreadComm& comm) {
    nn::GptModel<ThreadComm, HostBf16> model(cfg, comm, {}, {}, HostBf16{});
    host_loss = run(model, host_grads);
  });
  std::array<int, 1> devices{0};
  auto comms = NcclComm::init_all(devices, "gpt");
  nn::GptModel<NcclComm, Cuda> model(cfg, comms[0], {}, {}, Cuda(comms[0].stream()));
  const double cuda_loss = run(model, cuda_grads);
  CHECK(std::fabs(cuda_loss - host_loss) <= 5e-3 * std::fabs(host_loss));
  REQUIRE(cuda_grads.size() == host_grads.size());
  for (const auto& [name, g] : host_grads) {
    INFO(name);
    CHECK(nn_test::norm_relative(cuda_grads.at(name), g) <= kTolerance);
  }
}
