// train_gpt: trains a small GPT-2 on text with data, tensor and pipeline parallelism, ranks as
// threads of this process (default) or one per MPI process (--mpi). See README.md and --help.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "flags.hpp"
#include "plan_auto.hpp"
#include "run.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/kernels/thread_pool.hpp"
#if defined(TRELLIS_TRAIN_GPT_MPI)
#include "trellis/comm/mpi.hpp"
#endif

using namespace trellis;
using namespace train_gpt;

#if defined(TRELLIS_TRAIN_GPT_CUDA)
namespace train_gpt {
Outcome run_cuda(const Options& o, const Data& data);  // cuda_backend.cu
#if defined(TRELLIS_TRAIN_GPT_MPI)
void run_cuda_mpi(comm::MpiComm& world, const Options& o, const Data& data, Outcome& out);
#endif
}
#endif

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  train_gpt::Options o;
  try {
    o = train_gpt::parse_flags(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 2;
  }
  if (o.help) {
    std::fputs(train_gpt::usage().c_str(), stdout);
    return 0;
  }
  if (o.kernel_threads > 0 && o.kernel_threads <= 4096) kernels::host::set_num_threads(o.kernel_threads);  // before any kernel
  try {
    if (o.mpi) {
#if defined(TRELLIS_TRAIN_GPT_MPI)
      comm::MpiWorld world(argc, argv);
      train_gpt::validate(o, world.size());  // flags only: the same verdict on every rank
      if (!o.cluster.empty()) {  // the same file on every rank: the same speeds
        o = train_gpt::apply_balance(o, world.rank() == 0);
        train_gpt::validate(o, world.size());
      }
      const double peak = o.peak_gflops * 1e9;  // 0: measured in run_rank
      Data data;
      Outcome out;
      // Everything that can fail on one rank alone (a file missing on its node, a communication
      // timeout) runs inside run(): MpiWorld prints the error there and ends the whole job
      // (MPI_Abort) instead of leaving the other ranks waiting for this one.
      world.run([&](comm::MpiComm& comm) {
        if (o.plan == "auto") {  // rank 0 plans, every rank runs its choice
          o = train_gpt::apply_plan_mpi(comm, o);
          train_gpt::validate(o, comm.size());
        }
        train_gpt::validate_paths(o, default_corpus());
        data = load_data(o);
#if defined(TRELLIS_TRAIN_GPT_CUDA)
        if (o.backend == "cuda") return run_cuda_mpi(comm, o, data, out);
#endif
        run_rank(comm, o, data, peak, out);
      });
      if (world.rank() == 0) final_report(o, data, out);
      return 0;
#else
      std::fprintf(stderr,
                   "train_gpt: --mpi: this build has no MPI (configure with MPI found); run without --mpi\n");
      return 2;
#endif
    }
    try {
      train_gpt::validate(o);
      if (o.plan == "auto") {
        o = train_gpt::apply_plan(o);
        train_gpt::validate(o);
      }
      if (!o.cluster.empty() || o.stage_costs == "measured") {
        o = train_gpt::apply_balance(o);
        train_gpt::validate(o);
      }
      train_gpt::validate_paths(o, default_corpus());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "train_gpt: %s\n", e.what());
      return 2;
    }
    const Data data = load_data(o);
#if defined(TRELLIS_TRAIN_GPT_CUDA)
    if (o.backend == "cuda") {
      final_report(o, data, run_cuda(o, data));
      return 0;
    }
#endif
    const double peak = o.peak_gflops * 1e9;  // 0: measured in run_rank
    Outcome out;
    comm::ThreadWorld world(o.dp * o.tp * o.pp * o.cp);
    world.run([&](comm::ThreadComm& comm) { run_rank(comm, o, data, peak, out); });
    final_report(o, data, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
  return 0;
}
