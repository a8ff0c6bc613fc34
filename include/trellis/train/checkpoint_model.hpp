// The model configuration a checkpoint was saved with, and the check that a resume loads it into
// the same model. Saved as metadata (every rank; index.json "metadata"):
//   "model.vocab", "model.positions", "model.layers", "model.heads", "model.width"
// check_model_config refuses (naming the checkpoint and, per field, both values) a checkpoint
// whose recorded configuration differs, and, for checkpoints written before it was recorded too,
// one holding tensors this model would not load (another layer count leaves "h.1.*" behind,
// silently, otherwise). Layout (dp/tp/pp/ZeRO-1) is not part of it: any layout loads any other.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include "trellis/core/error.hpp"
#include "trellis/io/number.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/train_state.hpp"

namespace trellis::train {

inline constexpr std::array<std::pair<const char*, index_t nn::GptConfig::*>, 5> model_config_fields{{
    {"vocab", &nn::GptConfig::vocab},
    {"positions", &nn::GptConfig::positions},
    {"layers", &nn::GptConfig::layers},
    {"heads", &nn::GptConfig::heads},
    {"width", &nn::GptConfig::width},
}};
inline std::string model_config_key(const char* field) { return std::string("model.") + field; }

inline void save_model_config(CheckpointWriter& w, const nn::GptConfig& c) {
  for (const auto& [field, member] : model_config_fields) w.set_metadata(model_config_key(field), std::to_string(c.*member));
}

inline void check_model_config(const Checkpoint& ck, const nn::GptConfig& c) {
  const std::string where = "checkpoint " + ck.directory().string();
  std::string differ;
  for (const auto& [field, member] : model_config_fields) {
    auto it = ck.metadata().find(model_config_key(field));
    if (it == ck.metadata().end()) continue;  // written before the configuration was recorded
    const auto saved = io::parse_integer<index_t>(it->second, 1, std::numeric_limits<index_t>::max(),
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
                                       .n_ctx = static_cast<int>(c.positions)});
  for (const auto& p : params) {
    loaded.insert(p.name);
    loaded.insert(optim::adamw_m_name(p.name));
    loaded.insert(optim::adamw_v_name(p.name));
  }
  std::string unloaded;
  int count = 0;
  for (const auto& name : ck.tensor_names())
    if (!loaded.count(name) && ++count <= 4) unloaded += (unloaded.empty() ? "\"" : ", \"") + name + "\"";
  TRELLIS_CHECK(count == 0, where, ": ", count, " tensor(s) not loaded by this model (", c.layers, " layers, width ",
                c.width, ", vocab ", c.vocab, ", context ", c.positions, "): ", unloaded, count > 4 ? ", ..." : "",
                "; the checkpoint was saved from another model configuration");
}

}  // namespace trellis::train
