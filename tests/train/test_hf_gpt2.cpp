// GPT-2 files the Python ecosystem reads (train/hf_gpt2.hpp, checkpoint format version 3):
//  - a one-rank checkpoint's shard-0 is a plain GPT-2 file: the names and shapes listed by hand
//    below (GPT-2's formula for the tiny config), whole c_attn tensors, no "#" keys, no optimizer
//    tensors (those are in optim-0), metadata format "pt"; values == the trainer's parameters;
//  - export_hf_gpt2: names, shapes and dtypes of GPT2LMHeadModel's state dict (listed by hand),
//    values == the trainer's parameters (gathered from every rank by global index, not through a
//    checkpoint), read by our reader and by Python's safetensors; config.json's fields; a numpy
//    GPT-2 written from transformers' GPT2LMHeadModel gives our logits on the exported file;
//  - the export of a tp2 x pp2 and of a dp2 x tp2 ZeRO-1 checkpoint of the same model state is
//    byte-identical to the one-rank export;
//  - init_from_hf of an export: the first step's loss equals the exporting trainer's evaluate()
//    on that batch (exactly on one rank, 1e-5 under tp2 x pp2), step count 0;
//  - Hugging Face's own layout (bare names, attn.bias buffers) loads; a missing tensor, a wrong
//    shape and a tensor of a bigger model are refused naming the tensor.
//  - Generator (train/generate.hpp) on a checkpoint: greedy text and every step's logits equal the
//    independent double-precision GPT-2 (tests/nn/reference_gpt.hpp) run without a cache over the
//    last `positions` tokens, past the context length (the re-prefill path); 1e-5 of the largest
//    logit.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "nn/reference_gpt.hpp"
#include "temp_dir.hpp"
#include "test_trainer_support.hpp"
#include "trellis/io/json.hpp"
#include "trellis/io/safetensors.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/generate.hpp"
#include "trellis/train/hf_gpt2.hpp"

using namespace trainer_test;
using trellis::io::Shape;
namespace fs = std::filesystem;
namespace io = trellis::io;
namespace train = trellis::train;

namespace {

// GPT-2's tensors for vocab V, context P, L layers, width C, written out from the model's
// definition (not from train::gpt2_parameters): our names (no prefix) and shapes.
std::map<std::string, Shape> gpt2_tensors(index_t V, index_t P, int L, index_t C) {
  std::map<std::string, Shape> t{{"wte.weight", {V, C}}, {"wpe.weight", {P, C}}, {"ln_f.weight", {C}}, {"ln_f.bias", {C}}};
  for (int i = 0; i < L; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    t[h + "ln_1.weight"] = {C};
    t[h + "ln_1.bias"] = {C};
    t[h + "attn.c_attn.weight"] = {C, 3 * C};
    t[h + "attn.c_attn.bias"] = {3 * C};
    t[h + "attn.c_proj.weight"] = {C, C};
    t[h + "attn.c_proj.bias"] = {C};
    t[h + "ln_2.weight"] = {C};
    t[h + "ln_2.bias"] = {C};
    t[h + "mlp.c_fc.weight"] = {C, 4 * C};
    t[h + "mlp.c_fc.bias"] = {4 * C};
    t[h + "mlp.c_proj.weight"] = {4 * C, C};
    t[h + "mlp.c_proj.bias"] = {C};
  }
  return t;
}
std::map<std::string, Shape> tiny_tensors() { return gpt2_tensors(64, 16, 4, 32); }

// GPT2LMHeadModel's state dict: "transformer." + each, and lm_head.weight (V, C).
std::map<std::string, Shape> hf_state_dict(const std::map<std::string, Shape>& ours) {
  std::map<std::string, Shape> hf;
  for (const auto& [n, s] : ours) hf["transformer." + n] = s;
  hf["lm_head.weight"] = ours.at("wte.weight");
  return hf;
}

std::map<std::string, Shape> entries_of(const io::SafetensorsFile& f) {
  std::map<std::string, Shape> out;
  for (const auto& e : f.entries()) {
    CHECK(e.dtype == trellis::DType::f32);
    out[e.name] = e.shape;
  }
  return out;
}

bool python_has_safetensors() { return std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0; }

// Trains `steps` steps on one rank, saves to `root`; returns the global weights by name.
std::map<std::string, std::vector<float>> train_one_rank(int steps, const fs::path& root) {
  nn_test::Collector w;
  RunResult r;
  trainer_test::train(tiny_config(), steps, r, w, {}, root);
  std::map<std::string, std::vector<float>> out;
  for (const auto& n : r.names) out[n] = w.get(n);
  return out;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The loss of global batch `b` (loader seed 99 as trainer_test::train) under the weights of an
// HF file (none: the trainer's own initial weights), on layout l: evaluate, then step.
std::pair<double, double> losses_from_hf(const Layout& l, const fs::path& file, int b) {
  const auto cfg = with_layout(tiny_config(), l);
  double eval = 0, first = 0;
  nn_test::run_ranks(cfg.pp * cfg.dp * cfg.tp, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, cfg);
    if (!file.empty()) t.init_from_hf(file);
    RANK_CHECK(t.step_count() == 0);
    trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, t.mesh().template coord<trellis::dp>(), cfg.dp});
    for (int i = 0; i < b; ++i) loader.next();
    const auto batch = loader.next();
    const double e = t.evaluate(batch);
    const auto r = t.step(batch);
    RANK_CHECK(r.step == 1);
    if (comm.rank() == 0) {
      eval = e;
      first = r.loss;
    }
  });
  return {eval, first};
}

}  // namespace

TEST_CASE("a one-rank checkpoint's model shard is a plain GPT-2 file", "[train][hf][checkpoint]") {
  TempDir dir("hf-shard");
  const auto weights = train_one_rank(2, dir.path);
  const fs::path step = dir.path / "step-00000002";
  io::SafetensorsFile shard(step / "shard-0.safetensors");
  REQUIRE(entries_of(shard) == tiny_tensors());  // whole c_attn (32, 96) / (96), no "#k", no moments
  CHECK(shard.metadata().at("format") == "pt");
  for (const auto& [name, shape] : tiny_tensors()) {
    INFO(name);
    CHECK(shard.read_as<float>(name) == weights.at(name));
  }
  io::SafetensorsFile optim(step / "optim-0.safetensors");
  std::map<std::string, Shape> moments;
  for (const auto& [n, s] : tiny_tensors()) {
    moments["optimizer.m." + n] = s;
    moments["optimizer.v." + n] = s;
  }
  CHECK(entries_of(optim) == moments);
  auto index = io::json::parse(io::read_whole_file(step / "index.json"));
  CHECK(index.at("version").as_int() == 3);
  CHECK(index.at("tensors").at("h.0.attn.c_attn.weight").at("shards").as_array().size() == 1);

  // Under tp 2 a rank holds q, k and v column blocks that do not tile a box: several keys, and
  // the checkpoint still loads whole.
  TempDir tp2("hf-shard-tp2");
  nn_test::Collector w2;
  RunResult r2;
  trainer_test::train(with_layout(tiny_config(), Layout{.tp = 2}), 0, r2, w2, step, tp2.path);
  io::SafetensorsFile rank0(tp2.path / "step-00000002" / "shard-0.safetensors");
  CHECK(rank0.find("h.0.attn.c_attn.weight#2") != nullptr);
  CHECK(rank0.find("h.0.mlp.c_fc.weight") != nullptr);  // one box: the plain name
  train::Checkpoint ck(tp2.path);
  CHECK(ck.read_whole<float>("h.0.attn.c_attn.weight") == weights.at("h.0.attn.c_attn.weight"));
}

TEST_CASE("export_hf_gpt2 writes GPT2LMHeadModel's state dict and config", "[train][hf][python]") {
  TempDir dir("hf-export");
  const auto weights = train_one_rank(2, dir.path / "ckpt");
  const fs::path out = dir.path / "hf";
  train::export_hf_gpt2(train::Checkpoint(dir.path / "ckpt"), tiny_config().model, out);

  io::SafetensorsFile f(out / "model.safetensors");
  REQUIRE(entries_of(f) == hf_state_dict(tiny_tensors()));
  CHECK(f.metadata().at("format") == "pt");
  for (const auto& [name, shape] : tiny_tensors()) {
    INFO(name);
    CHECK(f.read_as<float>("transformer." + name) == weights.at(name));
  }
  CHECK(f.read_as<float>("lm_head.weight") == weights.at("wte.weight"));

  auto config = io::json::parse(io::read_whole_file(out / "config.json"));
  CHECK(config.at("model_type").as_string() == "gpt2");
  CHECK(config.at("architectures").as_array().at(0).as_string() == "GPT2LMHeadModel");
  CHECK(config.at("vocab_size").as_int() == 64);
  CHECK(config.at("n_positions").as_int() == 16);
  CHECK(config.at("n_embd").as_int() == 32);
  CHECK(config.at("n_layer").as_int() == 4);
  CHECK(config.at("n_head").as_int() == 4);
  CHECK(config.at("n_inner").is_null());
  CHECK(config.at("activation_function").as_string() == "gelu_new");
  CHECK(config.at("layer_norm_epsilon").as_double() == 1e-5);
  CHECK(config.at("initializer_range").as_double() == 0.02);
  CHECK(config.at("tie_word_embeddings").as_bool());
  CHECK(config.at("torch_dtype").as_string() == "float32");
  CHECK(config.at("eos_token_id").as_int() == 63);

  if (!python_has_safetensors()) {
    WARN("SKIPPED: python3 with safetensors + numpy is not importable (pip install safetensors numpy)");
    return;
  }
  // Python reads the file; the expected names, shapes and raw values come from this test.
  const fs::path ref = dir.path / "ref";
  fs::create_directories(ref);
  std::ofstream list(ref / "expected.txt");
  for (const auto& [name, shape] : hf_state_dict(tiny_tensors())) {
    list << name;
    for (index_t d : shape) list << ' ' << d;
    list << '\n';
    const std::string ours = name == "lm_head.weight" ? "wte.weight" : name.substr(12);
    const auto& v = weights.at(ours);
    std::ofstream(ref / (name + ".f32"), std::ios::binary).write(reinterpret_cast<const char*>(v.data()),
                                                                   static_cast<std::streamsize>(v.size() * 4));
  }
  list.close();
  const auto script = dir.path / "check.py";
  std::ofstream(script) << "import numpy as np\n"
                           "from safetensors import safe_open\n"
                           "from safetensors.numpy import load_file\n"
                           "path, ref = '" << (out / "model.safetensors").string() << "', '" << ref.string() << "'\n"
                           "with safe_open(path, framework='np') as f:\n"
                           "    assert f.metadata()['format'] == 'pt', f.metadata()\n"
                           "t = load_file(path)\n"
                           "expected = {}\n"
                           "for line in open(ref + '/expected.txt'):\n"
                           "    name, *shape = line.split()\n"
                           "    expected[name] = tuple(int(d) for d in shape)\n"
                           "assert sorted(t) == sorted(expected), (sorted(t), sorted(expected))\n"
                           "for name, shape in expected.items():\n"
                           "    a = t[name]\n"
                           "    assert a.dtype == np.float32 and a.shape == shape, (name, a.dtype, a.shape)\n"
                           "    want = np.fromfile(ref + '/' + name + '.f32', dtype='<f4').reshape(shape)\n"
                           "    assert np.array_equal(a, want), name\n";
  REQUIRE(std::system(("python3 " + script.string()).c_str()) == 0);
}

TEST_CASE("a numpy GPT-2 written from Hugging Face's GPT2LMHeadModel gives our logits on the export",
          "[train][hf][python]") {
  if (!python_has_safetensors()) {
    WARN("SKIPPED: python3 with safetensors + numpy is not importable (pip install safetensors numpy)");
    return;
  }
  // What from_pretrained would compute (transformers is not needed): c_attn's output split into
  // q, k, v of C columns each, head h = columns h*D..(h+1)*D of each, causal softmax(q k^T / sqrt(D)),
  // gelu_new, LayerNorm eps 1e-5, logits = x @ wte^T (tied lm_head).
  TempDir dir("hf-numpy");
  train_one_rank(3, dir.path / "ckpt");
  const train::Checkpoint ck(dir.path / "ckpt");
  train::export_hf_gpt2(ck, tiny_config().model, dir.path / "hf");
  const std::vector<std::int32_t> ids = {5, 17, 33, 2, 60, 41, 9, 12, 63, 0, 28, 7};
  std::vector<float> logits;
  nn_test::run_ranks(1, [&](ThreadComm& c) {
    trellis::train::Generator<ThreadComm> gen(ck, tiny_config().model, c);
    logits = gen.next_logits(ids);
  });
  std::ofstream ours(dir.path / "ours.txt");
  ours.precision(9);
  for (float x : logits) ours << x << '\n';
  ours.close();
  const auto script = dir.path / "forward.py";
  std::ofstream(script) << "import json, numpy as np\n"
                           "from safetensors.numpy import load_file\n"
                           "d = '" << dir.path.string() << "'\n"
                           "w = load_file(d + '/hf/model.safetensors')\n"
                           "cfg = json.load(open(d + '/hf/config.json'))\n"
                           "C, H, L, eps = cfg['n_embd'], cfg['n_head'], cfg['n_layer'], cfg['layer_norm_epsilon']\n"
                           "D = C // H\n"
                           "ids = np.array([5, 17, 33, 2, 60, 41, 9, 12, 63, 0, 28, 7])\n"
                           "T = len(ids)\n"
                           "def ln(x, p):\n"
                           "    m = x.mean(-1, keepdims=True); v = ((x - m) ** 2).mean(-1, keepdims=True)\n"
                           "    return (x - m) / np.sqrt(v + eps) * w[p + '.weight'] + w[p + '.bias']\n"
                           "def conv1d(x, p): return x @ w[p + '.weight'] + w[p + '.bias']\n"
                           "def gelu_new(x): return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))\n"
                           "x = (w['transformer.wte.weight'][ids] + w['transformer.wpe.weight'][:T]).astype(np.float64)\n"
                           "mask = np.triu(np.ones((T, T), dtype=bool), 1)\n"
                           "for i in range(L):\n"
                           "    h = 'transformer.h.%d.' % i\n"
                           "    q, k, v = np.split(conv1d(ln(x, h + 'ln_1'), h + 'attn.c_attn'), 3, axis=-1)\n"
                           "    heads = lambda t: t.reshape(T, H, D).transpose(1, 0, 2)\n"
                           "    a = heads(q) @ heads(k).transpose(0, 2, 1) / np.sqrt(D)\n"
                           "    a[:, mask] = -np.inf\n"
                           "    a = np.exp(a - a.max(-1, keepdims=True)); a /= a.sum(-1, keepdims=True)\n"
                           "    y = (a @ heads(v)).transpose(1, 0, 2).reshape(T, C)\n"
                           "    x = x + conv1d(y, h + 'attn.c_proj')\n"
                           "    x = x + conv1d(gelu_new(conv1d(ln(x, h + 'ln_2'), h + 'mlp.c_fc')), h + 'mlp.c_proj')\n"
                           "theirs = ln(x, 'transformer.ln_f')[-1] @ w['lm_head.weight'].T\n"
                           "ours = np.loadtxt(d + '/ours.txt')\n"
                           "err = np.abs(theirs - ours).max() / max(1.0, np.abs(ours).max())\n"
                           "assert err < 1e-4, err\n"
                           "assert np.abs(theirs - np.roll(ours, 1)).max() > 1e-3  # the comparison can fail\n";
  REQUIRE(std::system(("python3 " + script.string()).c_str()) == 0);
}

TEST_CASE("the export of any layout's checkpoint is byte-identical to the one-rank export", "[train][hf][reshard]") {
  TempDir dir("hf-layouts");
  train_one_rank(2, dir.path / "one");
  const auto one = *train::latest_checkpoint(dir.path / "one");
  train::export_hf_gpt2(train::Checkpoint(one), tiny_config().model, dir.path / "hf-one");
  const std::string want = file_bytes(dir.path / "hf-one" / "model.safetensors");
  for (const Layout& l : {Layout{.pp = 2, .tp = 2, .microbatches = 2}, Layout{.dp = 2, .tp = 2, .zero = 1}}) {
    INFO("pp " << l.pp << " dp " << l.dp << " tp " << l.tp << " zero " << l.zero);
    const std::string tag = "pp" + std::to_string(l.pp) + "dp" + std::to_string(l.dp);
    nn_test::Collector w;
    RunResult r;
    trainer_test::train(with_layout(tiny_config(), l), 0, r, w, one, dir.path / tag);  // load, save in layout l
    train::Checkpoint ck(dir.path / tag);
    REQUIRE(ck.world_size() == 4);
    CHECK(ck.tensor("h.0.attn.c_attn.weight").shards.size() == 6);  // 2 tp ranks x q, k, v
    train::export_hf_gpt2(ck, tiny_config().model, dir.path / ("hf-" + tag));
    CHECK(file_bytes(dir.path / ("hf-" + tag) / "model.safetensors") == want);
  }
}

TEST_CASE("init_from_hf of an export starts from the exported model, optimizer fresh", "[train][hf][init]") {
  TempDir dir("hf-init");
  // The reference: the exporting trainer's evaluate() on global batch 3 after its 3 steps.
  const auto cfg = tiny_config();
  double reference = 0;
  nn_test::run_ranks(1, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, cfg);
    trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, 0, 1});
    for (int s = 0; s < 3; ++s) t.step(loader.next());
    t.save(dir.path / "ckpt", loader.state());
    reference = t.evaluate(loader.next());
  });
  const fs::path hf = dir.path / "hf" / "model.safetensors";
  train::export_hf_gpt2(train::Checkpoint(dir.path / "ckpt"), cfg.model, dir.path / "hf");

  auto [eval1, first1] = losses_from_hf(Layout{}, hf, 3);
  CHECK(eval1 == reference);
  CHECK(first1 == reference);
  auto [eval4, first4] = losses_from_hf(Layout{.pp = 2, .tp = 2, .microbatches = 2}, hf, 3);
  CHECK(std::fabs(eval4 - reference) <= 1e-5 * reference);
  CHECK(std::fabs(first4 - reference) <= 1e-5 * reference);
  // Without init_from_hf the same batch gives another loss (the comparison can fail).
  auto [eval_fresh, unused] = losses_from_hf(Layout{}, {}, 3);
  CHECK(std::fabs(eval_fresh - reference) > 1e-3);
}

TEST_CASE("init_from_hf reads Hugging Face's bare names and refuses bad files naming the tensor",
          "[train][hf][init][errors]") {
  TempDir dir("hf-bad");
  const auto weights = train_one_rank(1, dir.path / "ckpt");
  const auto model = tiny_config().model;
  // Writes a file like Hugging Face's "gpt2" model.safetensors: bare names, the causal-mask
  // buffers; `edit` changes the tensor list first.
  auto write = [&](const std::string& file, auto&& edit) {
    std::map<std::string, std::pair<Shape, std::vector<float>>> t;
    for (const auto& [n, s] : tiny_tensors()) t[n] = {s, weights.at(n)};
    for (int i = 0; i < 4; ++i)
      t["h." + std::to_string(i) + ".attn.bias"] = {{1, 1, 16, 16}, std::vector<float>(256, 1.0f)};
    edit(t);
    io::SafetensorsWriter w;
    for (auto& [n, sv] : t) w.add(n, trellis::DType::f32, sv.first, sv.second.data());
    w.set_metadata("format", "pt");
    w.write(dir.path / file);
    return dir.path / file;
  };
  const auto bare = write("bare.safetensors", [](auto&) {});
  train::HfGpt2File f(bare, model);
  std::vector<float> got(32 * 96);
  f.read("h.2.attn.c_attn.weight", train::full_box({32, 96}), got.data());
  CHECK(got == weights.at("h.2.attn.c_attn.weight"));
  std::vector<float> column(32 * 8);  // a box: rows 0..31, columns 40..47 (part of k)
  f.read("h.2.attn.c_attn.weight", train::Box{{0, 40}, {32, 8}}, column.data());
  CHECK(column[33] == weights.at("h.2.attn.c_attn.weight")[4 * 96 + 41]);

  auto refuses = [&](const fs::path& file, const std::string& a, const std::string& b) {
    try {
      train::HfGpt2File bad(file, model);
      FAIL("accepted " << file);
    } catch (const trellis::Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(a) != std::string::npos);
      CHECK(std::string(e.what()).find(b) != std::string::npos);
    }
  };
  refuses(write("missing.safetensors", [](auto& t) { t.erase("h.1.mlp.c_fc.bias"); }), "h.1.mlp.c_fc.bias", "missing");
  refuses(write("shape.safetensors",
                [](auto& t) { t["wpe.weight"] = {{1024, 32}, std::vector<float>(1024 * 32)}; }),
          "wpe.weight", "(1024, 32)");
  refuses(write("bigger.safetensors", [](auto& t) { t["h.4.ln_1.weight"] = {{32}, std::vector<float>(32)}; }),
          "h.4.ln_1.weight", "not a parameter");
  // The trainer refuses on every rank before reading anything.
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, with_layout(tiny_config(), Layout{.tp = 2}));
    RANK_CHECK_THROWS_AS(t.init_from_hf(dir.path / "missing.safetensors"), trellis::Error);
  });
}

TEST_CASE("Generator: greedy decoding through the KV cache equals greedy decoding of the double-precision "
          "GPT-2 without a cache, past the context length",
          "[train][generate]") {
  TempDir dir("generate");
  train_one_rank(3, dir.path / "ckpt");
  const train::Checkpoint ck(dir.path / "ckpt");
  const auto cfg = tiny_config().model;  // 16 positions
  nn_test::RefParams P;
  for (const auto& [name, shape] : tiny_tensors()) {
    const auto v = ck.read_whole<float>(name);
    P[name].assign(v.begin(), v.end());
  }
  // The reference: every token from a whole forward over the last `positions` tokens, in double.
  auto ref_next_logits = [&](const std::vector<std::int32_t>& tokens) {
    const auto T = std::min<std::size_t>(tokens.size(), static_cast<std::size_t>(cfg.positions));
    const std::vector<std::int32_t> window(tokens.end() - static_cast<std::ptrdiff_t>(T), tokens.end());
    const auto h = nn_test::ref_final_hidden(cfg, P, window, 1, static_cast<index_t>(T));
    const auto d = nn_test::ref_row_logits(cfg, P, h, static_cast<index_t>(T) - 1);
    return std::vector<float>(d.begin(), d.end());
  };
  const std::vector<std::int32_t> prompt = {5, 17, 33, 2, 60};
  const int n = 20;  // contexts of 5..24 tokens: the last 8 are longer than the 16 positions
  std::vector<std::int32_t> ref = prompt;
  double min_margin = 1e30;  // reference top-1 minus top-2 logit: how safe greedy equality is
  for (int i = 0; i < n; ++i) {
    const auto l = ref_next_logits(ref);
    const auto best = std::max_element(l.begin(), l.end()) - l.begin();
    float second = -1e30f;
    for (std::size_t v = 0; v < l.size(); ++v)
      if (static_cast<std::ptrdiff_t>(v) != best) second = std::max(second, l[v]);
    min_margin = std::min(min_margin, static_cast<double>(l[best] - second));
    ref.push_back(static_cast<std::int32_t>(best));
  }
  nn_test::run_ranks(1, [&](ThreadComm& c) {
    train::Generator<ThreadComm> gen(ck, cfg, c);
    train::Rng rng(1, 2);
    // a prompt id outside the vocabulary (a UTF-8 byte read as a signed char) is refused up front
    CHECK_THROWS_WITH(gen.generate({5, -61, 7}, 2, 0.0, rng),
                      Catch::Contains("prompt token 1 is -61, outside the vocabulary 0..") &&
                          Catch::Contains(std::to_string(cfg.vocab - 1)));
    std::vector<std::int32_t> ours = prompt;
    double worst = 0;
    for (int i = 0; i < n; ++i) {
      const auto l = gen.next_logits(ours);
      worst = std::max(worst, nn_test::rel_error(l, ref_next_logits(ours)));
      ours.push_back(gen.pick(l, 0.0, rng));
    }
    WARN("Generator vs double reference: max relative logit error " << worst << ", smallest greedy margin "
                                                                       << min_margin);
    CHECK(worst <= 1e-5);
    CHECK(ours == ref);
    // One prefill for the prompt, then single-token decodes up to 16 tokens, then a re-prefill of
    // the last 16 for each of the contexts of 17..24 tokens.
    CHECK(gen.prefills() == 1 + 8);
    // The public loop gives the same text from a fresh generator; a context that does not extend
    // the cached one (another prompt) is prefilled again and still gives the reference logits.
    train::Generator<ThreadComm> fresh(ck, cfg, c);
    CHECK(fresh.generate(prompt, n, 0.0, rng) == ref);
    const std::vector<std::int32_t> other = {9, 12, 63, 0};
    CHECK(nn_test::rel_error(fresh.next_logits(other), ref_next_logits(other)) <= 1e-5);
    CHECK(nn_test::rel_error(fresh.next_logits(other), ref_next_logits(prompt)) > 1e-3);  // it can fail
  });
}
