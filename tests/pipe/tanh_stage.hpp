// Test support for the pipe executor tests (threads and MPI): a model of tanh(x W + b) layers,
// its single-rank reference gradients, and the Stage that runs a rank's chunks of it.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/pipe/executor.hpp"
#include "trellis/pipe/schedule.hpp"

// Catch2's assertions are not thread-safe: checks on rank threads (TRELLIS_CHECK) throw instead,
// and ThreadWorld rethrows the first failure on the test's thread.

namespace pipe_test {

constexpr int kWidth = 5;  // d: features
constexpr int kRows = 3;   // rows per microbatch

struct Model {
  int layers = 0;
  std::vector<std::vector<float>> weight;  // [layer] (d, d), row-major
  std::vector<std::vector<float>> bias;    // [layer] (d)
  std::vector<std::vector<float>> data;    // [mb] (rows, d)
};

inline Model make_model(int layers, int microbatches) {
  Model model;
  model.layers = layers;
  unsigned state = 12345u + static_cast<unsigned>(layers * 31 + microbatches);
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>((state >> 8) & 0xffff) / 65536.0f - 0.5f;
  };
  for (int l = 0; l < layers; ++l) {
    std::vector<float> w(kWidth * kWidth), b(kWidth);
    for (auto& x : w) x = 1.2f * next();
    for (auto& x : b) x = 0.2f * next();
    model.weight.push_back(w);
    model.bias.push_back(b);
  }
  for (int mb = 0; mb < microbatches; ++mb) {
    std::vector<float> x(kRows * kWidth);
    for (auto& v : x) v = 2.0f * next();
    model.data.push_back(x);
  }
  return model;
}

// y = tanh(x W + b); x, y: (rows, d)
inline void layer_forward(const Model& model, int l, const float* x, float* y) {
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kWidth; ++j) {
      float z = model.bias[l][j];
      for (int k = 0; k < kWidth; ++k) z += x[i * kWidth + k] * model.weight[l][k * kWidth + j];
      y[i * kWidth + j] = std::tanh(z);
    }
}
// gz = gy * (1 - y^2); gx = gz W^T
inline void layer_backward_input(const Model& model, int l, const float* y, const float* gy, float* gz,
                                 float* gx) {
  for (int e = 0; e < kRows * kWidth; ++e) gz[e] = gy[e] * (1.0f - y[e] * y[e]);
  for (int i = 0; i < kRows; ++i)
    for (int k = 0; k < kWidth; ++k) {
      float s = 0;
      for (int j = 0; j < kWidth; ++j) s += gz[i * kWidth + j] * model.weight[l][k * kWidth + j];
      gx[i * kWidth + k] = s;
    }
}
// gW += x^T gz; gb += column sums of gz
inline void layer_backward_weight(const float* x, const float* gz, float* gw, float* gb) {
  for (int k = 0; k < kWidth; ++k)
    for (int j = 0; j < kWidth; ++j) {
      float s = 0;
      for (int i = 0; i < kRows; ++i) s += x[i * kWidth + k] * gz[i * kWidth + j];
      gw[k * kWidth + j] += s;
    }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kWidth; ++j) gb[j] += gz[i * kWidth + j];
}

struct Grads {
  std::vector<std::vector<float>> weight, bias;
  explicit Grads(int layers)
      : weight(layers, std::vector<float>(kWidth * kWidth, 0.0f)),
        bias(layers, std::vector<float>(kWidth, 0.0f)) {}
};

// The reference: the whole model on one rank. The loss of a microbatch is 0.5 * sum(y^2) of the
// last layer; under local learning every stage [bounds[s], bounds[s+1]) has that loss on its own
// output, with its input detached.
inline Grads serial_gradients(const Model& model, const std::vector<int>& bounds, bool local) {
  Grads g(model.layers);
  const int n = kRows * kWidth;
  for (const auto& input : model.data) {
    std::vector<std::vector<float>> acts(model.layers + 1, std::vector<float>(n));
    acts[0] = input;
    for (int l = 0; l < model.layers; ++l) layer_forward(model, l, acts[l].data(), acts[l + 1].data());
    std::vector<float> gy(n), gz(n), gx(n);
    for (int l = model.layers - 1; l >= 0; --l) {
      const bool loss_here =
          l == model.layers - 1 || (local && std::find(bounds.begin(), bounds.end(), l + 1) != bounds.end());
      if (loss_here) gy = acts[l + 1];  // d(0.5 sum y^2)/dy = y; detaches under local learning
      layer_backward_input(model, l, acts[l + 1].data(), gy.data(), gz.data(), gx.data());
      layer_backward_weight(acts[l].data(), gz.data(), g.weight[l].data(), g.bias[l].data());
      gy = gx;
    }
  }
  return g;
}

// One rank's stage: its chunks' layers, gradients, and what F/B keep per (mb, chunk).
class TanhStage {
 public:
  using value_type = float;

  TanhStage(const Model& model, const trellis::pipe::Schedule& s, int rank, const std::vector<int>& bounds)
      : model_(model), schedule_(s), rank_(rank), grads_(model.layers) {
    for (int c = 0; c < s.chunks; ++c) {
      const int vs = s.virtual_stage(rank, c);
      first_layer_.push_back(bounds[vs]);
      end_layer_.push_back(bounds[vs + 1]);
    }
  }
  std::size_t input_size(int) const { return kRows * kWidth; }
  std::size_t output_size(int chunk) const { return schedule_.is_last(rank_, chunk) ? 0 : kRows * kWidth; }

  void forward(int mb, int chunk, std::span<const float> in, std::span<float> out) {
    const bool first = schedule_.is_first(rank_, chunk);
    TRELLIS_CHECK(in.size() == (first ? 0u : static_cast<std::size_t>(kRows * kWidth)));
    TRELLIS_CHECK(out.size() == output_size(chunk));
    Saved& saved = saved_[{mb, chunk}];
    TRELLIS_CHECK(saved.acts.empty());
    const int a = first_layer_[chunk], b = end_layer_[chunk], n = kRows * kWidth;
    saved.acts.assign(b - a + 1, std::vector<float>(n));
    if (first)
      saved.acts[0] = model_.data[mb];
    else
      saved.acts[0].assign(in.begin(), in.end());
    for (int l = a; l < b; ++l)
      layer_forward(model_, l, saved.acts[l - a].data(), saved.acts[l - a + 1].data());
    std::copy(saved.acts.back().begin(), saved.acts.back().begin() + static_cast<long>(out.size()),
              out.begin());
    ++forwards;
    peak_saved = std::max(peak_saved, static_cast<int>(saved_.size()));
  }

  void backward_input(int mb, int chunk, std::span<const float> grad_out, std::span<float> grad_in) {
    auto it = saved_.find({mb, chunk});
    TRELLIS_CHECK(it != saved_.end());
    Saved& saved = it->second;
    TRELLIS_CHECK(saved.gz.empty());
    const bool own_loss = schedule_.local_learning || schedule_.is_last(rank_, chunk);
    TRELLIS_CHECK(grad_out.size() == (own_loss ? 0u : static_cast<std::size_t>(kRows * kWidth)));
    const bool pass = !schedule_.local_learning && !schedule_.is_first(rank_, chunk);
    TRELLIS_CHECK(grad_in.size() == (pass ? static_cast<std::size_t>(kRows * kWidth) : 0u));
    const int a = first_layer_[chunk], b = end_layer_[chunk], n = kRows * kWidth;
    std::vector<float> gy =
        own_loss ? saved.acts.back() : std::vector<float>(grad_out.begin(), grad_out.end());
    std::vector<float> gx(n);
    saved.gz.assign(b - a, std::vector<float>(n));
    for (int l = b - 1; l >= a; --l) {
      layer_backward_input(model_, l, saved.acts[l - a + 1].data(), gy.data(), saved.gz[l - a].data(),
                           gx.data());
      gy = gx;
    }
    std::copy(gy.begin(), gy.begin() + static_cast<long>(grad_in.size()), grad_in.begin());
  }

  void backward_weight(int mb, int chunk) {
    auto it = saved_.find({mb, chunk});
    TRELLIS_CHECK(it != saved_.end());
    TRELLIS_CHECK(!it->second.gz.empty());  // B before W
    const int a = first_layer_[chunk], b = end_layer_[chunk];
    for (int l = a; l < b; ++l)
      layer_backward_weight(it->second.acts[l - a].data(), it->second.gz[l - a].data(),
                            grads_.weight[l].data(), grads_.bias[l].data());
    saved_.erase(it);  // this activation is freed as soon as its W is done
  }

  const Grads& grads() const { return grads_; }
  std::vector<int> layers() const {
    std::vector<int> out;
    for (std::size_t c = 0; c < first_layer_.size(); ++c)
      for (int l = first_layer_[c]; l < end_layer_[c]; ++l) out.push_back(l);
    return out;
  }
  std::size_t alive() const { return saved_.size(); }

  int forwards = 0;
  int peak_saved = 0;

 private:
  struct Saved {
    std::vector<std::vector<float>> acts;  // layer inputs and the chunk's output
    std::vector<std::vector<float>> gz;    // per layer, from B, for W
  };
  const Model& model_;
  const trellis::pipe::Schedule& schedule_;
  int rank_;
  Grads grads_;
  std::vector<int> first_layer_, end_layer_;
  std::map<std::pair<int, int>, Saved> saved_;
};

static_assert(trellis::pipe::Stage<TanhStage>);

}  // namespace pipe_test
