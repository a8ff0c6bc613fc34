// What a trainer checkpoints besides the weights, under fixed names:
//   metadata "train.step"  optimizer steps done          (every rank; rank 0's is canonical)
//            "train.rng"   this rank's Rng state (64 hex digits)
//            "train.data"  the loader position "seed=<n>;next_batch=<n>"
//   tensors  "optimizer.m.<param>", "optimizer.v.<param>": AdamW moments, same global shape and
//            sharding rules as the parameter (so ZeRO-1 / tp layouts reshard like weights).
// The data position is a GLOBAL batch index, so a run resumed with another dp size continues
// with the same global batches. At load the ranks must agree (open_checkpoint_collectively: the
// same index; check_saved_train_states: the saved ranks fit together; agree_on_train_state: what
// each rank loaded; read_tensors_collectively: every rank read its tensors, checksums intact):
// otherwise every rank throws the same error naming the checkpoint. Also the GPT-2 parameter
// names and shapes (docs/checkpoint.md).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
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

namespace detail {
inline TrainState parse_train_state(const Checkpoint& ck, int from) {
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
}  // namespace detail

// Every saved rank's train state, in rank order.
inline std::vector<TrainState> load_saved_train_states(const Checkpoint& ck) {
  std::vector<TrainState> out;
  for (int r = 0; r < ck.world_size(); ++r) out.push_back(detail::parse_train_state(ck, r));
  return out;
}

// `rank`'s saved state; a rank beyond the saved world size (resumed on more ranks) gets rank
// 0's step and data position and an Rng it must re-derive itself (returned as rank 0's).
// Every field is parsed strictly (train.step in [0, 2^63 - 1], next_batch likewise, the Rng as 64
// hex digits); an error names the checkpoint's index.json, the rank and the field. Every saved
// rank's fields are parsed, in rank order, so a malformed one throws the same error on every
// rank (not only on the rank that reads it, leaving the others waiting in a collective).
inline TrainState load_train_state(const Checkpoint& ck, int rank = 0) {
  std::vector<TrainState> all = load_saved_train_states(ck);
  return all.at(static_cast<std::size_t>(rank < ck.world_size() ? rank : 0));
}

namespace detail {
// "0-2, 5, 7-8"
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return out;
}
// Empty when every rank has the same value, else "ranks 0-2: <value>; rank 3: <value>".
inline std::string disagreement(const std::vector<std::string>& per_rank) {
  std::map<std::string, std::vector<int>> groups;
  for (std::size_t r = 0; r < per_rank.size(); ++r) groups[per_rank[r]].push_back(static_cast<int>(r));
  if (groups.size() <= 1) return {};
  std::vector<std::pair<std::vector<int>, std::string>> ordered;  // by first rank
  for (auto& [value, ranks] : groups) ordered.emplace_back(std::move(ranks), value);
  std::sort(ordered.begin(), ordered.end());
  std::string out;
  for (const auto& [ranks, value] : ordered)
    out += (out.empty() ? "" : "; ") + std::string(ranks.size() > 1 ? "ranks " : "rank ") + rank_list(ranks) +
           ": " + value;
  return out;
}
// Two ranks with the same Rng state, if any.
inline std::optional<std::pair<int, int>> same_rng(const std::vector<Rng::State>& states) {
  std::vector<std::pair<Rng::State, int>> sorted;
  for (std::size_t r = 0; r < states.size(); ++r) sorted.emplace_back(states[r], static_cast<int>(r));
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i].first == sorted[i - 1].first) return std::pair{sorted[i - 1].second, sorted[i].second};
  return std::nullopt;
}

// The helpers below are collective over `comm`, and every rank builds its message from the same
// gathered strings: all ranks throw an Error with the same message(), or none does.

// Every rank's `text`, in rank order (two all_gathers: lengths, then the padded bytes).
template <class C>
std::vector<std::string> all_gather_strings(C& comm, const std::string& text) {
  const auto n = static_cast<std::size_t>(comm.size());
  const std::uint64_t length = text.size();
  std::vector<std::uint64_t> lengths(n);
  comm.all_gather(&length, lengths.data(), 1);
  const auto longest = static_cast<std::size_t>(*std::max_element(lengths.begin(), lengths.end()));
  std::vector<std::uint8_t> mine(longest), all(longest * n);
  std::copy(text.begin(), text.end(), mine.begin());
  if (longest > 0) comm.all_gather(mine.data(), all.data(), longest);
  std::vector<std::string> out(n);
  for (std::size_t r = 0; r < n; ++r)
    out[r].assign(reinterpret_cast<const char*>(all.data() + r * longest), static_cast<std::size_t>(lengths[r]));
  return out;
}
// `error` is "" on ranks that succeeded; if any failed, all throw the lowest failed rank's error.
template <class C>
void throw_if_any_rank_failed(C& comm, const std::string& error) {
  const std::vector<std::string> errors = all_gather_strings(comm, error);
  std::vector<int> failed;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) failed.push_back(static_cast<int>(r));
  if (failed.empty()) return;
  TRELLIS_THROW(errors[static_cast<std::size_t>(failed[0])],
                failed.size() < errors.size()
                    ? " (on rank(s) " + rank_list(failed) + " of " + std::to_string(errors.size()) + ")"
                    : "");
}
// If the ranks' `value`s differ, all throw "<what>: ranks 0-2: <value>; rank 3: <value>".
template <class C>
void throw_unless_all_equal(C& comm, const std::string& value, const std::string& what) {
  if (auto d = disagreement(all_gather_strings(comm, value)); !d.empty()) TRELLIS_THROW(what, ": ", d);
}
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}
inline std::string checkpoint_identity(const Checkpoint& ck) {
  return ck.directory().string() + " (step " + std::to_string(ck.step()) + ", index crc32c " +
         io::crc_hex(ck.index_checksum()) + ")";
}
}  // namespace detail

// Collective over `comm`: every rank opens the checkpoint at `path` (a step directory or a root
// holding `latest`). When a rank cannot, every rank throws its error; when the ranks opened
// different checkpoints (node-local copies that differ, a `latest` that moved between the ranks'
// reads), every rank throws naming each (directory, step, index checksum) with its ranks. So
// what the ranks check on the index afterwards fails on all of them or none.
template <class C>
Checkpoint open_checkpoint_collectively(const std::filesystem::path& path, C& comm) {
  std::optional<Checkpoint> ck;
  detail::throw_if_any_rank_failed(comm, detail::error_of([&] { ck.emplace(path); }));
  detail::throw_unless_all_equal(comm, detail::checkpoint_identity(*ck), "the ranks did not open the same checkpoint");
  return std::move(*ck);
}

// What the saved ranks must agree on, read from the index alone, so every rank that opened the
// same checkpoint throws the same error: each rank's train.step is the checkpoint's step; all
// saved the same data position (a GLOBAL batch index: every dp group reads its rows of the same
// global batches, so one rank ahead would make its dp group train on other batches, silently);
// no two saved the same Rng state (rank r's stream descends from Rng(seed, r): a copy means a
// corrupted or edited state).
inline void check_saved_train_states(const Checkpoint& ck) {
  const std::string where = "checkpoint " + ck.directory().string();
  const std::vector<TrainState> states = load_saved_train_states(ck);
  std::vector<std::string> data;
  std::vector<Rng::State> rngs;
  for (std::size_t r = 0; r < states.size(); ++r) {
    if (states[r].step != ck.step())
      TRELLIS_THROW(where, ": rank ", r, " saved ", train_step_key, " ", states[r].step, " in a checkpoint of step ",
                    ck.step());
    data.push_back(states[r].data.to_string());
    rngs.push_back(states[r].rng.state());
  }
  if (auto d = detail::disagreement(data); !d.empty())
    TRELLIS_THROW(where, ": the ranks saved different data positions (", train_data_key,
                  "), but all ranks read the same global batches: ", d);
  if (auto twins = detail::same_rng(rngs))
    TRELLIS_THROW(where, ": ranks ", twins->first, " and ", twins->second, " saved the same Rng state (", train_rng_key,
                  "); each rank draws its own stream, so one was copied or corrupted");
}

// Collective over `world`, on every rank after it loaded `mine` from `ck` (a rank the checkpoint
// did not have re-derives its Rng first): check_saved_train_states, then the ranks compare what
// they hold: the same checkpoint (directory, step and index checksum), step and data position,
// and pairwise different Rng states. Any failure, on any rank, throws on every rank an Error with
// the same message, naming the checkpoint; no rank is left waiting in a later collective.
// Needs a communicator of host memory (thread ranks, MPI).
template <class C>
void agree_on_train_state(const Checkpoint& ck, const TrainState& mine, C& world) {
  detail::throw_if_any_rank_failed(world, detail::error_of([&] { check_saved_train_states(ck); }));
  detail::throw_unless_all_equal(world, detail::checkpoint_identity(ck), "the ranks did not load the same checkpoint");
  const std::string where = "checkpoint " + ck.directory().string();
  detail::throw_unless_all_equal(world, std::to_string(mine.step), where + ": the ranks loaded different steps");
  detail::throw_unless_all_equal(world, mine.data.to_string(),
                                 where + ": the ranks loaded different data positions, but all ranks read the "
                                         "same global batches");
  const Rng::State& g = mine.rng.state();
  std::vector<std::uint64_t> all(4 * static_cast<std::size_t>(world.size()));
  world.all_gather(g.data(), all.data(), 4);
  std::vector<Rng::State> rngs;
  for (std::size_t r = 0; r < all.size(); r += 4) rngs.push_back({all[r], all[r + 1], all[r + 2], all[r + 3]});
  if (auto twins = detail::same_rng(rngs))
    TRELLIS_THROW(where, ": ranks ", twins->first, " and ", twins->second,
                  " hold the same Rng state after loading; each rank draws its own stream");
}

// Collective over `world`: runs `read` (this rank's reads of tensors from `ck`), then one status
// exchange. Each rank reads only its own boxes, so a corrupt shard (CRC32C mismatch), a missing
// tensor or a failed read is found only by the ranks that read it; the others would go on and
// wait in a later collective. Instead every rank throws the same Error: the checkpoint, the lowest
// failing rank and its error (file and tensor), and every rank that failed. Needs a communicator
// of host memory (thread ranks, MPI; a trainer stages a device one, Trainer::with_host_world).
template <class C, class F>
void read_tensors_collectively(const Checkpoint& ck, C& world, F&& read) {
  const std::vector<std::string> errors = detail::all_gather_strings(world, detail::error_of(std::forward<F>(read)));
  std::vector<int> failed;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) failed.push_back(static_cast<int>(r));
  if (failed.empty()) return;
  TRELLIS_THROW("checkpoint ", ck.directory().string(), ": rank ", failed[0], " could not read its tensors: ",
                errors[static_cast<std::size_t>(failed[0])], " (failed on rank", failed.size() > 1 ? "s " : " ",
                detail::rank_list(failed), " of ", errors.size(), ")");
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
// "gpt2" safetensors, Conv1D weights stored (in, out)); the output head is tied to wte. With
// moe_every > 0, the MoE blocks' router and experts (trellis' names; not a Hugging Face model).
struct Gpt2Config {
  int n_layer = 12;
  int n_embd = 768;
  int vocab_size = 50257;
  int n_ctx = 1024;
  int moe_every = 0;  // > 0: block i % moe_every == 0 has `experts` experts instead of the dense MLP
  int experts = 0;
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
    if (c.moe_every > 0 && i % c.moe_every == 0) {  // nn/moe.hpp
      const index_t E = c.experts;
      p.push_back({h + "mlp.router.weight", {C, E}, true});
      p.push_back({h + "mlp.experts.c_fc.weight", {E, C, 4 * C}, true});
      p.push_back({h + "mlp.experts.c_fc.bias", {E, 4 * C}, false});
      p.push_back({h + "mlp.experts.c_proj.weight", {E, 4 * C, C}, true});
      p.push_back({h + "mlp.experts.c_proj.bias", {E, C}, false});
      continue;
    }
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
