// The export loads in Hugging Face transformers (when python3 can import torch and transformers;
// otherwise this program exits 77 and ctest reports it skipped; CI does not install torch):
// GPT2LMHeadModel.from_pretrained(dir, output_loading_info=True) reports no missing, unexpected
// or mismatched keys, and its logits for a token sequence equal our model's (Generator, one rank)
// within 1e-4 of their scale.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

#include "temp_dir.hpp"
#include "test_trainer_support.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/generate.hpp"
#include "trellis/train/hf_gpt2.hpp"

int main() {
  if (std::system("python3 -c 'import torch, transformers' >/dev/null 2>&1") != 0) {
    std::puts("SKIPPED: python3 cannot import torch and transformers");
    return 77;
  }
  try {
    using namespace trainer_test;
    TempDir dir("hf-transformers");
    nn_test::Collector w;
    RunResult r;
    trainer_test::train(tiny_config(), 3, r, w, {}, dir.path / "ckpt");
    const trellis::train::Checkpoint ck(dir.path / "ckpt");
    trellis::train::export_hf_gpt2(ck, tiny_config().model, dir.path / "hf");

    const std::vector<std::int32_t> tokens = {5, 17, 33, 2, 60, 41, 9, 12, 63, 0, 28, 7};
    std::vector<float> logits;
    trellis::comm::ThreadWorld one(1);
    one.run([&](trellis::comm::ThreadComm& c) {
      trellis::train::Generator<trellis::comm::ThreadComm> gen(ck, tiny_config().model, c);
      logits = gen.next_logits(tokens);
    });
    std::FILE* f = std::fopen((dir.path / "ours.txt").c_str(), "w");
    for (float x : logits) std::fprintf(f, "%.9g\n", static_cast<double>(x));
    std::fclose(f);
    const auto script = dir.path / "check.py";
    std::ofstream(script) << "import numpy as np, torch\n"
                             "from transformers import GPT2LMHeadModel\n"
                             "d = '" << dir.path.string() << "'\n"
                             "model, info = GPT2LMHeadModel.from_pretrained(d + '/hf', output_loading_info=True)\n"
                             "for k in ('missing_keys', 'unexpected_keys', 'mismatched_keys'):\n"
                             "    assert not info.get(k), (k, info[k])\n"
                             "model.eval()\n"
                             "ids = torch.tensor([[5, 17, 33, 2, 60, 41, 9, 12, 63, 0, 28, 7]])\n"
                             "with torch.no_grad():\n"
                             "    theirs = model(ids).logits[0, -1].numpy()\n"
                             "ours = np.loadtxt(d + '/ours.txt', dtype=np.float32)\n"
                             "err = np.abs(theirs - ours).max() / max(1.0, np.abs(ours).max())\n"
                             "print('max relative logit difference', err)\n"
                             "assert err < 1e-4, err\n";
    return std::system(("python3 " + script.string()).c_str()) == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
