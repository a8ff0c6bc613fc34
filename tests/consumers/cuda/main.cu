// Consumes trellis' CUDA parts from outside the source tree. Without a GPU it checks what the host
// can (the program built and links cudart) and reports that the kernel was not launched.
#include <trellis/cuda.cuh>

#include <cstdio>

__global__ void round_to_bf16(const float* in, trellis::bfloat16* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = trellis::bfloat16(in[i]);
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("trellis %s consumer built with nvcc; no CUDA device, kernel not launched\n",
                trellis::version_string);
    return 0;
  }
  const int n = 256;
  float host_in[n];
  for (int i = 0; i < n; ++i) host_in[i] = 1.0f + i / 1000.0f;
  trellis::Buffer<float, trellis::Cuda> in(n);
  trellis::Buffer<trellis::bfloat16, trellis::Cuda> out(n);
  in.copy_from_host(host_in, n);
  round_to_bf16<<<1, n>>>(in.data(), out.data(), n);
  trellis::bfloat16 host_out[n];
  out.copy_to_host(host_out, n);
  TRELLIS_CHECK_CUDA(cudaDeviceSynchronize());
  for (int i = 0; i < n; ++i)
    if (host_out[i].bits != trellis::bfloat16(host_in[i]).bits) return 1;
  std::printf("trellis consumer: %d device conversions match the host\n", n);
  return 0;
}
