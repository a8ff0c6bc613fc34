// core on the device: the stream-ordered Buffer<T, Cuda> (allocation, zero fill, copies, moves)
// and trellis::half / bfloat16 conversions computed in device code, bit for bit against the CUDA
// intrinsics __float2half_rn / __float2bfloat16_rn (every NaN included), and against
// __half2float / __bfloat162float (bit for bit except NaN payloads).
#include <catch2/catch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "support/gpu_test.hpp"
#include "trellis/core/cuda_buffer.hpp"
#include "trellis/core/dtype.hpp"

using trellis::Buffer;
using trellis::Cuda;
using trellis_gpu_test::Stream;

namespace {

// Float bit patterns: a stride through all 2^32 patterns (every exponent, many mantissas) plus the
// edges of the half range, ties, subnormals, infinities and NaNs.
std::vector<std::uint32_t> float_patterns() {
  std::vector<std::uint32_t> p;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 997) p.push_back(static_cast<std::uint32_t>(u));
  for (std::uint32_t sign : {0u, 0x80000000u}) {
    for (std::uint32_t u : {0x00000000u, 0x00000001u, 0x007fffffu, 0x00800000u, 0x33000000u, 0x33000001u,
                            0x337fffffu, 0x38800000u, 0x387fe000u, 0x387ff000u, 0x477fe000u, 0x477ff000u,
                            0x477fefffu, 0x7f7fffffu, 0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fffffffu,
                            0x3f808000u, 0x3f818000u, 0x3f800001u, 0x3f801000u, 0x3f803000u})
      p.push_back(sign | u);
    for (std::uint32_t m = 0; m < 4096; ++m) p.push_back(sign | 0x3f800000u | (m << 11));  // half ties near 1
  }
  return p;
}

__global__ void convert_kernel(const std::uint32_t* in, std::size_t n, std::uint16_t* ours_half,
                               std::uint16_t* cuda_half, std::uint16_t* ours_bf16, std::uint16_t* cuda_bf16) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float f = __uint_as_float(in[i]);
    ours_half[i] = trellis::half(f).bits;
    cuda_half[i] = __half_as_ushort(__float2half_rn(f));
    ours_bf16[i] = trellis::bfloat16(f).bits;
    cuda_bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
}

__global__ void widen_kernel(std::uint32_t* ours_half, std::uint32_t* cuda_half, std::uint32_t* ours_bf16,
                             std::uint32_t* cuda_bf16) {
  std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536u) return;
  auto bits = static_cast<std::uint16_t>(i);
  ours_half[i] = __float_as_uint(static_cast<float>(trellis::half(trellis::from_bits, bits)));
  cuda_half[i] = __float_as_uint(__half2float(__ushort_as_half(bits)));
  ours_bf16[i] = __float_as_uint(static_cast<float>(trellis::bfloat16(trellis::from_bits, bits)));
  cuda_bf16[i] = __float_as_uint(__bfloat162float(__ushort_as_bfloat16(bits)));
}

}  // namespace

TEST_CASE("Buffer<T, Cuda>: zero fill, copies both ways, moves", "[gpu][core]") {
  Stream stream;
  Buffer<float, Cuda> zeros(1000, stream);
  auto z = trellis_gpu_test::to_host(zeros);
  for (float v : z) REQUIRE(v == 0.0f);

  std::vector<int> values(4097);
  std::iota(values.begin(), values.end(), -17);
  Buffer<int, Cuda> d(values.size(), stream, false);
  REQUIRE(d.size() == values.size());
  REQUIRE(d.stream() == static_cast<cudaStream_t>(stream));
  d.copy_from_host(values.data(), values.size());
  Buffer<int, Cuda> moved(std::move(d));
  REQUIRE(d.empty());
  REQUIRE(d.data() == nullptr);
  REQUIRE(trellis_gpu_test::to_host(moved) == values);

  Buffer<int, Cuda> assigned;
  assigned = std::move(moved);
  REQUIRE(moved.empty());
  REQUIRE(trellis_gpu_test::to_host(assigned) == values);

  std::vector<int> too_big(values.size() + 1);
  REQUIRE_THROWS_AS(assigned.copy_from_host(too_big.data(), too_big.size()), trellis::Error);
  REQUIRE_THROWS_AS(assigned.copy_to_host(too_big.data(), too_big.size()), trellis::Error);
}

TEST_CASE("Buffer<T, Cuda>: an impossible allocation throws trellis::Error", "[gpu][core]") {
  Stream stream;
  REQUIRE_THROWS_AS((Buffer<char, Cuda>(std::size_t{1} << 62, stream)), trellis::Error);
  (void)cudaGetLastError();  // clear the (non-sticky) allocation error so later checks do not see it
}

TEST_CASE("half/bfloat16 from float in device code match the CUDA intrinsics bit for bit", "[gpu][core][dtype]") {
  Stream stream;
  auto patterns = float_patterns();
  auto in = trellis_gpu_test::to_device(patterns, stream);
  const std::size_t n = patterns.size();
  Buffer<std::uint16_t, Cuda> ours_half(n, stream), cuda_half(n, stream), ours_bf16(n, stream), cuda_bf16(n, stream);
  convert_kernel<<<1024, 256, 0, stream>>>(in.data(), n, ours_half.data(), cuda_half.data(), ours_bf16.data(),
                                           cuda_bf16.data());
  TRELLIS_CHECK_CUDA(cudaGetLastError());
  auto oh = trellis_gpu_test::to_host(ours_half), ch = trellis_gpu_test::to_host(cuda_half);
  auto ob = trellis_gpu_test::to_host(ours_bf16), cb = trellis_gpu_test::to_host(cuda_bf16);
  std::size_t half_mismatch = 0, bf16_mismatch = 0, first_half = n, first_bf16 = n;
  for (std::size_t i = 0; i < n; ++i) {
    if (oh[i] != ch[i] && half_mismatch++ == 0) first_half = i;
    if (ob[i] != cb[i] && bf16_mismatch++ == 0) first_bf16 = i;
  }
  INFO("patterns tested: " << n);
  if (first_half < n) INFO("first half mismatch: float bits " << std::hex << patterns[first_half] << " ours "
                                                               << oh[first_half] << " cuda " << ch[first_half]);
  REQUIRE(half_mismatch == 0);
  if (first_bf16 < n) INFO("first bf16 mismatch: float bits " << std::hex << patterns[first_bf16] << " ours "
                                                               << ob[first_bf16] << " cuda " << cb[first_bf16]);
  REQUIRE(bf16_mismatch == 0);
}

TEST_CASE("half/bfloat16 to float in device code match the CUDA intrinsics for all 65536 patterns (NaN: any NaN)",
          "[gpu][core][dtype]") {
  Stream stream;
  Buffer<std::uint32_t, Cuda> oh(65536, stream), ch(65536, stream), ob(65536, stream), cb(65536, stream);
  widen_kernel<<<256, 256, 0, stream>>>(oh.data(), ch.data(), ob.data(), cb.data());
  TRELLIS_CHECK_CUDA(cudaGetLastError());
  auto a = trellis_gpu_test::to_host(oh), b = trellis_gpu_test::to_host(ch);
  auto c = trellis_gpu_test::to_host(ob), d = trellis_gpu_test::to_host(cb);
  // Every non-NaN pattern bit for bit; NaN inputs must give a NaN (the payload the hardware
  // keeps is not part of the contract).
  auto is_nan = [](std::uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; };
  for (std::uint32_t i = 0; i < 65536u; ++i) {
    INFO("16-bit pattern " << std::hex << i << ": half " << a[i] << " vs " << b[i] << ", bf16 " << c[i] << " vs "
                           << d[i]);
    if (is_nan(b[i])) REQUIRE(is_nan(a[i]));
    else REQUIRE(a[i] == b[i]);
    if (is_nan(d[i])) REQUIRE(is_nan(c[i]));
    else REQUIRE(c[i] == d[i]);
  }
}
