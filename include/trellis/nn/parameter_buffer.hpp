// ParameterBuffer<B>: a model's parameters packed into two flat fp32 buffers (values and gradients)
// in backend B's memory,
// in the order given, each parameter starting at a multiple of `alignment` floats (16: 64 bytes;
// the Trainer asks lcm(16, dp) under ZeRO-1, so that every range splits evenly over dp ranks); the
// parameters' ParamArrays become views into them (not host-readable unless B's memory is). Built
// once after the layers created (and initialised, on the host) their parameters: their values are
// uploaded here.
//
// Why: with the gradients of consecutive parameters in one contiguous range, a data-parallel
// bucket is a span of the gradient buffer that a collective reduces in place (no pack/unpack
// copies), and "this block's gradients" or "this rank's ZeRO partition" are ranges too. The
// padding between parameters is zero in both buffers and nothing writes it, so reducing a range
// that spans padding adds zeros.
//
// Gradients::external packs the values only: the gradients get no storage here, and their views
// stay unbound (null) until the owner binds each parameter's gradient where it wants it (the
// Trainer's ZeRO-2 binds a weight unit's gradients to a short-lived slot around its W). The
// packed layout (packed_range) is the same either way.
//
// drop_values() frees the packed values and unbinds the value views (ZeRO-3 keeps a shard of each
// range elsewhere and binds a unit's values to a gathered slot while it computes);
// restore_values() packs them again (zeroed, the owner fills them: a checkpoint, FSDP's
// "summon full parameters").
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/host.hpp"
#include "trellis/core/error.hpp"
#include "trellis/nn/parameter.hpp"

namespace trellis::nn {

template <backend::Backend B = backend::Host<float>>
class ParameterBuffer {
 public:
  static constexpr std::size_t default_alignment = 16;  // floats: 64 bytes
  enum class Gradients { packed, external };

  ParameterBuffer() = default;
  // Packs `order` (distinct parameters with their own storage) in that order.
  explicit ParameterBuffer(std::span<Parameter* const> order, std::size_t alignment = default_alignment, B be = {},
                           Gradients gradients = Gradients::packed)
      : be_(std::move(be)), order_(order.begin(), order.end()), alignment_(alignment), gradients_(gradients) {
    TRELLIS_CHECK(alignment > 0 && alignment % default_alignment == 0, "ParameterBuffer: alignment ", alignment,
                  " floats is not a positive multiple of ", default_alignment);
    std::size_t n = 0;
    for (Parameter* p : order_) {
      TRELLIS_CHECK(p != nullptr && !p->value.is_view() && p->value.size() == p->grad.size(),
                    "ParameterBuffer: parameter ", p ? p->name : std::string("(null)"),
                    " is already packed or has mismatched value and gradient");
      offsets_.push_back(n);
      n = round_up(n + p->value.size());
    }
    values_ = be_.template allocate<float>(n);  // zeroed, padding included
    if (gradients_ == Gradients::packed) grads_ = be_.template allocate<float>(n);
    for (std::size_t i = 0; i < order_.size(); ++i) {
      Parameter& p = *order_[i];
      be_.upload(values_.data() + offsets_[i], p.value.data(), p.value.size());
      p.value.rebind(values_.data() + offsets_[i], B::host_readable);
      if (gradients_ == Gradients::packed) {
        be_.upload(grads_.data() + offsets_[i], p.grad.data(), p.grad.size());
        p.grad.rebind(grads_.data() + offsets_[i], B::host_readable);
      } else {
        p.grad.rebind(nullptr, B::host_readable);
      }
    }
  }

  std::span<float> values() { return {values_.data(), values_.size()}; }
  std::span<const float> values() const { return {values_.data(), values_.size()}; }
  bool values_held() const { return values_.size() > 0 || order_.empty(); }
  void drop_values() {
    values_ = {};
    for (Parameter* p : order_) p->value.rebind(nullptr, B::host_readable);
  }
  void restore_values() {
    if (values_held()) return;
    values_ = be_.template allocate<float>(packed_size());  // zeroed, padding included
    for (std::size_t i = 0; i < order_.size(); ++i) order_[i]->value.rebind(values_.data() + offsets_[i], B::host_readable);
  }
  std::span<float> grads() { return {grads_.data(), grads_.size()}; }
  std::size_t parameters() const { return order_.size(); }
  std::size_t alignment() const { return alignment_; }
  Gradients gradients() const { return gradients_; }
  void zero_grads() {
    if (gradients_ == Gradients::packed) be_.fill_zero(grads_.data(), grads_.size());
  }

  // The range from the start of `first` to the padded end of `last` (both packed here, first not
  // after last): every parameter packed between them and the padding, a multiple of alignment().
  std::span<float> grad_range(const Parameter& first, const Parameter& last) {
    TRELLIS_CHECK(gradients_ == Gradients::packed, "ParameterBuffer: gradients of ", first.name, "..", last.name,
                  " are external (not packed here)");
    const auto [at, n] = packed_range(first, last);
    return {grads_.data() + at, n};
  }
  std::span<float> value_range(const Parameter& first, const Parameter& last) {
    TRELLIS_CHECK(values_held(), "ParameterBuffer: values of ", first.name, "..", last.name,
                  " are dropped (sharded elsewhere: ZeRO-3)");
    const auto [at, n] = packed_range(first, last);
    return {values_.data() + at, n};
  }
  // (offset, size) of that range in the packed layout, in floats.
  std::pair<std::size_t, std::size_t> packed_range(const Parameter& first, const Parameter& last) const {
    const std::size_t a = index_of(first), b = index_of(last);
    TRELLIS_CHECK(a <= b, "ParameterBuffer: ", first.name, " is packed after ", last.name);
    return {offsets_[a], round_up(offsets_[b] + last.value.size()) - offsets_[a]};
  }
  // Floats of the whole packed layout, padding included.
  std::size_t packed_size() const {
    return order_.empty() ? 0 : round_up(offsets_.back() + order_.back()->value.size());
  }
  // Position of p in the packing order (error if p is not packed here).
  std::size_t index_of(const Parameter& p) const {
    for (std::size_t i = 0; i < order_.size(); ++i)
      if (order_[i] == &p) return i;
    TRELLIS_THROW("ParameterBuffer: parameter ", p.name, " is not packed in this buffer");
  }

 private:
  std::size_t round_up(std::size_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  B be_;
  std::vector<Parameter*> order_;
  std::size_t alignment_ = default_alignment;
  Gradients gradients_ = Gradients::packed;
  std::vector<std::size_t> offsets_;
  typename B::template buffer<float> values_, grads_;
};

}  // namespace trellis::nn
