// train_gpt's command line (examples/train_gpt/flags.hpp) and the trainer's layout checks: every
// bad flag or inconsistent layout is refused with a message naming what to change.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "temp_dir.hpp"
#include "train_gpt/flags.hpp"
#include "trellis/pipe/generators.hpp"

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
  CHECK(o.zero == 1);
  CHECK(o.schedule == "zb_v");
  CHECK(o.lr == Approx(1e-3));
  CHECK(o.layers == 6);
  CHECK(o.log == "out/m.jsonl");
  CHECK(o.seed == 7);
  auto hf = parse_flags({"--init-from", "gpt2/model.safetensors", "--export-hf=out/hf"});
  CHECK(hf.init_from == "gpt2/model.safetensors");
  CHECK(hf.export_hf == "out/hf");
  CHECK(parse_flags({"--help"}).help);
  CHECK(parse_flags({"--dtype", "bf16"}).dtype == "bf16");
  CHECK(error_of({"--dtype", "bf16", "--dp", "2", "--tp", "2", "--pp", "2"}).empty());  // every layout in bf16
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
  CHECK(error_of({"--pp", "2", "--schedule", "local_learning"}).empty());
  CHECK(train_gpt::trainer_config(parse_flags({"--pp", "2", "--schedule", "local_learning", "--local-head", "own"}))
            .local_head == trellis::train::TrainerConfig::LocalHead::own);
  CHECK(contains(error_of({"--pp", "2", "--schedule", "local_learning", "--local-head", "mine"}),
                 "--local-head must be tied or own, got 'mine'"));
  CHECK(train_gpt::trainer_config(parse_flags({"--pp", "2", "--stage-layers", "1,3"})).stage_layers == std::vector<int>{1, 3});
  CHECK(train_gpt::trainer_config(parse_flags({"--pp", "2", "--rank-speed", "1,0.5"})).rank_speed ==
        std::vector<double>{1.0, 0.5});
  CHECK(error_of({"--pp", "2", "--rank-speed", "1,0.5", "--simulate-rank-speed"}).empty());
  CHECK(contains(error_of({"--pp", "2", "--stage-layers", "1,2"}),
                 "--stage-layers needs --pp 2 counts of at least 1 block summing to --layers 4 (got 2 counts summing to 3)"));
  CHECK(contains(error_of({"--pp", "2", "--rank-speed", "1,0"}), "--rank-speed needs --pp 2 speeds in (0, 1e6]"));
  CHECK(contains(error_of({"--pp", "2", "--schedule", "zb_v", "--rank-speed", "1,1"}), "a schedule of one chunk per rank"));
  CHECK(contains(error_of({"--simulate-rank-speed"}), "--simulate-rank-speed needs --rank-speed or --dp-speed"));
  CHECK(contains(error_of({"--pp", "2", "--rank-speed", "1,x"}), "flag --rank-speed: 'x' is not a number"));
  // unequal dp shares: given, or balanced for --dp-speed (16 rows, 2 microbatches, speeds 1 and 0.5: 12 + 4)
  CHECK(train_gpt::trainer_config(parse_flags({"--dp", "2", "--dp-rows", "10,6"})).dp_rows ==
        std::vector<trellis::index_t>{10, 6});
  CHECK(train_gpt::trainer_config(parse_flags({"--dp", "2", "--dp-speed", "1,0.5"})).dp_rows ==
        std::vector<trellis::index_t>{12, 4});
  CHECK(error_of({"--dp", "2", "--dp-speed", "1,0.5", "--simulate-rank-speed"}).empty());
  CHECK(contains(error_of({"--dp", "2", "--dp-rows", "10,5"}), "--dp-rows needs --dp 2 row counts summing to --batch 16"));
  CHECK(contains(error_of({"--dp", "2", "--dp-speed", "1"}), "--dp-speed needs --dp 2 speeds"));
  CHECK(contains(error_of({"--pp", "4", "--schedule", "zb_v", "--layers", "4"}),
                 "fewer than the 8 virtual pipeline stages"));
  CHECK(contains(error_of({"--sp"}), "--sp shards the sequence over tp ranks"));
  CHECK(contains(error_of({"--zero1"}), "--zero 1 shards over the data-parallel replicas (dp x cp): it needs --dp or --cp > 1"));
  CHECK(contains(error_of({"--dp", "2", "--zero", "4"}), "--zero 4 is not a ZeRO stage this trainer has"));
  CHECK(parse_flags({"--dp", "2", "--zero", "2"}).zero == 2);
  const auto z3 = parse_flags({"--dp", "2", "--zero", "3", "--no-prefetch"});
  CHECK(z3.zero == 3);
  CHECK(!z3.prefetch);
  CHECK(!train_gpt::trainer_config(z3).prefetch_values);
  CHECK(train_gpt::trainer_config(parse_flags({"--dp", "2", "--zero", "3"})).prefetch_values);
  CHECK(train_gpt::trainer_config(parse_flags({"--dp", "4", "--zero", "3", "--shard-degree", "2"})).shard_degree == 2);
  CHECK(contains(error_of({"--dp", "4", "--shard-degree", "2"}), "--shard-degree 2 shards the ZeRO state: give --zero 1, 2 or 3"));
  CHECK(contains(error_of({"--dp", "4", "--zero", "2", "--shard-degree", "3"}), "--shard-degree 3 must divide the replicas dp x cp = 4"));
  CHECK(contains(error_of({"--dp", "4", "--zero", "2", "--shard-degree", "-1"}), "--shard-degree must be >= 0"));
  CHECK(contains(error_of({"--fused-update", "unclipped"}), "give --clip 0, or --fused-update previous-clip"));
  CHECK(error_of({"--fused-update", "unclipped", "--clip", "0"}).empty());
  CHECK(error_of({"--fused-update", "previous-clip"}).empty());
  CHECK(contains(error_of({"--fused-update", "previous-clip", "--clip", "0"}), "needs --clip > 0"));
  CHECK(contains(error_of({"--fused-update", "later"}), "--fused-update must be unclipped or previous-clip, got 'later'"));
  CHECK(train_gpt::trainer_config(parse_flags({"--offload", "optimizer"})).offload_optimizer);
  CHECK_FALSE(train_gpt::trainer_config(parse_flags({"--offload", "optimizer"})).offload_activations);
  {
    const auto both = train_gpt::trainer_config(parse_flags({"--offload", "activations,optimizer"}));
    CHECK((both.offload_activations && both.offload_optimizer));
    const auto acts = train_gpt::trainer_config(parse_flags({"--offload", "activations"}));
    CHECK((acts.offload_activations && !acts.offload_optimizer));
  }
  CHECK(error_of({"--offload", "activations"}).empty());
  CHECK(train_gpt::trainer_config(parse_flags({})).offload_disk_readahead == 2);
  CHECK(train_gpt::trainer_config(parse_flags({"--offload-disk-readahead", "4"})).offload_disk_readahead == 4);
  CHECK(contains(error_of({"--offload-disk-readahead", "0"}), "reads ahead at least 1 chunk (--offload-disk-readahead, got 0"));
  CHECK(contains(error_of({"--offload", "optimizer,weights"}),
                 "'weights' is not something to offload (a comma list of optimizer, activations"));
  CHECK(train_gpt::trainer_config(parse_flags({"--fused-update", "previous-clip"})).fused_update ==
        trellis::train::TrainerConfig::FusedUpdate::previous_clip);
  CHECK(error_of({"--cp", "2", "--context", "64", "--zero", "2"}).empty());
  CHECK(contains(error_of({"--backend", "cuda"}), "use --backend host"));  // this test is built without CUDA
  CHECK(contains(error_of({"--backend", "cuda"}), "head size 64 or 128"));   // width 128 / 4 heads = 32
  // every layout runs on CUDA (train::Trainer<NcclComm, backend::Cuda>): only the flag is refused here
  for (const char* layout : {"--dp", "--tp"}) {
    const auto e = error_of({"--backend", "cuda", "--heads", "2", layout, "2", "--batch", "16"});
    CHECK(contains(e, "use --backend host"));
    CHECK_FALSE(contains(e, "use --dp 1"));
  }
  CHECK(contains(error_of({"--backend", "tpu"}), "--backend must be host or cuda"));
  // absurd sizes are refused before any allocation: 16 bytes per parameter against physical memory
  CHECK(contains(error_of({"--width", "1048576", "--heads", "16384"}), "AdamW moments alone need"));
  CHECK(contains(error_of({"--layers", "100000"}), "of memory: reduce --width, --layers"));
  CHECK(contains(error_of({"--layers", "100000"}, 8), "per MPI rank"));
  CHECK_FALSE(contains(error_of({"--layers", "12", "--width", "768", "--heads", "12"}), "of memory"));  // GPT-2 124M fits
  CHECK(contains(error_of({"--dtype", "fp16"}), "--dtype must be fp32 or bf16, got 'fp16'"));
  CHECK(contains(error_of({"--backend", "cuda", "--dtype", "fp32"}), "--backend cuda computes in bf16"));
  CHECK(contains(error_of({"--resume"}), "--resume needs --ckpt-dir"));
  CHECK(contains(error_of({"--resume", "--ckpt-dir", "c", "--init-from", "m.safetensors"}), "give one of them"));
  CHECK(contains(error_of({"--steps", "5", "--warmup", "8"}), "--warmup must be in [0, --steps)"));
  // several problems are all listed at once
  auto e = error_of({"--tp", "3", "--zero1"});
  CHECK(contains(e, "--tp 3 does not divide"));
  CHECK(contains(e, "--zero 1 shards"));
}

TEST_CASE("check_config counts the ranks", "[train][flags][errors]") {
  trellis::train::TrainerConfig c;
  c.dp = 2;
  c.batch = 8;
  CHECK_NOTHROW(trellis::train::check_config(c, 2));
  CHECK_THROWS_WITH(trellis::train::check_config(c, 3),
                    Catch::Contains("start 2 ranks or change the layout"));
}

TEST_CASE("layer options reach the trainer", "[train][flags]") {
  auto o = parse_flags({"--tp", "2", "--dropout", "0.1", "--recompute", "--overlap", "3"});
  CHECK(o.dropout == Approx(0.1));
  CHECK(o.recompute);
  CHECK(o.overlap == 3);
  const auto c = train_gpt::trainer_config(o);
  CHECK(c.options.dropout == 0.1f);
  CHECK(c.options.recompute);
  CHECK(c.options.overlap_chunks == 3);
  CHECK(!c.custom_schedule);
  CHECK(error_of({"--tp", "2", "--dropout", "0.1", "--recompute", "--overlap", "3"}).empty());
  for (const char* u : {"--dropout", "--recompute", "--overlap", "--schedule-file"})
    CHECK(contains(train_gpt::usage(), u));
}

TEST_CASE("layer options out of range are refused", "[train][flags][errors]") {
  CHECK(contains(error_of({"--dropout", "1"}), "--dropout is a probability in [0, 1), got 1"));
  CHECK(contains(error_of({"--dropout", "-0.1"}), "--dropout is a probability in [0, 1)"));
  CHECK(contains(error_of({"--dropout", "nan"}), "--dropout"));
  CHECK(contains(error_of({"--overlap", "2"}),
                 "--overlap splits the tensor-parallel collectives into chunks: it needs --tp > 1"));
  CHECK(contains(error_of({"--tp", "2", "--overlap", "0"}), "--overlap must be >= 1"));
  CHECK(contains(error_of({"--pack", "256"}), "--pack names the token that starts each document"));
  CHECK(contains(error_of({"--pack", "-2"}), "--pack"));
  CHECK(error_of({"--pack", "10"}).empty());
  CHECK(parse_flags({"--pack", "10"}).pack == 10);
  CHECK(contains(train_gpt::usage(), "--pack"));
  // context parallelism
  CHECK(error_of({"--cp", "2", "--context", "64"}).empty());
  CHECK(parse_flags({"--cp", "4"}).cp == 4);
  CHECK(train_gpt::trainer_config(parse_flags({"--cp", "2"})).cp == 2);
  CHECK(contains(error_of({"--cp", "3", "--context", "64"}), "must be a multiple of 6"));
  CHECK(contains(error_of({"--cp-mode", "rong"}), "--cp-mode must be ring, ulysses or hybrid, got 'rong'"));
  CHECK(contains(error_of({"--cp", "0"}), "--cp must be >= 1"));
  CHECK(contains(error_of({"--cp", "2", "--tp", "4", "--sp", "--context", "32", "--heads", "4"}),
                 "--sp needs each rank's sequence length 16 (the sequence over --cp) divisible by --tp 4") == false);
  CHECK(contains(error_of({"--cp", "4", "--tp", "4", "--sp", "--context", "24", "--heads", "4"}),
                 "--sp needs each rank's sequence length 6 (the sequence over --cp) divisible by --tp 4"));
  CHECK(train_gpt::trainer_config(parse_flags({"--cp", "2", "--pack", "10", "--cp-balance-docs"})).cp_balance_documents);
  CHECK(error_of({"--cp", "2", "--pack", "10", "--cp-balance-docs"}).empty());
  CHECK(contains(error_of({"--cp", "2", "--cp-balance-docs"}), "--cp-balance-docs reorders packed documents: it needs --pack"));
  CHECK(contains(error_of({"--cp", "2", "--pack", "10", "--cp-balance-docs", "--dropout", "0.1"}), "--dropout 0"));
  CHECK(contains(train_gpt::usage(), "--cp-balance-docs"));
}

TEST_CASE("--schedule-file loads, checks and refuses bad files naming the problem", "[train][flags][pipe]") {
  TempDir dir("flags-schedule");
  auto write = [&](const std::string& name, const std::string& text) {
    const auto path = (dir.path / name).string();
    std::ofstream(path) << text;
    return path;
  };
  // The generator's 1F1B written out by pipe's text writer reads back as the same schedule.
  const auto generated = trellis::pipe::one_f_one_b(2, 4);
  const auto good = write("1f1b.txt", trellis::pipe::to_text(generated));
  const auto o = parse_flags({"--pp", "2", "--microbatches", "4", "--schedule-file", good});
  CHECK(o.schedule_file == good);
  CHECK(error_of({"--pp", "2", "--microbatches", "4", "--schedule-file", good}).empty());
  const auto c = train_gpt::trainer_config(o);
  REQUIRE(c.custom_schedule.has_value());
  CHECK(trellis::pipe::same_schedule(*c.custom_schedule, generated));

  // without a pipeline, with --schedule too, or with another shape than the flags
  CHECK(contains(error_of({"--schedule-file", good}),
                 "--schedule-file " + good + " is a pipeline schedule: it needs --pp > 1"));
  CHECK(contains(error_of({"--pp", "2", "--microbatches", "4", "--schedule-file", good, "--schedule", "gpipe"}),
                 "give one of them"));
  CHECK(contains(error_of({"--pp", "2", "--microbatches", "2", "--schedule-file", good}),
                 "has 4 microbatches but --microbatches is 2"));
  CHECK(contains(error_of({"--pp", "4", "--microbatches", "4", "--schedule-file", good}),
                 "has 2 rank lines but --pp is 4"));
  // a missing file, a syntax error (file, line and column named), a schedule that cannot run
  const auto missing = (dir.path / "nope.txt").string();
  CHECK(contains(error_of({"--pp", "2", "--schedule-file", missing}), "cannot open '" + missing + "'"));
  const auto typo = write("typo.txt", "# two ranks\nF0 F1 B0 W0 B1 W1\nF0 B0 W0 F1 X1 W1\n");
  CHECK(contains(error_of({"--pp", "2", "--schedule-file", typo}),
                 "--schedule-file: load_schedule '" + typo + "': schedule text, line 3, column 13: "
                 "unknown action 'X1'"));
  CHECK_THROWS_WITH(train_gpt::trainer_config(parse_flags({"--pp", "2", "--schedule-file", typo})),
                    Catch::Contains("line 3"));
  const auto incomplete = write("incomplete.txt", "F0 F1 B0 W0 B1 W1\nF0 B0 W0 F1 B1\n");
  CHECK(contains(error_of({"--pp", "2", "--schedule-file", incomplete}),
                 "does not verify: pipe schedule 'text': rank 1: backward-weight of microbatch 1"));
}

TEST_CASE("flags with impossible values are refused by the parser", "[train][flags][errors]") {
  CHECK_THROWS_WITH(parse_flags({"--weight-decay", "-0.1"}), Catch::Contains("--weight-decay: must be >= 0"));
  CHECK_THROWS_WITH(parse_flags({"--peak-gflops", "-5"}), Catch::Contains("--peak-gflops: must be a positive"));
  CHECK_THROWS_WITH(parse_flags({"--peak-gflops", "0"}), Catch::Contains("--peak-gflops: must be a positive"));
  CHECK_THROWS_WITH(parse_flags({"--keep-last", "0"}), Catch::Contains("--keep-last: must be >= 1"));
  CHECK(parse_flags({"--weight-decay", "0"}).weight_decay == 0.0);
  CHECK(parse_flags({"--peak-gflops", "12.5"}).peak_gflops == 12.5);
  CHECK(parse_flags({"--keep-last", "3"}).keep_last == 3);
  CHECK(Options{}.keep_last == 0);  // default: keep every checkpoint
}

TEST_CASE("rank products that overflow an int are refused", "[train][flags][errors]") {
  // 65536 x 65536 = 2^32 wrapped to 0 in int arithmetic.
  CHECK(contains(error_of({"--dp", "65536", "--tp", "65536"}), "more ranks than an int holds"));
  CHECK(contains(error_of({"--dp", "65536", "--tp", "65536"}, 4), "more ranks than an int holds"));
  CHECK(contains(error_of({"--dp", "2147483647", "--tp", "2147483647", "--pp", "2147483647"}),
                 "more ranks than an int holds"));
  CHECK(trellis::train::layout_ranks(2, 3, 4) == 24);
  CHECK(trellis::train::layout_ranks(1, 1 << 16, (1 << 15) - 1) == (std::int64_t{1} << 31) - (1 << 16));
  CHECK(trellis::train::layout_ranks(1, 1 << 16, 1 << 15) == -1);
}

TEST_CASE("files and directories are checked before any work, naming the flag and path", "[train][flags][errors]") {
  namespace fs = std::filesystem;
  TempDir dir("flags-paths");
  const std::string corpus = (dir.path / "corpus.txt").string();
  std::ofstream(corpus) << "some text to train on\n";
  auto paths = [&](std::vector<std::string> args) {
    std::string all;
    for (const auto& p : train_gpt::path_problems(parse_flags(args), corpus)) all += p + "\n";
    return all;
  };
  CHECK(paths({"--ckpt-dir", (dir.path / "ckpt").string()}).empty());  // created at the first save
  CHECK(paths({"--ckpt-dir", dir.path.string()}).empty());
  // A regular file where a directory must be (unwritable in the way that holds for root too).
  const std::string file = (dir.path / "a-file").string();
  std::ofstream(file) << "x";
  CHECK(contains(paths({"--ckpt-dir", file + "/ckpt"}), "--ckpt-dir " + file + "/ckpt cannot be used: " + file +
                                                            " is not a directory"));
  CHECK(contains(paths({"--ckpt-dir", file}), "is not a directory"));
  CHECK(contains(paths({"--log", file + "/m.jsonl"}), "--log"));
  if (::geteuid() != 0) {  // permissions bind only non-root users
    const auto ro = dir.path / "read-only";
    fs::create_directories(ro);
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    CHECK(contains(paths({"--ckpt-dir", (ro / "ckpt").string()}), "is not writable"));
    fs::permissions(ro, fs::perms::owner_all);
  }
  // Data: missing, empty, a FIFO (open() would block), a directory; every .bin shard is checked.
  CHECK(contains(paths({"--data", (dir.path / "missing.txt").string()}), "missing.txt: no such file"));
  const std::string empty = (dir.path / "empty.txt").string();
  std::ofstream(empty).close();
  CHECK(contains(paths({"--data", empty}), "--data " + empty + " is empty"));
  const std::string fifo = (dir.path / "fifo.txt").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(contains(paths({"--data", fifo}), "--data " + fifo + " is not a regular file (a FIFO)"));
  CHECK(contains(paths({"--data", dir.path.string()}), "(a directory)"));
  CHECK(contains(paths({"--data", corpus + ".bin," + fifo + ".bin"}), fifo + ".bin: no such file"));
  CHECK(contains(paths({"--init-from", fifo}), "--init-from " + fifo + " is not a regular file"));
  CHECK(contains(paths({"--schedule-file", fifo, "--pp", "2"}), "--schedule-file " + fifo + " is not a regular file"));
  CHECK(paths({"--data", corpus}).empty());
  CHECK(paths({}).empty());  // the default corpus
}

TEST_CASE("Mixture-of-Experts flags reach the trainer; bad ones are refused", "[train][flags][moe]") {
  auto o = parse_flags({"--experts", "8", "--topk", "2", "--moe-every", "1", "--ep", "2", "--dp", "2", "--capacity",
                        "1.25", "--aux-loss", "0.02", "--z-loss", "0.001"});
  const auto c = train_gpt::trainer_config(o);
  CHECK(c.model.experts == 8);
  CHECK(c.model.moe_topk == 2);
  CHECK(c.model.moe_every == 1);
  CHECK(c.ep == 2);
  CHECK(c.options.moe_capacity == 1.25f);
  CHECK(c.options.moe_aux_loss == 0.02f);
  CHECK(c.options.moe_z_loss == 0.001f);
  CHECK(error_of({"--experts", "8", "--topk", "2", "--moe-every", "1", "--ep", "2", "--dp", "2"}).empty());
  CHECK(train_gpt::trainer_config(parse_flags({"--experts", "4"})).model.moe_every == 2);  // the default
  CHECK(train_gpt::trainer_config(parse_flags({})).model.moe_every == 0);                  // dense
  CHECK(contains(error_of({"--ep", "2", "--dp", "2"}), "it needs an MoE model"));
  CHECK(contains(error_of({"--experts", "4", "--ep", "2"}), "must divide --dp 1"));
  CHECK(contains(error_of({"--experts", "6", "--ep", "4", "--dp", "4", "--batch", "16"}), "do not split evenly over --ep 4"));
  CHECK(contains(error_of({"--experts", "4", "--topk", "3"}), "top-1 or top-2"));
  CHECK(contains(error_of({"--experts", "1", "--topk", "2"}), "top-1 or top-2"));
  CHECK(contains(error_of({"--topk", "2"}), "they need --experts E"));
  CHECK(contains(error_of({"--experts", "4", "--capacity", "-1"}), "--capacity"));
  CHECK(contains(error_of({"--experts", "-1"}), "--experts must be >= 0"));
  for (const char* u : {"--experts", "--topk", "--moe-every", "--ep", "--capacity", "--aux-loss", "--z-loss"})
    CHECK(contains(train_gpt::usage(), u));
}
