// The parts of train_gpt shared by its host (main.cpp) and CUDA (cuda_backend.cu) translation
// units: data loading, the training loop (generic over the trainer), the final report.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flags.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/kernels/cpu_peak.hpp"
#include "trellis/report/loss_curve.hpp"
#include "trellis/report/progress.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/data.hpp"
#include "trellis/train/generate.hpp"
#include "trellis/train/hf_gpt2.hpp"
#include "trellis/train/metrics.hpp"
#include "trellis/train/trainer.hpp"
#if defined(TRELLIS_HAS_CBLAS)
#include <cblas.h>
#endif

#ifndef TRELLIS_SOURCE_DIR
#define TRELLIS_SOURCE_DIR "."
#endif

namespace train_gpt {

namespace fs = std::filesystem;
using namespace trellis;

// The BLAS' rate on this machine: the best of a few 512^3 sgemm calls (all BLAS threads). MFU's
// second figure ("% of sgemm"): what the BLAS reaches, not what the machine could.
inline double measured_peak_flops() {
#if defined(TRELLIS_HAS_CBLAS)
  const int n = 512;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n, 0.0f);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * n * n * n / best;
#else
  return 50e9;  // stated: no BLAS in this build
#endif
}

// What host MFU is measured against: the machine's peak for the compute dtype (theoretical from
// cpuid and the measured clock: kernels/cpu_peak.hpp), with the measured sgemm rate beside it.
struct HostPeak {
  double peak = 0;   // FLOP/s, the dtype's machine peak
  double blas = 0;   // FLOP/s, measured sgemm (0: none)
  std::string note;  // how the peak was found (for the header)
  kernels::host::CpuPeak cpu{};  // the measurement behind `peak`
};

inline HostPeak host_mfu_reference(const std::string& dtype) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const kernels::host::CpuPeak cpu = kernels::host::measure_cpu_peak(cores);
  HostPeak h;
  h.cpu = cpu;
  const bool bf16 = dtype == "bf16";
  h.peak = cpu.peak(bf16);
  h.blas = measured_peak_flops();
  h.note = std::string(bf16 ? "bf16" : "fp32") + " machine peak; " + cpu.describe();
  return h;
}

struct Data {
  train::TokenData train, val;
  double unigram = 0;
};

// The shipped corpus (the --data default).
inline std::string default_corpus() { return std::string(TRELLIS_SOURCE_DIR) + "/data/tiny_corpus.txt"; }

// Errors name the file and, for a split too small to train or validate on, the flags to change.
inline Data load_data(const Options& o) {
  train::TokenData all;
  const std::vector<std::string> files = data_files(o, default_corpus());
  const std::string path = o.data.empty() ? default_corpus() : o.data;
  if (path.size() > 4 && path.substr(path.size() - 4) == ".bin") {
    std::vector<fs::path> shards(files.begin(), files.end());
    all = train::load_llmc_tokens(shards.front(), o.vocab);
    if (shards.size() > 1) all = train::load_llmc_shards(shards, o.vocab);
  } else {
    TRELLIS_CHECK(fs::exists(path), "--data: no file ", path);
    TRELLIS_CHECK(o.vocab >= 256, "--data ", path,
                  " is text (bytes as tokens, 0..255): it needs --vocab >= 256, got ", o.vocab);
    all = train::load_text_as_bytes(path);
  }
  TRELLIS_CHECK(!all.tokens.empty(), "--data ", path, " holds no tokens: there is nothing to train on");
  Data d;
  std::tie(d.train, d.val) = train::train_val_split(all, o.val_fraction);
  // Each loader needs one global batch of --batch windows of --context + 1 tokens.
  const auto windows = [&](const train::TokenData& t) {
    return t.tokens.empty() ? 0 : static_cast<long long>(t.tokens.size() - 1) / o.context;
  };
  TRELLIS_CHECK(windows(d.train) >= o.batch && windows(d.val) >= o.batch, "--data ", path, ": its ",
                all.tokens.size(), " tokens split (--val-fraction ", o.val_fraction, ") into ", d.train.tokens.size(),
                " training and ", d.val.tokens.size(), " validation tokens, which give ", windows(d.train), " and ",
                windows(d.val), " windows of --context ", o.context, " + 1 tokens; each needs one batch of --batch ",
                o.batch, ": use more data, a larger --val-fraction, or a smaller --batch / --context");
  d.unigram = train::unigram_cross_entropy(d.train.tokens, d.val.tokens, o.vocab);
  return d;
}

struct Outcome {
  double first_loss = 0, last_loss = 0, val_loss = -1;
  int steps_done = 0;
  std::int64_t first_step = 0;  // the step training started at (a resumed checkpoint's)
  double seconds = 0;
  std::string checkpoint;
  double activation_peak_bytes = 0;  // saved activations held at once, the largest over the ranks (measured)
  double activation_host_peak_bytes = 0;  // the same, offloaded to host memory (--offload activations)
  std::vector<std::pair<int, std::vector<double>>> expert_load;  // MoE: tokens routed per expert, per MoE layer
};

// Parameters a token's forward uses: an MoE layer's token reaches k of its E experts (for the
// FLOPs of MFU; the router's E x width are counted whole: train::moe_active_parameters).
inline double active_parameters(double n_params, const Options& o) {
  if (o.experts <= 0) return n_params;
  const auto cfg = trainer_config(o).model;
  double moe_layers = 0;
  for (index_t i = 0; i < cfg.layers; ++i) moe_layers += cfg.is_moe_layer(i) ? 1 : 0;
  return train::moe_active_parameters(n_params, moe_layers, o.experts, o.topk, o.width);
}

// The training loop of one rank, for any trainer with Trainer's step / evaluate / save / load /
// step_count (train::Trainer over thread, MPI or NCCL ranks, any backend). `lead`: the rank
// that prints and logs; `dp_rank`: which rows of the global batch this rank reads; `n_params`: the
// whole model's parameter count (for MFU); `peak`: FLOP/s of everything the run uses; `blas`: a
// measured GEMM rate for MFU's second figure (0: none), `peak_note`: how `peak` was found.
template <class TrainerT>
void run_training(TrainerT& trainer, bool lead, int dp_rank, double n_params, const Options& o, const Data& data,
                  double peak, const std::string& ranks, Outcome& outcome, double blas = 0,
                  const std::string& peak_note = "") {
  const auto cfg = trainer_config(o);
  train::DataLoader loader(data.train.tokens, {cfg.batch, cfg.seq, o.seed, true, dp_rank, cfg.dp, o.pack, cfg.dp_rows});
  train::DataLoader val_loader(data.val.tokens, {cfg.batch, cfg.seq, o.seed, false, dp_rank, cfg.dp, o.pack, cfg.dp_rows});
  const fs::path ckpt_root = checkpoint_root(o);
  auto save = [&]() {  // collective; then the lead prunes (--keep-last), never the one `latest` names
    trainer.save(ckpt_root, loader.state());
    if (lead && o.keep_last > 0) train::prune_checkpoints(ckpt_root, o.keep_last);
  };
  if (o.resume) {
    auto latest = train::latest_checkpoint(ckpt_root);
    TRELLIS_CHECK(latest.has_value(), "--resume: no checkpoint under ", ckpt_root);
    auto state = trainer.load(*latest);
    try {
      loader.restore(state.data);
    } catch (const Error& e) {
      TRELLIS_THROW("--resume from ", latest->string(), ": ", e.message(), " (--seed)");
    }
    if (lead) {
      std::cout << "resumed from " << latest->string() << " at step " << state.step;
      if (latest->extension() == ".old" || latest->extension() == ".partial")
        std::cout << " (its step directory was missing after an interrupted save; the next save repairs it)";
      std::cout << "\n";
      // Rows a crashed run logged after this checkpoint are about to be trained (and logged) again.
      if (!o.log.empty() && fs::exists(o.log)) {
        const auto removed = train::trim_metrics_after(o.log, state.step);
        if (removed > 0) std::cout << "removed " << removed << " rows past step " << state.step << " from " << o.log << "\n";
      }
    }
  }
  if (!o.init_from.empty()) {  // every rank reads its own pieces
    trainer.init_from_hf(o.init_from);
    if (lead) std::cout << "initialised from " << o.init_from << " (fresh optimizer, step 0)\n";
  }
  // Useful work only: packed rows count their real tokens, attending over their documents.
  const double flops_per_token =
      train::gpt_flops_per_token(active_parameters(n_params, o), o.layers, o.width, loader.attention_span());
  const double tokens_per_step = static_cast<double>(cfg.batch * cfg.seq) * loader.packing_efficiency();
  std::unique_ptr<train::MetricsWriter> metrics;
  std::unique_ptr<report::ProgressBar> bar;
  if (lead) {
    if (!o.log.empty()) {
      if (fs::path(o.log).has_parent_path()) fs::create_directories(fs::path(o.log).parent_path());
      metrics = std::make_unique<train::MetricsWriter>(o.log, o.resume);
    }
    bar = std::make_unique<report::ProgressBar>(std::cout);
    std::printf("model: %d layers, %d heads, width %d, vocab %d, context %d: %.3gM parameters\n", o.layers,
                o.heads, o.width, o.vocab, o.context, n_params / 1e6);
    if (o.experts > 0)
      std::printf("experts: %d per MoE block (every %d blocks from block 0), top-%d, %s, ep %d; %.3gM parameters "
                  "active per token; load-balancing loss x %g, z-loss x %g (shown as aux)\n",
                  o.experts, static_cast<int>(cfg.model.moe_every), o.topk,
                  o.capacity > 0 ? ("capacity factor " + std::to_string(o.capacity)).c_str() : "dropless", o.ep,
                  active_parameters(n_params, o) / 1e6, o.aux_loss, o.z_loss);
    const std::string schedule = o.pp == 1                  ? "(none, pp=1)"
                                 : o.schedule_file.empty() ? o.schedule
                                                           : cfg.custom_schedule->name + " from " + o.schedule_file;
    const char* dtype = o.backend == "cuda" || o.dtype == "bf16" ? "bf16 compute, fp32 master weights" : "fp32";
    const std::string cp = o.cp > 1 ? " x cp " + std::to_string(o.cp) + " (" + o.cp_mode + ")" : "";
    const std::string zero = o.zero > 0 ? " +zero" + std::to_string(o.zero) : "";
    std::printf("layout: dp %d x tp %d x pp %d%s%s%s, schedule %s, %d microbatches of %lld rows; %s ranks; %s\n",
                o.dp, o.tp, o.pp, cp.c_str(), o.sp ? " +sp" : "", zero.c_str(), schedule.c_str(), o.microbatches,
                static_cast<long long>(trellis::train::dp_rows_of(cfg, 0) / cfg.microbatches), ranks.c_str(), dtype);
    if (!cfg.dp_rows.empty()) {
      std::string rows;
      for (std::size_t d = 0; d < cfg.dp_rows.size(); ++d) rows += (d ? ", " : "") + std::to_string(cfg.dp_rows[d]);
      std::printf("dp shares: %s rows of the global batch of %lld (dp rank 0's microbatches above)%s\n", rows.c_str(),
                  static_cast<long long>(cfg.batch), o.simulate_rank_speed && !o.dp_speed.empty()
                                                         ? "; dp ranks slowed to --dp-speed (simulated on the host)" : "");
    }
    if (o.pp > 1 && (!o.stage_layers.empty() || !o.rank_speed.empty())) {  // uneven stages: the split and its prediction
      const auto pred = trellis::train::predict_pipeline(cfg);
      const double block = trellis::train::layer_costs(cfg).layers.front();  // one block's forward
      std::string blocks, times;
      for (std::size_t s = 0; s + 1 < pred.bounds.size(); ++s) {
        blocks += (s ? ", " : "") + std::to_string(pred.bounds[s + 1] - pred.bounds[s]);
        times += (s ? " : " : "") + std::to_string(pred.stage_time[s] / block).substr(0, 4);
      }
      std::printf("pipeline stages: %s blocks; predicted time per stage and microbatch pass (%s / --rank-speed, "
                  "in block passes) %s; the schedule simulated with them: a step of %.1f block passes%s\n",
                  blocks.c_str(), cfg.stage_costs ? "F+B+W timed here" : "FLOPs", times.c_str(), pred.step / block,
                  o.simulate_rank_speed ? "; ranks slowed to their speed (simulated on the host)" : "");
    }
    if (loader.packed())
      std::printf("packing: documents start at token %d; %lld rows of %d tokens, %.1f %% of them real tokens "
                  "(the rest padding, not trained on); tok/s and MFU count real tokens over a mean attention "
                  "span of %.0f\n",
                  o.pack, static_cast<long long>(loader.windows()), o.context, 100.0 * loader.packing_efficiency(),
                  loader.attention_span());
    if (o.cp_balance_docs)
      std::printf("balanced documents: each row's documents reordered (whole) for near-equal causal attention "
                  "work over the %d cp ranks (nn/context_parallel.hpp)\n", o.cp);
    if (o.dropout > 0 || o.recompute || o.overlap > 1 || !o.fused_update.empty())
      std::printf("options: dropout %g (training only), recompute %s, tp overlap chunks %d, fused AdamW update %s\n",
                  o.dropout, o.recompute ? "on" : "off", o.overlap,
                  o.fused_update.empty() ? "off" : o.fused_update.c_str());
    const auto mem = trainer.memory();
    const auto mib = [](std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
    std::printf("memory, rank 0: weights %.2f MiB, gradients %.2f MiB%s, AdamW state %.2f MiB, saved activations "
                "%.2f MiB reserved, workspace %.2f MiB: %.2f MiB",
                mib(mem.parameters), mib(mem.gradients),
                o.zero >= 2 ? " (ZeRO: shards + unit slots)" : "", mib(mem.optimizer), mib(mem.activations),
                mib(mem.workspace), mib(mem.total()));
    if (mem.host_optimizer > 0 || mem.host_activations > 0) {  // measured after the first step; here the moments alone
      std::printf("; offloaded to host memory:");
      if (mem.host_optimizer > 0) std::printf(" AdamW state %.2f MiB", mib(mem.host_optimizer));
      if (mem.host_activations > 0)
        std::printf("%s saved activations %.2f MiB reserved", mem.host_optimizer > 0 ? "," : "",
                    mib(mem.host_activations));
    }
    std::printf("\n");
    const char* dtype_peak = o.dtype == "bf16" ? " (bf16 machine peak)" : " (fp32 machine peak)";
    std::printf(
        "data: %zu train / %zu validation tokens; unigram baseline %.4f nats/token; MFU against %.1f "
        "GFLOP/s%s\n",
        data.train.tokens.size(), data.val.tokens.size(), data.unigram, peak / 1e9,
        o.peak_gflops > 0 ? " (given)" : o.backend == "cuda" ? " (stated GPU peak)" : dtype_peak);
    if (!peak_note.empty() || blas > 0) {
      std::string line = "peak: " + peak_note;
      if (blas > 0) {
        char buf[128];
        std::snprintf(buf, sizeof buf, "%smeasured sgemm %.1f GFLOP/s (whole machine): the \"%% of sgemm\" figure",
                      peak_note.empty() ? "" : "; ", blas / 1e9);
        line += buf;
      }
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
  }
  auto validate_now = [&]() {
    val_loader.reset();
    const auto nb = std::min<index_t>(val_loader.batches_per_epoch(), 4);
    double sum = 0;
    for (index_t b = 0; b < nb; ++b) sum += trainer.evaluate(val_loader.next());
    return sum / static_cast<double>(nb);
  };
  const auto first_step = trainer.step_count();
  const auto t_start = std::chrono::steady_clock::now();
  double last_loss = 0, first_loss = -1, val = -1;
  for (auto step = first_step; step < o.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = trainer.step(loader.next());
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last_loss = r.loss;
    if (first_loss < 0) first_loss = r.loss;
    const bool eval = (r.step % o.eval_every == 0) || r.step == o.steps;
    std::optional<double> val_now;
    if (eval) val = *(val_now = validate_now());
    if (lead) {
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      train::StepMetrics m;
      m.step = r.step;
      m.loss = r.loss;
      m.lr = r.lr;
      m.grad_norm = r.grad_norm;
      m.tokens_per_s = tokens_per_step / dt;
      m.mfu = train::model_flops_utilization(flops_per_token, m.tokens_per_s, peak);
      const double mfu_blas = blas > 0 ? train::model_flops_utilization(flops_per_token, m.tokens_per_s, blas) : 0.0;
      if (blas > 0) m.extra["mfu_sgemm"] = io::json::Value(mfu_blas);
      if (o.experts > 0) m.extra["moe_aux_loss"] = io::json::Value(r.moe_aux_loss);
      m.elapsed_s = elapsed;
      m.val_loss = val_now;
      if (metrics) metrics->write(m);
      report::ProgressInfo p;
      p.step = r.step;
      p.total = o.steps;
      p.loss = r.loss;
      p.tokens_per_s = m.tokens_per_s;
      p.mfu = m.mfu;
      p.mfu_blas = mfu_blas;
      p.elapsed_s = elapsed;
      p.first_step = first_step;
      if (o.experts > 0) p.aux_loss = r.moe_aux_loss;
      bar->update(p);
      if (val_now && bar->is_terminal()) {
        std::ostringstream s;
        s << "step " << r.step << ": validation loss " << *val_now;
        bar->message(s.str());
      }
    }
    // After the step's metrics row: a stop after the commit leaves the row written (a resume trims
    // rows past its checkpoint's step, never recomputes one before it).
    if (o.ckpt_every > 0 && r.step % o.ckpt_every == 0 && r.step < o.steps) save();
  }
  if (val < 0) val = validate_now();
  if (o.experts > 0) {  // tokens per expert over the run's steps (a collective)
    const auto load = trainer.take_expert_load();
    if (lead) outcome.expert_load = load;
  }
  save();
  // Saved activations: the most bytes any rank's arena held at once (a collective max).
  const double act_peak = trainer.peak_activation_bytes_over_ranks();
  const double act_host_peak = trainer.peak_activation_bytes_over_ranks(/*host=*/true);
  if (lead) {
    outcome.activation_peak_bytes = act_peak;
    outcome.activation_host_peak_bytes = act_host_peak;
    bar->finish();
    outcome.first_step = first_step;
    outcome.first_loss = first_loss;
    outcome.last_loss = last_loss;
    outcome.val_loss = val;
    outcome.steps_done = static_cast<int>(trainer.step_count() - first_step);
    outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    outcome.checkpoint = train::latest_checkpoint(ckpt_root)->string();
  }
}

// One rank of the host backend (threads or MPI processes).
template <class Comm>
void run_rank(Comm& comm, const Options& o, const Data& data, double peak, Outcome& outcome) {
  // Not given: the machine's peak for the dtype (and the sgemm rate beside it), measured by one rank
  // while the others wait (they would share the cores).
  double measured[2] = {peak, 0};  // peak, sgemm
  std::string note;
  if (peak <= 0) {
    if (comm.rank() == 0) {
      const HostPeak h = host_mfu_reference(o.dtype);
      measured[0] = h.peak, measured[1] = h.blas, note = h.note;
    }
    comm.broadcast(measured, 2, 0);
    peak = measured[0];
  }
  auto train_with = [&]<class Backend>(Backend be) {
    train::Trainer<Comm, Backend> trainer(comm, trainer_config(o), be);
    const double n_params = trainer.global_parameter_count();
    run_training(trainer, comm.rank() == 0, trainer.mesh().template coord<trellis::dp>(), n_params, o, data, peak,
                 o.mpi ? "MPI" : "thread", outcome, measured[1], note);
  };
  if (o.dtype == "bf16") train_with(trellis::backend::Host<trellis::bfloat16>{});
  else train_with(trellis::backend::Host<float>{});
}

// The summary line of a run. A resumed run already at --steps trained nothing: it says so (there
// is no first or last train loss to report).
inline std::string summary(const Options& o, const Data& data, const Outcome& out) {
  char buf[512];
  const char* verdict = out.val_loss < data.unigram ? "below: the model uses context" : "NOT below the baseline";
  if (out.steps_done == 0)
    std::snprintf(buf, sizeof buf,
                  "nothing to train: the checkpoint is at step %lld and --steps is %d; validation loss %.4f vs "
                  "unigram baseline %.4f (%s)",
                  static_cast<long long>(out.first_step), o.steps, out.val_loss, data.unigram, verdict);
  else
    std::snprintf(buf, sizeof buf,
                  "trained %d steps in %.1f s: train loss %.4f -> %.4f; validation loss %.4f vs unigram baseline "
                  "%.4f (%s)",
                  out.steps_done, out.seconds, out.first_loss, out.last_loss, out.val_loss, data.unigram, verdict);
  std::string line = buf;
  for (const auto& [layer, counts] : out.expert_load) {  // the expert load histogram
    double total = 0;
    for (double c : counts) total += c;
    std::snprintf(buf, sizeof buf, "\nexpert load, block %d (share of the tokens' routed copies over the run):", layer);
    line += buf;
    for (std::size_t e = 0; e < counts.size(); ++e) {
      const double share = total > 0 ? counts[e] / total : 0.0;
      std::snprintf(buf, sizeof buf, "\n  expert %2zu %5.1f %% %s", e, 100.0 * share,
                    std::string(static_cast<std::size_t>(std::lround(share * 100)), '#').c_str());
      line += buf;
    }
  }
  if (out.activation_peak_bytes > 0) {
    std::snprintf(buf, sizeof buf, "\nsaved activations: peak %.1f MiB per rank (the largest rank, measured in its arena)",
                  out.activation_peak_bytes / (1024.0 * 1024.0));
    line += buf;
    if (out.activation_host_peak_bytes > 0) {
      std::snprintf(buf, sizeof buf, ", and %.1f MiB offloaded to host memory at most",
                    out.activation_host_peak_bytes / (1024.0 * 1024.0));
      line += buf;
    }
  }
  return line;
}

// After training (one process / the lead rank): sample text, draw the loss curve, print a summary.
inline void final_report(const Options& o, const Data& data, const Outcome& out) {
  std::printf("\n%s\n", summary(o, data, out).c_str());
  if (!o.log.empty()) {
    fs::path svg = fs::path(o.log).replace_extension(".svg");
    auto curves = train::loss_curves_from_metrics(o.log);
    report::LossCurveOptions lo;
    std::ostringstream title;
    title << "train_gpt: " << o.layers << " layers, width " << o.width << ", dp" << o.dp << " tp" << o.tp
          << " pp" << o.pp;
    lo.title = title.str();
    lo.baseline = data.unigram;
    report::write_loss_curve_svg(svg, curves.train, curves.val, lo);
    std::printf("metrics: %s, loss curve: %s\n", o.log.c_str(), svg.string().c_str());
  }
  std::printf("checkpoint: %s\n", out.checkpoint.c_str());
  if (!o.export_hf.empty()) {
    train::export_hf_gpt2(train::Checkpoint(out.checkpoint), trainer_config(o).model, o.export_hf,
                          trainer_config(o).options);
    std::printf("Hugging Face GPT-2: %s (config.json, model.safetensors)\n", o.export_hf.c_str());
  }
  if (o.sample_tokens > 0 && o.vocab == 256) {
    comm::ThreadWorld one(1);
    one.run([&](comm::ThreadComm& c) {
      train::Checkpoint ck(out.checkpoint);
      train::Generator<comm::ThreadComm> gen(ck, trainer_config(o).model, c);
      train::Rng rng(o.seed, 999);
      std::vector<std::int32_t> prompt;  // bytes as tokens: 0..255 (a UTF-8 byte is not a negative id)
      for (unsigned char b : o.prompt) prompt.push_back(b);
      if (prompt.empty()) prompt.push_back(' ');
      auto text = gen.generate(prompt, o.sample_tokens, o.temperature, rng);
      std::string s;
      for (auto t : text) s.push_back(static_cast<char>(static_cast<unsigned char>(t)));
      std::printf("sample (temperature %.2f):\n----\n%s\n----\n", o.temperature, s.c_str());
    });
  }
}

}  // namespace train_gpt
