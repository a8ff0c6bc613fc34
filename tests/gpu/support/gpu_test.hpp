// Helpers for the GPU tests: a stream, host <-> device copies through trellis::Buffer<T, Cuda>,
// seeded random data and an element-wise tolerance check that names the worst element.
#pragma once

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/reference.hpp"
#include "trellis/core/check_cuda.hpp"
#include "trellis/core/cuda_buffer.hpp"
#include "trellis/core/dtype.hpp"

namespace trellis_gpu_test {

class Stream {
 public:
  Stream() { TRELLIS_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return stream_; }
  void sync() const { TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

template <class T>
trellis::Buffer<T, trellis::Cuda> to_device(const std::vector<T>& host, cudaStream_t stream) {
  trellis::Buffer<T, trellis::Cuda> d(host.size(), stream, false);
  if (!host.empty()) d.copy_from_host(host.data(), host.size());
  return d;
}

template <class T>
std::vector<T> to_host(const trellis::Buffer<T, trellis::Cuda>& d) {
  std::vector<T> host(d.size());
  if (!host.empty()) d.copy_to_host(host.data(), host.size());
  TRELLIS_CHECK_CUDA(cudaStreamSynchronize(d.stream()));
  return host;
}

using trellis_test::random_vector;  // seeded uniform fill, shared with the host kernel tests

// |got - want| <= abs_tol + rel_tol * |want| for every element; NaN must match NaN.
template <class A, class B>
void require_close(const A& got, const B& want, double abs_tol, double rel_tol, const char* what = "") {
  REQUIRE(got.size() == want.size());
  if (want.empty()) return;  // nothing to compare (and no element to report)
  double worst = 0.0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = static_cast<double>(static_cast<float>(got[i]));
    const double w = static_cast<double>(static_cast<float>(want[i]));
    if (std::isnan(w) && std::isnan(g)) continue;
    if (std::isinf(w) && g == w) continue;
    const double excess = std::fabs(g - w) - (abs_tol + rel_tol * std::fabs(w));
    if (!(excess <= worst)) {
      worst = std::isnan(excess) ? 1e30 : excess;
      worst_i = i;
    }
  }
  INFO(what << ": worst element " << worst_i << " of " << want.size() << ": got "
            << static_cast<float>(got[worst_i]) << " want " << static_cast<float>(want[worst_i]) << " (abs "
            << abs_tol << ", rel " << rel_tol << ")");
  REQUIRE(worst <= 0.0);
}

template <class To, class From>
std::vector<To> convert(const std::vector<From>& v) {
  std::vector<To> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = To(static_cast<float>(v[i]));
  return out;
}

}  // namespace trellis_gpu_test
