// Context parallelism on the host (thread ranks), three tables:
//  1. memory: the saved activations of one GPT microbatch per rank (bytes the layers took from the
//     activation arena, measured), against T for cp = 1, 2, 4, 8; the constant is bytes / (T / cp).
//  2. attention work per rank: each cp rank's ring blocks (nn::ring_plan, the list the layer runs)
//     executed alone on the machine, forward + backward kernels, against cp = 1's whole-sequence
//     attention / cp (1.0 = perfect split). Alone: ranks sharing 2 cores would time each other.
//     2b: the same on one packed row of documents, the plain zig-zag against balanced documents
//     (nn::balanced_document_order), with the causal pairs each rank computes.
//  3. overlap: RingAttention forward + backward on cp thread ranks over comm::SimulatedLink (a
//     SIMULATED link: each message held for latency + bytes / bandwidth, bandwidth chosen so one
//     K/V block takes half of a forward ring step's compute), against the same ranks without the
//     link, and against a link that cannot overlap (LinkModel::synchronous): the control. The
//     three run round robin in one world; the last columns are what the ring still waited for
//     (a member's slowness included: ranks share the machine's 2 cores).
//  4. Ulysses against ring at equal cp: the attention layer (its GEMMs included) forward +
//     backward over simulated links from none to 30 MB/s, time and bytes each rank sends, and
//     where the faster mode changes.
//   long_context_bench [--quick] [--json FILE]
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "support/counting_comm.hpp"
#include "support/report.hpp"
#include "trellis/comm/simulated_link.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/kernels/attention_host.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/ring_attention.hpp"
#include "trellis/nn/gpt.hpp"

using namespace trellis;
using namespace trellis::nn;
using Comm = comm::ThreadComm;
using HostFp32 = backend::Host<float>;

namespace {

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>((splitmix64(seed + i) >> 40) * 0x1.0p-24 - 0.5);
  return v;
}

// ---- 1. saved activations per rank --------------------------------------------------------------
std::size_t saved_bytes_per_rank(const GptConfig& cfg, index_t T, int cp) {
  std::size_t worst = 0;
  std::mutex mutex;
  comm::ThreadWorld world(cp);
  world.run([&](Comm& c) {
    Comm solo = c.split(c.rank(), 0);  // tp 1
    GptModel<Comm> model(cfg, solo, {}, {}, {}, nullptr, {&c, CpMode::ring});
    TokenShape shape{1, T / cp};
    shape.cp_rank = c.rank();
    shape.cp_size = cp;
    ActivationArena<HostFp32> arena;
    const int pool = arena.add_pool("model", model.saved_bytes(shape), 1);
    arena.allocate();
    model.set_saved_memory(&arena, pool);
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(T / cp)), targets(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<std::int32_t>(i * 7 % cfg.vocab);
      targets[i] = static_cast<std::int32_t>(i * 13 % cfg.vocab);
    }
    model.forward(0, shape, {tokens.data(), nullptr, targets.data(), static_cast<double>(T)}, nullptr);
    model.backward_input(0, shape, nullptr, nullptr);  // the slot holds forward + backward_input's state
    const std::size_t used = arena.used_bytes(pool, 0);
    model.backward_weight(0);
    std::lock_guard lock(mutex);
    worst = std::max(worst, used);
  });
  return worst;
}

// ---- 2. each rank's attention work, alone ------------------------------------------------------
struct AttentionShape {
  index_t heads = 4, head_dim = 32;
};
// cp rank r's ring blocks (forward: kernel + merge per block; backward: the accumulating kernel
// per block) as a callable, or the whole sequence with cp = 1. `ids`: one packed row's document
// ids as stored (T of them; empty: one sequence), each block masked as RingAttention masks it.
struct RankAttention {
  kernels::AttentionArgs args;
  std::vector<RingBlock> plan;
  std::size_t n = 0, m = 0;
  std::vector<float> q, k, v, d_o, o, lse, dq, dk, dv, part, part_lse;
  std::vector<std::int32_t> ids;
  int cp = 1;
  RankAttention(const AttentionShape& a, index_t T, int cp_, int r, std::vector<std::int32_t> row_ids = {})
      : ids(std::move(row_ids)), cp(cp_) {
    const index_t L = cp > 1 ? T / (2 * cp) : T, chunks = cp > 1 ? 2 : 1;
    args.q_heads = args.kv_heads = a.heads;
    args.head_dim = a.head_dim;
    args.q_len = args.kv_len = L;
    args.causal = true;
    n = static_cast<std::size_t>(args.q_elements()), m = static_cast<std::size_t>(args.lse_elements());
    q = random_floats(chunks * n, 1), k = random_floats(chunks * n, 2), v = random_floats(chunks * n, 3);
    d_o = random_floats(chunks * n, 4);
    o.resize(chunks * n), lse.resize(chunks * m), dq.resize(chunks * n), dk.resize(chunks * n), dv.resize(chunks * n);
    part.resize(n), part_lse.resize(m);
    plan = cp > 1 ? ring_plan(r, zigzag_chunks(cp), true) : std::vector<RingBlock>{RingBlock{}};
  }
  void operator()() {
    HostFp32 be;
    const index_t L = args.q_len;
    auto block_args = [&](const RingBlock& b) {
      auto x = args;
      x.causal_offset = (b.qc - b.kc) * L;
      if (!ids.empty()) x.q_segments = ids.data() + b.qc * L, x.kv_segments = ids.data() + b.kc * L;
      return x;
    };
    for (const RingBlock& b : plan) {
      const auto x = block_args(b);
      // The K/V of other ranks are stand-ins of the same size: the work does not depend on values.
      if (b.step == 0 && b.diagonal()) {
        be.attention_forward(x, q.data() + b.qi * n, k.data() + b.ki * n, v.data() + b.ki * n, o.data() + b.qi * n,
                             lse.data() + b.qi * m);
      } else {
        be.attention_forward(x, q.data() + b.qi * n, k.data() + b.ki * n, v.data() + b.ki * n, part.data(),
                             part_lse.data());
        be.merge_attention_partials(static_cast<index_t>(m), args.head_dim, o.data() + b.qi * n, lse.data() + b.qi * m,
                                    part.data(), part_lse.data());
      }
    }
    for (const RingBlock& b : plan) {
      const auto x = block_args(b);
      be.attention_backward(x, q.data() + b.qi * n, k.data() + b.ki * n, v.data() + b.ki * n, o.data() + b.qi * n,
                            d_o.data() + b.qi * n, lse.data() + b.qi * m, dq.data() + b.qi * n, dk.data() + b.ki * n,
                            dv.data() + b.ki * n, /*accumulate=*/cp > 1);
    }
  }
};

// work[0] (cp = 1) and work[1..] (the cp ranks), round robin so that a change of machine load
// touches all alike: seconds of cp = 1, and of the fastest and slowest rank (min over iters).
struct RankTimes {
  double whole, lo, hi;
};
RankTimes time_ranks(std::vector<RankAttention>& work, int iters) {
  std::vector<std::function<void()>> fns;
  for (auto& w : work) fns.push_back([&w] { w(); });
  const auto t = bench::time_round_robin(fns, 1, iters);
  RankTimes out{t[0].first, 1e30, 0};
  for (std::size_t r = 1; r < t.size(); ++r) out.lo = std::min(out.lo, t[r].first), out.hi = std::max(out.hi, t[r].first);
  return out;
}

// ---- 3. the ring's exchange behind the compute --------------------------------------------------
// One rank's RingAttention forward + backward over communicator C (seconds per call: forward
// alone, and forward + backward), plus where its time went (RingAttention::Stats).
template <class C>
struct RingRun {
  C& comm;
  kernels::AttentionArgs args;
  std::size_t n = 0, m = 0;
  std::vector<float> q, k, v, d_o, o, lse, dq, dk, dv;
  double kv_wait = 0, grad_wait = 0;
  RingRun(C& c, const AttentionShape& a, index_t T) : comm(c) {
    args.q_heads = args.kv_heads = a.heads;
    args.head_dim = a.head_dim;
    args.q_len = args.kv_len = T / (2 * c.size());
    args.causal = true;
    n = static_cast<std::size_t>(args.q_elements()), m = static_cast<std::size_t>(args.lse_elements());
    q = random_floats(2 * n, 11 + c.rank()), k = random_floats(2 * n, 21 + c.rank());
    v = random_floats(2 * n, 31 + c.rank()), d_o = random_floats(2 * n, 41);
    o.resize(2 * n), lse.resize(2 * m), dq.resize(2 * n), dk.resize(2 * n), dv.resize(2 * n);
  }
  double forward() {
    HostFp32 be;
    comm.barrier();
    const double t0 = bench::now_seconds();
    RingAttention<C, HostFp32>(comm, be, args, nullptr).forward(q.data(), k.data(), v.data(), o.data(), lse.data());
    comm.barrier();
    return bench::now_seconds() - t0;
  }
  double step() {
    HostFp32 be;
    comm.barrier();
    const double t0 = bench::now_seconds();
    RingAttention<C, HostFp32> ring(comm, be, args, nullptr);
    ring.forward(q.data(), k.data(), v.data(), o.data(), lse.data());
    ring.backward(q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(), dk.data(), dv.data());
    comm.barrier();
    kv_wait = ring.stats().kv_wait_seconds, grad_wait = ring.stats().grad_exchange_seconds;
    return bench::now_seconds() - t0;
  }
};

// ---- 4. Ulysses against ring: the attention layer over a simulated link --------------------------
// Seconds of one CausalSelfAttention forward + backward (mode over cp thread ranks, a simulated
// link of `bandwidth` B/s; 0: no link) and the bytes rank 0 put on the wire (CountingComm).
struct LayerRun {
  double seconds = 0, bytes = 0;
};
LayerRun attention_layer(CpMode mode, int cp, index_t T, index_t width, index_t heads, double bandwidth, int iters) {
  using Link = comm::SimulatedLink<Comm>;
  using Counted = bench::CountingComm<Link>;
  LayerRun out;
  comm::ThreadWorld world(cp);
  world.run([&](Comm& c) {
    // No link: a bandwidth no message notices (the same code path, the same counters).
    const comm::LinkModel model{.bandwidth = bandwidth > 0 ? bandwidth : 1e15, .latency = bandwidth > 0 ? 20e-6 : 0.0};
    Counted cp_comm(Link(c.split(0, c.rank()), model));
    Counted tp_comm = cp_comm.split(c.rank(), 0);  // tp 1
    TensorParallel<Counted> tp;
    tp.comm = &tp_comm;
    CausalSelfAttention<Counted, HostFp32> attn("h.0.attn", width, heads, tp, HostFp32{},
                                                ContextParallel<Counted>{&cp_comm, mode});
    TokenShape shape{1, T / cp};
    shape.cp_rank = c.rank();
    shape.cp_size = cp;
    const auto n = static_cast<std::size_t>(shape.rows() * width);
    auto x = random_floats(n, 5 + c.rank()), dy = random_floats(n, 7 + c.rank());
    std::vector<float> y(n), dx(n);
    auto step = [&] {
      c.barrier();
      attn.forward(0, shape, x.data(), y.data());
      attn.backward_input(0, shape, dy.data(), dx.data());
      attn.backward_weight(0);
      c.barrier();
    };
    step();  // warm-up, and the bytes of one step
    const double bytes = cp_comm.counters().bytes;
    const double t = bench::time_min_median(step, 0, iters).first;
    if (c.rank() == 0) out = {t, bytes};
  });
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::has_flag(argc, argv, "--quick");
  bench::JsonReport json("long_context_bench");
  std::printf("# long_context_bench (host, thread ranks; %s)\n", quick ? "quick" : "full");

  // 1. memory
  GptConfig cfg;
  cfg.vocab = 256;
  cfg.layers = 2;
  cfg.heads = 4;
  cfg.width = 128;
  cfg.positions = 4096;
  std::printf("\n## saved activations per rank (measured arena bytes; GPT %lld layers, width %lld, batch 1)\n",
              static_cast<long long>(cfg.layers), static_cast<long long>(cfg.width));
  std::printf("%8s %4s %14s %12s %16s\n", "T", "cp", "bytes/rank", "vs cp=1", "bytes/(T/cp)");
  const std::vector<index_t> lengths = quick ? std::vector<index_t>{512, 1024} : std::vector<index_t>{512, 1024, 2048, 4096};
  for (index_t T : lengths) {
    std::size_t one = 0;
    for (int cp : {1, 2, 4, 8}) {
      const std::size_t bytes = saved_bytes_per_rank(cfg, T, cp);
      if (cp == 1) one = bytes;
      const double per_token = static_cast<double>(bytes) / static_cast<double>(T / cp);
      std::printf("%8lld %4d %14zu %12.3f %16.1f\n", static_cast<long long>(T), cp, bytes,
                  static_cast<double>(bytes) / static_cast<double>(one), per_token);
      bench::Row row;
      row.add_text("table", "memory").add("T", static_cast<long long>(T)).add("cp", static_cast<long long>(cp));
      row.add("bytes_per_rank", static_cast<long long>(bytes)).add("bytes_per_local_token", per_token, "%.1f");
      json.add(row);
    }
  }

  // 2. attention work per rank
  const AttentionShape shape{};
  const int iters = quick ? 3 : 9;
  const index_t T_work = quick ? 2048 : 4096;
  std::printf("\n## attention work per rank, alone (T %lld, %lld heads x %lld; forward + backward; min of %d)\n",
              static_cast<long long>(T_work), static_cast<long long>(shape.heads),
              static_cast<long long>(shape.head_dim), iters);
  std::printf("%4s %12s %12s %14s %14s\n", "cp", "min rank ms", "max rank ms", "max/(cp1/cp)", "max/min");
  for (int cp : {2, 4, 8}) {
    std::vector<RankAttention> work;
    work.emplace_back(shape, T_work, 1, 0);
    for (int r = 0; r < cp; ++r) work.emplace_back(shape, T_work, cp, r);
    const auto [whole, lo, hi] = time_ranks(work, iters);
    std::printf("%4d %12.1f %12.1f %14.3f %14.3f   (cp 1: %.1f ms)\n", cp, lo * 1e3, hi * 1e3, hi / (whole / cp),
                hi / lo, whole * 1e3);
    bench::Row row;
    row.add_text("table", "work").add("T", static_cast<long long>(T_work)).add("cp", static_cast<long long>(cp));
    row.add("cp1_ms", whole * 1e3).add("min_rank_ms", lo * 1e3).add("max_rank_ms", hi * 1e3);
    row.add("max_over_ideal", hi / (whole / cp));
    json.add(row);
  }

  // 2b. the same on one packed row (T and 4 T: more documents to place): documents of 16 to 1024
  // tokens, plain zig-zag against balanced documents, and the causal pairs each rank computes
  // (counted from the plan and the ids, as the kernel masks them).
  for (const index_t T_row : quick ? std::vector<index_t>{T_work} : std::vector<index_t>{T_work, 4 * T_work}) {
    std::vector<std::int32_t> row_ids(static_cast<std::size_t>(T_row));
    for (index_t t = 0, d = 0; t < T_row; ++d) {
      const index_t len = std::min(T_row - t, static_cast<index_t>(16 + splitmix64(static_cast<std::uint64_t>(d) + 5) % 1009));
      for (index_t i = 0; i < len; ++i, ++t) row_ids[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(d);
    }
    std::printf("\n## attention work per rank on one PACKED row (T %lld, %d documents of 16..1024 tokens; min of %d)\n",
                static_cast<long long>(T_row), row_ids.back() + 1, iters);
    std::printf("%4s %-10s %12s %12s %14s %14s %16s\n", "cp", "order", "min rank ms", "max rank ms", "max/(cp1/cp)",
                "max/min", "pairs max/min");
    for (int cp : {2, 4, 8}) {
      for (bool balanced : {false, true}) {
        const auto stored = balanced ? balance_documents(row_ids, T_row, cp) : row_ids;
        std::vector<RankAttention> work;
        work.emplace_back(shape, T_row, 1, 0, row_ids);
        for (int r = 0; r < cp; ++r) work.emplace_back(shape, T_row, cp, r, stored);
        std::vector<double> pairs(static_cast<std::size_t>(cp), 0.0);  // counted as the kernel masks
        const index_t L = T_row / (2 * cp);
        for (int r = 0; r < cp; ++r)
          for (const RingBlock& b : work[static_cast<std::size_t>(1 + r)].plan)
            for (index_t i = 0; i < L; ++i)
              for (index_t j = 0; j < L && j <= i + (b.qc - b.kc) * L; ++j)
                pairs[static_cast<std::size_t>(r)] += stored[static_cast<std::size_t>(b.qc * L + i)] ==
                                                      stored[static_cast<std::size_t>(b.kc * L + j)];
        const auto [whole, lo, hi] = time_ranks(work, iters);
        const auto [plo, phi] = std::minmax_element(pairs.begin(), pairs.end());
        std::printf("%4d %-10s %12.1f %12.1f %14.3f %14.3f %16.3f   (cp 1: %.1f ms)\n", cp,
                    balanced ? "documents" : "zig-zag", lo * 1e3, hi * 1e3, hi / (whole / cp), hi / lo, *phi / *plo,
                    whole * 1e3);
        bench::Row row;
        row.add_text("table", "packed_work").add_text("order", balanced ? "documents" : "zigzag");
        row.add("T", static_cast<long long>(T_row)).add("cp", static_cast<long long>(cp));
        row.add("cp1_ms", whole * 1e3).add("min_rank_ms", lo * 1e3).add("max_rank_ms", hi * 1e3);
        row.add("max_over_ideal", hi / (whole / cp)).add("pairs_max_over_min", *phi / *plo);
        json.add(row);
      }
    }
  }

  // 3. overlap on a simulated link: the three variants round robin in one world, the link's
  // bandwidth set from the measured forward so that one K/V block takes half of a forward ring
  // step's compute (compute dominates).
  std::printf("\n## ring exchange on a SIMULATED link (RingAttention forward + backward, T %lld; min of %d)\n",
              static_cast<long long>(T_work), iters);
  std::printf("%4s %11s %10s %10s %13s %12s %14s %13s\n", "cp", "no link ms", "link MB/s", "link ms", "link/no link",
              "sync link ms", "kv wait ms", "dK/dV wait ms");
  for (int cp : {2, 4}) {
    double plain = 1e30, linked = 1e30, sync = 1e30, bandwidth = 0, kv_wait = 0, grad_wait = 0;
    // K and V of both local chunks, fp32: what one ring step sends.
    const double block_bytes = 2.0 * 2 * shape.heads * (T_work / (2 * cp)) * shape.head_dim * 4;
    comm::ThreadWorld world(cp);
    world.run([&](Comm& c) {
      RingRun<Comm> bare(c, shape, T_work);
      double fwd = 1e30;
      for (int i = 0; i < 3; ++i) fwd = std::min(fwd, bare.forward());
      double bw = block_bytes / (0.5 * fwd / cp);
      c.broadcast(&bw, 1, 0);
      comm::SimulatedLink<Comm> link(c.split(0, c.rank()), {.bandwidth = bw, .latency = 20e-6});
      comm::SimulatedLink<Comm> blocking(c.split(0, c.rank()), {.bandwidth = bw, .latency = 20e-6, .synchronous = true});
      RingRun<comm::SimulatedLink<Comm>> over_link(link, shape, T_work), over_blocking(blocking, shape, T_work);
      double t[3] = {1e30, 1e30, 1e30};
      for (int i = 0; i < iters; ++i) {
        t[0] = std::min(t[0], bare.step());
        t[1] = std::min(t[1], over_link.step());
        t[2] = std::min(t[2], over_blocking.step());
      }
      if (c.rank() == 0) {
        plain = t[0], linked = t[1], sync = t[2], bandwidth = bw;
        kv_wait = over_link.kv_wait, grad_wait = over_link.grad_wait;
      }
    });
    std::printf("%4d %11.1f %10.0f %10.1f %13.3f %12.1f %14.1f %13.1f\n", cp, plain * 1e3, bandwidth / 1e6,
                linked * 1e3, linked / plain, sync * 1e3, kv_wait * 1e3, grad_wait * 1e3);
    bench::Row row;
    row.add_text("table", "overlap").add("T", static_cast<long long>(T_work)).add("cp", static_cast<long long>(cp));
    row.add("no_link_ms", plain * 1e3).add("link_ms", linked * 1e3).add("sync_link_ms", sync * 1e3);
    row.add("link_bytes_per_s", bandwidth, "%.0f").add("kv_wait_ms", kv_wait * 1e3).add("grad_wait_ms", grad_wait * 1e3);
    json.add(row);
  }
  // 4. Ulysses against ring at equal cp, over link bandwidths: where the winner changes.
  const index_t width = 128, heads = 4;
  std::printf("\n## Ulysses against ring (CausalSelfAttention %lld heads x %lld, forward + backward, T %lld; "
              "SIMULATED link; min of %d)\n",
              static_cast<long long>(heads), static_cast<long long>(width / heads), static_cast<long long>(T_work), iters);
  std::printf("%4s %12s %10s %12s %14s %16s %9s\n", "cp", "link MB/s", "ring ms", "ulysses ms", "ring MB/rank",
              "ulysses MB/rank", "faster");
  for (int cp : {2, 4}) {
    std::string previous;
    for (double bw : {0.0, 2e9, 5e8, 1.25e8, 3e7}) {
      const LayerRun ring = attention_layer(CpMode::ring, cp, T_work, width, heads, bw, iters);
      const LayerRun uly = attention_layer(CpMode::ulysses, cp, T_work, width, heads, bw, iters);
      const std::string faster = ring.seconds <= uly.seconds ? "ring" : "ulysses";
      std::printf("%4d %12s %10.1f %12.1f %14.2f %16.2f %9s%s\n", cp,
                  bw > 0 ? std::to_string(static_cast<long long>(bw / 1e6)).c_str() : "none", ring.seconds * 1e3,
                  uly.seconds * 1e3, ring.bytes / 1e6, uly.bytes / 1e6, faster.c_str(),
                  !previous.empty() && previous != faster ? "   <- crossover" : "");
      previous = faster;
      bench::Row row;
      row.add_text("table", "ulysses_vs_ring").add("T", static_cast<long long>(T_work)).add("cp", static_cast<long long>(cp));
      row.add("link_bytes_per_s", bw, "%.0f").add("ring_ms", ring.seconds * 1e3).add("ulysses_ms", uly.seconds * 1e3);
      row.add("ring_bytes_per_rank", ring.bytes, "%.0f").add("ulysses_bytes_per_rank", uly.bytes, "%.0f");
      json.add(row);
    }
  }
  std::printf("\n(the link is simulated: comm::SimulatedLink holds each message for latency + bytes / bandwidth)\n");
  json.write(bench::json_path(argc, argv));
  return 0;
}
