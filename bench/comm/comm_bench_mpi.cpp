// comm_bench_mpi: the same table as comm_bench, for OpenMPI's own collectives (MPI_Allreduce,
// MPI_Allgather, MPI_Reduce_scatter_block, MPI_Alltoall, MPI_Bcast) -- the peer the thread
// backend is compared with -- and for trellis' MpiComm on the same operations, buffers and sizes
// in the same run. Run under mpirun:
//   mpirun -np 4 --allow-run-as-root --oversubscribe --mca btl self,vader --bind-to none
//     comm_bench_mpi [--sizes 16M,64M] [--op all_reduce,...] [--impl openmpi,trellis_mpi,...]
//                    [--json mpi.json]
// Backends (the "backend" field of each JSON row, chosen with --impl; default the first two):
//   openmpi               the MPI call itself, on MPI_COMM_WORLD;
//   trellis_mpi           MpiComm as shipped (a timeout set): MPI_I* + a polite test loop;
//   trellis_mpi_blocking  MpiComm with the timeout off: MPI's blocking call behind trellis' checks.
// Columns (nccl-tests): size count type redop | time algbw busbw #wrong, see bench_common.hpp.
// Backends alternate for every (op, size), so load from other processes hits them alike.
// time is the mean per call over a block of iterations between two barriers, for the fastest of
// --trials blocks (busbw(mean): over all blocks); #wrong counts elements, over all
// ranks, that differ from the closed-form answer after the timed loop.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "comm/bench_common.hpp"
#include "trellis/comm/mpi.hpp"
#include "trellis/core/buffer.hpp"

namespace tb = trellis::bench;
namespace cb = trellis::bench::comm;
using trellis::comm::MpiComm;
using trellis::comm::ReduceOp;

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int n = 0, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  auto settings = cb::Settings::parse(argc, argv, "all_reduce,all_gather,reduce_scatter,all_to_all");
  const auto impls = cb::parse_list(cb::flag_value(argc, argv, "--impl", "openmpi,trellis_mpi"));
  tb::JsonReport json("comm_bench_mpi");
  {
    // trellis communicators (each a duplicate of MPI_COMM_WORLD); destroyed before MPI_Finalize.
    MpiComm trellis_mpi(MPI_COMM_WORLD, "bench");
    trellis_mpi.set_timeout(std::chrono::minutes(5));
    trellis_mpi.set_debug(false);
    MpiComm trellis_blocking(MPI_COMM_WORLD, "bench_blocking");
    trellis_blocking.set_timeout(std::chrono::milliseconds(0));
    trellis_blocking.set_debug(false);

    for (const std::string& impl : impls)
      if (impl != "openmpi" && impl != "trellis_mpi" && impl != "trellis_mpi_blocking" && r == 0)
        std::printf("# unknown --impl %s (openmpi, trellis_mpi, trellis_mpi_blocking)\n", impl.c_str());
    if (r == 0) {
      std::printf("# OpenMPI and trellis::comm::MpiComm (comm_bench_mpi), %d ranks; backends alternate per size\n", n);
      std::printf("# %-20s %-15s %12s %12s %7s %6s | %11s %11s %11s %7s | %11s\n", "backend", "op", "size(B)", "count",
                  "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "busbw(mean)");
      std::printf("# time/algbw/busbw: fastest timed block (--trials); busbw(mean): all timed iterations\n");
    }
    for (const std::string& op_name : settings.ops) {
      cb::OpInfo op{op_name.c_str()};
      for (std::size_t bytes : settings.sizes) {
        for (const std::string& impl : impls) {
          if (impl != "openmpi" && impl != "trellis_mpi" && impl != "trellis_mpi_blocking") continue;
          MpiComm& comm = impl == "trellis_mpi" ? trellis_mpi : trellis_blocking;
          const bool raw = impl == "openmpi";
          const std::size_t count = op.count(bytes, sizeof(float), n);
          if (count == 0) continue;
          const int iters = settings.iterations(bytes);
          const std::size_t total = count * static_cast<std::size_t>(n);
          const bool is_reduce = op_name == "all_reduce", is_gather = op_name == "all_gather",
                     is_scatter = op_name == "reduce_scatter", is_a2a = op_name == "all_to_all";
          const std::size_t in_count = is_reduce || op_name == "broadcast" || is_gather ? count : total;
          const std::size_t out_count = is_reduce || op_name == "broadcast" || is_scatter ? count : total;
          trellis::Buffer<float> in(in_count, false), out(out_count, false);
          for (std::size_t i = 0; i < in_count; ++i) in.data()[i] = static_cast<float>((r + 1) + (i % 7));
          for (std::size_t i = 0; i < out_count; ++i) out.data()[i] = 0.0f;
          const int c = static_cast<int>(count);
          auto once = [&] {
            if (raw) {
              if (is_reduce) MPI_Allreduce(in.data(), out.data(), c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
              else if (is_gather) MPI_Allgather(in.data(), c, MPI_FLOAT, out.data(), c, MPI_FLOAT, MPI_COMM_WORLD);
              else if (is_scatter) MPI_Reduce_scatter_block(in.data(), out.data(), c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
              else if (is_a2a) MPI_Alltoall(in.data(), c, MPI_FLOAT, out.data(), c, MPI_FLOAT, MPI_COMM_WORLD);
              else MPI_Bcast(r == 0 ? in.data() : out.data(), c, MPI_FLOAT, 0, MPI_COMM_WORLD);
              return;
            }
            if (is_reduce) comm.all_reduce(in.data(), out.data(), count, ReduceOp::sum);
            else if (is_gather) comm.all_gather(in.data(), out.data(), count);
            else if (is_scatter) comm.reduce_scatter(in.data(), out.data(), count, ReduceOp::sum);
            else if (is_a2a) comm.all_to_all(in.data(), out.data(), count);
            else comm.broadcast(r == 0 ? in.data() : out.data(), count, 0);
          };
          for (int i = 0; i < settings.warmup; ++i) once();
          double seconds = 1e30, sum = 0;  // fastest timed block (--trials) and the mean of all
          for (int trial = 0; trial < settings.trials; ++trial) {
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = MPI_Wtime();
            for (int i = 0; i < iters; ++i) once();
            MPI_Barrier(MPI_COMM_WORLD);
            const double block = (MPI_Wtime() - t0) / iters;
            seconds = std::min(seconds, block);
            sum += block;
          }
          const double mean_seconds = sum / settings.trials;
          long long bad = cb::count_wrong(op_name, out.data(), out_count, count, r, n), all_bad = 0;
          MPI_Reduce(&bad, &all_bad, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
          if (r == 0) {
            const bool reduction = is_reduce || is_scatter;
            std::printf("  %-20s", impl.c_str());
            json.add(cb::print_row(impl.c_str(), op_name.c_str(), n, bytes, count, "float", reduction ? "sum" : "none",
                                   seconds, op.bus_factor(n), all_bad, mean_seconds));
          }
        }
      }
    }
  }
  if (r == 0) json.write(settings.json);
  MPI_Finalize();
  return 0;
}
