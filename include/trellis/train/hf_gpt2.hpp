// GPT-2 in the Hugging Face layout, both ways:
//   export_hf_gpt2(ck, model, dir)   a checkpoint of ANY layout -> dir/config.json + dir/model.safetensors,
//                                    what transformers' GPT2LMHeadModel.from_pretrained(dir) loads
//   HfGpt2File f(path, model)        a GPT-2 safetensors file with Hugging Face names, checked against
//                                    the model config; f.read(name, box, out) reads any box of a
//                                    tensor, so every rank of any layout reads only its own pieces
//                                    (Trainer::init_from_hf)
// Names: ours are GPT-2's without a prefix ("h.0.attn.c_attn.weight", docs/checkpoint.md);
// GPT2LMHeadModel's state dict prefixes them with "transformer." and adds "lm_head.weight" (tied
// to wte). Hugging Face's own "gpt2" model.safetensors uses the bare names; both are read.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/io/atomic_file.hpp"
#include "trellis/io/json.hpp"
#include "trellis/io/safetensors.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/train_state.hpp"

namespace trellis::train {

// Hugging Face GPT-2 has no experts: a Mixture-of-Experts model (GptConfig::moe_every) is refused.
inline Gpt2Config gpt2_config_of(const nn::GptConfig& c) {
  TRELLIS_CHECK(c.moe_every == 0, "Hugging Face GPT-2 files hold dense models; this model has Mixture-of-Experts ",
                "blocks (moe_every ", c.moe_every, ", ", c.experts, " experts)");
  return {.n_layer = static_cast<int>(c.layers),
          .n_embd = static_cast<int>(c.width),
          .vocab_size = static_cast<int>(c.vocab),
          .n_ctx = static_cast<int>(c.positions)};
}

// "h.0.ln_1.weight" -> "transformer.h.0.ln_1.weight" (GPT2LMHeadModel's state-dict name).
inline std::string hf_gpt2_name(std::string_view name) { return "transformer." + std::string(name); }

namespace detail {
// The shortest decimal that reads back as `f`, as a double: 1e-5f is written 1e-05, not
// 9.999999747378752e-06.
inline double decimal_of(float f) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, f);
  *r.ptr = '\0';
  return std::strtod(buf, nullptr);
}
}  // namespace detail

// config.json of GPT2LMHeadModel for this model (GPT2Config's fields). GELU is the tanh form
// ("gelu_new"); bos/eos are the last token id (50256 for GPT-2's vocabulary).
inline std::string hf_gpt2_config_json(const nn::GptConfig& c, const nn::GptOptions& o = {}) {
  namespace json = io::json;
  const double pdrop = detail::decimal_of(o.dropout);
  json::Object j;
  j["model_type"] = json::Value("gpt2");
  j["architectures"] = json::Value(json::Array{json::Value("GPT2LMHeadModel")});
  j["vocab_size"] = json::Value(c.vocab);
  j["n_positions"] = json::Value(c.positions);
  j["n_ctx"] = json::Value(c.positions);
  j["n_embd"] = json::Value(c.width);
  j["n_layer"] = json::Value(c.layers);
  j["n_head"] = json::Value(c.heads);
  j["n_inner"] = json::Value(nullptr);  // 4 * n_embd
  j["activation_function"] = json::Value("gelu_new");
  j["layer_norm_epsilon"] = json::Value(detail::decimal_of(c.ln_eps));
  j["resid_pdrop"] = json::Value(pdrop);
  j["embd_pdrop"] = json::Value(pdrop);
  j["attn_pdrop"] = json::Value(0.0);  // the model has no attention dropout
  j["initializer_range"] = json::Value(detail::decimal_of(o.init_std));
  j["scale_attn_weights"] = json::Value(true);
  j["tie_word_embeddings"] = json::Value(true);
  j["use_cache"] = json::Value(true);
  j["torch_dtype"] = json::Value("float32");
  j["bos_token_id"] = json::Value(c.vocab - 1);
  j["eos_token_id"] = json::Value(c.vocab - 1);
  return json::dump(json::Value(std::move(j)), 2) + "\n";
}

// Writes dir/config.json and dir/model.safetensors (F32, metadata {"format": "pt"}) from a
// checkpoint of any layout: every GPT-2 tensor under its GPT2LMHeadModel name, plus
// "lm_head.weight", a copy of wte. With it the file is the model's whole state dict: from_pretrained
// reports no missing and no unexpected keys either way (lm_head is tied), and readers that do not
// tie (plain safetensors users) find the output head. Throws naming the tensor when the
// checkpoint lacks one or holds another shape than `model`.
inline void export_hf_gpt2(const Checkpoint& ck, const nn::GptConfig& model, const std::filesystem::path& dir,
                           const nn::GptOptions& options = {}) {
  const auto params = gpt2_parameters(gpt2_config_of(model));
  for (const auto& p : params) ck.expect(p.name, DType::f32, p.shape);  // every problem before any write
  std::vector<std::vector<float>> values;  // alive until write()
  io::SafetensorsWriter w;
  for (const auto& p : params) {
    values.push_back(ck.read_whole<float>(p.name));
    w.add(hf_gpt2_name(p.name), DType::f32, p.shape, values.back().data());
    if (p.name == "wte.weight") w.add("lm_head.weight", DType::f32, p.shape, values.back().data());
  }
  w.set_metadata("format", "pt");
  std::filesystem::create_directories(dir);
  w.write(dir / "model.safetensors");
  io::write_file_atomically(dir / "config.json", hf_gpt2_config_json(model, options));
}

// A GPT-2 safetensors file with Hugging Face names ("transformer."-prefixed or bare), checked at
// open against the configured model: every tensor present with its shape and a floating dtype
// (read as float); the attention-mask buffers ("attn.bias", "attn.masked_bias") and the tied
// "lm_head.weight" are ignored, anything else is refused (a file of a bigger model).
class HfGpt2File {
 public:
  HfGpt2File(const std::filesystem::path& path, const nn::GptConfig& model) : file_(path) {
    const std::string where = path.string();
    std::map<std::string, const ParameterSpec*> expected;
    const auto params = gpt2_parameters(gpt2_config_of(model));
    for (const auto& p : params) expected[p.name] = &p;
    for (const auto& e : file_.entries()) {
      std::string_view name = e.name;
      if (name.starts_with("transformer.")) name.remove_prefix(std::string_view("transformer.").size());
      if (name == "lm_head.weight" || name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) continue;
      auto it = expected.find(std::string(name));
      TRELLIS_CHECK(it != expected.end(), where, ": tensor \"", e.name, "\" is not a parameter of the configured GPT-2 (",
                    model.layers, " layers, width ", model.width, ", vocab ", model.vocab, ", context ",
                    model.positions, ")");
      TRELLIS_CHECK(key_.emplace(std::string(name), e.name).second, where, ": tensor \"", name,
                    "\" is there twice (with and without \"transformer.\")");
      TRELLIS_CHECK(e.shape == it->second->shape, where, ": tensor \"", e.name, "\" is ", io::shape_string(e.shape),
                    ", the configured model needs ", io::shape_string(it->second->shape));
      TRELLIS_CHECK(detail::is_float_dtype(e.dtype), where, ": tensor \"", e.name, "\" is ",
                    io::safetensors_dtype(e.dtype), ", not a floating type");
    }
    for (const auto& p : params)
      TRELLIS_CHECK(key_.count(p.name) == 1, where, ": tensor \"", hf_gpt2_name(p.name), "\" (or \"", p.name,
                    "\") is missing");
  }

  // Box `box` of GPT-2 parameter `name` (our name) into `out` (row-major, box.shape), as float.
  void read(std::string_view name, const Box& box, float* out) const {
    auto it = key_.find(std::string(name));
    TRELLIS_CHECK(it != key_.end(), file_.path(), ": no GPT-2 parameter \"", name, "\"");
    const io::SafetensorsEntry& e = file_.entry(it->second);
    detail::check_box_in(e.shape, box, file_.path().string() + ", tensor \"" + e.name + "\"");
    if (cached_ != e.name) {  // the pieces of one tensor (q, k, v of c_attn) come one after another
      std::vector<std::byte> bytes = file_.read(e.name);
      whole_.resize(static_cast<std::size_t>(io::shape_elements(e.shape)));
      if (e.dtype == DType::f32)
        std::memcpy(whole_.data(), bytes.data(), bytes.size());
      else
        detail::convert_floats(bytes.data(), e.dtype, whole_.data(), DType::f32, whole_.size());
      cached_ = e.name;
    }
    detail::copy_region(box, reinterpret_cast<const std::byte*>(whole_.data()), full_box(e.shape),
                        reinterpret_cast<std::byte*>(out), box, sizeof(float));
  }

  const std::filesystem::path& path() const { return file_.path(); }

 private:
  io::SafetensorsFile file_;
  std::map<std::string, std::string, std::less<>> key_;  // our name -> the file's
  mutable std::string cached_;
  mutable std::vector<float> whole_;
};

}  // namespace trellis::train
