// Command line of train_gpt: a hand-written parser (no dependency) and the checks that stop a bad
// run before any work, each message saying what to change. Pure functions, tested directly
// (tests/train/test_trainer_flags.cpp).
#pragma once

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "trellis/core/error.hpp"
#include "trellis/pipe/text.hpp"
#include "trellis/train/trainer.hpp"

namespace train_gpt {

struct Options {
  // model
  int layers = 4, heads = 4, width = 128, vocab = 256, context = 64;
  // Mixture of Experts: every --moe-every-th block (0, N, 2N, ...) has --experts experts
  int experts = 0, topk = 1, moe_every = 0, ep = 1;
  double capacity = 0.0, aux_loss = 0.01, z_loss = 0.0;
  // batch and layout
  int batch = 16, microbatches = 2;
  int dp = 1, tp = 1, pp = 1;
  std::string plan;  // "auto": the layout chosen by the planner (plan_auto.hpp) for --ranks thread ranks
  int ranks = 0;
  int kernel_threads = 0;  // host kernels' threads, shared by the thread ranks (0: every core)
  int cp = 1;                   // context parallel: each sequence split over cp ranks
  std::string cp_mode = "ring";
  int cp_ulysses = 2;           // hybrid: Ulysses group size
  bool cp_balance_docs = false; // packed rows' documents reordered for equal cp work
  bool sp = false;
  int zero = 0;  // ZeRO stage over the dp x cp replicas
  bool prefetch = true;  // ZeRO-3: the next block's gather while one computes
  int shard_degree = 0;  // hybrid sharding: ZeRO shards over groups of this many replicas (0: all)
  std::string fused_update;  // empty: off; unclipped | previous-clip
  std::string offload;       // comma list of what to offload to host memory: optimizer, activations
  std::string offload_dir;   // the optimizer state's disk tier
  int offload_disk_readahead = 2;  // ... chunks read ahead of the update
  std::string schedule = "1f1b";
  bool schedule_given = false;  // --schedule on the command line (conflicts with --schedule-file)
  std::string schedule_file;    // a text schedule (pipe/text.hpp) instead of a generator
  std::string local_head = "tied";  // local learning: tied | own
  std::vector<int> stage_layers;     // uneven pipeline stages: blocks per stage
  std::vector<double> rank_speed;    // pipeline ranks' relative speeds (the balanced split)
  bool simulate_rank_speed = false;  // and each pipeline rank slowed to its speed
  std::vector<int> dp_rows;          // unequal dp shares: rows of the global batch per dp rank
  std::vector<double> dp_speed;      // dp ranks' relative speeds (the shares when --dp-rows is not given)
  std::string cluster;               // a cluster file (plan/cluster.hpp) whose device speeds give the two above
  std::string stage_costs = "flops";  // what the balanced split weighs: flops | measured (timed here)
  std::optional<trellis::train::LayerCosts> measured_costs;  // --stage-costs measured, timed before the run
  int chunks = 2;
  int overlap = 1;              // tp collectives split into this many chunks, overlapped with GEMMs
  bool recompute = false;       // per-block activation recompute
  double dropout = 0.0;         // embedding + residual dropout
  std::string backend = "host";
  std::string dtype;  // compute dtype: fp32 | bf16; empty: the backend's own (host fp32, cuda bf16)
  bool mpi = false;
  // data
  std::string data;  // empty: the shipped corpus; *.bin (comma separated): llm.c token shards
  double val_fraction = 0.1;
  int pack = -1;  // >= 0: pack documents that start with this token into rows (train/packing.hpp)
  // optimisation
  int steps = 150;
  double lr = 3e-3, min_lr = 3e-4;
  int warmup = 10;
  double clip = 1.0;
  double weight_decay = 0.1;
  std::uint64_t seed = 1234;
  // checkpoints, logs, reporting
  std::string ckpt_dir;
  int ckpt_every = 0;  // 0: only at the end (when --ckpt-dir is given)
  int keep_last = 0;   // > 0: after each save, remove all but the newest N step directories
  bool resume = false;
  std::string init_from;  // a GPT-2 safetensors file with Hugging Face names: start from its weights
  std::string export_hf;  // at the end: config.json + model.safetensors for transformers' GPT2LMHeadModel
  std::string log;  // metrics.jsonl; the loss curve goes next to it (.svg)
  int eval_every = 20;
  int sample_tokens = 200;
  double temperature = 0.8;
  std::string prompt = "The ";
  double peak_gflops = 0;  // 0: measure the host sgemm at start
  bool help = false;
};

inline std::string usage() {
  return R"(train_gpt: train a GPT-2 on text with data, tensor and pipeline parallelism (trellis).

usage: train_gpt [flags]            (ranks are threads of this process)
       mpirun -np N train_gpt --mpi [flags]   (one rank per process)

model:     --layers N (4) --heads N (4) --width N (128) --vocab N (256) --context T (64)
moe:       --experts E (0: dense) --topk K (1 or 2) --moe-every N (2 with --experts: blocks 0, N, 2N, ...
           get an MoE MLP) --ep P (1; experts split over groups of P consecutive dp ranks; divides
           --dp and E) --capacity F (0: dropless; else each expert keeps ceil(F tokens k / E) copies
           per microbatch, the rest dropped) --aux-loss X (0.01, Switch load balancing)
           --z-loss X (0, router z-loss)
batch:     --batch B (16, global rows of T tokens) --microbatches M (2)
layout:    --dp N (1) --tp N (1) --pp N (1) --cp N (1)  [ranks = dp x tp x pp x cp]
           --plan auto --ranks N: the planner picks dp x tp x pp x cp = N, the schedule, microbatches,
           --sp, --recompute, --zero and, with --experts, --ep (include/trellis/plan: rates
           timed on this machine, memory: this machine's / N), prints its table and runs the
           fastest (threads, host);
           with --schedule local_learning it plans local-learning pipelines (pp >= 2) only;
           with --mpi (no --ranks): for mpirun's ranks, rank 0 plans (the link measured over
           the world, rates timed on its node) and every rank runs its choice
           --cp N: context parallelism, every sequence split over N ranks (2N zig-zag chunks,
           --context a multiple of 2N); --cp-mode ring (attention's keys and values passed round
           the cp ranks while each block computes) | ulysses (an all-to-all from sequence to head
           shards and back; heads / tp a multiple of N) | hybrid (Ulysses in groups of
           --cp-ulysses U ranks, 2 by default, a ring across the groups)
           --cp-balance-docs (with --pack, ring or hybrid, dropout 0: each packed row's documents
           reordered, whole, so the cp ranks get near-equal causal attention work)
           --sp (sequence parallelism with tp)
           --zero 0|1|2|3 (0; ZeRO over the dp x cp replicas: 1 shards the AdamW state, 2 the
           gradients too, reduce-scattered every microbatch, 3 the weights too, each block's
           gathered while it computes, the next one's prefetched; --zero1 is --zero 1)
           --no-prefetch (with --zero 3: each block's gather starts when it is needed)
           --shard-degree N (0; with --zero: hybrid sharding, shards over groups of N consecutive
           replicas, replicated across the groups, whose gradients are all-reduced once a step)
           --fused-update unclipped|previous-clip (each block's AdamW step as soon as its
           gradients are reduced; clipping by the global norm needs them all, so unclipped needs
           --clip 0, and previous-clip scales by the clip factor of the previous step's norm)
           --offload optimizer,activations (AdamW moments in host memory, the update on the
             CPU; saved activations in host memory unit by unit, a unit's fetched back
             before its backward, the next one while it computes)
           --offload-dir DIR (AdamW moments in a scratch file under DIR, streamed through
           bounded host buffers for each update: state larger than host memory)
           --offload-disk-readahead N (2; with --offload-dir: chunks read ahead while one
             updates, in N + 1 host buffers of a chunk's moments)
           --schedule NAME (1f1b; gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_h2, zb_v, dualpipe_v,
             local_learning: PPLL, every stage but the last trains on a loss of its own and no
             gradient crosses a stage boundary)
           --local-head tied|own (tied; local learning: a stage's LM head is the tied embedding,
             or a matrix of its own)
           --stage-layers N,N,.. (blocks per pipeline stage; default: even) or --rank-speed
             S,S,.. (each pipeline rank's relative speed: the split whose slowest stage is
             fastest, from a FLOP count per block and head) --simulate-rank-speed (each rank
             also computes 1/S times slower: a slow device simulated on the host)
           --stage-costs flops|measured (flops; what the balanced split weighs: FLOP counts, or
             each block's and head's F+B+W timed on this machine by the planner's cost model)
           --cluster FILE (a cluster file, include/trellis/plan/cluster.hpp, one device per rank:
             its "speed" list gives --rank-speed and --dp-speed; instead of those two)
           --dp-rows N,N,.. (rows of the global batch per dp rank, each a multiple of
             --microbatches; default: batch / dp each) or --dp-speed S,S,.. (each dp rank's relative
             speed: the shares whose slowest rank finishes first; with --simulate-rank-speed each
             dp rank also computes 1/S times slower); the loss stays the global mean
           --chunks V (2, model chunks per rank for interleaved_1f1b)
           --schedule-file FILE (a pipeline schedule of your own in the text format of
           include/trellis/pipe/text.hpp, one line per pipeline rank; replaces --schedule, needs
           --pp > 1; its ranks and microbatches must match --pp and --microbatches; verified first)
           --overlap N (1; N > 1 splits each tp collective into N chunks overlapped with the GEMMs;
           needs --tp > 1) --recompute (re-run each block's forward in its backward: less memory)
           --dropout P (0; embedding + residual dropout in [0, 1); evaluation runs without it)
backend:   --backend host|cuda (host; cuda: dp x tp x pp GPUs over NCCL, one thread per GPU, or one
           process per GPU with --mpi under mpirun; bf16 compute with fp32 master weights; needs a
           CUDA build; head size 64 or 128)
           --dtype fp32|bf16 (compute dtype; host: fp32 default, bf16 runs every layout with the
           CUDA backend's bf16 rounding points, fp32 master weights and optimizer state)
           --kernel-threads N (every core; the host kernels' threads, one pool the thread ranks
             share: a rank that finds it busy computes on its own thread. 1: each rank on one
             core, e.g. for a simulated slow rank whose idle core no other rank may take)
           --mpi (one rank per MPI process instead of threads)
data:      --data FILE (text, bytes as tokens; default data/tiny_corpus.txt)
           --data a.bin,b.bin (llm.c uint16 token shards; set --vocab, e.g. 50257)
           --val-fraction F (0.1)
           --pack TOKEN (pack whole documents into rows of --context tokens, attention and positions
           per document; a document starts at each TOKEN: 50256 for llm.c shards, e.g. 10 for lines
           of text; padding is not trained on and the packing efficiency is printed)
optimiser: --steps N (150) --lr X (3e-3) --min-lr X (3e-4) --warmup N (10) --clip X (1.0, 0: off)
           --weight-decay X (0.1) --seed N (1234)
output:    --log FILE (metrics.jsonl; the SVG loss curve is written next to it)
           --ckpt-dir DIR --ckpt-every N (0: only at the end) --resume (continue from DIR/latest)
           --keep-last N (after each save keep only the newest N step directories; default all)
           --init-from FILE (start from GPT-2 weights: a safetensors file with Hugging Face names,
           e.g. an --export-hf model.safetensors; fresh optimizer, step 0)
           --export-hf DIR (at the end: DIR/config.json + DIR/model.safetensors of the final
           checkpoint, loadable by transformers' GPT2LMHeadModel.from_pretrained(DIR))
           --eval-every N (20) --sample-tokens N (200) --temperature X (0.8, 0: greedy)
           --prompt TEXT ("The ") --peak-gflops X (MFU reference; default: the machine peak of --dtype)
           --help
)";
}

// A flag's comma list (empty items dropped).
inline std::vector<std::string> comma_list(const std::string& list) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    if (comma > at) out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// Parses argv; throws trellis::Error naming the flag and what is wrong.
inline Options parse_flags(const std::vector<std::string>& args) {
  Options o;
  auto need = [&](std::size_t& i) -> const std::string& {
    if (i + 1 >= args.size()) TRELLIS_THROW("flag ", args[i], " needs a value (see --help)");
    return args[++i];
  };
  auto to_int = [&](const std::string& flag, const std::string& v) {
    long long x = 0;
    auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec != std::errc() || p != v.data() + v.size() || x < -(1ll << 31) || x > (1ll << 31) - 1)
      TRELLIS_THROW("flag ", flag, ": '", v, "' is not an integer");
    return static_cast<int>(x);
  };
  auto to_double = [&](const std::string& flag, const std::string& v) {
    std::istringstream s(v);
    double x = 0;
    s >> x;
    if (!s || !s.eof()) TRELLIS_THROW("flag ", flag, ": '", v, "' is not a number");
    return x;
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string f = args[i];
    std::string inline_value;
    bool has_inline = false;
    if (auto eq = f.find('='); f.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = f.substr(eq + 1);
      f = f.substr(0, eq);
      has_inline = true;
    }
    auto value = [&]() -> std::string { return has_inline ? inline_value : need(i); };
    auto int_flag = [&](int& dst) { dst = to_int(f, value()); };
    auto dbl_flag = [&](double& dst) { dst = to_double(f, value()); };
    if (f == "--help" || f == "-h")
      o.help = true;
    else if (f == "--layers")
      int_flag(o.layers);
    else if (f == "--heads")
      int_flag(o.heads);
    else if (f == "--width")
      int_flag(o.width);
    else if (f == "--vocab")
      int_flag(o.vocab);
    else if (f == "--context")
      int_flag(o.context);
    else if (f == "--batch")
      int_flag(o.batch);
    else if (f == "--experts")
      int_flag(o.experts);
    else if (f == "--topk")
      int_flag(o.topk);
    else if (f == "--moe-every")
      int_flag(o.moe_every);
    else if (f == "--ep")
      int_flag(o.ep);
    else if (f == "--capacity")
      dbl_flag(o.capacity);
    else if (f == "--aux-loss")
      dbl_flag(o.aux_loss);
    else if (f == "--z-loss")
      dbl_flag(o.z_loss);
    else if (f == "--microbatches")
      int_flag(o.microbatches);
    else if (f == "--dp")
      int_flag(o.dp);
    else if (f == "--tp")
      int_flag(o.tp);
    else if (f == "--pp")
      int_flag(o.pp);
    else if (f == "--cp")
      int_flag(o.cp);
    else if (f == "--cp-mode")
      o.cp_mode = value();
    else if (f == "--cp-ulysses")
      int_flag(o.cp_ulysses);
    else if (f == "--cp-balance-docs")
      o.cp_balance_docs = true;
    else if (f == "--sp")
      o.sp = true;
    else if (f == "--zero1")
      o.zero = 1;
    else if (f == "--zero")
      int_flag(o.zero);
    else if (f == "--no-prefetch")
      o.prefetch = false;
    else if (f == "--shard-degree")
      int_flag(o.shard_degree);
    else if (f == "--fused-update")
      o.fused_update = value();
    else if (f == "--offload")
      o.offload = value();
    else if (f == "--offload-dir")
      o.offload_dir = value();
    else if (f == "--offload-disk-readahead")
      int_flag(o.offload_disk_readahead);
    else if (f == "--schedule") {
      o.schedule = value();
      o.schedule_given = true;
    } else if (f == "--schedule-file")
      o.schedule_file = value();
    else if (f == "--overlap")
      int_flag(o.overlap);
    else if (f == "--recompute")
      o.recompute = true;
    else if (f == "--plan")
      o.plan = value();
    else if (f == "--ranks")
      int_flag(o.ranks);
    else if (f == "--kernel-threads")
      int_flag(o.kernel_threads);
    else if (f == "--dropout")
      dbl_flag(o.dropout);
    else if (f == "--chunks")
      int_flag(o.chunks);
    else if (f == "--local-head")
      o.local_head = value();
    else if (f == "--stage-layers" || f == "--rank-speed" || f == "--dp-rows" || f == "--dp-speed") {
      const std::string list = value();
      auto& ints = f == "--stage-layers" ? o.stage_layers : o.dp_rows;
      auto& reals = f == "--rank-speed" ? o.rank_speed : o.dp_speed;
      const bool real = f == "--rank-speed" || f == "--dp-speed";
      (real ? reals.clear() : ints.clear());
      for (const auto& item : comma_list(list)) real ? reals.push_back(to_double(f, item)) : ints.push_back(to_int(f, item));
    } else if (f == "--cluster")
      o.cluster = value();
    else if (f == "--stage-costs")
      o.stage_costs = value();
    else if (f == "--simulate-rank-speed")
      o.simulate_rank_speed = true;
    else if (f == "--backend")
      o.backend = value();
    else if (f == "--dtype")
      o.dtype = value();
    else if (f == "--mpi")
      o.mpi = true;
    else if (f == "--data")
      o.data = value();
    else if (f == "--val-fraction")
      dbl_flag(o.val_fraction);
    else if (f == "--pack")
      int_flag(o.pack);
    else if (f == "--steps")
      int_flag(o.steps);
    else if (f == "--lr")
      dbl_flag(o.lr);
    else if (f == "--min-lr")
      dbl_flag(o.min_lr);
    else if (f == "--warmup")
      int_flag(o.warmup);
    else if (f == "--clip")
      dbl_flag(o.clip);
    else if (f == "--weight-decay") {
      dbl_flag(o.weight_decay);
      if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
        TRELLIS_THROW("flag --weight-decay: must be >= 0 (0: no decay), got ", o.weight_decay);
    }
    else if (f == "--seed") {
      const int s = to_int(f, value());
      if (s < 0) TRELLIS_THROW("flag --seed: must be >= 0");
      o.seed = static_cast<std::uint64_t>(s);
    } else if (f == "--ckpt-dir")
      o.ckpt_dir = value();
    else if (f == "--ckpt-every")
      int_flag(o.ckpt_every);
    else if (f == "--keep-last") {
      int_flag(o.keep_last);
      if (o.keep_last < 1)
        TRELLIS_THROW("flag --keep-last: must be >= 1 (leave it out to keep every checkpoint), got ", o.keep_last);
    }
    else if (f == "--resume")
      o.resume = true;
    else if (f == "--init-from")
      o.init_from = value();
    else if (f == "--export-hf")
      o.export_hf = value();
    else if (f == "--log")
      o.log = value();
    else if (f == "--eval-every")
      int_flag(o.eval_every);
    else if (f == "--sample-tokens")
      int_flag(o.sample_tokens);
    else if (f == "--temperature")
      dbl_flag(o.temperature);
    else if (f == "--prompt")
      o.prompt = value();
    else if (f == "--peak-gflops") {
      dbl_flag(o.peak_gflops);
      if (!(o.peak_gflops > 0) || !std::isfinite(o.peak_gflops))
        TRELLIS_THROW("flag --peak-gflops: must be a positive number of GFLOP/s, got ", o.peak_gflops,
                      " (leave it out to measure this machine's sgemm)");
    }
    else
      TRELLIS_THROW("unknown flag '", args[i], "' (see --help)");
  }
  return o;
}

// The trainer's configuration; loads --schedule-file (throws naming the file, line and column:
// problems() reports that first).
inline trellis::train::TrainerConfig trainer_config(const Options& o) {
  trellis::train::TrainerConfig c;
  c.model.layers = o.layers;
  c.model.heads = o.heads;
  c.model.width = o.width;
  c.model.vocab = o.vocab;
  c.model.positions = o.context;
  if (o.experts > 0) {
    c.model.experts = o.experts;
    c.model.moe_every = o.moe_every > 0 ? o.moe_every : 2;
    c.model.moe_topk = o.topk;
    c.options.moe_capacity = static_cast<float>(o.capacity);
    c.options.moe_aux_loss = static_cast<float>(o.aux_loss);
    c.options.moe_z_loss = static_cast<float>(o.z_loss);
  }
  c.ep = o.ep;
  c.options.sequence_parallel = o.sp;
  c.options.overlap_chunks = o.overlap;
  c.options.recompute = o.recompute;
  c.options.dropout = static_cast<float>(o.dropout);
  c.options.seed = o.seed;
  c.pp = o.pp;
  c.dp = o.dp;
  c.tp = o.tp;
  c.cp = o.cp;
  c.cp_mode = trellis::nn::parse_cp_mode(o.cp_mode);
  c.cp_ulysses = o.cp_ulysses;
  c.cp_balance_documents = o.cp_balance_docs;
  c.schedule = o.schedule;
  if (!o.schedule_file.empty()) c.custom_schedule = trellis::pipe::load_schedule(o.schedule_file);
  c.virtual_chunks = o.chunks;
  c.stage_layers = o.stage_layers;
  c.rank_speed = o.rank_speed;
  c.simulate_rank_speed = o.simulate_rank_speed;
  c.stage_costs = o.measured_costs;
  c.dp_speed = o.dp_speed;
  c.dp_rows.assign(o.dp_rows.begin(), o.dp_rows.end());
  // --dp-speed without --dp-rows: the shares whose slowest rank finishes first (when they can be made)
  if (c.dp_rows.empty() && !o.dp_speed.empty() && static_cast<int>(o.dp_speed.size()) == o.dp && o.microbatches >= 1 &&
      o.batch % o.microbatches == 0 && o.batch / o.microbatches >= o.dp) {
    bool positive = true;
    for (double x : o.dp_speed) positive = positive && x > 0 && x <= 1e6;
    if (positive) c.dp_rows = trellis::train::balanced_dp_rows(o.batch, o.microbatches, o.dp_speed);
  }
  c.local_head = o.local_head == "own" ? trellis::train::TrainerConfig::LocalHead::own
                                       : trellis::train::TrainerConfig::LocalHead::tied;
  c.microbatches = o.microbatches;
  c.batch = o.batch;
  c.seq = o.context;
  c.zero = o.zero;
  c.prefetch_values = o.prefetch;
  c.shard_degree = o.shard_degree;
  for (const auto& what : comma_list(o.offload)) {
    c.offload_optimizer = c.offload_optimizer || what == "optimizer";
    c.offload_activations = c.offload_activations || what == "activations";
  }
  c.offload_dir = o.offload_dir;
  c.offload_disk_readahead = o.offload_disk_readahead;
  using Fused = trellis::train::TrainerConfig::FusedUpdate;
  c.fused_update = o.fused_update == "unclipped"       ? Fused::unclipped
                   : o.fused_update == "previous-clip" ? Fused::previous_clip
                                                       : Fused::off;
  c.adamw.lr = static_cast<float>(o.lr);
  c.adamw.weight_decay = static_cast<float>(o.weight_decay);
  c.lr.max_lr = o.lr;
  c.lr.min_lr = o.min_lr;
  c.lr.warmup_steps = o.warmup;
  c.lr.total_steps = o.steps;
  c.clip = o.clip;
  c.seed = o.seed;
  return c;
}

// Bytes of fp32 weights, gradients and both AdamW moments (16 per parameter) the run holds at
// least: in this process for thread ranks (dp replicas of the whole model), per rank under MPI
// (its tp x pp share). A lower bound (activations come on top), computed in double so absurd
// sizes cannot overflow: what refuses --width 1048576 or --layers 100000 before any allocation.
inline double state_bytes(const Options& o, bool per_mpi_rank) {
  const double W = o.width, L = o.layers, V = o.vocab, P = o.context;
  const double params = V * W + P * W + L * (12.0 * W * W + 13.0 * W) + 2.0 * W;
  const double tp_pp = std::max(1.0, static_cast<double>(o.tp)) * std::max(1.0, static_cast<double>(o.pp));
  const double R = std::max(1, o.dp) * std::max(1, o.cp);  // replicas; ZeRO shards over them
  const double G = o.shard_degree > 0 ? std::max(1.0, R / o.shard_degree) : 1.0;  // hybrid: a copy per group
  // every replica's weights (4 bytes), gradients (4) and moments (8), or a copy per shard group of what is sharded
  const double all =
      params * ((o.zero >= 3 ? 4.0 * G : 4.0 * R) + (o.zero >= 2 ? 4.0 * G : 4.0 * R) + (o.zero >= 1 ? 8.0 * G : 8.0 * R));
  return per_mpi_rank ? all / (R * tp_pp) : all;
}
inline double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}
inline std::string gib(double bytes) {
  std::ostringstream s;
  s.precision(3);
  s << bytes / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return s.str();
}

// Every problem of the options (flags alone and the trainer's layout rules), each saying what to
// change; `world_size`: the ranks the run has (MPI) or nothing (threads: dp x tp x pp are made).
inline std::vector<std::string> problems(const Options& o, std::optional<int> world_size = std::nullopt) {
  std::vector<std::string> out;
  // The schedule file first: the layout checks below run on the loaded schedule, or without it
  // when it cannot be used at all.
  Options checked = o;
  if (!o.schedule_file.empty()) {
    if (o.pp <= 1) {
      out.push_back("--schedule-file " + o.schedule_file + " is a pipeline schedule: it needs --pp > 1");
      checked.schedule_file.clear();
    } else {
      try {
        trellis::pipe::load_schedule(o.schedule_file);
      } catch (const trellis::Error& e) {
        out.push_back("--schedule-file: " + e.message());
        checked.schedule_file.clear();
      }
    }
    if (o.schedule_given)
      out.push_back("--schedule and --schedule-file both name the pipeline schedule: give one of them");
  }
  if (!o.plan.empty() && o.plan != "auto") out.push_back("--plan takes auto (got '" + o.plan + "')");
  if (o.plan.empty() && o.ranks != 0) out.push_back("--ranks N is for --plan auto (give --dp/--tp/--pp otherwise)");
  if (o.plan == "auto") {
    if (o.ranks < 1 && !o.mpi) out.push_back("--plan auto needs --ranks N >= 1: the thread ranks to plan for");
    if (o.mpi && o.ranks != 0) out.push_back("--plan auto --mpi plans for mpirun's ranks: drop --ranks");
    if (o.backend != "host" || o.dtype == "bf16")
      out.push_back("--plan auto plans ranks of the host backend in fp32 (no --backend cuda, --dtype bf16)");
    if (o.cp > 1 || !o.offload.empty() || !o.offload_dir.empty() || o.shard_degree > 0 ||
        !o.fused_update.empty() || !o.schedule_file.empty() || !o.stage_layers.empty() || !o.rank_speed.empty() ||
        !o.dp_rows.empty() || !o.dp_speed.empty() || o.stage_costs != "flops")
      out.push_back("--plan auto chooses --cp (and its mode), --shard-degree and --offload optimizer itself, and does "
                    "not model --offload activations, --offload-dir, --fused-update, --schedule-file, "
                    "--stage-layers, --rank-speed, --dp-rows, --dp-speed or --stage-costs yet: drop "
                    "them or give the layout yourself (--cluster FILE gives the ranks' speeds)");
    if (o.overlap > 1) out.push_back("--plan auto chooses --overlap (tp overlap chunks) itself: drop --overlap");
    if (o.ep > 1) out.push_back("--plan auto chooses --ep (expert parallelism) itself: drop --ep");
    if (o.mpi && !o.cluster.empty()) out.push_back("--plan auto --mpi plans with speeds measured, not from --cluster");
  }
  if (!o.cluster.empty() && (!o.rank_speed.empty() || !o.dp_speed.empty()))
    out.push_back("--cluster gives the ranks' speeds: drop --rank-speed and --dp-speed, or --cluster");
  if (o.kernel_threads < 0 || o.kernel_threads > 4096)
    out.push_back("--kernel-threads must be in [1, 4096] (0: every core), got " + std::to_string(o.kernel_threads));
  if (o.stage_costs != "flops" && o.stage_costs != "measured")
    out.push_back("--stage-costs must be flops or measured, got '" + o.stage_costs + "'");
  if (o.stage_costs == "measured") {
    if (o.pp < 2 || (o.rank_speed.empty() && o.cluster.empty() && !o.measured_costs))
      out.push_back("--stage-costs measured weighs the balanced pipeline split: it needs --pp > 1 and --rank-speed or "
                    "--cluster");
    if (o.mpi || o.backend != "host")
      out.push_back("--stage-costs measured times the host kernels of thread ranks (no --mpi, --backend cuda): give "
                    "--stage-layers, or weigh flops");
  }
  if (o.backend != "host" && o.backend != "cuda")
    out.push_back("--backend must be host or cuda, got '" + o.backend + "'");
  if (o.cp_mode != "ring" && o.cp_mode != "ulysses" && o.cp_mode != "hybrid") {
    out.push_back("--cp-mode must be ring, ulysses or hybrid, got '" + o.cp_mode + "'");
    checked.cp_mode = "ring";
  }
  if (!o.dtype.empty() && o.dtype != "fp32" && o.dtype != "bf16")
    out.push_back("--dtype must be fp32 or bf16, got '" + o.dtype + "'");
  if (o.backend == "cuda" && o.dtype == "fp32")
    out.push_back("--backend cuda computes in bf16 (fp32 master weights): drop --dtype fp32 or use --backend host");
  if (o.backend == "cuda") {
#if !defined(TRELLIS_TRAIN_GPT_CUDA)
    out.push_back(
        "--backend cuda: this train_gpt was built without CUDA (configure with -DTRELLIS_ENABLE_CUDA=ON, e.g. "
        "cmake --preset cuda); use --backend host");
#endif
    if (o.heads >= 1 && o.width % o.heads == 0 && o.width / o.heads != 64 && o.width / o.heads != 128)
      out.push_back("--backend cuda: the flash attention takes head size 64 or 128, got --width " +
                    std::to_string(o.width) + " / --heads " + std::to_string(o.heads) + " = " +
                    std::to_string(o.width / o.heads) + ": change --heads (e.g. --heads " +
                    std::to_string(std::max(1, o.width / 64)) + ")");
  }
  if (o.steps < 1) out.push_back("--steps must be >= 1");
  if (o.lr <= 0 || o.min_lr < 0 || o.min_lr > o.lr) out.push_back("need 0 <= --min-lr <= --lr and --lr > 0");
  if (o.warmup < 0 || o.warmup >= o.steps) out.push_back("--warmup must be in [0, --steps)");
  if (o.val_fraction <= 0 || o.val_fraction >= 0.5) out.push_back("--val-fraction must be in (0, 0.5)");
  if (o.pack < -1 || o.pack >= o.vocab)
    out.push_back("--pack names the token that starts each document: it must be in [0, --vocab), got " +
                  std::to_string(o.pack));
  if (o.cp_balance_docs && o.pack < 0) out.push_back("--cp-balance-docs reorders packed documents: it needs --pack");
  if (o.experts < 0) out.push_back("--experts must be >= 0 (0: a dense model)");
  if (o.experts == 0 && (o.moe_every != 0 || o.topk != 1 || o.capacity != 0.0))
    out.push_back("--moe-every, --topk and --capacity shape Mixture-of-Experts blocks: they need --experts E");
  if (o.eval_every < 1) out.push_back("--eval-every must be >= 1");
  if (o.ckpt_every < 0) out.push_back("--ckpt-every must be >= 0");
  if (o.resume && o.ckpt_dir.empty()) out.push_back("--resume needs --ckpt-dir (where the checkpoints are)");
  if (o.resume && !o.init_from.empty())
    out.push_back("--resume continues a checkpoint, --init-from starts from other weights: give one of them");
  if (o.sample_tokens < 0) out.push_back("--sample-tokens must be >= 0");
  if (o.temperature < 0) out.push_back("--temperature must be >= 0");
  if (o.sp && o.tp == 1) out.push_back("--sp shards the sequence over tp ranks: it needs --tp > 1");
  for (const auto& what : comma_list(o.offload))
    if (what != "optimizer" && what != "activations")
      out.push_back("--offload '" + o.offload + "': '" + what +
                    "' is not something to offload (a comma list of optimizer, activations; the disk tier is "
                    "--offload-dir DIR)");
  if (!o.fused_update.empty() && o.fused_update != "unclipped" && o.fused_update != "previous-clip")
    out.push_back("--fused-update must be unclipped or previous-clip, got '" + o.fused_update + "'");
  if (o.zero >= 1 && o.dp * o.cp == 1)
    out.push_back("--zero " + std::to_string(o.zero) + " shards over the data-parallel replicas (dp x cp): it needs --dp or --cp > 1");
  if (o.overlap > 1 && o.tp == 1)
    out.push_back("--overlap splits the tensor-parallel collectives into chunks: it needs --tp > 1");
  if (o.local_head != "tied" && o.local_head != "own")
    out.push_back("--local-head must be tied or own, got '" + o.local_head + "'");
  // --cluster's speeds are read later (plan_auto.hpp: apply_balance); checked here as equal ones
  if (!o.cluster.empty() && o.rank_speed.empty() && o.dp_speed.empty()) checked.dp_speed.assign(static_cast<std::size_t>(std::max(1, o.dp)), 1.0);
  for (auto& p : trellis::train::config_problems(trainer_config(checked))) out.push_back(p);
  if (const double need = state_bytes(o, world_size.has_value()), have = physical_memory_bytes();
      have > 0 && need > have)
    out.push_back("the model's fp32 weights, gradients and AdamW moments alone need " + gib(need) +
                  (world_size ? " per MPI rank" : " in this process (every dp replica)") + " but this machine has " +
                  gib(have) + " of memory: reduce --width, --layers, --vocab or --context" +
                  (world_size ? "" : ", or --dp"));
  const std::int64_t ranks = trellis::train::layout_ranks(o.pp, o.dp, o.tp, o.cp);
  if (world_size && ranks > 0 && *world_size != ranks && o.plan != "auto")  // planned: the layout comes later
    out.push_back("mpirun started " + std::to_string(*world_size) + " ranks but dp x tp x pp" +
                  (o.cp > 1 ? " x cp" : "") + " = " + std::to_string(ranks) +
                  ": start that many or change --dp/--tp/--pp" + (o.cp > 1 ? "/--cp" : ""));
  return out;
}

// Where checkpoints go: --ckpt-dir, else checkpoints/ next to --log, else ./train_gpt_checkpoints.
inline std::filesystem::path checkpoint_root(const Options& o) {
  namespace fs = std::filesystem;
  if (!o.ckpt_dir.empty()) return o.ckpt_dir;
  return o.log.empty() ? fs::path("train_gpt_checkpoints") : fs::path(o.log).parent_path() / "checkpoints";
}

// The --data files: one text file, or comma-separated llm.c .bin shards; `default_corpus` when
// --data is not given.
inline std::vector<std::string> data_files(const Options& o, const std::string& default_corpus) {
  const std::string path = o.data.empty() ? default_corpus : o.data;
  std::vector<std::string> out;
  if (path.size() > 4 && path.substr(path.size() - 4) == ".bin") {
    std::stringstream s(path);
    for (std::string part; std::getline(s, part, ',');) out.push_back(part);
  } else {
    out.push_back(path);
  }
  return out;
}

// Problems with the files and directories the run will use, found before any work (each naming
// the flag and path): data files that are missing, not regular (a FIFO would block open()),
// unreadable or empty; --init-from and --schedule-file likewise; a checkpoint or --log directory
// that cannot be created or written (checked on the nearest existing ancestor when it does not
// exist yet). Only looks: nothing is created.
inline std::vector<std::string> path_problems(const Options& o, const std::string& default_corpus) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  auto file = [&](const std::string& flag, const std::string& path, bool must_have_bytes) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      out.push_back(flag + " " + path + ": no such file");
    } else if (!S_ISREG(st.st_mode)) {
      out.push_back(flag + " " + path + " is not a regular file (" +
                    (S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISDIR(st.st_mode) ? "a directory" : "a device or socket") +
                    "): give a file");
    } else if (::access(path.c_str(), R_OK) != 0) {
      out.push_back(flag + " " + path + " is not readable");
    } else if (must_have_bytes && st.st_size == 0) {
      out.push_back(flag + " " + path + " is empty: there is nothing to train on");
    }
  };
  auto directory = [&](const std::string& flag, const fs::path& dir) {
    std::error_code ec;
    fs::path existing = dir.empty() ? fs::path(".") : dir;
    while (!fs::exists(existing, ec) && existing.has_parent_path() && existing != existing.parent_path())
      existing = existing.parent_path();
    if (!fs::exists(existing, ec)) existing = ".";
    if (!fs::is_directory(existing, ec))
      out.push_back(flag + " " + dir.string() + " cannot be used: " + existing.string() + " is not a directory");
    else if (::access(existing.c_str(), W_OK | X_OK) != 0)
      out.push_back(flag + " " + dir.string() + " is not writable (" + existing.string() +
                    (existing == dir ? "" : ", where it would be created") + ", is not writable by this user)");
  };
  for (const auto& d : data_files(o, default_corpus)) file("--data", d, true);
  if (!o.init_from.empty()) file("--init-from", o.init_from, true);
  if (!o.schedule_file.empty()) file("--schedule-file", o.schedule_file, false);
  directory(o.ckpt_dir.empty() ? "the checkpoint directory (--ckpt-dir)" : "--ckpt-dir", checkpoint_root(o));
  if (!o.log.empty()) directory("--log", fs::path(o.log).parent_path());
  if (!o.offload_dir.empty()) directory("--offload-dir", o.offload_dir);
  return out;
}

// Throws trellis::Error with every problem.
inline void validate(const Options& o, std::optional<int> world_size = std::nullopt) {
  auto p = problems(o, world_size);
  if (p.empty()) return;
  std::string msg = "cannot start:";
  for (auto& s : p) msg += "\n  - " + s;
  TRELLIS_THROW(msg);
}
// Throws trellis::Error with every problem of path_problems.
inline void validate_paths(const Options& o, const std::string& default_corpus) {
  auto p = path_problems(o, default_corpus);
  if (p.empty()) return;
  std::string msg = "cannot start:";
  for (auto& s : p) msg += "\n  - " + s;
  TRELLIS_THROW(msg);
}

}  // namespace train_gpt
