// The model configuration a checkpoint was saved with, and the check that a resume loads it into
// the same model. Saved as metadata (every rank; index.json "metadata"):
//   "model.vocab", "model.positions", "model.layers", "model.heads", "model.width",
//   "model.moe_every", "model.experts", "model.moe_topk"
// check_model_config refuses (naming the checkpoint and, per field, both values) a checkpoint
// whose recorded configuration differs, and, for checkpoints written before it was recorded too,
// one holding tensors this model would not load (another layer count leaves "h.1.*" behind,
// silently, otherwise). Layout (dp/tp/pp/ZeRO-1) is not part of it: any layout loads any other.
// Also here: cutting a rank's parameter-shaped arrays into the boxes a checkpoint stores, and
// reading them back into backend memory.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/core/error.hpp"
#include "trellis/io/number.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/train_state.hpp"

namespace trellis::train {

// ---- a rank's parameter shards (host copies; train/checkpoint.hpp stores them as boxes) -------
// Contiguous copy of one piece of a parameter-shaped local array (value, grad or a moment).
inline std::vector<float> gather_piece(const nn::ShardPiece& pc, std::span<const float> local) {
  std::vector<float> out(static_cast<std::size_t>(io::shape_elements(pc.shape)));
  const std::size_t r = pc.shape.size();
  std::vector<index_t> idx(r, 0);
  for (std::size_t k = 0; k < out.size(); ++k) {
    index_t off = pc.local_offset;
    for (std::size_t d = 0; d < r; ++d) off += idx[d] * pc.local_strides[d];
    out[k] = local[static_cast<std::size_t>(off)];
    for (std::size_t d = r; d-- > 0;)
      if (++idx[d] < pc.shape[d])
        break;
      else
        idx[d] = 0;
  }
  return out;
}
inline void scatter_piece(const nn::ShardPiece& pc, std::span<const float> piece, std::span<float> local) {
  const std::size_t r = pc.shape.size();
  std::vector<index_t> idx(r, 0);
  for (std::size_t k = 0; k < piece.size(); ++k) {
    index_t off = pc.local_offset;
    for (std::size_t d = 0; d < r; ++d) off += idx[d] * pc.local_strides[d];
    local[static_cast<std::size_t>(off)] = piece[k];
    for (std::size_t d = r; d-- > 0;)
      if (++idx[d] < pc.shape[d])
        break;
      else
        idx[d] = 0;
  }
}
// Reads tensor `name` (the parameter's GPT-2 global shape) into `local`, an array of B's memory
// shaped like `p` (its value, or a moment): each of p's boxes into a host copy, then one upload.
template <backend::Backend B>
void read_parameter_shaped(const Checkpoint& ck, const std::string& name, const nn::Parameter& p,
                           std::span<float> local, const B& be) {
  ck.expect(name, DType::f32, p.global_shape);
  std::vector<float> host(local.size(), 0.0f);
  for (const auto& pc : p.pieces()) {
    std::vector<float> piece(static_cast<std::size_t>(io::shape_elements(pc.shape)));
    ck.read(name, DType::f32, Box{pc.offsets, pc.shape}, piece.data());
    scatter_piece(pc, piece, host);
  }
  be.upload(local.data(), host.data(), host.size());
}


using GptConfigMember = index_t nn::GptConfig::*;  // an alias: nvcc's host pass would parenthesise the declarator
struct ModelConfigField {
  const char* name;
  GptConfigMember member;
  index_t min;  // smallest legal value
};
inline constexpr std::array<ModelConfigField, 8> model_config_fields{{
    {"vocab", &nn::GptConfig::vocab, 1},
    {"positions", &nn::GptConfig::positions, 1},
    {"layers", &nn::GptConfig::layers, 1},
    {"heads", &nn::GptConfig::heads, 1},
    {"width", &nn::GptConfig::width, 1},
    {"moe_every", &nn::GptConfig::moe_every, 0},
    {"experts", &nn::GptConfig::experts, 0},
    {"moe_topk", &nn::GptConfig::moe_topk, 1},
}};
inline std::string model_config_key(const char* field) { return std::string("model.") + field; }

inline void save_model_config(CheckpointWriter& w, const nn::GptConfig& c) {
  for (const auto& [field, member, min] : model_config_fields) w.set_metadata(model_config_key(field), std::to_string(c.*member));
}

// extra: tensors this run has beyond GPT-2's (local learning's heads: local_head_names).
inline void check_model_config(const Checkpoint& ck, const nn::GptConfig& c, std::span<const std::string> extra = {}) {
  const std::string where = "checkpoint " + ck.directory().string();
  std::string differ;
  for (const auto& [field, member, min] : model_config_fields) {
    auto it = ck.metadata().find(model_config_key(field));
    if (it == ck.metadata().end()) continue;  // written before the configuration was recorded
    const auto saved = io::parse_integer<index_t>(it->second, min, std::numeric_limits<index_t>::max(),
                                                  where + "/index.json, metadata \"" + model_config_key(field) + "\"");
    if (saved != c.*member)
      differ += std::string("\n  - ") + field + ": " + std::to_string(saved) + " in the checkpoint, " +
                std::to_string(c.*member) + " in this model";
  }
  TRELLIS_CHECK(differ.empty(), where, " was saved from another model configuration:", differ,
                "\n(resume with the checkpoint's configuration, or start a new run in another directory)");
  std::set<std::string> loaded;
  const auto params = gpt2_parameters({.n_layer = static_cast<int>(c.layers),
                                       .n_embd = static_cast<int>(c.width),
                                       .vocab_size = static_cast<int>(c.vocab),
                                       .n_ctx = static_cast<int>(c.positions),
                                       .moe_every = static_cast<int>(c.moe_every),
                                       .experts = static_cast<int>(c.experts)});
  std::vector<std::string> names(extra.begin(), extra.end());
  for (const auto& p : params) names.push_back(p.name);
  for (const auto& name : names) {
    loaded.insert(name);
    loaded.insert(optim::adamw_m_name(name));
    loaded.insert(optim::adamw_v_name(name));
  }
  std::string unloaded;
  int count = 0;
  for (const auto& name : ck.tensor_names())
    if (!loaded.count(name) && ++count <= 4) unloaded += (unloaded.empty() ? "\"" : ", \"") + name + "\"";
  TRELLIS_CHECK(count == 0, where, ": ", count, " tensor(s) not loaded by this model (", c.layers, " layers, width ",
                c.width, ", vocab ", c.vocab, ", context ", c.positions, "): ", unloaded, count > 4 ? ", ..." : "",
                "; the checkpoint was saved from another model configuration");
}

// The parameters of local learning's heads (nn::GptStage::local_head) in a pipeline of
// `virtual_stages`: every stage's but the last's LayerNorm and, untied, its LM matrix.
inline std::vector<std::string> local_head_names(int virtual_stages, bool tied) {
  std::vector<std::string> out;
  for (int k = 0; k + 1 < virtual_stages; ++k) {
    const std::string prefix = "local_head." + std::to_string(k) + ".";
    out.push_back(prefix + "ln_f.weight");
    out.push_back(prefix + "ln_f.bias");
    if (!tied) out.push_back(prefix + "lm_head.weight");
  }
  return out;
}

}  // namespace trellis::train
