// What a trainer checkpoints besides the weights, under fixed names:
//   metadata "train.step"  optimizer steps done          (every rank; rank 0's is canonical)
//            "train.rng"   this rank's Rng state (64 hex digits)
//            "train.data"  the loader position "seed=<n>;next_batch=<n>"
//   tensors  "optimizer.m.<param>", "optimizer.v.<param>": AdamW moments, same global shape and
//            sharding rules as the parameter (so ZeRO-1 / tp layouts reshard like weights).
// The data position is a GLOBAL batch index, so a run resumed with another dp size continues
// with the same global batches. Also the GPT-2 parameter names and shapes (docs/checkpoint.md).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/io/number.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/data.hpp"
#include "trellis/train/rng.hpp"

namespace trellis::train {

struct TrainState {
  std::int64_t step = 0;
  Rng rng{};
  DataState data{};
};

inline constexpr const char* train_step_key = "train.step";
inline constexpr const char* train_rng_key = "train.rng";
inline constexpr const char* train_data_key = "train.data";

inline void save_train_state(CheckpointWriter& w, const TrainState& s) {
  w.set_metadata(train_step_key, std::to_string(s.step));
  w.set_metadata(train_rng_key, s.rng.to_string());
  w.set_metadata(train_data_key, s.data.to_string());
}

// `rank`'s saved state; a rank beyond the saved world size (resumed on more ranks) gets rank
// 0's step and data position and an Rng it must re-derive itself (returned as rank 0's).
// Every field is parsed strictly (train.step in [0, 2^63 - 1], next_batch likewise, the Rng as 64
// hex digits); an error names the checkpoint's index.json, the rank and the field.
inline TrainState load_train_state(const Checkpoint& ck, int rank = 0) {
  const int from = rank < ck.world_size() ? rank : 0;
  const Metadata& m = ck.rank_metadata(from);
  const std::string where = "checkpoint " + (ck.directory() / "index.json").string() + ", metadata of rank " +
                            std::to_string(from) + ", \"";
  auto get = [&](const char* key) -> const std::string& {
    auto it = m.find(key);
    if (it == m.end()) TRELLIS_THROW("checkpoint ", ck.directory(), ": no \"", key, "\" in the metadata of rank ", from);
    return it->second;
  };
  TrainState s;
  s.step = io::parse_integer<std::int64_t>(get(train_step_key), 0, std::numeric_limits<std::int64_t>::max(),
                                           where + train_step_key + "\"");
  try {
    s.rng = Rng::from_string(get(train_rng_key));
  } catch (const Error& e) {
    TRELLIS_THROW(where, train_rng_key, "\": ", e.message());
  }
  s.data = DataState::parse(get(train_data_key), where + train_data_key + "\"");
  return s;
}

// AdamW moments of this rank's box of parameter `param`.
inline void add_adamw_moments(CheckpointWriter& w, std::string_view param, const Shape& global_shape, const Box& box,
                              std::span<const float> m, std::span<const float> v) {
  const auto n = static_cast<std::size_t>(io::shape_elements(box.shape));
  TRELLIS_CHECK(m.size() == n && v.size() == n, "AdamW moments of \"", param, "\": ", m.size(), "/", v.size(),
                " elements for ", box_string(box));
  w.add(optim::adamw_m_name(param), DType::f32, global_shape, box, m.data(), CheckpointFile::optimizer);
  w.add(optim::adamw_v_name(param), DType::f32, global_shape, box, v.data(), CheckpointFile::optimizer);
}
inline void read_adamw_moments(const Checkpoint& ck, std::string_view param, const Box& box, std::span<float> m,
                               std::span<float> v) {
  const auto n = static_cast<std::size_t>(io::shape_elements(box.shape));
  TRELLIS_CHECK(m.size() == n && v.size() == n, "AdamW moments of \"", param, "\": ", m.size(), "/", v.size(),
                " elements for ", box_string(box));
  ck.read(optim::adamw_m_name(param), DType::f32, box, m.data());
  ck.read(optim::adamw_v_name(param), DType::f32, box, v.data());
}

// GPT-2's parameters, in the order and shapes of the reference checkpoints (Hugging Face
// "gpt2" safetensors, Conv1D weights stored (in, out)); the output head is tied to wte.
struct Gpt2Config {
  int n_layer = 12;
  int n_embd = 768;
  int vocab_size = 50257;
  int n_ctx = 1024;
};
struct ParameterSpec {
  std::string name;
  Shape shape;
  bool weight_decay;  // matrices decay; biases and norm weights do not
};
inline std::vector<ParameterSpec> gpt2_parameters(const Gpt2Config& c) {
  const index_t C = c.n_embd;
  std::vector<ParameterSpec> p;
  p.push_back({"wte.weight", {c.vocab_size, C}, true});
  p.push_back({"wpe.weight", {c.n_ctx, C}, true});
  for (int i = 0; i < c.n_layer; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    p.push_back({h + "ln_1.weight", {C}, false});
    p.push_back({h + "ln_1.bias", {C}, false});
    p.push_back({h + "attn.c_attn.weight", {C, 3 * C}, true});
    p.push_back({h + "attn.c_attn.bias", {3 * C}, false});
    p.push_back({h + "attn.c_proj.weight", {C, C}, true});
    p.push_back({h + "attn.c_proj.bias", {C}, false});
    p.push_back({h + "ln_2.weight", {C}, false});
    p.push_back({h + "ln_2.bias", {C}, false});
    p.push_back({h + "mlp.c_fc.weight", {C, 4 * C}, true});
    p.push_back({h + "mlp.c_fc.bias", {4 * C}, false});
    p.push_back({h + "mlp.c_proj.weight", {4 * C, C}, true});
    p.push_back({h + "mlp.c_proj.bias", {C}, false});
  }
  p.push_back({"ln_f.weight", {C}, false});
  p.push_back({"ln_f.bias", {C}, false});
  return p;
}

}  // namespace trellis::train
