// Devices that share a machine (plan::Rates::shared_by and alone; thread ranks on one CPU): a
// pipeline's actions charged between the rates of one device computing alone and of all of them
// at once, by how many of the node's devices compute beside each (plan::detail::shared_node_costs,
// predict_step). References: hand cases of the blend; a pipeline that never computes on two
// ranks at once predicted exactly as with the alone rates; layouts without such pipelines
// exactly as without them.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <vector>

#include "trellis/backend/device_checked.hpp"
#include "trellis/comm/simulated_link.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/plan/measured_link.hpp"
#include "trellis/plan/measured_rates.hpp"
#include "trellis/plan/search.hpp"

using namespace trellis;

namespace {

pipe::TimedAction compute(int rank, int mb, double start, double end) {
  return {rank, pipe::Action{.kind = pipe::ActionKind::forward, .microbatch = mb}, start, end};
}

// Rates that take `factor` times the time of r.
plan::Rates scaled(const plan::Rates& r, double factor) {
  plan::Rates s = r;
  s.gemm = [=](double m, double n, double k, plan::GemmForm f) { return factor * r.gemm(m, n, k, f); };
  s.attention_forward = [=](double b, double h, double t, double d) { return factor * r.attention_forward(b, h, t, d); };
  s.attention_backward = [=](double b, double h, double t, double d) { return factor * r.attention_backward(b, h, t, d); };
  s.layernorm = [=](double rows, double dim, bool bwd) { return factor * r.layernorm(rows, dim, bwd); };
  s.gelu = [=](double n, bool bwd) { return factor * r.gelu(n, bwd); };
  s.cross_entropy = [=](double rows, double cols, bool bwd) { return factor * r.cross_entropy(rows, cols, bwd); };
  s.memory = [=](double bytes) { return factor * r.memory(bytes); };
  s.adamw = [=](double n) { return factor * r.adamw(n); };
  return s;
}

plan::Cluster one_node(int devices, int nodes = 1) {
  plan::Cluster c;
  c.name = "shared test node";
  c.nodes = nodes;
  c.devices_per_node = devices;
  c.device = {.name = "core", .memory_bytes = 64e9, .peak_flops_fp32 = 1e11, .peak_flops_bf16 = 1e11,
              .memory_bandwidth = 2e10};
  c.intra_node = c.inter_node = {.bandwidth = 1e10, .latency = 1e-5};
  return c;
}

train::TrainerConfig model() {
  train::TrainerConfig c;
  c.model = {.vocab = 512, .positions = 64, .layers = 4, .heads = 4, .width = 128};
  c.seq = 64;
  c.batch = 8;
  return c;
}

}  // namespace

TEST_CASE("shared_node_costs: each action between alone and shared by the node's devices computing beside it",
          "[cost][shared]") {
  pipe::Timeline t;
  t.stages = 3;
  // rank 0 computes [0, 10); rank 1 computes [5, 10) and [12, 20); rank 2 [0, 20)
  t.events = {compute(0, 0, 0, 10), compute(1, 0, 5, 10), compute(1, 1, 12, 20), compute(2, 0, 0, 20)};
  auto alone = [](int, const pipe::Action&) { return 1.0; };
  auto shared = [](int, const pipe::Action&) { return 3.0; };
  auto at = [](const std::map<plan::detail::ActionKey, double>& cost, int rank, int mb) {
    return cost.at(plan::detail::action_key(rank, pipe::Action{.kind = pipe::ActionKind::forward, .microbatch = mb}));
  };
  {  // one device per rank, 2 per node: ranks 0 and 1 share a node, rank 2 has its own; timed 2 at once
    const auto cost = plan::detail::shared_node_costs(t, 1, 2, 2, shared, alone);
    CHECK(at(cost, 0, 0) == Approx(1 + 2 * 0.5));        // rank 1 computes half of [0, 10)
    CHECK(at(cost, 1, 0) == Approx(3.0));                // rank 0 computes all of [5, 10)
    CHECK(at(cost, 1, 1) == Approx(1.0));                // nobody beside it
    CHECK(at(cost, 2, 0) == Approx(1.0));                // alone on its node
  }
  {  // 2 devices per rank, 6 per node (all three share), timed with 6 at once: 2 + 2 x (busy fractions)
    const auto cost = plan::detail::shared_node_costs(t, 2, 6, 6, shared, alone);
    CHECK(at(cost, 0, 0) == Approx(1 + 2 * (2 + 2 * 0.5 + 2 * 1.0 - 1) / 5));
    CHECK(at(cost, 1, 1) == Approx(1 + 2 * (2 + 0 + 2 * 1.0 - 1) / 5));
    CHECK(at(cost, 2, 0) == Approx(1 + 2 * (2 + 2 * 0.5 + 2 * 13.0 / 20 - 1) / 5));
  }
}

TEST_CASE("predict_step on a shared node: alone where one rank computes at a time, shared where all do", "[cost][shared]") {
  const plan::Cluster node = one_node(2);
  plan::Rates shared = plan::cluster_rates(node, plan::Precision::fp32);
  const plan::Rates alone = scaled(shared, 0.5);
  plan::Rates both = shared;
  both.shared_by = 2;
  both.alone = std::make_shared<const plan::Rates>(alone);

  train::TrainerConfig c = model();
  c.pp = 2;
  c.schedule = "gpipe";
  c.microbatches = 1;
  // one microbatch: F on rank 0, F and B on rank 1, B on rank 0 -- never two at once
  const plan::StepCost one = plan::predict_step(c, node, both);
  CHECK(one.pipeline == Approx(plan::predict_step(c, node, alone).pipeline).epsilon(1e-12));
  CHECK(one.pipeline < 0.6 * plan::predict_step(c, node, shared).pipeline);

  // many microbatches: both ranks compute most of the time, so between the two, nearer the shared
  c.schedule = "1f1b";
  c.microbatches = 8;
  const double with_alone = plan::predict_step(c, node, alone).pipeline,
               with_shared = plan::predict_step(c, node, shared).pipeline, blended = plan::predict_step(c, node, both).pipeline;
  CHECK(blended > with_alone * 1.2);
  CHECK(blended < with_shared * 0.99);
  CHECK(blended > (with_alone + with_shared) / 2);

  // pipeline ranks on nodes of their own share nothing: the shared rates as they are
  const plan::Cluster apart = one_node(1, 2);
  CHECK(plan::predict_step(c, apart, both).step == plan::predict_step(c, apart, shared).step);
  // no pipeline: every rank computes at once
  c.pp = 1;
  c.dp = 2;
  CHECK(plan::predict_step(c, node, both).step == plan::predict_step(c, node, shared).step);
}

TEST_CASE("predict_step on a shared node: the search's bound never exceeds the prediction", "[cost][shared]") {
  const plan::Cluster node = one_node(4);
  plan::Rates both = plan::cluster_rates(node, plan::Precision::fp32);
  both.shared_by = 4;
  both.alone = std::make_shared<const plan::Rates>(scaled(both, 0.4));
  plan::SearchSpace space;
  space.max_microbatches = 8;
  int piped = 0;
  for (const auto& c : plan::layouts(model(), node.devices(), 4, space)) {
    if (!train::config_problems(c).empty()) continue;
    const plan::StepCost full = plan::predict_step(c, node, both), bound = plan::predict_step(c, node, both, 0.0);
    CHECK(bound.step <= full.step * (1 + 1e-12));
    piped += c.pp > 1;
  }
  CHECK(piped > 20);
}

TEST_CASE("MeasuredRates with concurrent copies times each shape alone too", "[cost][shared]") {
  plan::MeasuredRates measured(1, 2);
  const plan::Rates r = measured.rates();
  REQUIRE(r.shared_by == 2);
  REQUIRE(r.alone != nullptr);
  REQUIRE(measured.alone() != nullptr);
  CHECK(r.alone->shared_by == 1);
  CHECK(r.alone->alone == nullptr);
  // the alone view reads the alone table: a shape timed through it lands there, not in the shared one
  const double a = r.alone->gemm(64, 64, 64, plan::GemmForm::nn);
  CHECK(a == measured.alone()->gemm(64, 64, 64, plan::GemmForm::nn));
  CHECK(a > 0);
  CHECK(plan::MeasuredRates(1, 1).rates().alone == nullptr);
}

TEST_CASE("MeasuredRates::retime times every shape again and keeps the faster", "[cost][shared]") {
  plan::MeasuredRates measured(1, 2);
  const plan::Rates r = measured.rates();
  const double g = r.gemm(96, 64, 32, plan::GemmForm::tn), a = r.attention_forward(1, 2, 64, 16);
  const double per_byte = r.memory(1.0), alone = r.alone->gemm(96, 64, 32, plan::GemmForm::tn);
  REQUIRE(measured.timings() == 3);
  REQUIRE(measured.alone()->timings() == 1);
  measured.retime();
  CHECK(measured.timings() == 6);  // each shape timed once more
  CHECK(measured.alone()->timings() == 2);
  CHECK(r.gemm(96, 64, 32, plan::GemmForm::tn) <= g);
  CHECK(r.attention_forward(1, 2, 64, 16) <= a);
  CHECK(r.memory(1.0) <= per_byte);
  CHECK(r.alone->gemm(96, 64, 32, plan::GemmForm::tn) <= alone);
  CHECK(measured.timings() == 6);  // and remembered: asking again times nothing
}

TEST_CASE("MeasuredRates and measure_link on a device-like backend: device buffers only, one copy", "[cost][shared]") {
  // backend::DeviceChecked: host kernels behind a device's rules (buffers not host-readable,
  // every kernel pointer one of its allocations), so the GPU timing path runs here
  using Checked = backend::DeviceChecked<backend::Host<float>>;
  plan::BasicMeasuredRates<Checked> dev(1, 1);
  const plan::Rates r = dev.rates();
  for (auto form : {plan::GemmForm::nn, plan::GemmForm::nt, plan::GemmForm::tn}) {
    const double t = r.gemm(256, 192, 128, form);
    CHECK((t > 0 && std::isfinite(t)));
  }
  for (const double t : {r.attention_forward(1, 2, 128, 64), r.attention_backward(1, 2, 128, 64),
                         r.layernorm(512, 256, false), r.layernorm(512, 256, true), r.gelu(1 << 16, false),
                         r.gelu(1 << 16, true), r.cross_entropy(128, 1024, false), r.cross_entropy(128, 1024, true),
                         r.memory(1e6), r.adamw(1e6)})
    CHECK((t > 0 && std::isfinite(t)));
  const int timed = dev.timings();
  CHECK(timed == 13);  // 3 GEMMs, 2 attention, 2 norms, 2 GELU, 2 cross-entropy, the memory pass, AdamW
  dev.retime();
  CHECK(dev.timings() == 2 * timed);
  // a device's rates: no host optimizer or host copy of its own, no collective copies on its cores
  CHECK(!r.host_adamw);
  CHECK(!r.host_copy);
  CHECK(r.collective_copy_bytes == 0);
  CHECK_THROWS_WITH(plan::BasicMeasuredRates<Checked>(1, 2), Catch::Contains("concurrent = 2"));
  // the link through the backend's buffers: the simulated link's bandwidth found again
  const comm::LinkModel model{.bandwidth = 1e9, .latency = 1e-3};
  std::vector<plan::LinkFit> fits(2);
  comm::ThreadWorld(2).run([&](comm::ThreadComm& world) {
    comm::SimulatedLink<comm::ThreadComm> c(world.split(0, world.rank()), model);
    Checked be;
    fits[static_cast<std::size_t>(world.rank())] = plan::measure_link(be, c);
  });
  CHECK(fits[0].link.bandwidth == Approx(model.bandwidth).epsilon(0.1));
  CHECK(fits[0].link.latency >= 0.8 * model.latency);  // (a loaded machine can tilt the fit a little)
  CHECK(fits[0].link == fits[1].link);
}
