// AdamW: hyper-parameters, the optimizer state (first and second moments per parameter tensor,
// and the step count, in a backend's memory), and one update over many tensors. The arithmetic is
// the backend's fused AdamW kernel (kernels/adamw_host.hpp, kernels/adamw_cuda.cuh; fp32 master
// weights); this file holds what a trainer keeps between steps. Formula (PyTorch's torch.optim.AdamW), t = step count from 1:
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// Defaults are PyTorch's; GPT training commonly uses {.beta2 = 0.95, .weight_decay = 0.1} with
// decay off for biases and norm weights (decay_mult = 0).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/host.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/kernels/adamw.hpp"

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
// at the start, in backend B's memory (one flat buffer each); step() counts updates done. The
// update is the backend's fused AdamW kernel over every tensor at once.
template <backend::Backend B = backend::Host<float>>
class AdamWState {
 public:
  AdamWState() = default;
  explicit AdamWState(std::span<const index_t> sizes, B be = {}) : be_(std::move(be)) {
    std::size_t total = 0;
    for (index_t n : sizes) {
      TRELLIS_CHECK(n >= 0, "AdamWState: negative tensor size ", n);
      offsets_.push_back(total);
      sizes_.push_back(static_cast<std::size_t>(n));
      total += static_cast<std::size_t>(n);
    }
    m_ = be_.template allocate<float>(total);
    v_ = be_.template allocate<float>(total);
  }
  AdamWState(std::initializer_list<index_t> sizes) : AdamWState(std::span<const index_t>(sizes.begin(), sizes.size())) {}

  std::size_t tensors() const { return sizes_.size(); }
  std::size_t bytes() const { return (m_.size() + v_.size()) * sizeof(float); }  // both moments
  // Tensor i's moments, in B's memory (host code reads them with B's download unless B::host_readable).
  std::span<float> m(std::size_t i) { return {m_.data() + offset(i), sizes_[i]}; }
  std::span<float> v(std::size_t i) { return {v_.data() + offset(i), sizes_[i]}; }
  std::span<const float> m(std::size_t i) const { return {m_.data() + offset(i), sizes_[i]}; }
  std::span<const float> v(std::size_t i) const { return {v_.data() + offset(i), sizes_[i]}; }
  std::int64_t step() const { return step_; }
  void set_step(std::int64_t s) {
    TRELLIS_CHECK(s >= 0, "AdamWState: negative step ", s);
    step_ = s;
  }
  // Zero moments and step 0 (a fresh optimizer).
  void reset() {
    be_.fill_zero(m_.data(), m_.size());
    be_.fill_zero(v_.data(), v_.size());
    step_ = 0;
  }

  // One AdamW update of every tensor: params[i] -= ... using grads[i] * grad_scale and this
  // state's m/v[i] (all in B's memory). `decay_mults` (optional, one per tensor) scales weight
  // decay (0 = none).
  void update(const AdamW& hp, float lr_now, std::span<const std::span<float>> params,
              std::span<const std::span<const float>> grads, std::span<const float> decay_mults = {},
              float grad_scale = 1.0f) {
    TRELLIS_CHECK(params.size() == tensors() && grads.size() == tensors(), "AdamW update: ", params.size(),
                  " params and ", grads.size(), " grads for a state of ", tensors(), " tensors");
    TRELLIS_CHECK(decay_mults.empty() || decay_mults.size() == tensors(), "AdamW update: ", decay_mults.size(),
                  " decay multipliers for ", tensors(), " tensors");
    std::vector<kernels::AdamWTensor<float>> work;
    work.reserve(tensors());
    for (std::size_t i = 0; i < tensors(); ++i) {
      TRELLIS_CHECK(params[i].size() == sizes_[i], "AdamW update: tensor ", i, " has ", params[i].size(),
                    " parameters but the state holds ", sizes_[i]);
      work.push_back({params[i], grads[i], m(i), v(i), decay_mults.empty() ? 1.0f : decay_mults[i]});
    }
    be_.adamw(std::span<const kernels::AdamWTensor<float>>(work), hp.config(lr_now), step_ + 1, grad_scale);
    ++step_;
  }
  // The same update for tensors `which` only, at the step this one is counting (step() + 1),
  // without counting it: a trainer that updates each block as soon as its gradients are final
  // (the optimizer step fused into the backward) calls this per block, then advance_step() once.
  // AdamW is elementwise, so the pieces together give the bits of one update() over all tensors.
  void update_part(const AdamW& hp, float lr_now, std::span<const std::size_t> which,
                   std::span<const std::span<float>> params, std::span<const std::span<const float>> grads,
                   std::span<const float> decay_mults, float grad_scale = 1.0f) {
    TRELLIS_CHECK(params.size() == which.size() && grads.size() == which.size() && decay_mults.size() == which.size(),
                  "AdamW update_part: ", params.size(), " params, ", grads.size(), " grads and ", decay_mults.size(),
                  " decay multipliers for ", which.size(), " tensors");
    std::vector<kernels::AdamWTensor<float>> work;
    work.reserve(which.size());
    for (std::size_t k = 0; k < which.size(); ++k) {
      const std::size_t i = which[k];
      TRELLIS_CHECK(i < tensors() && params[k].size() == sizes_[i], "AdamW update_part: tensor ", i, " of ",
                    tensors(), " given ", params[k].size(), " parameters");
      work.push_back({params[k], grads[k], m(i), v(i), decay_mults[k]});
    }
    if (!work.empty())
      be_.adamw(std::span<const kernels::AdamWTensor<float>>(work), hp.config(lr_now), step_ + 1, grad_scale);
  }
  void advance_step() { ++step_; }

  void update(const AdamW& hp, float lr_now, const std::vector<std::span<float>>& params,
              const std::vector<std::span<const float>>& grads, std::span<const float> decay_mults = {},
              float grad_scale = 1.0f) {
    update(hp, lr_now, std::span<const std::span<float>>(params), std::span<const std::span<const float>>(grads),
           decay_mults, grad_scale);
  }

 private:
  std::size_t offset(std::size_t i) const {
    TRELLIS_CHECK(i < sizes_.size(), "AdamWState: tensor ", i, " of ", sizes_.size());
    return offsets_[i];
  }

  B be_;
  std::vector<std::size_t> offsets_, sizes_;
  typename B::template buffer<float> m_, v_;
  std::int64_t step_ = 0;
};

}  // namespace trellis::optim
