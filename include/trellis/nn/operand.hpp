// A parameter as the operand its layer's GEMMs read: the fp32 master values themselves when the
// backend computes in fp32, else a copy in the backend's activation type (bf16), converted from
// the master values at each use.
//
// Converting at each use keeps one source of truth while parameters are host vectors
// (nn/parameter.hpp); when they move into flat backend buffers, the copy becomes one shadow
// buffer refreshed once per optimizer step (docs/backend.md, "where this goes").
#pragma once

#include <cstddef>
#include <type_traits>

#include "trellis/backend/backend.hpp"
#include "trellis/nn/parameter.hpp"

namespace trellis::nn {

template <backend::Backend B>
class Operand {
 public:
  using act_t = typename B::act_t;

  const act_t* of(const B& be, const Parameter& p) {
    if constexpr (std::is_same_v<act_t, float>) {
      return p.value.data();
    } else {
      if (copy_.size() != p.value.size()) copy_ = be.template allocate<act_t>(p.value.size());
      be.convert(p.value.size(), p.value.data(), copy_.data());
      return copy_.data();
    }
  }

 private:
  typename B::template buffer<act_t> copy_;
};

}  // namespace trellis::nn
