// train_gpt --backend cuda: the same training loop (run.hpp) driving train::Trainer<NcclComm,
// backend::Cuda> -- the one model stack, every layout -- on dp * tp * pp GPUs (bf16 compute, fp32
// master weights): one thread per GPU of this process, or one process per GPU under mpirun
// (--mpi; the NCCL id is broadcast over MPI). Compiled only in CUDA builds with NCCL.
#include <cuda_runtime_api.h>

#include <exception>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "run.hpp"
#include "trellis/backend/cuda.cuh"
#include "trellis/comm/nccl.hpp"
#if defined(TRELLIS_TRAIN_GPT_MPI)
#include "trellis/comm/mpi.hpp"
#endif

namespace train_gpt {

// Dense bf16 peak of one GPU for MFU: stated (datasheet) for the GPUs we know, else --peak-gflops.
inline double stated_gpu_peak_flops(const cudaDeviceProp& p) {
  const std::string name = p.name;
  for (const char* hopper : {"H100", "H200", "H800", "GH200"})
    if (name.find(hopper) != std::string::npos) return 989e12;
  if (p.major == 8 && p.minor == 0) return 312e12;  // A100
  TRELLIS_THROW("--backend cuda: no stated bf16 peak for ", name, ": pass --peak-gflops for the MFU column");
}

namespace {

int usable_devices() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  TRELLIS_CHECK(e == cudaSuccess && devices > 0, "--backend cuda: no usable CUDA device (",
                e == cudaSuccess ? "none found" : cudaGetErrorString(e), "); use --backend host");
  return devices;
}

// FLOP/s of all `ranks` GPUs (--peak-gflops is per GPU).
double peak_of(const Options& o, int device, int ranks) {
  cudaDeviceProp prop{};
  TRELLIS_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  return ranks * (o.peak_gflops > 0 ? o.peak_gflops * 1e9 : stated_gpu_peak_flops(prop));
}

// One rank: its GPU is current; the Trainer runs its kernels and collectives on comm's stream.
void run_gpu_rank(comm::NcclComm& comm, const Options& o, const Data& data, double peak, const char* ranks,
                  Outcome& out) {
  train::Trainer<comm::NcclComm, backend::Cuda> trainer(comm, trainer_config(o), backend::Cuda(comm.stream()));
  const double n_params = trainer.global_parameter_count();
  if (comm.rank() == 0) {
    cudaDeviceProp prop{};
    int device = 0;
    TRELLIS_CHECK_CUDA(cudaGetDevice(&device));
    TRELLIS_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    std::printf("device: %d x %s (NCCL)\n", comm.size(), prop.name);
  }
  run_training(trainer, comm.rank() == 0, trainer.mesh().template coord<trellis::dp>(), n_params, o, data, peak,
               ranks, out);
}

}  // namespace

Outcome run_cuda(const Options& o, const Data& data) {
  const int ranks = o.dp * o.tp * o.pp * o.cp;
  const int devices = usable_devices();
  TRELLIS_CHECK(ranks <= devices, "--backend cuda: --dp x --tp x --pp = ", ranks, " GPUs, but ", devices,
                " are visible (one thread per GPU; or run one process per GPU with mpirun and --mpi)");
  const double peak = peak_of(o, 0, ranks);
  std::vector<int> list(static_cast<std::size_t>(ranks));
  std::iota(list.begin(), list.end(), 0);
  auto comms = comm::NcclComm::init_all(list, "train_gpt");
  Outcome out;
  std::vector<std::exception_ptr> errors(list.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        TRELLIS_CHECK_CUDA(cudaSetDevice(list[static_cast<std::size_t>(r)]));
        run_gpu_rank(comms[static_cast<std::size_t>(r)], o, data, peak, "GPU thread", out);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

#if defined(TRELLIS_TRAIN_GPT_MPI)
// mpirun -np N train_gpt --mpi --backend cuda ...: rank r uses GPU r mod (GPUs of its node).
void run_cuda_mpi(comm::MpiComm& world, const Options& o, const Data& data, Outcome& out) {
  const int devices = usable_devices();
  const int device = world.rank() % devices;
  TRELLIS_CHECK_CUDA(cudaSetDevice(device));
  auto nccl = comm::NcclComm::bootstrap(world, device, "train_gpt");
  run_gpu_rank(nccl, o, data, peak_of(o, device, world.size()), "MPI + GPU", out);
}
#endif

}  // namespace train_gpt
