// The names of a layer's passes as backend ranges (NVTX on CUDA: Nsight Systems shows each block's
// forward, backward-input and backward-weight, and its attention and MLP inside): "h.3 forward",
// "h.3 backward_input", "h.3 backward_weight". Built once per layer, so a pass opens its range
// with no allocation: `auto r = be_.range(names_.forward.c_str());`.
#pragma once

#include <string>

namespace trellis::nn {

struct PassNames {
  std::string forward, backward_input, backward_weight;

  PassNames() = default;
  explicit PassNames(const std::string& layer)
      : forward(layer + " forward"), backward_input(layer + " backward_input"), backward_weight(layer + " backward_weight") {}
};

}  // namespace trellis::nn
