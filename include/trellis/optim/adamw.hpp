// AdamW: hyper-parameters, the optimizer state (first and second moments per parameter tensor,
// and the step count), and one update over many tensors. The arithmetic is the host kernel
// kernels::host::adamw_step (fused, multi-threaded, fp32 master weights); this file holds what
// a trainer keeps between steps. Formula (PyTorch's torch.optim.AdamW), t = step count from 1:
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// Defaults are PyTorch's; GPT training commonly uses {.beta2 = 0.95, .weight_decay = 0.1} with
// decay off for biases and norm weights (decay_mult = 0).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/core/buffer.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/kernels/adamw_host.hpp"

namespace trellis::optim {

struct AdamW {
  float lr = 1e-3f;  // the peak rate; a schedule scales it per step
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;

  kernels::AdamWConfig config(float lr_now) const { return {lr_now, beta1, beta2, eps, weight_decay}; }
};

// Checkpoint names of the moments of parameter `param` (e.g. "optimizer.m.h.0.attn.c_attn.weight").
inline std::string adamw_m_name(std::string_view param) { return "optimizer.m." + std::string(param); }
inline std::string adamw_v_name(std::string_view param) { return "optimizer.v." + std::string(param); }

// m and v for a list of tensors (the local shards of parameters, or ZeRO-1 pieces), fp32, zero
// at the start; step() counts updates done.
class AdamWState {
  template <class Buffers>
  static auto& at(Buffers& buffers, std::size_t i) {
    TRELLIS_CHECK(i < buffers.size(), "AdamWState: tensor ", i, " of ", buffers.size());
    return buffers[i];
  }

 public:
  AdamWState() = default;
  explicit AdamWState(std::span<const index_t> sizes) {
    for (index_t n : sizes) {
      TRELLIS_CHECK(n >= 0, "AdamWState: negative tensor size ", n);
      m_.emplace_back(static_cast<std::size_t>(n));
      v_.emplace_back(static_cast<std::size_t>(n));
    }
  }
  AdamWState(std::initializer_list<index_t> sizes) : AdamWState(std::span<const index_t>(sizes.begin(), sizes.size())) {}

  std::size_t tensors() const { return m_.size(); }
  std::span<float> m(std::size_t i) { return at(m_, i).span(); }
  std::span<float> v(std::size_t i) { return at(v_, i).span(); }
  std::span<const float> m(std::size_t i) const { return at(m_, i).span(); }
  std::span<const float> v(std::size_t i) const { return at(v_, i).span(); }
  std::int64_t step() const { return step_; }
  void set_step(std::int64_t s) {
    TRELLIS_CHECK(s >= 0, "AdamWState: negative step ", s);
    step_ = s;
  }

  // One AdamW update of every tensor: params[i] -= ... using grads[i] * grad_scale and this
  // state's m/v[i]. `decay_mults` (optional, one per tensor) scales weight decay (0 = none).
  template <class G>
  void update(const AdamW& hp, float lr_now, std::span<const std::span<float>> params,
              std::span<const std::span<const G>> grads, std::span<const float> decay_mults = {},
              float grad_scale = 1.0f) {
    TRELLIS_CHECK(params.size() == tensors() && grads.size() == tensors(), "AdamW update: ", params.size(),
                  " params and ", grads.size(), " grads for a state of ", tensors(), " tensors");
    TRELLIS_CHECK(decay_mults.empty() || decay_mults.size() == tensors(), "AdamW update: ", decay_mults.size(),
                  " decay multipliers for ", tensors(), " tensors");
    std::vector<kernels::AdamWTensor<G>> work;
    work.reserve(tensors());
    for (std::size_t i = 0; i < tensors(); ++i) {
      TRELLIS_CHECK(params[i].size() == m_[i].size(), "AdamW update: tensor ", i, " has ", params[i].size(),
                    " parameters but the state holds ", m_[i].size());
      work.push_back({params[i], grads[i], m(i), v(i), decay_mults.empty() ? 1.0f : decay_mults[i]});
    }
    kernels::host::adamw_step<G>(std::span<const kernels::AdamWTensor<G>>(work), hp.config(lr_now),
                                 step_ + 1, grad_scale);
    ++step_;
  }
  template <class G>
  void update(const AdamW& hp, float lr_now, const std::vector<std::span<float>>& params,
              const std::vector<std::span<const G>>& grads, std::span<const float> decay_mults = {},
              float grad_scale = 1.0f) {
    update<G>(hp, lr_now, std::span<const std::span<float>>(params), std::span<const std::span<const G>>(grads),
              decay_mults, grad_scale);
  }

 private:
  std::vector<Buffer<float>> m_, v_;
  std::int64_t step_ = 0;
};

}  // namespace trellis::optim
