// train::OptimizerState<B>: a Trainer's AdamW state, in the compute backend's memory or offloaded
// to host memory (ZeRO-Offload's optimizer tier). Offloaded, the moments live in host memory and
// each update runs on the CPU (the host AdamW kernel) over staged host copies of the tensors'
// values and gradients, downloaded from B's memory; the updated values are uploaded back. That
// frees the moments' 8 bytes per parameter (or per ZeRO shard element) of device memory; the fp32
// values stay on the device, where the layers read them, so no master copy is kept on the host.
// On the host backends both tiers are RAM, but separate allocations counted apart
// (device_bytes, host_bytes), so the logic and the accounting are tested on any machine, and the
// host kernel is the one the host backends run: offloading changes no bits there.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/host.hpp"
#include "trellis/core/error.hpp"
#include "trellis/optim/adamw.hpp"

namespace trellis::train {

template <backend::Backend B>
class OptimizerState {
 public:
  OptimizerState() = default;
  // One moment pair per tensor of `sizes` (parameters' local shards, or ZeRO pieces).
  OptimizerState(std::span<const index_t> sizes, bool offload, B be) : be_(std::move(be)), offload_(offload) {
    if (offload_)
      host_ = optim::AdamWState<backend::Host<float>>(sizes);
    else
      device_ = optim::AdamWState<B>(sizes, be_);
    for (index_t n : sizes) sizes_.push_back(static_cast<std::size_t>(n));
  }

  bool offloaded() const { return offload_; }
  std::size_t tensors() const { return sizes_.size(); }
  std::size_t size(std::size_t i) const { return sizes_.at(i); }
  std::int64_t step() const { return offload_ ? host_.step() : device_.step(); }
  void set_step(std::int64_t s) { offload_ ? host_.set_step(s) : device_.set_step(s); }
  void advance_step() { offload_ ? host_.advance_step() : device_.advance_step(); }
  void reset() { offload_ ? host_.reset() : device_.reset(); }
  // Moments in B's memory; offloaded moments and the staging buffers' largest size, in host memory.
  std::size_t device_bytes() const { return offload_ ? 0 : device_.bytes(); }
  std::size_t host_bytes() const { return offload_ ? host_.bytes() + staged_peak_ * 2 * sizeof(float) : 0; }

  // Tensor i's moments from / to host memory (checkpoints).
  void read_m(std::size_t i, float* dst) const { read(i, dst, true); }
  void read_v(std::size_t i, float* dst) const { read(i, dst, false); }
  void write_m(std::size_t i, const float* src) { write(i, src, true); }
  void write_v(std::size_t i, const float* src) { write(i, src, false); }

  // AdamW for tensors `which` at step() + 1, not counted (advance_step once per optimizer step):
  // values and grads in B's memory, one per tensor of `which`.
  void update(const optim::AdamW& hp, float lr, std::span<const std::size_t> which,
              std::span<const std::span<float>> values, std::span<const std::span<const float>> grads,
              std::span<const float> decay, float scale) {
    if (!offload_) {
      device_.update_part(hp, lr, which, values, grads, decay, scale);
      return;
    }
    std::size_t n = 0;
    for (const auto& v : values) n += v.size();
    staged_values_.resize(std::max(staged_values_.size(), n));
    staged_grads_.resize(std::max(staged_grads_.size(), n));
    staged_peak_ = std::max(staged_peak_, n);
    std::vector<std::span<float>> hv;
    std::vector<std::span<const float>> hg;
    std::size_t at = 0;
    for (std::size_t k = 0; k < values.size(); ++k) {
      TRELLIS_CHECK(grads[k].size() == values[k].size(), "OptimizerState: tensor ", which[k], " has ",
                    values[k].size(), " values and ", grads[k].size(), " gradients");
      be_.download(staged_values_.data() + at, values[k].data(), values[k].size());
      be_.download(staged_grads_.data() + at, grads[k].data(), grads[k].size());
      hv.emplace_back(staged_values_.data() + at, values[k].size());
      hg.emplace_back(staged_grads_.data() + at, grads[k].size());
      at += values[k].size();
    }
    host_.update_part(hp, lr, which, hv, hg, decay, scale);
    for (std::size_t k = 0; k < values.size(); ++k) be_.upload(values[k].data(), hv[k].data(), hv[k].size());
  }

 private:
  void read(std::size_t i, float* dst, bool m) const {
    if (offload_) {
      const auto src = m ? host_.m(i) : host_.v(i);
      std::copy(src.begin(), src.end(), dst);
    } else {
      const auto src = m ? device_.m(i) : device_.v(i);
      be_.download(dst, src.data(), src.size());
    }
  }
  void write(std::size_t i, const float* src, bool m) {
    if (offload_) {
      auto dst = m ? host_.m(i) : host_.v(i);
      std::copy_n(src, dst.size(), dst.begin());
    } else {
      auto dst = m ? device_.m(i) : device_.v(i);
      be_.upload(dst.data(), src, dst.size());
    }
  }

  B be_;
  bool offload_ = false;
  std::vector<std::size_t> sizes_;
  optim::AdamWState<B> device_;
  optim::AdamWState<backend::Host<float>> host_;
  std::vector<float> staged_values_, staged_grads_;  // one update's values and gradients, on the host
  std::size_t staged_peak_ = 0;
};

}  // namespace trellis::train
