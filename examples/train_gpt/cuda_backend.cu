// train_gpt --backend cuda: the same training loop (run.hpp) driving train::FlatTrainer<backend::Cuda>
// on one GPU (bf16 compute, fp32 master weights). Compiled only in CUDA builds.
#include <cuda_runtime_api.h>

#include <string>

#include "run.hpp"
#include "trellis/backend/cuda.cuh"
#include "trellis/nn/flat_gpt.hpp"
#include "trellis/train/flat_trainer.hpp"

namespace train_gpt {

// Dense bf16 peak of the GPU for MFU: stated (datasheet) for the GPUs we know, else --peak-gflops.
inline double stated_gpu_peak_flops(const cudaDeviceProp& p) {
  const std::string name = p.name;
  for (const char* hopper : {"H100", "H200", "H800", "GH200"})
    if (name.find(hopper) != std::string::npos) return 989e12;
  if (p.major == 8 && p.minor == 0) return 312e12;  // A100
  TRELLIS_THROW("--backend cuda: no stated bf16 peak for ", name, ": pass --peak-gflops for the MFU column");
}

Outcome run_cuda(const Options& o, const Data& data) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  TRELLIS_CHECK(e == cudaSuccess && devices > 0, "--backend cuda: no usable CUDA device (",
                e == cudaSuccess ? "none found" : cudaGetErrorString(e), "); use --backend host");
  cudaDeviceProp prop{};
  TRELLIS_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double peak = o.peak_gflops > 0 ? o.peak_gflops * 1e9 : stated_gpu_peak_flops(prop);
  cudaStream_t stream = nullptr;
  TRELLIS_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Outcome out;
  {
    train::FlatTrainer<backend::Cuda> trainer(trainer_config(o), backend::Cuda(stream));
    std::printf("device: %s\n", prop.name);
    run_training(trainer, true, 0, static_cast<double>(trainer.model().parameter_count()), o, data, peak,
                 "one GPU, no", out);
  }
  TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream));
  (void)cudaStreamDestroy(stream);
  return out;
}

}  // namespace train_gpt
