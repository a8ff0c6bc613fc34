// train_gpt's command line (examples/train_gpt/flags.hpp) and the trainer's layout checks: every
// bad flag or inconsistent layout is refused with a message naming what to change.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "train_gpt/flags.hpp"

using train_gpt::Options;
using train_gpt::parse_flags;

namespace {
std::string error_of(const std::vector<std::string>& args, std::optional<int> world = std::nullopt) {
  try {
    train_gpt::validate(parse_flags(args), world);
  } catch (const trellis::Error& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("flags parse into options", "[train][flags]") {
  auto o = parse_flags({"--dp", "2", "--tp=2", "--pp", "2", "--sp", "--zero1", "--schedule", "zb_v", "--lr",
                        "1e-3", "--layers", "6", "--log", "out/m.jsonl", "--seed", "7"});
  CHECK(o.dp == 2);
  CHECK(o.tp == 2);
  CHECK(o.pp == 2);
  CHECK(o.sp);
  CHECK(o.zero1);
  CHECK(o.schedule == "zb_v");
  CHECK(o.lr == Approx(1e-3));
  CHECK(o.layers == 6);
  CHECK(o.log == "out/m.jsonl");
  CHECK(o.seed == 7);
  auto hf = parse_flags({"--init-from", "gpt2/model.safetensors", "--export-hf=out/hf"});
  CHECK(hf.init_from == "gpt2/model.safetensors");
  CHECK(hf.export_hf == "out/hf");
  CHECK(parse_flags({"--help"}).help);
  CHECK(error_of({"--dp", "2", "--tp", "2", "--pp", "2"}).empty());  // the default demo layout is valid
  CHECK(train_gpt::usage().find("--schedule") != std::string::npos);
}

TEST_CASE("malformed flags are refused naming the flag", "[train][flags][errors]") {
  CHECK_THROWS_WITH(parse_flags({"--bogus"}), Catch::Contains("unknown flag '--bogus'"));
  CHECK_THROWS_WITH(parse_flags({"--dp"}), Catch::Contains("--dp needs a value"));
  CHECK_THROWS_WITH(parse_flags({"--dp", "two"}), Catch::Contains("--dp: 'two' is not an integer"));
  CHECK_THROWS_WITH(parse_flags({"--lr", "1e-3x"}), Catch::Contains("--lr: '1e-3x' is not a number"));
}

TEST_CASE("inconsistent layouts are refused saying what to change", "[train][flags][errors]") {
  CHECK(contains(error_of({"--tp", "3"}), "--tp 3 does not divide --heads 4"));
  CHECK(contains(error_of({"--width", "130"}), "--width 130 is not divisible by --heads 4"));
  CHECK(contains(error_of({"--dp", "2", "--tp", "2"}, 8), "mpirun started 8 ranks but dp x tp x pp = 4"));
  CHECK(contains(error_of({"--batch", "10", "--dp", "2", "--microbatches", "2"}),
                 "--batch 10 must be a multiple of dp x microbatches"));
  CHECK(contains(error_of({"--pp", "2", "--schedule", "magic"}), "unknown --schedule 'magic'"));
  CHECK(contains(error_of({"--pp", "2", "--schedule", "local_learning"}), "auxiliary loss"));
  CHECK(contains(error_of({"--pp", "4", "--schedule", "zb_v", "--layers", "4"}),
                 "fewer than the 8 virtual pipeline stages"));
  CHECK(contains(error_of({"--sp"}), "--sp shards the sequence over tp ranks"));
  CHECK(contains(error_of({"--zero1"}), "--zero1 shards the optimizer over dp ranks"));
  CHECK(contains(error_of({"--backend", "cuda"}), "use --backend host"));  // this test is built without CUDA
  CHECK(contains(error_of({"--backend", "cuda"}), "head size 64 or 128"));   // width 128 / 4 heads = 32
  CHECK(contains(error_of({"--backend", "cuda", "--heads", "2", "--dp", "2"}), "use --dp 1"));
  CHECK(contains(error_of({"--backend", "cuda", "--heads", "2", "--tp", "2"}), "use --pp 1 --tp 1"));
  CHECK(contains(error_of({"--backend", "tpu"}), "--backend must be host or cuda"));
  CHECK(contains(error_of({"--resume"}), "--resume needs --ckpt-dir"));
  CHECK(contains(error_of({"--resume", "--ckpt-dir", "c", "--init-from", "m.safetensors"}), "give one of them"));
  CHECK(contains(error_of({"--steps", "5", "--warmup", "8"}), "--warmup must be in [0, --steps)"));
  // several problems are all listed at once
  auto e = error_of({"--tp", "3", "--zero1"});
  CHECK(contains(e, "--tp 3 does not divide"));
  CHECK(contains(e, "--zero1 shards"));
}

TEST_CASE("check_config counts the ranks", "[train][flags][errors]") {
  trellis::train::TrainerConfig c;
  c.dp = 2;
  c.batch = 8;
  CHECK_NOTHROW(trellis::train::check_config(c, 2));
  CHECK_THROWS_WITH(trellis::train::check_config(c, 3),
                    Catch::Contains("start 2 ranks or change the layout"));
}
