// One GPT-2 training step (forward, backward_input, backward_weight over all microbatches) on
// thread ranks, for each tensor-parallel layout and option (sequence parallelism, chunked
// overlap, recompute), next to the peer measured in the same run: the step's matrix products
// (the same shapes, forward and both backward products) as bare cblas_sgemm calls on one rank,
// i.e. the compute floor of the step. Columns: ms per step (min / median), tokens/s, and
// step / floor (1.0 = nothing but GEMM time).
//   nn_bench [--quick] [--json FILE]
#include <cblas.h>

#include <cstdio>
#include <vector>

#include "support/gpt_sgemm_floor.hpp"
#include "support/report.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/nn/gpt.hpp"

using namespace trellis;
using namespace trellis::nn;
using Comm = comm::ThreadComm;

namespace {

struct Layout {
  int tp;
  bool sp;
  int chunks;
  bool recompute;
};

std::pair<double, double> step_seconds(const GptConfig& cfg, const Layout& lay, index_t batch, index_t seq,
                                       int microbatches, int warmup, int iters) {
  std::pair<double, double> result;
  comm::ThreadWorld world(lay.tp);
  world.run([&](Comm& comm) {
    GptOptions opt;
    opt.sequence_parallel = lay.sp;
    opt.overlap_chunks = lay.chunks;
    opt.recompute = lay.recompute;
    GptModel<Comm> model(cfg, comm, opt);
    std::vector<std::int32_t> tokens(batch * seq), targets(batch * seq);
    for (index_t i = 0; i < batch * seq; ++i) {
      tokens[i] = static_cast<std::int32_t>((i * 7919) % cfg.vocab);
      targets[i] = static_cast<std::int32_t>((i * 104729 + 3) % cfg.vocab);
    }
    const double count = static_cast<double>(batch * seq * microbatches);
    auto step = [&] {
      model.zero_grad();
      for (int mb = 0; mb < microbatches; ++mb) {
        model.forward(mb, {batch, seq}, {tokens.data(), nullptr, targets.data(), count}, nullptr);
        model.backward_input(mb, {batch, seq}, nullptr, nullptr);
        model.backward_weight(mb);
      }
      model.reduce_tp_partial_grads();
      comm.barrier();
    };
    auto t = bench::time_min_median(step, warmup, iters);
    if (comm.rank() == 0) result = t;
  });
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::has_flag(argc, argv, "--quick");
  GptConfig cfg;
  cfg.vocab = quick ? 512 : 4096;
  cfg.positions = 256;
  cfg.layers = 2;
  cfg.heads = 4;
  cfg.width = quick ? 128 : 256;
  const index_t batch = 4, seq = quick ? 64 : 128;
  const int microbatches = 2, warmup = 1, iters = quick ? 2 : 5;
  const index_t tokens = batch * seq;

  const double floor = bench::gpt_sgemm_floor_seconds(cfg, static_cast<int>(tokens), warmup, iters) * microbatches;
  std::printf("# GPT-2 step: layers %lld width %lld heads %lld vocab %lld, %d microbatches of %lld x %lld tokens\n",
              static_cast<long long>(cfg.layers), static_cast<long long>(cfg.width), static_cast<long long>(cfg.heads),
              static_cast<long long>(cfg.vocab), microbatches, static_cast<long long>(batch), static_cast<long long>(seq));
  std::printf("# peer (same run): the step's GEMMs as bare cblas_sgemm on one rank: %.2f ms\n", floor * 1e3);
  std::printf("%4s %3s %6s %9s | %10s %10s %12s %12s\n", "tp", "sp", "chunks", "recompute", "min ms", "median ms",
              "tokens/s", "step/floor");
  bench::JsonReport report("nn_bench");
  const Layout layouts[] = {{1, false, 1, false}, {1, false, 1, true}, {2, false, 1, false}, {2, true, 1, false},
                            {2, true, 4, false},  {2, false, 4, false}, {4, true, 1, false}};
  for (const Layout& lay : layouts) {
    auto [tmin, tmed] = step_seconds(cfg, lay, batch, seq, microbatches, warmup, iters);
    const double tps = static_cast<double>(tokens * microbatches) / tmin;
    std::printf("%4d %3d %6d %9d | %10.2f %10.2f %12.0f %12.2f\n", lay.tp, lay.sp, lay.chunks, lay.recompute,
                tmin * 1e3, tmed * 1e3, tps, tmin / floor);
    bench::Row row;
    row.add("tp", static_cast<long long>(lay.tp)).add("sp", static_cast<long long>(lay.sp));
    row.add("chunks", static_cast<long long>(lay.chunks)).add("recompute", static_cast<long long>(lay.recompute));
    row.add("min_ms", tmin * 1e3).add("median_ms", tmed * 1e3).add("tokens_per_s", tps, "%.0f");
    row.add("sgemm_floor_ms", floor * 1e3).add("step_over_floor", tmin / floor);
    report.add(row);
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}
