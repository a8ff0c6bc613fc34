// The planner's cost model against measurement: every layout of one GPT on this host's 2 thread
// ranks -- dp2 (ZeRO 0-3), tp2 (with and without sequence parallelism), pp2 (gpipe, 1f1b,
// interleaved, zb_h1), cp2 (ring attention, ZeRO 0-3) -- at every microbatch count, and four tp2
// layouts with overlap chunks (--overlap 2 and 4, with and without sp), four cp2 Ulysses layouts
// (--cp-mode ulysses, ZeRO 0 and 3, 1 and 4 microbatches), pp2 local learning at 1-8
// microbatches, and four layouts of the same GPT with Mixture-of-Experts blocks (blocks 0 and 2: 4
// experts, top-2, capacity 1.25; dp2 ep1, dp2 ep2 at 1 and 4 microbatches, dp2 ep2 ZeRO-1;
// "[MoE]" in the table, counted in the figures as the other rows), timed for real and predicted by plan::predict_step with rates measured on this machine
// (plan::MeasuredRates: the host kernels timed at the model's shapes, as many copies at once as
// there are ranks) and the link fitted to all-reduces timed on it (plan::measure_link). The
// ranks' communicator is comm::SimulatedLink (every collective held for
// latency + ring bytes / --gbps): a SIMULATED link on the host, not a network; kernels run on one
// thread per rank (one core each on a 2-core machine).
// Measured: the layouts are run in --passes rounds (each layout once per round: built, one warm-up
// step, --iters timed steps), and a layout's time is its fastest step over all rounds. Round robin
// rather than all of one layout's steps at once: on a shared machine a slow spell then costs one
// round of every layout instead of all the steps of a few, which reorders them. The spread of a
// layout's per-round best (slowest / fastest round) is printed as the noise beside each row.
// The rates are timed before the rounds and again after each (the faster kept), as the layouts'
// steps are. Prints the table, the Spearman rank correlation and the median relative error between predicted
// and measured, and the measured time of the planner's choice against the best measured layout.
//   bench_plan [--ranks N (2)] [--passes N (3)] [--iters N (2)] [--gbps G] [--recompute] [--json FILE]
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/report.hpp"
#include "support/synthetic_batch.hpp"
#include "trellis/comm/simulated_link.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/kernels/thread_pool.hpp"
#include "trellis/plan/measured_link.hpp"
#include "trellis/plan/measured_rates.hpp"
#include "trellis/plan/search.hpp"
#include "trellis/train/trainer.hpp"

using namespace trellis;

namespace {

using Link = comm::SimulatedLink<comm::ThreadComm>;

// The fastest of `iters` steps after one warm-up, in seconds.
double measure(const train::TrainerConfig& c, const comm::LinkModel& model, int iters) {
  double best = 1e30;
  comm::ThreadWorld(c.dp * c.tp * c.pp * c.cp).run([&](comm::ThreadComm& world) {
    Link link(world.split(0, world.rank()), model);
    train::Trainer<Link> t(link, c);
    const index_t rows = c.batch / c.dp;
    const auto b = bench::make_batch(rows, c.seq, c.model.vocab, t.mesh().template coord<trellis::dp>() * rows);
    t.step(b);
    for (int i = 0; i < iters; ++i) {
      world.barrier();
      const double t0 = bench::now_seconds();
      t.step(b);
      world.barrier();
      const double dt = bench::now_seconds() - t0;
      if (world.rank() == 0) best = std::min(best, dt);
    }
  });
  return best;
}

std::vector<double> ranks_of(const std::vector<double>& x) {  // average ranks for ties
  std::vector<std::size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](auto a, auto b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < idx.size();) {
    std::size_t j = i;
    while (j + 1 < idx.size() && x[idx[j + 1]] == x[idx[i]]) ++j;
    for (std::size_t k = i; k <= j; ++k) r[idx[k]] = (static_cast<double>(i + j)) / 2.0;
    i = j + 1;
  }
  return r;
}
double pearson(const std::vector<double>& a, const std::vector<double>& b) {
  const double n = static_cast<double>(a.size());
  const double ma = std::accumulate(a.begin(), a.end(), 0.0) / n, mb = std::accumulate(b.begin(), b.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return sab / std::sqrt(saa * sbb);
}

}  // namespace

int main(int argc, char** argv) try {
  kernels::host::set_num_threads(1);
  const int iters = static_cast<int>(bench::int_flag(argc, argv, "--iters", 2));
  const int passes = static_cast<int>(bench::int_flag(argc, argv, "--passes", 3));
  if (iters < 1 || passes < 1) throw std::invalid_argument("--iters and --passes must be at least 1");
  const double gbps = std::stod(bench::flag_value(argc, argv, "--gbps", "1"));
  const int ranks = static_cast<int>(bench::int_flag(argc, argv, "--ranks", 2));
  const comm::LinkModel link{.bandwidth = gbps * 1e9, .latency = 20e-6};

  train::TrainerConfig base;
  base.model = {.vocab = 2048, .positions = 128, .layers = 4, .heads = 4, .width = 256};
  base.seq = 128;
  base.batch = 16;
  base.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};

  plan::Cluster host;
  host.name = "this host: thread ranks, one kernel thread each, on a simulated link";
  host.nodes = 1;
  host.devices_per_node = ranks;
  host.device = {.name = "one core", .memory_bytes = 8e9, .peak_flops_fp32 = 1, .peak_flops_bf16 = 1, .memory_bandwidth = 1};
  host.intra_node = host.inter_node = {.bandwidth = link.bandwidth, .latency = link.latency};
  if (ranks > 1) {  // the link as the planner would see it: fitted to all-reduces timed on it
    plan::LinkFit fit;
    comm::ThreadWorld(ranks).run([&](comm::ThreadComm& world) {
      Link c(world.split(0, world.rank()), link);
      plan::LinkFit f = plan::measure_link(c);
      if (world.rank() == 0) fit = f;
    });
    std::printf("# link fitted to all-reduces of 4 KiB..4 MiB on it (plan::measure_link): %.3f GB/s, %.1f us "
                "(set: %.3f GB/s, %.1f us); the predictions use the fitted one\n",
                fit.link.bandwidth / 1e9, fit.link.latency * 1e6, link.bandwidth / 1e9, link.latency * 1e6);
    host.intra_node = host.inter_node = fit.link;
  }

  plan::SearchSpace space;
  space.max_microbatches = 8;
  space.overlap_chunks = {1};  // every layout without overlap; a few with it below
  space.cp_modes = {nn::CpMode::ring};  // ring cp; a few Ulysses layouts below
  space.shard_degrees = false;          // dp2 / cp2: no shard degree besides full sharding anyway
  space.offload_optimizer = {false};
  space.recompute = bench::has_flag(argc, argv, "--recompute") ? std::vector<bool>{false, true} : std::vector<bool>{false};
  plan::MeasuredRates measured(3, ranks);  // every kernel timed with `ranks` copies running at once
  const plan::Rates rates = measured.rates();
  // the same rates without the alone ones (every action at the shared rates, as before they were
  // modelled): printed beside, from the same measurement
  plan::Rates shared_only = rates;
  shared_only.shared_by = 1;
  shared_only.alone = nullptr;

  std::printf("# GPT 4 layers, width 256, 4 heads, vocab 2048, T 128, global batch 16, fp32; %d thread ranks, one "
              "kernel thread each, on a SIMULATED link of %.2f GB/s bus bandwidth, 20 us latency; measured: the "
              "fastest of %d rounds x %d steps (round robin over the layouts); noise: the slowest round's best / the "
              "fastest's; predicted: plan::predict_step with rates timed on this machine\n",
              ranks, gbps, passes, iters);
  std::vector<double> pred, meas;
  std::vector<std::string> names;
  bench::JsonReport report("bench_plan");
  std::vector<train::TrainerConfig> list = plan::layouts(base, host.devices(), ranks, space);
  // tp overlap chunks: tp2 (sp or not) at 1 or 2 microbatches with --overlap 2 or 4, beside the
  // same layouts without overlap above
  const struct {
    bool sp;
    int microbatches, chunks;
  } overlapped[] = {{false, 1, 2}, {false, 1, 4}, {true, 1, 4}, {true, 2, 2}};
  for (const auto& o : overlapped)
    for (const train::TrainerConfig& c : plan::layouts(base, host.devices(), ranks, space))
      if (c.tp == 2 && c.dp * c.pp * c.cp * c.tp == ranks && c.options.sequence_parallel == o.sp &&
          c.microbatches == o.microbatches && !c.options.recompute && plan::overlap_fits(c, o.chunks)) {
        list.push_back(c);
        list.back().options.overlap_chunks = o.chunks;
        break;
      }
  // Ulysses: cp2 --cp-mode ulysses at ZeRO 0 and 3, 1 and 4 microbatches, beside the same ring layouts
  for (int zero : {0, 3})
    for (int m : {1, 4})
      for (const train::TrainerConfig& c : plan::layouts(base, host.devices(), ranks, space))
        if (c.cp == 2 && c.dp * c.pp * c.cp * c.tp == ranks && c.zero == zero && c.microbatches == m &&
            !c.options.recompute) {
          list.push_back(c);
          list.back().cp_mode = nn::CpMode::ulysses;
          break;
        }
  // local learning (PPLL, heads tied to wte): pp2 at 1, 2, 4 and 8 microbatches (another model:
  // the search plans it only when asked, so it is listed here by hand)
  {
    train::TrainerConfig local = base;
    local.schedule = "local_learning";
    for (const train::TrainerConfig& c : plan::layouts(local, host.devices(), ranks, space))
      if (c.pp == ranks && !c.options.recompute) list.push_back(c);
  }
  // Mixture of Experts: the same GPT with 4 experts (top-2, capacity 1.25) in blocks 0 and 2, over
  // dp2 with the experts whole on each rank (ep1) or split (ep2: an all-to-all each way per MoE
  // block and pass)
  {
    train::TrainerConfig moe = base;
    moe.model.moe_every = 2;
    moe.model.experts = 4;
    moe.model.moe_topk = 2;
    moe.options.moe_capacity = 1.25f;
    const struct {
      int ep, microbatches, zero;
    } moe_layouts[] = {{1, 1, 0}, {2, 1, 0}, {2, 4, 0}, {2, 1, 1}};
    for (const auto& l : moe_layouts) {
      train::TrainerConfig c = moe;
      c.dp = ranks;
      c.ep = l.ep;
      c.microbatches = l.microbatches;
      c.zero = l.zero;
      if (ranks % l.ep == 0) list.push_back(c);
    }
  }
  std::erase_if(list, [](const train::TrainerConfig& c) { return !train::config_problems(c).empty(); });
  std::vector<double> round_best_min(list.size(), 1e30), round_best_max(list.size(), 0);
  // the fastest over the even rounds and over the odd ones: two independent measurements, whose
  // rank correlation is how well this machine reproduces its own order (the prediction's ceiling)
  std::array<std::vector<double>, 2> half(std::array<std::vector<double>, 2>{std::vector<double>(list.size(), 1e30),
                                                                             std::vector<double>(list.size(), 1e30)});
  // The rates: every shape the predictions need timed now, and again after each round (the
  // faster kept, MeasuredRates::retime), so that the calibration, like the measurement (each
  // layout's fastest round), meets the machine's quick spells; the predictions from the first
  // timing alone are kept for a line of comparison.
  std::vector<double> pred_first;
  for (const train::TrainerConfig& c : list) pred_first.push_back(plan::predict_step(c, host, rates).step);
  for (int round = 0; round < passes; ++round) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      const double m = measure(list[i], link, iters);
      round_best_min[i] = std::min(round_best_min[i], m);
      round_best_max[i] = std::max(round_best_max[i], m);
      half[round % 2][i] = std::min(half[round % 2][i], m);
    }
    measured.retime();
    std::fprintf(stderr, "# round %d of %d measured\n", round + 1, passes);
  }
  std::printf("%-72s %10s %10s %8s %6s %9s\n", "layout (train_gpt flags)", "pred ms", "meas ms", "pred/meas", "noise",
              "shared/m");
  std::vector<double> noise, pred_shared;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const train::TrainerConfig& c = list[i];
    const double p = plan::predict_step(c, host, rates).step;
    const double m = round_best_min[i];
    pred.push_back(p);
    meas.push_back(m);
    noise.push_back(round_best_max[i] / m);
    names.push_back((c.model.moe_every > 0 ? "[MoE] " : "") + plan::train_gpt_flags(c));
    pred_shared.push_back(plan::predict_step(c, host, shared_only).step);
    std::printf("%-72s %10.1f %10.1f %8.3f %6.3f %9.3f\n", names.back().c_str(), p * 1e3, m * 1e3, p / m, noise.back(),
                pred_shared.back() / m);
    bench::Row row;
    row.add_text("layout", names.back()).add("predicted_ms", p * 1e3).add("measured_ms", m * 1e3).add("noise", noise.back())
        .add("predicted_shared_only_ms", pred_shared.back() * 1e3);
    report.add(row);
  }
  std::vector<double> err;
  for (std::size_t i = 0; i < pred.size(); ++i) err.push_back(std::abs(pred[i] / meas[i] - 1));
  const auto median_of = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  const double median = median_of(err);
  const double rho = pearson(ranks_of(pred), ranks_of(meas));
  const auto chosen = static_cast<std::size_t>(std::min_element(pred.begin(), pred.end()) - pred.begin());
  const auto fastest = static_cast<std::size_t>(std::min_element(meas.begin(), meas.end()) - meas.begin());
  std::printf("# %zu layouts: Spearman rank correlation %.3f (goal >= 0.9), median |pred/meas - 1| %.1f %% (goal <= 10 %%)\n",
              pred.size(), rho, 100 * median);
  {
    std::vector<double> err_shared;
    for (std::size_t i = 0; i < pred.size(); ++i) err_shared.push_back(std::abs(pred_shared[i] / meas[i] - 1));
    const auto pick = static_cast<std::size_t>(std::min_element(pred_shared.begin(), pred_shared.end()) - pred_shared.begin());
    std::printf("# every action at the shared rates (Rates::alone not used): Spearman %.3f, median error %.1f %%, choice / "
                "best %.3f\n",
                pearson(ranks_of(pred_shared), ranks_of(meas)), 100 * median_of(err_shared), meas[pick] / *std::min_element(meas.begin(), meas.end()));
  }
  {
    std::vector<double> err_first;
    for (std::size_t i = 0; i < pred.size(); ++i) err_first.push_back(std::abs(pred_first[i] / meas[i] - 1));
    std::printf("# the rates timed once, before the rounds (no retime): Spearman %.3f, median error %.1f %%\n",
                pearson(ranks_of(pred_first), ranks_of(meas)), 100 * median_of(err_first));
  }
  std::printf("# noise: median slowest / fastest round %.3f, largest %.3f\n", median_of(noise),
              *std::max_element(noise.begin(), noise.end()));
  double rho_halves = 0;
  if (passes >= 2) {
    rho_halves = pearson(ranks_of(half[0]), ranks_of(half[1]));
    std::printf("# the measurement against itself: Spearman between the even rounds' and the odd rounds' fastest %.3f "
                "(predicted against them: %.3f and %.3f)\n",
                rho_halves, pearson(ranks_of(pred), ranks_of(half[0])), pearson(ranks_of(pred), ranks_of(half[1])));
  }
  std::printf("# the planner's choice: %s, measured %.1f ms; the fastest measured: %s, %.1f ms; choice / best %.3f "
              "(goal <= 1.05)\n",
              names[chosen].c_str(), meas[chosen] * 1e3, names[fastest].c_str(), meas[fastest] * 1e3,
              meas[chosen] / meas[fastest]);
  bench::Row summary;
  summary.add_text("layout", "summary").add("spearman", rho).add("median_error", median).add("choice_over_best", meas[chosen] / meas[fastest])
      .add("median_noise", median_of(noise))
      .add("spearman_measured_halves", rho_halves);
  report.add(summary);
  report.write(bench::json_path(argc, argv));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_plan: %s\n", e.what());
  return 1;
}
