// Host dropout kernel (contract: kernels/dropout.hpp): x *= keep / (1 - p) in place, the scale
// applied in fp32 and rounded once to T.
#pragma once

#include <cstdint>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/dropout.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

template <class T>
void dropout_apply(const DropoutArgs& a, T* x) {
  TRELLIS_CHECK(a.p >= 0.0f && a.p < 1.0f && a.batch > 0 && a.rows >= 0 && a.width >= 0 && a.row0 >= 0,
                "dropout: p=", a.p, " batch=", a.batch, " rows=", a.rows, " width=", a.width, " row0=", a.row0);
  const float scale = 1.0f / (1.0f - a.p);
  parallel_for(a.rows, [&](std::int64_t r) {
    const std::uint64_t key = dropout_key_of_row(a, r);
    T* xr = x + r * a.width;
    for (std::int64_t c = 0; c < a.width; ++c)
      xr[c] = dropout_keep(key, c, a.p) ? from_float<T>(to_float(xr[c]) * scale) : from_float<T>(0.0f);
  });
}

}  // namespace trellis::kernels::host
