// plan::predict_memory against what train::Trainer really allocates: a grid of layouts of a small
// GPT (4 layers, 4 heads, width 32 or 64, vocab 64, 96 or 97), each run for one step on thread
// ranks, then on every rank Trainer::memory() compared with predict_memory(cfg, that rank's
// coordinates) field by field. Tolerance: none -- these are allocation sizes, and the model
// follows the trainer's packing, shard and arena rules, so every field must be equal to the byte
// (one exception, stated at its case: the fused update's offloaded staging is predicted as an
// upper bound). tp overlap chunks are in the grid: they change no field. Also: the measured
// activation peak is > 0 and within the predicted reserve, and predict_peak_memory names a
// pipeline rank whose measured total is the largest.
#include <catch2/catch.hpp>

#include <algorithm>
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
  trellis::train::MemoryUse use;
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
    m.use = t.memory();
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
  // The peak: the pipeline rank predicted holds the largest measured total.
  std::vector<double> by_pp(static_cast<std::size_t>(k.cfg.pp), 0.0);
  for (const Measured& m : measured)
    by_pp[static_cast<std::size_t>(m.at.pp)] = std::max(by_pp[static_cast<std::size_t>(m.at.pp)], static_cast<double>(m.use.total()));
  const auto peak = trellis::plan::predict_peak_memory(k.cfg);
  CHECK(by_pp[static_cast<std::size_t>(peak.pp_rank)] == *std::max_element(by_pp.begin(), by_pp.end()));
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
  TrainerConfig moe = layout({.moe = true});
  CHECK_THROWS_WITH(trellis::plan::predict_memory(moe, 0), Catch::Contains("Mixture-of-Experts"));
  TrainerConfig bad = layout({.dp = 3});  // batch 8 does not split over 3 dp ranks
  CHECK_THROWS_WITH(trellis::plan::predict_memory(bad, 0), Catch::Contains("--batch"));
}
