// Mixture of Experts on the host (issue #14's figures), in one run:
//  1. The MoE block (nn::MoeMlp: router, top-2, dropless, E experts shaped as GPT-2 MLPs) at
//     ep = 1, 2, 4 on thread ranks, each rank with its own tokens: forward + backward_input +
//     backward_weight per rank, and where the time goes (MoeMlp::set_timing: routing, dispatch,
//     experts, combine). "dispatch + combine" is the share of the block's time spent moving
//     tokens to the experts and back (permutations, all_to_allv, the weighted sums). The ranks are
//     threads sharing this machine's cores (and its memory bandwidth): at ep > cores they also
//     share cores, so the times are per rank on a loaded machine, not a GPU cluster's.
//  2. A training step (train::Trainer, one rank) of an MoE GPT (every block: E experts, top-1,
//     dropless) against the dense GPT of the same width: top-1 routing sends each token through
//     one expert, a GPT-2 MLP, so the two have equal active FLOPs (plus the router's E columns);
//     timed alternately (round robin), min and median of the step.
//   moe_bench [--quick] [--json FILE]
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "support/report.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/nn/moe.hpp"
#include "trellis/train/data.hpp"
#include "trellis/train/trainer.hpp"

using namespace trellis;
namespace tb = trellis::bench;

namespace {

struct BlockResult {
  double seconds = 0;  // per rank per pass (F + B + W), the slowest rank
  nn::MoePhaseSeconds phases;  // rank 0's, per pass
};

BlockResult time_block(int ep, index_t width, index_t tokens, int experts, int reps) {
  BlockResult out;
  std::mutex mu;
  comm::ThreadWorld world(ep);
  world.run([&](comm::ThreadComm& c) {
    comm::ThreadComm self = c.split(c.rank(), 0);
    nn::MoeConfig cfg;
    cfg.experts = experts, cfg.topk = 2;
    nn::MoeMlp<comm::ThreadComm> m("h.0.mlp", width, 4 * width, cfg, nn::TensorParallel<comm::ThreadComm>{&self},
                                   nn::ExpertParallel<comm::ThreadComm>{&c});
    m.for_each_parameter([](nn::Parameter& p) { nn::init_normal(p, 7, 0.02f); });
    std::vector<float> x(static_cast<std::size_t>(tokens * width)), y(x.size()), dx(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = nn::counter_normal(c.rank() + 1, "x", static_cast<index_t>(i));
    const nn::TokenShape shape{1, tokens};
    auto pass = [&] {
      m.forward(0, shape, x.data(), y.data());
      m.backward_input(0, shape, y.data(), dx.data());
      m.backward_weight(0);
    };
    pass();  // warm-up
    c.barrier();
    m.set_timing(true);
    const double t0 = tb::now_seconds();
    for (int r = 0; r < reps; ++r) pass();
    const double mine = (tb::now_seconds() - t0) / reps;
    double slowest = 0;
    c.all_reduce(&mine, &slowest, 1, comm::ReduceOp::max);
    if (c.rank() == 0) {
      std::lock_guard lock(mu);
      out.seconds = slowest;
      out.phases = m.phase_seconds();
      for (double* v : {&out.phases.route, &out.phases.dispatch, &out.phases.experts, &out.phases.combine}) *v /= reps;
    }
  });
  return out;
}

std::vector<train::token_t> bench_tokens(std::size_t n) {
  std::vector<train::token_t> v(n);
  std::uint64_t x = 3;
  for (std::size_t i = 0; i < n; ++i) {
    x = splitmix64(x);
    v[i] = static_cast<train::token_t>((i * 7 + (i / 11)) % 256 ^ (x % 3 == 0 ? (x >> 20) % 256 : 0));
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  }
  const index_t width = quick ? 128 : 384, tokens = quick ? 256 : 2048;
  const int experts = 8, reps = quick ? 2 : 5;
  tb::JsonReport report("moe_bench");

  std::printf("1. MoE block: width %lld, hidden %lld, %d experts, top-2, dropless, %lld tokens per rank; "
              "F + B + W per rank (slowest rank), %d passes; ranks are threads on this machine's cores\n",
              static_cast<long long>(width), static_cast<long long>(4 * width), experts, static_cast<long long>(tokens),
              reps);
  std::printf("%4s %10s %8s %8s %8s %8s %18s\n", "ep", "block_ms", "route%", "disp%", "expert%", "comb%",
              "dispatch+combine%");
  for (int ep : {1, 2, 4}) {
    const BlockResult r = time_block(ep, width, tokens, experts, reps);
    const double total = r.phases.total();
    auto pct = [&](double v) { return total > 0 ? 100.0 * v / total : 0.0; };
    std::printf("%4d %10.2f %8.1f %8.1f %8.1f %8.1f %18.1f\n", ep, 1e3 * r.seconds, pct(r.phases.route),
                pct(r.phases.dispatch), pct(r.phases.experts), pct(r.phases.combine),
                pct(r.phases.dispatch + r.phases.combine));
    tb::Row row;
    row.add_text("part", "block").add("ep", static_cast<long long>(ep)).add("block_ms", 1e3 * r.seconds)
        .add("dispatch_combine_share", (r.phases.dispatch + r.phases.combine) / total, "%.4f");
    report.add(row);
  }

  // 2. MoE GPT (top-1: equal active FLOPs) against the dense GPT, one rank.
  train::TrainerConfig dense;
  dense.model = {.vocab = 256, .positions = 128, .layers = 4, .heads = 4, .width = quick ? 64 : 256};
  dense.batch = quick ? 4 : 8;
  dense.seq = quick ? 64 : 128;
  dense.microbatches = 1;
  train::TrainerConfig moe = dense;
  moe.model.moe_every = 1;
  moe.model.experts = experts;
  moe.model.moe_topk = 1;
  const auto data = bench_tokens(1 << 16);
  comm::ThreadWorld one(1);
  one.run([&](comm::ThreadComm& c) {
    train::Trainer<comm::ThreadComm> td(c, dense), tm(c, moe);
    train::DataLoader ld(data, {dense.batch, dense.seq, 1, true, 0, 1}), lm(data, {moe.batch, moe.seq, 1, true, 0, 1});
    std::vector<std::function<void()>> fns{[&] { td.step(ld.next()); }, [&] { tm.step(lm.next()); }};
    const auto t = tb::time_round_robin(fns, 1, quick ? 3 : 8);
    const double pd = td.global_parameter_count(), pm = tm.global_parameter_count();
    std::printf("\n2. GPT step, one rank: %lld layers, width %lld, batch %lld x %lld tokens; MoE: every block %d "
                "experts, top-1 (equal active FLOPs)\n",
                static_cast<long long>(dense.model.layers), static_cast<long long>(dense.model.width),
                static_cast<long long>(dense.batch), static_cast<long long>(dense.seq), experts);
    std::printf("%-6s %10s %10s %12s\n", "model", "min_ms", "med_ms", "parameters");
    std::printf("%-6s %10.1f %10.1f %11.2fM\n", "dense", 1e3 * t[0].first, 1e3 * t[0].second, pd / 1e6);
    std::printf("%-6s %10.1f %10.1f %11.2fM\n", "moe", 1e3 * t[1].first, 1e3 * t[1].second, pm / 1e6);
    std::printf("MoE step / dense step: %.2fx (min), %.2fx (median)\n", t[1].first / t[0].first, t[1].second / t[0].second);
    tb::Row row;
    row.add_text("part", "gpt_step").add("dense_ms", 1e3 * t[0].first).add("moe_ms", 1e3 * t[1].first)
        .add("moe_over_dense", t[1].first / t[0].first);
    report.add(row);
  });
  report.write(json);
  return 0;
}
