// trellis_plan: which dp x tp x pp x cp layout, cp mode, schedule, microbatch count, recompute, ZeRO
// stage and shard degree, offloaded optimizer and tp overlap chunks to train a GPT with on a cluster. A model shape and a cluster file (or --host N: this machine's
// thread ranks, rates measured here) in; the fastest layouts by predicted step time out, with
// MFU, memory per rank and the train_gpt flags of each. No training happens (docs/plan.md).
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "trellis/kernels/cpu_peak.hpp"
#include "trellis/kernels/thread_pool.hpp"
#include "trellis/plan/cluster.hpp"
#include "trellis/plan/measured_rates.hpp"
#include "trellis/plan/search.hpp"

using namespace trellis;

namespace {

const char* kUsage = R"(usage: trellis_plan (--cluster FILE | --host N) [model] [options]
cluster:  --cluster FILE (plan/cluster.hpp format; examples/trellis_plan/clusters/) [--nodes N]
          --host N (this machine as N thread ranks, one kernel thread each, rates measured here,
            on a simulated link of --link-gbps G (1) and --link-latency-us U (20); memory: this
            machine's divided by N)
model:    --model gpt2|gpt2-medium|gpt2-large|gpt2-xl|gpt3-1.3b|gpt3-2.7b|gpt3-6.7b|gpt3-13b|gpt3-175b
          or --layers N --heads N --width N --vocab N --context T (defaults: GPT-2 124M)
          --batch B (global rows of --seq T tokens; default 512) --seq T (default: the context)
options:  --precision bf16|fp32 (bf16 with a cluster file: the bf16 peak, activations at 2 bytes;
            fp32 with --host) --top K (10) --max-microbatches M (64)
          --schedules a,b,.. (gpipe,1f1b,interleaved_1f1b,zb_h1) --max-tp N (a node's devices)
          --overlap K,.. (1,2,4: tp overlap chunks tried with tp > 1, train_gpt --overlap)
          --cp-modes a,b,.. (ring,ulysses,hybrid: context-parallel modes tried with cp > 1)
          --shard-degrees on|off (on: hybrid sharding's degrees tried with ZeRO, --shard-degree)
          --offload on|off (on: the optimizer offloaded where nothing fits without, --offload optimizer)
)";

struct Shape {
  index_t layers, heads, width;
  index_t batch;  // the paper's global batch in sequences
};
// GPT-2 (Radford et al. 2019) and GPT-3 (Brown et al. 2020, Table 2.1: batch in tokens / 2048).
const std::map<std::string, Shape> kModels = {
    {"gpt2", {12, 12, 768, 512}},       {"gpt2-medium", {24, 16, 1024, 512}}, {"gpt2-large", {36, 20, 1280, 512}},
    {"gpt2-xl", {48, 25, 1600, 512}},   {"gpt3-1.3b", {24, 16, 2048, 512}},   {"gpt3-2.7b", {32, 32, 2560, 512}},
    {"gpt3-6.7b", {32, 32, 4096, 1024}}, {"gpt3-13b", {40, 40, 5120, 1024}},  {"gpt3-175b", {96, 96, 12288, 1536}}};

std::string arg(std::map<std::string, std::string>& flags, const std::string& k, const std::string& fallback = {}) {
  auto it = flags.find(k);
  if (it == flags.end()) return fallback;
  std::string v = it->second;
  flags.erase(it);
  return v;
}
long long number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  TRELLIS_CHECK(!v.empty() && *end == '\0' && x >= 1 && x <= (1ll << 40), flag, " needs a positive integer (got '", v, "')");
  return x;
}
double real(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  TRELLIS_CHECK(!v.empty() && *end == '\0' && x >= 0 && x < 1e30, flag, " needs a number >= 0 (got '", v, "')");
  return x;
}

double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

}  // namespace

int main(int argc, char** argv) try {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    TRELLIS_CHECK(a.rfind("--", 0) == 0 && i + 1 < argc, "unexpected argument '", a, "' (every flag takes a value; --help)");
    flags[a] = argv[++i];
  }
  train::TrainerConfig base;
  base.model = {.vocab = 50257, .positions = 1024, .layers = 12, .heads = 12, .width = 768};
  base.batch = 512;
  if (auto name = arg(flags, "--model"); !name.empty()) {
    auto it = kModels.find(name);
    TRELLIS_CHECK(it != kModels.end(), "unknown --model '", name, "' (--help lists them)");
    base.model.layers = it->second.layers;
    base.model.heads = it->second.heads;
    base.model.width = it->second.width;
    base.batch = it->second.batch;
    if (name.rfind("gpt3", 0) == 0) base.model.positions = 2048;
  }
  if (auto v = arg(flags, "--layers"); !v.empty()) base.model.layers = number("--layers", v);
  if (auto v = arg(flags, "--heads"); !v.empty()) base.model.heads = number("--heads", v);
  if (auto v = arg(flags, "--width"); !v.empty()) base.model.width = number("--width", v);
  if (auto v = arg(flags, "--vocab"); !v.empty()) base.model.vocab = number("--vocab", v);
  if (auto v = arg(flags, "--context"); !v.empty()) base.model.positions = number("--context", v);
  if (auto v = arg(flags, "--batch"); !v.empty()) base.batch = number("--batch", v);
  base.seq = base.model.positions;
  if (auto v = arg(flags, "--seq"); !v.empty()) base.seq = number("--seq", v);

  plan::SearchSpace space;
  const int top = static_cast<int>(number("--top", arg(flags, "--top", "10")));
  space.max_microbatches = static_cast<int>(number("--max-microbatches", arg(flags, "--max-microbatches", "64")));
  if (auto v = arg(flags, "--max-tp"); !v.empty()) space.max_tp = static_cast<int>(number("--max-tp", v));
  if (auto v = arg(flags, "--schedules"); !v.empty()) {
    space.schedules.clear();
    for (std::size_t at = 0; at <= v.size();) {
      const std::size_t comma = std::min(v.find(',', at), v.size());
      space.schedules.push_back(v.substr(at, comma - at));
      at = comma + 1;
    }
  }

  if (auto v = arg(flags, "--overlap"); !v.empty()) {
    space.overlap_chunks.clear();
    for (std::size_t at = 0; at <= v.size();) {
      const std::size_t comma = std::min(v.find(',', at), v.size());
      space.overlap_chunks.push_back(static_cast<int>(number("--overlap", v.substr(at, comma - at))));
      at = comma + 1;
    }
  }

  if (auto v = arg(flags, "--cp-modes"); !v.empty()) {
    space.cp_modes.clear();
    for (std::size_t at = 0; at <= v.size();) {
      const std::size_t comma = std::min(v.find(',', at), v.size());
      space.cp_modes.push_back(nn::parse_cp_mode(v.substr(at, comma - at)));
      at = comma + 1;
    }
  }
  auto on_off = [&](const std::string& flag) {
    const std::string v = arg(flags, flag, "on");
    TRELLIS_CHECK(v == "on" || v == "off", flag, " is on or off (got '", v, "')");
    return v == "on";
  };
  space.shard_degrees = on_off("--shard-degrees");
  if (!on_off("--offload")) space.offload_optimizer = {false};

  plan::Cluster cluster;
  plan::MeasuredRates measured;
  plan::Rates rates;
  double peak = 0;
  const std::string host = arg(flags, "--host"), file = arg(flags, "--cluster");
  TRELLIS_CHECK(host.empty() != file.empty(), "give one of --cluster FILE or --host N (--help)");
  const std::string precision = arg(flags, "--precision", host.empty() ? "bf16" : "fp32");
  TRELLIS_CHECK(precision == "bf16" || precision == "fp32", "--precision is bf16 or fp32 (got '", precision, "')");
  if (!file.empty()) {
    cluster = plan::load_cluster(file);
    if (auto v = arg(flags, "--nodes"); !v.empty()) cluster.nodes = static_cast<int>(number("--nodes", v));
    TRELLIS_CHECK(cluster.speed.empty() || static_cast<int>(cluster.speed.size()) == cluster.devices(),
                  "--nodes changes the device count but the cluster file gives ", cluster.speed.size(), " speeds");
    rates = plan::cluster_rates(cluster, precision == "bf16" ? plan::Precision::bf16 : plan::Precision::fp32);
    peak = precision == "bf16" ? cluster.device.peak_flops_bf16 : cluster.device.peak_flops_fp32;
    if (precision == "bf16") space.activation_scale = 0.5;
  } else {
    TRELLIS_CHECK(precision == "fp32", "--host plans the host's fp32 trainer (--precision fp32)");
    kernels::host::set_num_threads(1);
    const int n = static_cast<int>(number("--host", host));
    const double gbps = real("--link-gbps", arg(flags, "--link-gbps", "1"));
    const double latency = real("--link-latency-us", arg(flags, "--link-latency-us", "20")) * 1e-6;
    const auto cpu = kernels::host::measure_cpu_peak(1);
    cluster.name = "this host as " + std::to_string(n) + " thread ranks";
    cluster.devices_per_node = n;
    cluster.device = {.name = "one core", .memory_bytes = physical_memory_bytes() / n, .peak_flops_fp32 = cpu.peak(false),
                      .peak_flops_bf16 = cpu.peak(true), .memory_bandwidth = 1};
    cluster.intra_node = cluster.inter_node = {.bandwidth = gbps * 1e9, .latency = latency};
    rates = measured.rates();
    peak = cluster.device.peak_flops_fp32;
  }
  TRELLIS_CHECK(flags.empty(), "unknown flag ", flags.begin()->first, " (--help)");

  const double params = static_cast<double>(base.model.layers) * 12 * base.model.width * base.model.width +
                        static_cast<double>(base.model.vocab + base.model.positions) * base.model.width;
  std::printf("model: %lld layers, width %lld, %lld heads, vocab %lld, T %lld (%.2f B parameters); global batch %lld "
              "sequences (%.2f M tokens)\n",
              static_cast<long long>(base.model.layers), static_cast<long long>(base.model.width),
              static_cast<long long>(base.model.heads), static_cast<long long>(base.model.vocab),
              static_cast<long long>(base.seq), params / 1e9, static_cast<long long>(base.batch),
              static_cast<double>(base.batch * base.seq) / 1e6);
  std::printf("cluster: %s: %d x %d devices of %.1f GiB, %s peak %.1f TFLOP/s\n", cluster.name.c_str(), cluster.nodes,
              cluster.devices_per_node, cluster.device.memory_bytes / (1ull << 30), precision.c_str(), peak / 1e12);
  const plan::Plan p = plan::search(base, cluster, rates, space, top);
  std::printf("searched %ld layouts: %ld refused by the trainer's checks, %ld offloaded not needed, %ld over memory, "
              "%ld pruned by the time bound, %ld simulated\n",
              p.layouts, p.invalid, p.offload_not_needed, p.over_memory, p.pruned, p.simulated);
  if (p.best.empty()) {
    std::printf("no layout fits: use more devices, a smaller batch or model\n");
    return 2;
  }
  const double flops = plan::model_flops(base);
  std::printf("%3s %11s %10s %6s %9s %7s %7s %7s %7s  %s\n", "#", "step (s)", "tokens/s", "MFU", "mem (GiB)", "bubble",
              "tp comm", "overlap", "dp exp", "train_gpt flags");
  for (std::size_t i = 0; i < p.best.size(); ++i) {
    const auto& c = p.best[i];
    std::printf("%3zu %11.4f %10.0f %5.1f%% %9.2f %6.1f%% %6.1f%% %7d %6.1f%%  %s\n", i + 1, c.cost.step,
                static_cast<double>(base.batch * base.seq) / c.cost.step,
                100 * flops / (c.cost.step * cluster.devices() * peak), c.memory.device_total() / (1ull << 30),
                100 * c.cost.bubble_fraction, 100 * c.cost.tp_comm / c.cost.step, c.config.options.overlap_chunks,
                100 * c.cost.dp_exposed / c.cost.step, plan::train_gpt_flags(c.config).c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "trellis_plan: %s\n", e.what());
  return 1;
}
