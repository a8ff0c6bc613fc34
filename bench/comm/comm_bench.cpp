// comm_bench: nccl-tests-style table for the thread-rank backend.
//   comm_bench [--ranks N] [--op all_reduce,all_gather,reduce_scatter,all_to_all,broadcast]
//              [--sizes 8K,1M,16M,64M] [--iters I] [--warmup W] [--trials T] [--no-memcpy] [--no-ideal]
//              [--json FILE]
// Every size also gets a row of single-thread memcpy bandwidth (the machine's reference), so the
// table says how close the collectives come to moving memory at one core's copy speed. all_gather,
// reduce_scatter and all_reduce of 4 MiB and more also get an "ideal" row: the op's reads and writes alone, on all
// hardware threads with no synchronisation (cb::ideal_traffic_seconds), in busbw, which is about
// what any shared-memory algorithm can reach on this machine (--no-ideal drops those rows).
// Data are small integers so every result is exact: #wrong counts elements that differ from the
// closed-form answer.
#include <atomic>
#include <cstdio>
#include <string>
#include <vector>

#include "comm/bench_common.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/core/buffer.hpp"

using trellis::Buffer;
using trellis::comm::ReduceOp;
using trellis::comm::ThreadComm;
using trellis::comm::ThreadWorld;
namespace tb = trellis::bench;
namespace cb = trellis::bench::comm;

static bool is_reduction(const std::string& op) { return op == "all_reduce" || op == "reduce_scatter"; }

int main(int argc, char** argv) {
  const int ranks = std::atoi(cb::flag_value(argc, argv, "--ranks", "2").c_str());
  auto settings = cb::Settings::parse(argc, argv, "all_reduce,all_gather,reduce_scatter,all_to_all");
  const bool with_memcpy = !tb::has_flag(argc, argv, "--no-memcpy");
  const bool with_ideal = !tb::has_flag(argc, argv, "--no-ideal");
  tb::JsonReport json("comm_bench");
  cb::print_header("trellis thread ranks (comm_bench)", ranks);

  for (const std::string& op_name : settings.ops) {
    cb::OpInfo op{op_name.c_str()};
    for (std::size_t bytes : settings.sizes) {
      const std::size_t count = op.count(bytes, sizeof(float), ranks);
      if (count == 0) continue;
      const int iters = settings.iterations(bytes);
      double seconds = 0, mean_seconds = 0;
      std::atomic<long long> wrong{0};
      ThreadWorld(ranks).run([&](ThreadComm& comm) {
        const int n = comm.size(), r = comm.rank();
        const std::size_t total = count * static_cast<std::size_t>(n);
        const bool is_reduce = op_name == "all_reduce", is_gather = op_name == "all_gather",
                   is_scatter = op_name == "reduce_scatter", is_a2a = op_name == "all_to_all";
        const std::size_t in_count = is_reduce || op_name == "broadcast" ? count : is_gather ? count : total;
        const std::size_t out_count = is_reduce || op_name == "broadcast" ? count : is_scatter ? count : total;
        Buffer<float> in(in_count, false), out(out_count, false);
        for (std::size_t i = 0; i < in_count; ++i) in.data()[i] = static_cast<float>((r + 1) + (i % 7));
        for (std::size_t i = 0; i < out_count; ++i) out.data()[i] = 0.0f;
        auto once = [&] {
          if (is_reduce) comm.all_reduce(in.data(), out.data(), count, ReduceOp::sum);
          else if (is_gather) comm.all_gather(in.data(), out.data(), count);
          else if (is_scatter) comm.reduce_scatter(in.data(), out.data(), count, ReduceOp::sum);
          else if (is_a2a) comm.all_to_all(in.data(), out.data(), count);
          else comm.broadcast(r == 0 ? in.data() : out.data(), count, 0);
        };
        for (int i = 0; i < settings.warmup; ++i) once();
        double best = 1e30, sum = 0;
        for (int trial = 0; trial < settings.trials; ++trial) {
          comm.barrier();
          const double t0 = tb::now_seconds();
          for (int i = 0; i < iters; ++i) once();
          comm.barrier();
          const double block = (tb::now_seconds() - t0) / iters;
          best = std::min(best, block);
          sum += block;
        }
        if (r == 0) {
          seconds = best;
          mean_seconds = sum / settings.trials;
        }
        // Check against the closed form.
        const long long bad = cb::count_wrong(op_name, out.data(), out_count, count, r, n);
        wrong += bad;
      });
      json.add(cb::print_row("threads", op_name.c_str(), ranks, bytes, count, "float", is_reduction(op_name) ? "sum" : "none",
                             seconds, op.bus_factor(ranks), wrong.load(), mean_seconds));
      const cb::Traffic traffic = cb::op_traffic(op_name, bytes, ranks);
      // Only where memory bandwidth rules: below 4 MiB the reference's own barriers dominate.
      if (with_ideal && traffic.reads > 0 && bytes >= (std::size_t{4} << 20)) {
        const double ideal = cb::ideal_traffic_seconds(traffic.reads, traffic.writes, traffic.stream_bytes, iters,
                                                       settings.trials);
        json.add(cb::print_row("ideal", ("ideal:" + op_name).c_str(), ranks, bytes, count, "float", "-", ideal,
                               op.bus_factor(ranks), 0));
      }
    }
  }
  if (with_memcpy) {
    std::printf("# single-thread memcpy (bytes copied / s)\n");
    for (std::size_t bytes : settings.sizes) {
      const auto [bw, bw_mean] = cb::memcpy_bandwidth(bytes, settings.iterations(bytes), settings.trials);
      std::printf("  %-15s %12zu %12s %7s %6s | %11s %11.2f %11s %7s | %11.2f\n", "memcpy", bytes, "-", "bytes", "-", "-", bw,
                  "-", "-", bw_mean);
      tb::Row row;
      row.add_text("backend", "memcpy").add_text("op", "memcpy").add("ranks", 1LL).add("bytes", static_cast<long long>(bytes))
          .add("algbw", bw).add("busbw", bw).add("busbw_mean", bw_mean);
      json.add(row);
    }
  }
  json.write(settings.json);
  return 0;
}
