// train_gpt's training loop (examples/train_gpt/run.hpp) on thread ranks, a tiny model and a
// small text file: what a user sees around checkpoints. Each case compares with a run it made
// itself (the rows and losses of an uninterrupted run, the directories a policy must leave).
//  - a crash after logging steps past the last checkpoint, then --resume: metrics.jsonl holds
//    every step once, and the re-trained steps' losses equal the uninterrupted run's;
//  - --keep-last 2 leaves the newest two step directories;
//  - resuming a finished run trains nothing and says so (no "train loss -1.0000 -> 0.0000");
//  - data too small or empty: the error names the file and the flags;
//  - --pack over dp 2: resumes to the same bits as the uninterrupted packed run;
//  - --plan auto with a Mixture-of-Experts model: the planned layout keeps the model's experts,
//    with an ep the trainer and train_gpt's flags accept; it and the fastest planned ep 2 layout
//    train (the loss falls) and their MFU counts the FLOPs a token really does (top-k experts),
//    worked out by hand.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "temp_dir.hpp"
#include "train_gpt/flags.hpp"
#include "train_gpt/plan_auto.hpp"
#include "train_gpt/run.hpp"

namespace {

namespace fs = std::filesystem;

// Text with structure: enough for 5000 tokens (bytes).
std::string corpus_text() {
  std::string s;
  for (int i = 0; s.size() < 5000; ++i) s += "the cat " + std::to_string(i % 37) + " sat on mat " + std::to_string(i % 11) + ". ";
  return s;
}

train_gpt::Options tiny(const TempDir& dir) {
  train_gpt::Options o;
  o.layers = 1;
  o.heads = 2;
  o.width = 16;
  o.context = 16;
  o.batch = 4;
  o.microbatches = 1;
  o.steps = 4;
  o.warmup = 1;
  o.eval_every = 2;
  o.sample_tokens = 0;
  o.peak_gflops = 1;  // no sgemm measurement
  o.data = (dir.path / "corpus.txt").string();
  o.ckpt_dir = (dir.path / "ckpt").string();
  o.log = (dir.path / "metrics.jsonl").string();
  if (!fs::exists(o.data)) std::ofstream(o.data) << corpus_text();
  return o;
}

train_gpt::Outcome run(const train_gpt::Options& o) {
  train_gpt::validate(o);
  const train_gpt::Data data = train_gpt::load_data(o);
  train_gpt::Outcome out;
  trellis::comm::ThreadWorld world(o.dp * o.tp * o.pp * o.cp);
  world.run([&](trellis::comm::ThreadComm& comm) { train_gpt::run_rank(comm, o, data, o.peak_gflops * 1e9, out); });
  return out;
}

// step -> loss of every row (a step twice fails).
std::map<std::int64_t, double> rows(const std::string& log) {
  std::map<std::int64_t, double> out;
  for (const auto& row : trellis::train::read_metrics(log)) {
    const auto step = static_cast<std::int64_t>(row.find("step")->as_double());
    INFO("step " << step);
    CHECK(out.count(step) == 0);
    out[step] = row.find("loss")->as_double();
  }
  return out;
}

std::vector<std::string> step_dirs(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory()) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("train_gpt: after a crash and --resume, metrics.jsonl holds every step once", "[train][train_gpt][resume]") {
  TempDir dir("train-gpt-metrics");
  auto o = tiny(dir);
  o.ckpt_every = 2;
  run(o);  // steps 1..4; checkpoints at 2 and 4
  const auto straight = rows(o.log);
  REQUIRE(straight.size() == 4);
  // A crash after step 4 was logged but before it was saved: step 2 is the newest checkpoint.
  fs::remove_all(fs::path(o.ckpt_dir) / "step-00000004");
  trellis::io::write_file_atomically(fs::path(o.ckpt_dir) / "latest", "step-00000002\n");
  std::ofstream(o.log, std::ios::app) << "{\"step\": 5, \"loss\": 1.0, \"to";  // and a row torn by the crash
  o.resume = true;
  const auto out = run(o);
  CHECK(out.steps_done == 2);
  const auto resumed = rows(o.log);
  REQUIRE(resumed.size() == 4);
  for (const auto& [step, loss] : straight) {
    INFO("step " << step);
    CHECK(resumed.at(step) == loss);  // steps 3 and 4 re-trained from the checkpoint: the same bits
  }
}

TEST_CASE("train_gpt --pack: packed rows train over dp 2 and resume to the same bits", "[train][train_gpt][packed]") {
  TempDir dir("train-gpt-pack");
  auto o = tiny(dir);
  o.pack = 'h';  // a document per sentence of corpus_text ("the cat ..."), longer ones cut at 16
  o.dp = 2;
  o.ckpt_every = 2;
  const auto straight_out = run(o);
  REQUIRE(straight_out.steps_done == 4);
  const auto straight = rows(o.log);
  REQUIRE(straight.size() == 4);
  fs::remove_all(fs::path(o.ckpt_dir) / "step-00000004");
  trellis::io::write_file_atomically(fs::path(o.ckpt_dir) / "latest", "step-00000002\n");
  o.resume = true;
  run(o);
  const auto resumed = rows(o.log);
  for (const auto& [step, loss] : straight) {
    INFO("step " << step);
    CHECK(resumed.at(step) == loss);
  }
  // Packing changes what is trained on: the first loss differs from the unpacked run's.
  TempDir plain_dir("train-gpt-nopack");
  auto plain = tiny(plain_dir);
  plain.dp = 2;
  CHECK(run(plain).first_loss != straight_out.first_loss);
}

TEST_CASE("train_gpt: --keep-last N keeps the newest N step directories", "[train][train_gpt][checkpoint]") {
  TempDir dir("train-gpt-keep");
  auto o = tiny(dir);
  o.ckpt_every = 1;
  o.keep_last = 2;
  run(o);
  CHECK(step_dirs(o.ckpt_dir) == std::vector<std::string>{"step-00000003", "step-00000004"});
  CHECK(*trellis::train::latest_checkpoint(o.ckpt_dir) == fs::path(o.ckpt_dir) / "step-00000004");
  o.keep_last = 0;  // without the flag nothing is removed
  o.steps = 6;
  o.resume = true;
  run(o);
  CHECK(step_dirs(o.ckpt_dir) ==
        std::vector<std::string>{"step-00000003", "step-00000004", "step-00000005", "step-00000006"});
}

TEST_CASE("train_gpt: resuming a finished run trains nothing and says so", "[train][train_gpt][resume]") {
  TempDir dir("train-gpt-finished");
  auto o = tiny(dir);
  const auto first = run(o);
  REQUIRE(first.steps_done == 4);
  o.resume = true;
  const auto again = run(o);
  CHECK(again.steps_done == 0);
  CHECK(again.first_step == 4);
  const train_gpt::Data data = train_gpt::load_data(o);
  const std::string line = train_gpt::summary(o, data, again);
  CHECK(line.find("nothing to train: the checkpoint is at step 4 and --steps is 4") != std::string::npos);
  CHECK(line.find("-1.0000") == std::string::npos);
  CHECK(train_gpt::summary(o, data, first).find("trained 4 steps") != std::string::npos);
  CHECK(again.val_loss == first.val_loss);  // the same weights, evaluated again
}

TEST_CASE("train_gpt: data that is empty or too small is refused naming the file and flags",
          "[train][train_gpt][errors]") {
  TempDir dir("train-gpt-data");
  auto o = tiny(dir);
  const std::string empty = (dir.path / "empty.txt").string();
  std::ofstream(empty).close();
  o.data = empty;
  CHECK_THROWS_WITH(train_gpt::load_data(o), Catch::Contains("--data " + empty + " holds no tokens"));
  const std::string small = (dir.path / "small.txt").string();
  std::ofstream(small) << corpus_text().substr(0, 400);  // 360 + 40 tokens: 22 + 2 windows of 16 + 1
  o.data = small;
  CHECK_THROWS_WITH(train_gpt::load_data(o), Catch::Contains("--data " + small) && Catch::Contains("--val-fraction 0.1") &&
                                                 Catch::Contains("2 windows") && Catch::Contains("--batch 4"));
}

TEST_CASE("train_gpt: without --peak-gflops, MFU is against the machine peak of --dtype, sgemm beside it",
          "[train][train_gpt][mfu]") {
  using namespace trellis::kernels::host;
  // The reference: the dtype's peak worked out from the measured clock and FMA units (bf16: AMX's
  // 1024 FLOP per cycle per core, or 2x / 1x the fp32 FMAs' lanes x units x 2).
  const train_gpt::HostPeak fp32 = train_gpt::host_mfu_reference("fp32");
  const train_gpt::HostPeak bf16 = train_gpt::host_mfu_reference("bf16");
  const CpuFeatures f = cpu_features();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  INFO(fp32.note << " | " << bf16.note);
  CHECK(fp32.note.starts_with("fp32 machine peak; "));
  CHECK(bf16.note.starts_with("bf16 machine peak; "));
  CHECK(fp32.cpu.threads == cores);
  CHECK(fp32.peak == Approx(cores * fp32.cpu.clock_hz * 2.0 * fp32_lanes(f) * fp32.cpu.fma_units));
  const double bf16_per_cycle = f.amx_bf16 ? 1024.0 : (f.avx512_bf16 ? 2.0 : 1.0) * 2.0 * fp32_lanes(f) * bf16.cpu.fma_units;
  CHECK(bf16.peak == Approx(cores * bf16.cpu.clock_hz * bf16_per_cycle));
  CHECK(fp32.peak > 1e9);
#if defined(TRELLIS_HAS_CBLAS)
  CHECK(fp32.blas > 0);
  CHECK(fp32.blas < 1.2 * fp32.peak);  // a BLAS above the machine's peak would mean a wrong peak
#endif

  // A run without --peak-gflops logs MFU against that peak and, with a BLAS, mfu_sgemm beside it:
  // the same model FLOP/s over the two rates, so mfu_sgemm / mfu = peak / sgemm > 1.
  TempDir dir("train-gpt-mfu");
  auto o = tiny(dir);
  o.peak_gflops = 0;
  o.steps = 2;
  run(o);
  const auto metrics = trellis::train::read_metrics(o.log);
  REQUIRE(metrics.size() == 2);
  for (const auto& row : metrics) {
    const double mfu = row.find("mfu")->as_double();
    CHECK(mfu > 0);
    CHECK(mfu < 1);
#if defined(TRELLIS_HAS_CBLAS)
    REQUIRE(row.find("mfu_sgemm") != nullptr);
    CHECK(row.find("mfu_sgemm")->as_double() > mfu);
#endif
  }
}

TEST_CASE("train_gpt: --resume with another --seed names the checkpoint and the flag", "[train][train_gpt][resume]") {
  TempDir dir("train-gpt-seed");
  auto o = tiny(dir);
  o.steps = 2;
  run(o);
  o.resume = true;
  o.steps = 3;
  o.seed = 1;  // saved with 1234
  REQUIRE_THROWS_WITH(run(o), Catch::Contains("--resume from") && Catch::Contains("step-00000002") &&
                                  Catch::Contains("data seed 1234, this loader uses 1") && Catch::Contains("--seed"));
}

TEST_CASE("train_gpt --plan auto: an MoE model is planned with ep, trains, and its MFU counts top-k experts",
          "[train][train_gpt][plan][moe]") {
  TempDir dir("train-gpt-plan-moe");
  auto o = tiny(dir);
  o.layers = 2;  // block 0: 4 experts, top-2; block 1 dense
  o.experts = 4;
  o.topk = 2;
  o.moe_every = 2;
  o.steps = 10;
  o.eval_every = 5;
  o.plan = "auto";
  o.ranks = 2;
  REQUIRE(train_gpt::problems(o).empty());
  const train_gpt::Options planned = train_gpt::apply_plan(o);
  const trellis::train::TrainerConfig c = train_gpt::trainer_config(planned);
  const std::string flags = trellis::plan::train_gpt_flags(c);
  INFO("planned: " << flags << " (ep " << planned.ep << ")");
  CHECK(planned.plan.empty());
  CHECK(planned.dp * planned.tp * planned.pp * planned.cp == 2);
  CHECK(c.model.experts == 4);
  CHECK(c.model.moe_topk == 2);
  CHECK(c.model.moe_every == 2);
  CHECK(c.ep == planned.ep);
  CHECK(planned.dp % planned.ep == 0);
  CHECK(4 % planned.ep == 0);
  CHECK(train_gpt::problems(planned).empty());
  CHECK(trellis::train::config_problems(c).empty());
  // the planner's flags, after the model's, parse back into the same layout (ep included)
  std::vector<std::string> args = {"--layers", "2", "--heads", "2", "--width", "16", "--context", "16",
                                   "--batch", "4", "--experts", "4", "--topk", "2", "--moe-every", "2"};
  std::istringstream words(flags);
  for (std::string w; words >> w;) args.push_back(w);
  const train_gpt::Options back = train_gpt::parse_flags(args);
  CHECK(train_gpt::problems(back).empty());
  CHECK(back.ep == planned.ep);
  CHECK(back.dp == planned.dp);
  CHECK(back.tp == planned.tp);
  CHECK(back.pp == planned.pp);

  const train_gpt::Outcome out = run(planned);
  CHECK(out.steps_done == 10);
  std::printf("plan auto MoE (%s): loss %.4f -> %.4f, val %.4f\n", flags.c_str(), out.first_loss, out.last_loss,
              out.val_loss);
  CHECK(out.last_loss < out.first_loss - 0.5);
  CHECK(out.val_loss > 0);
  CHECK(out.val_loss < out.first_loss);

  // MFU: flops per token = mfu x peak (1 GFLOP/s) / tokens per second, against 6N + 12 L W T with N
  // the parameters a token uses, counted by hand: wte, wpe, ln_f; block 1 dense (12 W^2 + 13 W);
  // block 0 its norms and attention (4 W^2 + 8 W), the router (W E) and 2 of the 4 experts
  // (8 W^2 + 5 W each)
  const double W = 16, V = 256, T = 16, E = 4, k = 2;
  const double active = V * W + T * W + 2 * W + (12 * W * W + 13 * W) + (4 * W * W + 8 * W + W * E + k * (8 * W * W + 5 * W));
  const double per_token = 6 * active + 12 * 2 * W * T;
  const auto metrics = trellis::train::read_metrics(o.log);
  REQUIRE(metrics.size() == 10);
  for (const auto& row : metrics)
    CHECK(row.find("mfu")->as_double() * 1e9 / row.find("tokens_per_s")->as_double() == Approx(per_token).epsilon(1e-9));

  // the fastest planned layout that splits the experts (ep 2) runs too, as train_gpt takes it
  const trellis::plan::Plan p = train_gpt::plan_layouts(o, 16);
  const trellis::plan::Candidate* split = nullptr;
  for (const auto& cand : p.best)
    if (!split && cand.config.ep > 1) split = &cand;
  REQUIRE(split != nullptr);
  train_gpt::Options ep = o;
  train_gpt::adopt_layout(ep, split->config);
  INFO("ep layout: " << trellis::plan::train_gpt_flags(split->config));
  CHECK(ep.ep == 2);
  CHECK(ep.dp == 2);
  CHECK(train_gpt::problems(ep).empty());
  fs::remove_all(dir.path / "ckpt");
  fs::remove(o.log);
  const train_gpt::Outcome split_out = run(ep);
  std::printf("plan auto MoE, ep layout (%s): loss %.4f -> %.4f, val %.4f\n",
              trellis::plan::train_gpt_flags(split->config).c_str(), split_out.first_loss, split_out.last_loss,
              split_out.val_loss);
  CHECK(split_out.steps_done == 10);
  CHECK(split_out.last_loss < split_out.first_loss - 0.5);
  CHECK(split_out.val_loss < split_out.first_loss);
  const auto split_metrics = trellis::train::read_metrics(o.log);
  REQUIRE(split_metrics.size() == 10);
  for (const auto& row : split_metrics)
    CHECK(row.find("mfu")->as_double() * 1e9 / row.find("tokens_per_s")->as_double() == Approx(per_token).epsilon(1e-9));
}
