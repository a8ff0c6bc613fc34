// Overlap measured, not counted: thread ranks whose communicator is a comm::SimulatedLink (each
// collective held for latency + ring bytes / bandwidth; async ones complete at their deadline
// without blocking the caller). The same work with overlap on and off, side by side:
//  - dp buckets: a Trainer step (dp2, 6 blocks, one bucket each, plus wte), overlap_dp = true vs
//    false; losses and grad norms bitwise equal;
//  - ZeRO-1: the same with --zero1: each bucket's reduce-scatter starts during the backward (the
//    all-gathers of the updated parameters after the optimizer step are not overlapped, so only
//    the reduce-scatter half of the traffic can hide); bitwise equal;
//  - ZeRO-3: prefetch_values on vs off: each weight unit's all-gather starts while the unit before
//    it computes, or when the unit needs it; bitwise equal;
//  - tp chunks: a tp2 MLP (c_fc + c_proj), forward + backward, overlap_chunks = 4 vs 1, with and
//    without sequence parallelism; outputs and gradients within 1e-5 (norm-relative: chunked
//    GEMMs may round differently).
// Two measurements, both wall-clock, against the modelled communication M (per step):
//  1. blocked time: how long the ranks actually spent blocked in communication (SimulatedLink::
//     blocked_seconds: blocking calls and wait(), waits for the other rank included). Without
//     overlap it is >= M; with overlap it must drop below a fraction of that. A collective that
//     ran synchronously (LinkModel::synchronous, the hidden "[negative]" case) blocks for all of
//     M, so this fails -- and other load on the machine does not fake it (slower compute only
//     hides more).
//  2. step time: the fastest step with overlap must beat the fastest without by a share of M.
//     On a quiet machine this alone would do; on a loaded one it is noisy, and the scheduler
//     favours threads that sleep often (4 chunks sleep 4x as often), so the negative control can
//     show a spurious wall-clock "saving" there -- which is why check 1 is the one that decides.
// Each rank computes on its own thread only (kernel pool of one thread): with the shared pool, a
// rank asleep on the link hands its core to the other rank, which then computes faster -- a
// saving that has nothing to do with overlap.
// Calibration: the link's bandwidth is set at run time from a probe over an infinitely fast link
// (the ranks agree on the slowest), so M is a fixed share of the measured compute on any machine;
// steps of the two variants are interleaved (alternating which goes first).
// Retries: ctest runs these cases alone (RUN_SERIAL), but other processes on the machine still
// disturb them (a tp run once blocked 56.1 ms with overlap against its bound of 0.6 x 84.7 ms).
// Each case measures up to `attempts` times and passes at the first measurement that meets all of
// its timing bounds; the exactness checks (bits, rounding) hold on every attempt.
// A retry cannot make a missing overlap pass: without it every step blocks for all of M on each
// attempt, and load only adds to that (it would have to slow every step without overlap by 2/3
// while sparing those with it). Checked by removing the overlap from the library (the chunks' and
// buckets' requests waited for at once, the ZeRO-3 prefetch waited for when started): every case
// then fails all its attempts.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "test_trainer_support.hpp"
#include "trellis/comm/simulated_link.hpp"
#include "trellis/kernels/thread_pool.hpp"
#include "trellis/nn/mlp.hpp"

using namespace trainer_test;
using trellis::comm::LinkModel;
using trellis::comm::ReduceOp;
using Link = trellis::comm::SimulatedLink<ThreadComm>;
using clock_type = std::chrono::steady_clock;

namespace {

// Before any kernel runs in this process (the pool is made on first use).
const bool single_threaded_kernels = [] {
  trellis::kernels::host::set_num_threads(1);
  return true;
}();

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// One variant's best step on this rank: the fastest wall time, and the least time blocked in
// communication (each over the steps: the least disturbed by other load).
struct Best {
  double step_s = 1e9, blocked_s = 1e9;
  // Times f() (one step) and the link's blocked seconds during it.
  template <class F>
  void time(Link& link, F&& f) {
    const double blocked0 = link.blocked_seconds();
    const auto t0 = clock_type::now();
    f();
    step_s = std::min(step_s, seconds_since(t0));
    blocked_s = std::min(blocked_s, link.blocked_seconds() - blocked0);
  }
};

// What one comparison measured, per step. Step times: rank 0's best; blocked: the best step of
// the most blocked rank with overlap, of the least blocked rank without (the check's worst case).
struct Measured {
  double on_s = 1e9, off_s = 1e9;      // fastest step with overlap on / off
  double comm_s = 0;                   // modelled communication of the baseline
  double blocked_on_s = 0, blocked_off_s = 0;  // measured wall time blocked in communication
  std::vector<double> loss_on, loss_off, norm_on, norm_off;
  double max_rel_diff = 0;  // tp: outputs and gradients, on vs off
};

std::string describe(const Measured& m) {
  std::ostringstream s;
  s.precision(3);
  s << "modelled comm " << m.comm_s * 1e3 << " ms; blocked in it " << m.blocked_on_s * 1e3 << " ms with overlap vs "
    << m.blocked_off_s * 1e3 << " ms without; step " << m.on_s * 1e3 << " vs " << m.off_s * 1e3 << " ms (saved "
    << (m.off_s - m.on_s) * 1e3 << " ms = " << 100 * (m.off_s - m.on_s) / m.comm_s << " % of the modelled comm)";
  return s.str();
}

// One timing bound of a case: what it requires, and whether the measurement meets it.
struct Bound {
  const char* what;
  bool ok;
};

constexpr int attempts = 3;

// Measures (measure()) up to `attempts` times, each attempt reported (WARN) and its exactness
// checked (exact(m): CHECKs), and returns the first measurement that meets every bound (bounds(m))
// or else the last, whose bounds then fail (check_bounds).
template <class Measure, class Exact, class Bounds>
Measured measure_until(const std::string& what, Measure&& measure, Exact&& exact, Bounds&& bounds) {
  Measured m;
  for (int a = 1; a <= attempts; ++a) {
    m = measure();
    bool ok = true;
    for (const Bound& b : bounds(m)) ok = ok && b.ok;
    WARN(what << ", attempt " << a << " of " << attempts << (ok ? "" : " (timing bounds missed)") << ": "
              << describe(m));
    exact(m);
    if (ok) break;
  }
  return m;
}

void check_bounds(const Measured& m, const std::vector<Bound>& bounds) {
  INFO(describe(m));
  for (const Bound& b : bounds) {
    INFO("bound: " << b.what);
    CHECK(b.ok);
  }
}

// The link that makes `bytes` per step take `share` x `compute_s`, agreed over the world.
LinkModel calibrated(ThreadComm& world, double bytes, double compute_s, double share, bool synchronous) {
  double slowest = 0;
  world.all_reduce(&compute_s, &slowest, 1, ReduceOp::max);
  return {.bandwidth = bytes / (share * slowest), .latency = 20e-6, .synchronous = synchronous};
}

// The largest / smallest value of a per-rank quantity over the ranks.
double largest(ThreadComm& world, double v) {
  double out = 0;
  world.all_reduce(&v, &out, 1, ReduceOp::max);
  return out;
}
double smallest(ThreadComm& world, double v) {
  double out = 0;
  world.all_reduce(&v, &out, 1, ReduceOp::min);
  return out;
}

// ---- dp buckets: two Trainers ------------------------------------------------------------------

// 6 blocks (one dp bucket each, plus wte), width 96.
TrainerConfig dp_config(bool overlap, int zero = 0) {
  TrainerConfig c = tiny_config();
  c.zero = zero;
  c.model.layers = 6;
  c.model.width = 96;
  c.model.heads = 4;
  c.model.positions = 32;
  c.seq = 32;
  c.batch = 16;
  c.dp = 2;
  c.overlap_dp = overlap;
  return c;
}

// Trainer steps of config(true) against config(false) on the replicas' link.
template <class Config>
Measured trainer_case(bool synchronous, Config config) {
  const int steps = 4;
  Measured m;
  std::mutex mutex;
  trellis::comm::ThreadWorld(2).run([&](ThreadComm& world) {
    world.set_timeout(std::chrono::milliseconds(60000));
    using trellis::train::DataLoader;
    auto loader = [](Trainer<Link>& t) {
      const auto& c = t.config();
      return DataLoader(tokens(), {c.batch, c.seq, 99, true, t.mesh().coord<trellis::dp>(), c.dp});
    };
    // Gradients are reduced over the replicas, dp x cp (cp 1 here): that communicator's link.
    auto dp_link = [](Trainer<Link>& t) -> Link& { return t.mesh().comm<trellis::dp, trellis::cp>(); };
    // Probe: compute time and dp wire bytes per step (an infinitely fast link books bytes / 1e15).
    double compute_s = 1e9, bytes = 0;
    {
      Link fast(world.split(0, world.rank()), {.bandwidth = 1e15, .latency = 0});
      Trainer<Link> t(fast, config(true));
      auto l = loader(t);
      for (int s = 0; s < 3; ++s) {
        const auto t0 = clock_type::now();
        t.step(l.next());
        compute_s = std::min(compute_s, seconds_since(t0));
      }
      bytes = dp_link(t).modelled_seconds() * 1e15 / 3;
    }
    // The dp reductions take about half a step's compute (~3/4 of the backward).
    Link link(world.split(0, world.rank()), calibrated(world, bytes, compute_s, 0.5, synchronous));
    Trainer<Link> on(link, config(true)), off(link, config(false));
    auto l_on = loader(on), l_off = loader(off);
    Best best_on, best_off;
    std::vector<double> loss_on, loss_off, norm_on, norm_off;
    auto run = [&](Trainer<Link>& t, DataLoader& l, Best& best, std::vector<double>& loss, std::vector<double>& norm) {
      world.barrier();  // start together (the plain world: no modelled cost)
      best.time(dp_link(t), [&] {
        auto r = t.step(l.next());
        loss.push_back(r.loss);
        norm.push_back(r.grad_norm);
      });
    };
    for (int s = 0; s < steps; ++s) {
      if (s % 2 == 0) run(on, l_on, best_on, loss_on, norm_on), run(off, l_off, best_off, loss_off, norm_off);
      else run(off, l_off, best_off, loss_off, norm_off), run(on, l_on, best_on, loss_on, norm_on);
    }
    const double blocked_on = largest(world, best_on.blocked_s);
    const double blocked_off = smallest(world, best_off.blocked_s);
    if (world.rank() == 0) {
      std::lock_guard lock(mutex);
      m.on_s = best_on.step_s;
      m.off_s = best_off.step_s;
      m.comm_s = dp_link(off).modelled_seconds() / steps;
      m.blocked_on_s = blocked_on;
      m.blocked_off_s = blocked_off;
      m.loss_on = loss_on;
      m.loss_off = loss_off;
      m.norm_on = norm_on;
      m.norm_off = norm_off;
    }
  });
  return m;
}
// dp buckets started during the backward (on) or after it (off); zero: the ZeRO stage.
Measured dp_case(bool synchronous, int zero = 0) {
  return trainer_case(synchronous, [zero](bool on) { return dp_config(on, zero); });
}
// ZeRO-3: each unit's gather prefetched while the unit before computes (on) or started when needed.
Measured prefetch_case(bool synchronous) {
  return trainer_case(synchronous, [](bool on) {
    TrainerConfig c = dp_config(true, 3);
    c.prefetch_values = on;
    return c;
  });
}

// ---- tp chunks: two MLPs -----------------------------------------------------------------------

// A Megatron MLP (c_fc column-parallel + GELU, c_proj row-parallel), width 256, 8192 token rows,
// tp2: forward + backward_input + backward_weight. The link is calibrated so the modelled tp
// communication is ~30 % of the compute: about the share of the GEMMs that sit next to a
// collective and can hide it (c_proj forward, c_fc's dX; with sp also c_fc forward and c_proj's
// dX). Each chunk's GEMM is a few ms, well above the scheduler's time slices on a loaded machine
// (with 512 rows, rank skew from preemption ate most of what a chunk could hide; with 2048 rows and
// OpenBLAS' AVX-512 kernels, 5x faster than its generic ones, chunks hid only 33 %). A whole
// tiny-GPT step is not used: there the GEMMs next to a collective are a small part of the step,
// so only a few percent of a link sized to the step could be hidden.
Measured mlp_case(bool sp, bool synchronous) {
  using trellis::nn::Mlp;
  using trellis::nn::Parameter;
  using trellis::nn::TensorParallel;
  using trellis::nn::TokenShape;
  const index_t width = 256, hidden = 4 * width;
  const TokenShape shape{64, 128};
  const int steps = 8;
  Measured m;
  std::mutex mutex;
  trellis::comm::ThreadWorld(2).run([&](ThreadComm& world) {
    world.set_timeout(std::chrono::milliseconds(60000));
    const auto make = [&](Link& link, int chunks) {
      auto mlp = std::make_unique<Mlp<Link>>("h.0.mlp", width, hidden, TensorParallel<Link>{&link, sp, chunks});
      mlp->for_each_parameter([](Parameter& p) { nn_test::randomize(p, 0.05f); });
      return mlp;
    };
    const index_t local = sp ? shape.rows() / 2 : shape.rows();
    std::vector<float> x(static_cast<std::size_t>(local * width)), dy(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const auto g = static_cast<index_t>(i) + (sp ? world.rank() * local * width : 0);  // global index
      x[i] = nn_test::global_value("x", g);
      dy[i] = nn_test::global_value("dy", g, 0.1f);
    }
    // One forward + backward, timed into `best`. y and dx: this rank's output and input gradient.
    const auto pass = [&](Mlp<Link>& mlp, Link& link, Best& best, int mb, std::vector<float>& y, std::vector<float>& dx) {
      y.assign(x.size(), 0.0f);
      dx.assign(x.size(), 0.0f);
      world.barrier();
      best.time(link, [&] {
        mlp.forward(mb, shape, x.data(), y.data());
        mlp.backward_input(mb, shape, dy.data(), dx.data());
        mlp.backward_weight(mb);
      });
    };
    std::vector<float> y_on, dx_on, y_off, dx_off;
    double compute_s = 1e9, bytes = 0;
    {
      Link fast(world.split(0, world.rank()), {.bandwidth = 1e15, .latency = 0});
      auto mlp = make(fast, 1);
      Best probe;
      for (int s = 0; s < 2; ++s) pass(*mlp, fast, probe, s, y_on, dx_on);
      compute_s = probe.step_s;
      bytes = fast.modelled_seconds() * 1e15 / 2;
    }
    const LinkModel model = calibrated(world, bytes, compute_s, 0.3, synchronous);
    Link link_on(world.split(0, world.rank()), model), link_off(world.split(0, world.rank()), model);
    auto on = make(link_on, 4), off = make(link_off, 1);
    Best best_on, best_off;
    double diff = 0;
    for (int s = 0; s < steps; ++s) {
      if (s % 2 == 0) {
        pass(*on, link_on, best_on, s, y_on, dx_on);
        pass(*off, link_off, best_off, s, y_off, dx_off);
      } else {
        pass(*off, link_off, best_off, s, y_off, dx_off);
        pass(*on, link_on, best_on, s, y_on, dx_on);
      }
      diff = std::max({diff, nn_test::rel_error(y_on, y_off), nn_test::rel_error(dx_on, dx_off)});
    }
    std::vector<Parameter*> p_on, p_off;
    on->for_each_parameter([&](Parameter& p) { p_on.push_back(&p); });
    off->for_each_parameter([&](Parameter& p) { p_off.push_back(&p); });
    for (std::size_t i = 0; i < p_on.size(); ++i) diff = std::max(diff, nn_test::rel_error(p_on[i]->grad, p_off[i]->grad));
    diff = largest(world, diff);
    const double blocked_on = largest(world, best_on.blocked_s);
    const double blocked_off = smallest(world, best_off.blocked_s);
    if (world.rank() == 0) {
      std::lock_guard lock(mutex);
      m.on_s = best_on.step_s;
      m.off_s = best_off.step_s;
      m.comm_s = link_off.modelled_seconds() / steps;
      m.blocked_on_s = blocked_on;
      m.blocked_off_s = blocked_off;
      m.max_rel_diff = diff;
    }
  });
  return m;
}

void check_tp(bool sp) {
  const auto exact = [](const Measured& m) {
    INFO("max norm-relative difference " << m.max_rel_diff);
    CHECK(m.max_rel_diff <= 1e-5);  // chunked GEMMs may round differently; the sums are the same
  };
  const auto bounds = [sp](const Measured& m) {
    // The baseline blocks for every collective -- with sp except the re-gather of the saved input
    // in c_fc's backward, which is async even without chunks (1 of the 5 equal collectives).
    return std::vector<Bound>{
        {sp ? "blocked without overlap >= 0.7 x modelled comm" : "blocked without overlap >= 0.9 x modelled comm",
         m.blocked_off_s >= (sp ? 0.7 : 0.9) * m.comm_s},
        // measured: chunks hide 40 % or more
        {"blocked with overlap <= 0.6 x blocked without", m.blocked_on_s <= 0.6 * m.blocked_off_s}};
  };
  const Measured m = measure_until(std::string("tp2") + (sp ? "+sp" : "") + " MLP, overlap_chunks 4 vs 1",
                                   [sp] { return mlp_case(sp, false); }, exact, bounds);
  check_bounds(m, bounds(m));
  // Wall clock is reported (WARN above), not asserted: with ctest -j2 and a compiler on the same
  // 2 cores a tp2+sp pass once took 501 ms with chunks vs 382 ms without while its blocked time
  // was 21 vs 114 ms. Blocked time is what a synchronous link fails ([negative] test).
}

// Losses and gradient norms of a Trainer case, bitwise (on every attempt).
void check_same_bits(const Measured& m) {
  CHECK(m.loss_on == m.loss_off);  // bitwise: the same buckets, reduced in the same fixed order
  CHECK(m.norm_on == m.norm_off);
}

}  // namespace

TEST_CASE("dp buckets: overlap hides the reductions on a simulated link, same bits", "[train][overlap][timing][dp]") {
  const auto bounds = [](const Measured& m) {
    return std::vector<Bound>{
        // The baseline waits for every bucket, less what copying the later buckets' gradients in
        // overlaps with the first transfers (all start at the end, then it waits).
        {"blocked without overlap >= 0.75 x modelled comm", m.blocked_off_s >= 0.75 * m.comm_s},
        // measured: at least half of it hidden
        {"blocked with overlap <= 0.5 x blocked without", m.blocked_on_s <= 0.5 * m.blocked_off_s},
        {"step saved >= 0.25 x modelled comm", m.off_s - m.on_s >= 0.25 * m.comm_s}};
  };
  const Measured m = measure_until("dp2 buckets, overlap_dp on vs off", [] { return dp_case(false); }, check_same_bits, bounds);
  check_bounds(m, bounds(m));
}

TEST_CASE("ZeRO-1: bucket reduce-scatters overlap the backward on a simulated link, same bits",
          "[train][overlap][timing][zero1]") {
  // About half of the modelled traffic is the reduce-scatters (the rest: the all-gathers after
  // the update, never overlapped). At least half of the reduce-scatters must be hidden.
  const auto bounds = [](const Measured& m) {
    return std::vector<Bound>{
        {"blocked without overlap >= 0.75 x modelled comm", m.blocked_off_s >= 0.75 * m.comm_s},
        {"blocked without - with overlap >= 0.25 x modelled comm", m.blocked_off_s - m.blocked_on_s >= 0.25 * m.comm_s}};
  };
  const Measured m =
      measure_until("dp2 ZeRO-1 buckets, overlap_dp on vs off", [] { return dp_case(false, 1); }, check_same_bits, bounds);
  check_bounds(m, bounds(m));
}

TEST_CASE("ZeRO-3: prefetched gathers overlap the unit before on a simulated link, same bits",
          "[train][overlap][timing][zero3]") {
  const auto bounds = [](const Measured& m) {
    return std::vector<Bound>{
        {"blocked without prefetch >= 0.6 x modelled comm", m.blocked_off_s >= 0.6 * m.comm_s},
        {"blocked without - with prefetch >= 0.2 x modelled comm", m.blocked_off_s - m.blocked_on_s >= 0.2 * m.comm_s}};
  };
  const Measured m =
      measure_until("dp2 ZeRO-3, prefetch on vs off", [] { return prefetch_case(false); }, check_same_bits, bounds);
  check_bounds(m, bounds(m));
}

TEST_CASE("tp chunks: overlap hides an MLP's all-reduces on a simulated link", "[train][overlap][timing][tp]") {
  check_tp(false);
}

TEST_CASE("tp chunks: overlap hides an MLP's sequence-parallel gathers and reduce-scatters", "[train][overlap][timing][tp_sp]") {
  check_tp(true);
}

// The negative control: collectives that hold the caller (no overlap possible). The blocked-time
// checks above fail here; the wall-clock difference is reported (on a loaded machine it is not
// zero, see the top of the file). Hidden: it only shows that the tests can fail.
TEST_CASE("a synchronous link hides nothing", "[.][negative][train][overlap][timing]") {
  const Measured dp = dp_case(true);
  WARN("synchronous dp2: " << describe(dp));
  CHECK(dp.blocked_on_s > 0.5 * dp.blocked_off_s);
  const Measured z = dp_case(true, 1);
  WARN("synchronous dp2 ZeRO-1: " << describe(z));
  CHECK(z.blocked_off_s - z.blocked_on_s < 0.25 * z.comm_s);
  const Measured z3 = prefetch_case(true);
  WARN("synchronous dp2 ZeRO-3 prefetch: " << describe(z3));
  CHECK(z3.blocked_off_s - z3.blocked_on_s < 0.2 * z3.comm_s);
  for (bool sp : {false, true}) {
    const Measured tp = mlp_case(sp, true);
    WARN("synchronous tp2" << (sp ? "+sp" : "") << ": " << describe(tp));
    CHECK(tp.blocked_on_s > 0.6 * tp.blocked_off_s);
  }
}
