// The GPT-2 model over MPI processes (MpiComm): the layers are written against the Communicator
// concept, so the same model must give the 1-rank gradients under mpirun.
//  np 2: tensor parallel over the 2 processes (plain, sp, sp + overlap).
//  np 4: make_mesh<pp, tp>({2, 2}) driven by pipe::execute with ZB-H1 and sp.
// Each process compares its own shards with a 1-rank reference it computes itself (thread
// backend, one rank): |grad - reference| <= 2e-5 * max |reference tensor|.
#include <catch2/catch.hpp>

#include <chrono>
#include <map>

#include "support.hpp"
#include "trellis/comm/mesh.hpp"
#include "trellis/comm/mpi.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/nn/pipeline_stage.hpp"
#include "trellis/pipe/executor.hpp"
#include "trellis/pipe/generators.hpp"

using namespace trellis;
using namespace trellis::nn;
using nn_test::kBatch;
using nn_test::kSeq;
using nn_test::make_ids;

namespace {

constexpr int kMicrobatches = 2;

struct Reference {
  double loss = 0;
  std::map<std::string, std::vector<float>> grad;
};

Reference reference() {
  Reference ref;
  const GptConfig cfg = nn_test::tiny();
  nn_test::run_ranks(1, [&](comm::ThreadComm& comm) {
    GptModel<comm::ThreadComm> model(cfg, comm);
    for (Parameter* p : model.parameters()) nn_test::randomize(*p, 0.05f);
    const double count = nn_test::count_targets(kMicrobatches, cfg.vocab);
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      auto tokens = make_ids("tokens", mb, cfg.vocab), targets = make_ids("targets", mb, cfg.vocab);
      ref.loss += model.forward(mb, {kBatch, kSeq}, {tokens.data(), nullptr, targets.data(), count}, nullptr);
      model.backward_input(mb, {kBatch, kSeq}, nullptr, nullptr);
      model.backward_weight(mb);
    }
    for (Parameter* p : model.parameters()) ref.grad[p->name].assign(p->grad.begin(), p->grad.end());
  });
  return ref;
}

// Largest |grad - reference| relative to the reference tensor's scale, over this rank's shards.
double worst_error(const std::vector<Parameter*>& params, const Reference& ref) {
  double worst = 0;
  for (Parameter* p : params) {
    const auto& want = ref.grad.at(p->name);
    double scale = 1e-30;
    for (float v : want) scale = std::max(scale, std::fabs(static_cast<double>(v)));
    for (index_t i = 0; i < p->numel(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(p->grad[i]) - want[p->global_index(i)]) / scale);
  }
  return worst;
}

}  // namespace

TEST_CASE("GPT-2 on MPI processes equals the 1-rank model", "[nn][gpt][mpi]") {
  const Reference ref = reference();
  const GptConfig cfg = nn_test::tiny();
  const double count = nn_test::count_targets(kMicrobatches, cfg.vocab);
  comm::MpiWorld world;
  world.run([&](comm::MpiComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(30000));
    if (comm.size() == 2) {
      struct Layout {
        bool sp;
        int chunks;
      };
      for (Layout lay : {Layout{false, 1}, Layout{true, 1}, Layout{true, 3}}) {
        GptOptions opt;
        opt.sequence_parallel = lay.sp;
        opt.overlap_chunks = lay.chunks;
        GptModel<comm::MpiComm> model(cfg, comm, opt);
        for (Parameter* p : model.parameters()) nn_test::randomize(*p, 0.05f);
        double loss = 0;
        for (int mb = 0; mb < kMicrobatches; ++mb) {
          auto tokens = make_ids("tokens", mb, cfg.vocab), targets = make_ids("targets", mb, cfg.vocab);
          loss += model.forward(mb, {kBatch, kSeq}, {tokens.data(), nullptr, targets.data(), count}, nullptr);
          model.backward_input(mb, {kBatch, kSeq}, nullptr, nullptr);
          model.backward_weight(mb);
        }
        model.reduce_tp_partial_grads();
        INFO("rank " << comm.rank() << " sp=" << lay.sp << " chunks=" << lay.chunks);
        CHECK(std::fabs(loss - ref.loss) <= 1e-5 * std::fabs(ref.loss));
        CHECK(worst_error(model.parameters(), ref) <= 2e-5);
        CHECK(model.saved_microbatches() == 0);
      }
    } else if (comm.size() == 4) {
      auto mesh = make_mesh<trellis::pp, trellis::tp>(comm, {2, 2});
      auto& tp_comm = mesh.comm<trellis::tp>();
      auto& pp_comm = mesh.comm<trellis::pp>();
      const auto schedule = pipe::make_schedule("zb_h1", 2, kMicrobatches);
      GptOptions opt;
      opt.sequence_parallel = true;
      (void)tp_comm;
      auto model = make_gpt_stage(cfg, mesh, opt);
      for (Parameter* p : model.parameters()) nn_test::randomize(*p, 0.05f);
      std::vector<std::vector<std::int32_t>> tokens, targets;
      std::vector<const std::int32_t*> tok, tgt;
      for (int mb = 0; mb < kMicrobatches; ++mb) {
        tokens.push_back(make_ids("tokens", mb, cfg.vocab));
        targets.push_back(make_ids("targets", mb, cfg.vocab));
      }
      for (int mb = 0; mb < kMicrobatches; ++mb) tok.push_back(tokens[mb].data()), tgt.push_back(targets[mb].data());
      GptPipelineStage<comm::MpiComm> stage({&model}, TokenShape{kBatch, kSeq});
      stage.set_batch(tok, tgt, count);
      pipe::execute(pp_comm, schedule, stage);
      stage.all_reduce_tied_wte_grad(pp_comm);
      model.reduce_tp_partial_grads();
      INFO("rank " << comm.rank() << " pp " << mesh.coord<trellis::pp>() << " tp " << mesh.coord<trellis::tp>());
      if (model.stage().head) CHECK(std::fabs(stage.loss() - ref.loss) <= 1e-5 * std::fabs(ref.loss));
      CHECK(worst_error(model.parameters(), ref) <= 2e-5);
      CHECK(model.saved_microbatches() == 0);
    } else {
      WARN("nn.gpt_mpi runs with 2 or 4 processes; nothing to do for " << comm.size());
    }
  });
}
