// plan::predict_memory against what train::Trainer really allocates: a grid of layouts of a small
// GPT (4 layers, 4 heads, width 32 or 64, vocab 64, 96 or 97), each run for one step on thread
// ranks, then on every rank Trainer::memory() compared with predict_memory(cfg, that rank's
// coordinates) field by field. Tolerance: none -- these are allocation sizes, and the model
// follows the trainer's packing, shard and arena rules, so every field must be equal to the byte
// (one exception, stated at its case: the fused update's offloaded staging is predicted as an
// upper bound). tp overlap chunks are in the grid: they change no field. Mixture-of-Experts
// layouts are in the grid too (experts over ep, their own buckets and ZeRO parts, the router, the
// arena without the MoE MLP), exact as the rest. Also: the measured activation peak is > 0 and
// within the predicted reserve, and predict_peak_memory names a pipeline rank whose measured
// total is the largest. The MoE layers' own saved buffers (MemoryEstimate::moe_activations,
// which Trainer::memory() does not count: their size follows the routing) are checked apart: by
// hand for one shape, and as a bound against the copies the routers really sent.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "train/temp_dir.hpp"
#include "train/test_trainer_support.hpp"
#include "trellis/plan/memory_model.hpp"

namespace {

using trainer_test::Layout;
using trainer_test::ThreadComm;
using trainer_test::Trainer;
using trainer_test::TrainerConfig;
using trellis::plan::MemoryEstimate;
using trellis::plan::RankCoords;

struct Case {
  std::string name;
  TrainerConfig cfg;
  bool host_optimizer_bound = false;  // fused update + offload: the staging is an upper bound
};

struct Measured {
  RankCoords at;
  int dp = 0;
  trellis::train::MemoryUse use;
  // MoE: each MoE layer's load() after the step (copies of this rank's tokens routed to each of
  // the E experts, before dropping), the rank's chunks first to last, each chunk's layers in order
  std::vector<std::vector<std::int64_t>> moe_load;
};

// One step of `cfg` on its thread ranks; every rank's coordinates and memory afterwards.
std::vector<Measured> run(const TrainerConfig& cfg) {
  const int ranks = cfg.pp * cfg.dp * cfg.tp * cfg.cp;
  std::vector<Measured> out(static_cast<std::size_t>(ranks));
  trellis::comm::ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(30000));
    Trainer<ThreadComm> t(comm, cfg);
    auto& mesh = t.mesh();
    const int dp = mesh.template coord<trellis::dp>();
    trellis::train::DataLoader loader(trainer_test::tokens(), {cfg.batch, cfg.seq, 99, true, dp, cfg.dp, -1, cfg.dp_rows});
    t.step(loader.next());
    Measured& m = out[static_cast<std::size_t>(comm.rank())];
    m.at = {mesh.template coord<trellis::pp>(), mesh.template coord<trellis::tp>(),
            dp * cfg.cp + mesh.template coord<trellis::cp>()};
    m.dp = dp;
    m.use = t.memory();
    for (auto& chunk : t.chunks())
      for (auto [layer, moe] : chunk->moe_layers()) m.moe_load.push_back(moe->load());
  });
  return out;
}

TrainerConfig base(trellis::index_t width = 32, trellis::index_t vocab = 64) {
  TrainerConfig c = trainer_test::tiny_config();  // 4 layers, 4 heads, T 16, global batch 8
  c.model.width = width;
  c.model.vocab = vocab;
  return c;
}
TrainerConfig layout(const Layout& l, trellis::index_t width = 32, trellis::index_t vocab = 64) {
  TrainerConfig c = trainer_test::with_layout(base(width, vocab), l);
  c.poison_activations = false;
  return c;
}

// Mixture of Experts (trainer_test's MoE: blocks 0 and 2 with 4 experts, top-2, split over ep).
std::vector<Case> moe_grid() {
  std::vector<Case> g;
  g.push_back({"MoE dp2 ep1", layout({.dp = 2, .moe = true})});
  g.push_back({"MoE dp2 ep2", layout({.dp = 2, .moe = true, .ep = 2})});
  {
    Case k{"MoE dp2 ep2 top-1 capacity 1.25", layout({.dp = 2, .moe = true, .ep = 2, .capacity = 1.25f})};
    k.cfg.model.moe_topk = 1;
    g.push_back(k);
  }
  g.push_back({"MoE dp4 ep2 ZeRO-1", layout({.dp = 4, .zero = 1, .moe = true, .ep = 2})});
  {
    Case k{"MoE dp4 ep2 ZeRO-2 buckets of 1000", layout({.dp = 4, .zero = 2, .moe = true, .ep = 2})};
    k.cfg.bucket_elements = 1000;  // the experts' tensors and the rest cut into several buckets each
    g.push_back(k);
  }
  g.push_back({"MoE dp4 ep2 ZeRO-3", layout({.dp = 4, .zero = 3, .moe = true, .ep = 2})});
  g.push_back({"MoE dp4 ep4 ZeRO-1 (one replica per expert)", layout({.dp = 4, .zero = 1, .moe = true, .ep = 4})});
  g.push_back({"MoE dp4 ep1 ZeRO-2 shard_degree 2 (experts over all 4)",
               layout({.dp = 4, .zero = 2, .shard_degree = 2, .moe = true})});
  g.push_back({"MoE pp2 1f1b m4 (an MoE block per stage)",
               layout({.pp = 2, .schedule = "1f1b", .microbatches = 4, .moe = true})});
  g.push_back({"MoE dp2.pp2 ep2 zb_h1 m2 ZeRO-2",
               layout({.pp = 2, .dp = 2, .zero = 2, .schedule = "zb_h1", .microbatches = 2, .moe = true, .ep = 2})});
  g.push_back({"MoE tp2", layout({.tp = 2, .moe = true})});
  g.push_back({"MoE dp2.tp2+sp ep2 ZeRO-1", layout({.dp = 2, .tp = 2, .sp = true, .zero = 1, .moe = true, .ep = 2})});
  g.push_back({"MoE dp2.cp2 ep2 ZeRO-3", layout({.dp = 2, .zero = 3, .cp = 2, .moe = true, .ep = 2})});
  g.push_back({"MoE dp2 ep2 recompute", layout({.dp = 2, .recompute = true, .moe = true, .ep = 2})});
  return g;
}

std::vector<Case> grid() {
  std::vector<Case> g;
  g.push_back({"1 rank", layout({})});
  g.push_back({"dp2", layout({.dp = 2})});
  g.push_back({"tp2", layout({.tp = 2})});
  g.push_back({"tp2+sp", layout({.tp = 2, .sp = true})});
  g.push_back({"tp2+sp vocab 97 (uneven over tp)", layout({.tp = 2, .sp = true}, 32, 97)});
  {  // tp overlap chunks: the same saved tensors at any K (their staging is scratch of one call)
    Case k{"tp2 overlap 4", layout({.tp = 2})};
    k.cfg.options.overlap_chunks = 4;
    g.push_back(k);
    Case u{"tp2+sp overlap 3 (uneven chunks)", layout({.tp = 2, .sp = true})};
    u.cfg.options.overlap_chunks = 3;
    g.push_back(u);
  }
  g.push_back({"pp2 gpipe m4", layout({.pp = 2, .schedule = "gpipe", .microbatches = 4})});
  g.push_back({"pp2 1f1b m4", layout({.pp = 2, .schedule = "1f1b", .microbatches = 4})});
  g.push_back({"pp2 zb_h1 m4", layout({.pp = 2, .schedule = "zb_h1", .microbatches = 4})});
  g.push_back({"pp2 interleaved v2 m4", layout({.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4})});
  g.push_back({"pp2 zb_v m4 width 64 vocab 96", layout({.pp = 2, .schedule = "zb_v", .microbatches = 4}, 64, 96)});
  g.push_back({"pp2 1f1b m4 recompute", layout({.pp = 2, .schedule = "1f1b", .microbatches = 4, .recompute = true})});
  g.push_back({"dp2 ZeRO-1", layout({.dp = 2, .zero = 1})});
  g.push_back({"dp2 ZeRO-2", layout({.dp = 2, .zero = 2})});
  g.push_back({"dp2 ZeRO-3", layout({.dp = 2, .zero = 3})});
  g.push_back({"dp2.pp2 unequal dp shares 6+2", layout({.pp = 2, .dp = 2, .microbatches = 2, .dp_rows = {6, 2}})});
  {
    Case k{"dp4 ZeRO-3 shard_degree 2, buckets of 1500", layout({.dp = 4, .zero = 3, .shard_degree = 2})};
    k.cfg.bucket_elements = 1500;  // units cut into several buckets: the pieces per rank differ
    g.push_back(k);
  }
  {
    Case k{"dp3 ZeRO-2 buckets of 1000 (alignment 48)", layout({.dp = 3, .zero = 2})};
    k.cfg.batch = 12;
    k.cfg.bucket_elements = 1000;
    g.push_back(k);
  }
  {
    Case k{"dp2 ZeRO-1 offload_optimizer", layout({.dp = 2, .zero = 1})};
    k.cfg.offload_optimizer = true;
    g.push_back(k);
  }
  {
    Case k{"dp2 ZeRO-0 offload_optimizer fused (bound)", layout({.dp = 2})};
    k.cfg.offload_optimizer = true;
    k.cfg.fused_update = TrainerConfig::FusedUpdate::previous_clip;
    k.host_optimizer_bound = true;
    g.push_back(k);
  }
  g.push_back({"dp2.tp2.pp2 ZeRO-1 1f1b m2", layout({.pp = 2, .dp = 2, .tp = 2, .zero = 1, .microbatches = 2})});
  g.push_back({"dp2.tp2+sp.pp2 ZeRO-3 zb_v m2 vocab 97",
               layout({.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 3, .schedule = "zb_v", .microbatches = 2}, 32, 97)});
  g.push_back({"dp2.cp2 ring ZeRO-2", layout({.dp = 2, .zero = 2, .cp = 2})});
  g.push_back({"tp2+sp.cp2 ulysses", layout({.tp = 2, .sp = true, .cp = 2, .cp_mode = trellis::nn::CpMode::ulysses})});
  g.push_back({"pp2 local learning m4 (heads tied to wte)", layout({.pp = 2, .schedule = "local_learning", .microbatches = 4})});
  {
    Case k{"dp2.pp2 local learning m2, heads of their own, ZeRO-2",
           layout({.pp = 2, .dp = 2, .zero = 2, .schedule = "local_learning", .microbatches = 2})};
    k.cfg.local_head = TrainerConfig::LocalHead::own;
    g.push_back(k);
  }
  {
    Case k{"pp4 local learning m4, heads of their own, tp2", layout({.pp = 4, .tp = 2, .schedule = "local_learning", .microbatches = 4})};
    k.cfg.local_head = TrainerConfig::LocalHead::own;
    g.push_back(k);
  }
  {
    Case k{"pp2 1f1b m4 offload_activations", layout({.pp = 2, .schedule = "1f1b", .microbatches = 4})};
    k.cfg.offload_activations = true;
    g.push_back(k);
  }
  for (const Case& k : moe_grid()) g.push_back(k);
  return g;
}

void check_case(const Case& k, const std::vector<Measured>& measured) {
  INFO("layout: " << k.name);
  for (const Measured& m : measured) {
    INFO("rank pp " << m.at.pp << " tp " << m.at.tp << " replica " << m.at.replica);
    const MemoryEstimate p = trellis::plan::predict_memory(k.cfg, m.at);
    const auto& u = m.use;
    CHECK(static_cast<double>(u.parameters) == p.parameters);
    CHECK(static_cast<double>(u.gradients) == p.gradients);
    CHECK(static_cast<double>(u.optimizer) == p.optimizer);
    if (k.host_optimizer_bound) {
      CHECK(static_cast<double>(u.host_optimizer) <= p.host_optimizer);
      CHECK(static_cast<double>(u.host_optimizer) >= 0.75 * p.host_optimizer);  // the bound is near: moments dominate
    } else {
      CHECK(static_cast<double>(u.host_optimizer) == p.host_optimizer);
    }
    CHECK(static_cast<double>(u.disk_optimizer) == p.disk_optimizer);
    CHECK(static_cast<double>(u.activations) == p.activations);
    CHECK(static_cast<double>(u.host_activations) == p.host_activations);
    CHECK(static_cast<double>(u.workspace) == p.workspace);
    CHECK(u.activations_peak > 0);
    CHECK(static_cast<double>(u.activations_peak) <= p.activations);
  }
  // The peak: the pipeline rank predicted holds the largest measured total. With MoE layers the
  // prediction adds their own buffers, which the measured totals do not hold: the rank compared
  // is then the largest without them.
  std::vector<double> by_pp(static_cast<std::size_t>(k.cfg.pp), 0.0);
  for (const Measured& m : measured)
    by_pp[static_cast<std::size_t>(m.at.pp)] = std::max(by_pp[static_cast<std::size_t>(m.at.pp)], static_cast<double>(m.use.total()));
  const auto peak = trellis::plan::predict_peak_memory(k.cfg);
  int counted = 0;
  for (int r = 1; r < k.cfg.pp; ++r) {
    const MemoryEstimate a = trellis::plan::predict_memory(k.cfg, r), b = trellis::plan::predict_memory(k.cfg, counted);
    if (a.device_total() - a.moe_activations > b.device_total() - b.moe_activations) counted = r;
  }
  if (k.cfg.model.moe_every == 0) {
    CHECK(peak.memory.moe_activations == 0);
    CHECK(counted == peak.pp_rank);
  }
  CHECK(by_pp[static_cast<std::size_t>(counted)] == *std::max_element(by_pp.begin(), by_pp.end()));
  for (int r = 0; r < k.cfg.pp; ++r) CHECK(trellis::plan::predict_memory(k.cfg, r).device_total() <= peak.memory.device_total());
}

}  // namespace

TEST_CASE("memory model: predict_memory equals Trainer::memory() on every rank of a grid of layouts", "[plan][memory]") {
  for (const Case& k : grid()) check_case(k, run(k.cfg));
}

TEST_CASE("memory model: the disk tier's file and host buffers", "[plan][memory]") {
  TempDir dir("memory-model");
  for (int readahead : {1, 2, 4}) {  // the ring of read-ahead chunks grows the host buffers
    Case k{"dp2 ZeRO-1 moments on disk, buffers of 1000, read-ahead " + std::to_string(readahead),
           layout({.dp = 2, .zero = 1})};
    k.cfg.offload_dir = dir.path;
    k.cfg.offload_buffer_elements = 1000;
    k.cfg.offload_disk_readahead = readahead;
    check_case(k, run(k.cfg));
  }
}

TEST_CASE("memory model: refuses what it does not model, naming it", "[plan][memory]") {
  TrainerConfig bad = layout({.dp = 3});  // batch 8 does not split over 3 dp ranks
  CHECK_THROWS_WITH(trellis::plan::predict_memory(bad, 0), Catch::Contains("--batch"));
}

// The MoE layers' own buffers. By hand first: the tiny model (W 32, E 4, top-2, hidden 4 W = 128
// on one tp rank) on dp2 ep2 at capacity 1: 64 rows per rank (8 / 2 sequences of 16), capacity
// ceil(1 x 64 x 2 / 4) = 32 per expert, so at most 2 sources x 2 experts x 32 = 128 copies
// received and min(64 x 2, 4 x 32) = 128 sent; each buffer of nn/moe.hpp's MoeMlp::Saved listed.
TEST_CASE("memory model: an MoE layer's own buffers, by hand", "[plan][memory][moe]") {
  TrainerConfig c = layout({.dp = 2, .moe = true, .ep = 2, .capacity = 1.0f});
  const double rows = 64, W = 32, E = 4, k = 2, H = 128, received = 128, sent = 128;
  const double x = rows * W, probs = rows * E, lse = rows, expert = rows * k, gate = rows * k, slot = rows * k,
               source_row = rows * k, dlogits = rows * E;
  const double xe = received * W, pre = received * H, h = received * H, dye = received * W, dh = received * H;
  const double by_expert = received, by_source = received, yp = sent * W;
  const double layer = 4 * (x + probs + lse + expert + gate + slot + source_row + dlogits + xe + pre + h + dye + dh +
                            by_expert + by_source + yp);
  const MemoryEstimate p = trellis::plan::predict_memory(c, RankCoords{0, 0, 1});
  CHECK(p.moe_activations == 2 * layer);  // two MoE blocks (0 and 2), one live microbatch
  // dropless: the balanced count, rows x k = 128 each way, here the same as at capacity 1
  c.options.moe_capacity = 0;
  CHECK(trellis::plan::predict_memory(c, RankCoords{0, 0, 1}).moe_activations == 2 * layer);
  // capacity 2: every copy can reach one rank (2 sources x 2 experts x min(64, 64) = 256 received)
  c.options.moe_capacity = 2;
  const double more = layer + 4 * (received * (2 * W + 3 * H + 2));
  CHECK(trellis::plan::predict_memory(c, RankCoords{0, 0, 1}).moe_activations == 2 * more);
  // a pipeline keeps a stage's MoE buffers for each live microbatch: 1f1b m4, stage 0 holds 2
  TrainerConfig piped = layout({.pp = 2, .schedule = "1f1b", .microbatches = 4, .moe = true, .capacity = 1.0f});
  const double r = 2 * 16, cap = 16;  // 8 / 4 sequences of 16 rows; capacity ceil(32 x 2 / 4)
  const double one = trellis::plan::memory_detail::moe_layer_bytes(r, 4 * cap, std::min(r * k, E * cap), W, H, E, k, 1);
  CHECK(trellis::plan::predict_memory(piped, 0).moe_activations == 2 * one);
  CHECK(trellis::plan::predict_memory(piped, 1).moe_activations == 1 * one);
}

// Against the routing: one step, one microbatch, then every rank's MoE layers' copies received and
// sent computed from the load() of the ranks of its ep group (the copies before dropping, kept up
// to the capacity per expert and source, as the dispatch plan keeps them). With a capacity factor
// the prediction is an upper bound: it must hold on every rank (margin: none needed, it is the
// most the capacity allows). Dropless it is the balanced mean; the measured may exceed it: it
// must stay within the worst case (every copy of every source to one rank's experts), and for
// this seeded model within 10 % of the balanced figure (a margin for this model, not a bound).
TEST_CASE("memory model: the MoE layers' buffers bound the routing's", "[plan][memory][moe]") {
  struct MoeCase {
    std::string name;
    TrainerConfig cfg;
  };
  std::vector<MoeCase> cases;
  cases.push_back({"dp2 ep2 capacity 1", layout({.dp = 2, .moe = true, .ep = 2, .capacity = 1.0f})});
  cases.push_back({"dp4 ep2 capacity 1.25 top-1", layout({.dp = 4, .moe = true, .ep = 2, .capacity = 1.25f})});
  cases.back().cfg.model.moe_topk = 1;
  cases.push_back({"dp2 ep1 capacity 1.5", layout({.dp = 2, .moe = true, .capacity = 1.5f})});
  cases.push_back({"dp2 ep2 dropless", layout({.dp = 2, .moe = true, .ep = 2})});
  for (const MoeCase& k : cases) {
    INFO("layout: " << k.name);
    const TrainerConfig& c = k.cfg;
    const std::vector<Measured> measured = run(c);
    const double rows = static_cast<double>(c.batch / c.dp * c.seq), W = static_cast<double>(c.model.width);
    const double E = static_cast<double>(c.model.experts), topk = static_cast<double>(c.model.moe_topk);
    const int El = static_cast<int>(c.model.experts) / c.ep;
    const bool dropless = c.options.moe_capacity <= 0;
    const auto cap = static_cast<std::int64_t>(
        dropless ? 1 << 30 : std::ceil(static_cast<double>(c.options.moe_capacity) * rows * topk / E));
    for (const Measured& m : measured) {
      INFO("dp rank " << m.dp);
      double bytes = 0, worst = 0;
      for (std::size_t l = 0; l < m.moe_load.size(); ++l) {
        double sent = 0, received = 0;
        for (int e = 0; e < static_cast<int>(E); ++e) sent += static_cast<double>(std::min(m.moe_load[l][e], cap));
        for (const Measured& src : measured)  // the sources: the ranks of this rank's ep group
          if (src.dp / c.ep == m.dp / c.ep && src.at.tp == m.at.tp)
            for (int e = m.dp % c.ep * El; e < (m.dp % c.ep + 1) * El; ++e)
              received += static_cast<double>(std::min(src.moe_load[l][e], cap));
        bytes += trellis::plan::memory_detail::moe_layer_bytes(rows, received, sent, W, 4 * W, E, topk, c.ep);
        worst += trellis::plan::memory_detail::moe_layer_bytes(rows, c.ep * rows * std::min<double>(topk, El), rows * topk,
                                                               W, 4 * W, E, topk, c.ep);
      }
      CHECK(m.moe_load.size() == 2);
      const double predicted = trellis::plan::predict_memory(c, m.at).moe_activations;
      INFO("measured " << bytes << " predicted " << predicted);
      CHECK(bytes > 0);
      if (dropless) {
        CHECK(bytes <= worst);
        // the balanced figure is near for this seeded model (measured: within 1.5 %); a margin of 10 %
        CHECK(bytes <= 1.10 * predicted);
        CHECK(bytes >= 0.90 * predicted);
      } else {
        CHECK(bytes <= predicted);
      }
    }
  }
}
