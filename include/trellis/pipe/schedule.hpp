// Pipeline schedules as data: a per-rank list of actions {F, B, W, send, recv} x microbatch x
// chunk. Everything else in trellis/pipe (generators, text format, verifier, simulator, executor,
// pictures) reads or writes this one representation.
//
// Vocabulary
//   p = stages   pipeline ranks
//   m            microbatches per step
//   v = chunks   model chunks held by each rank; the model is cut into S = p*v "virtual stages"
//   placement    which rank/chunk holds virtual stage s:
//                  loop (Megatron interleaved): s = chunk*p + rank      (v = 1 is plain 1F1B/GPipe)
//                  vee  (ZB-V, DualPipeV, v = 2): chunk 0 holds s = rank, chunk 1 holds 2p-1-rank,
//                       so the data goes down the ranks and comes back up.
//   F(mb, c)     forward of microbatch mb through this rank's chunk c
//   B(mb, c)     backward for the input (gradient w.r.t. the chunk's input activation)
//   W(mb, c)     backward for the weights (parameter gradients); a full backward is B then W
//   send/recv    carry a direction (activation forward, gradient backward) and the peer rank.
//                The chunk of a send is the sender's chunk that produced the data; the chunk of a
//                recv is the receiver's chunk that consumes it.
// Local learning (PPLL-style): every virtual stage trains against its own auxiliary loss, so B
// needs no gradient from the next stage and no gradient travels between stages.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trellis/core/error.hpp"

namespace trellis::pipe {

enum class ActionKind : std::uint8_t { forward, backward_input, backward_weight, send, recv };
enum class Direction : std::uint8_t { activation, gradient };
enum class Placement : std::uint8_t { loop, vee };

struct Action {
  ActionKind kind = ActionKind::forward;
  int microbatch = 0;
  int chunk = 0;
  Direction direction = Direction::activation;  // send/recv only
  int peer = -1;                                // send/recv only

  bool is_compute() const {
    return kind == ActionKind::forward || kind == ActionKind::backward_input ||
           kind == ActionKind::backward_weight;
  }
  bool is_comm() const { return !is_compute(); }
  friend bool operator==(const Action& a, const Action& b) {
    if (a.kind != b.kind || a.microbatch != b.microbatch || a.chunk != b.chunk) return false;
    return a.is_compute() || (a.direction == b.direction && a.peer == b.peer);
  }
};

inline Action forward_action(int mb, int chunk = 0) { return {ActionKind::forward, mb, chunk}; }
inline Action backward_input_action(int mb, int chunk = 0) { return {ActionKind::backward_input, mb, chunk}; }
inline Action backward_weight_action(int mb, int chunk = 0) {
  return {ActionKind::backward_weight, mb, chunk};
}
inline Action send_action(Direction d, int mb, int chunk, int peer) {
  return {ActionKind::send, mb, chunk, d, peer};
}
inline Action recv_action(Direction d, int mb, int chunk, int peer) {
  return {ActionKind::recv, mb, chunk, d, peer};
}

// The action's token in the text format (docs/pipe.md): F3, B3.1, W0, Sa3.1>2, Rg0<1 ...
// The ".chunk" suffix is written when the schedule has more than one chunk per rank.
inline std::string action_token(const Action& a, bool with_chunk = true) {
  std::string out;
  switch (a.kind) {
    case ActionKind::forward:
      out = "F";
      break;
    case ActionKind::backward_input:
      out = "B";
      break;
    case ActionKind::backward_weight:
      out = "W";
      break;
    case ActionKind::send:
      out = a.direction == Direction::activation ? "Sa" : "Sg";
      break;
    case ActionKind::recv:
      out = a.direction == Direction::activation ? "Ra" : "Rg";
      break;
  }
  out += std::to_string(a.microbatch);
  if (with_chunk) out += "." + std::to_string(a.chunk);
  if (a.kind == ActionKind::send) out += ">" + std::to_string(a.peer);
  if (a.kind == ActionKind::recv) out += "<" + std::to_string(a.peer);
  return out;
}

// A sentence for error messages: "forward of microbatch 3, chunk 1 (F3.1)".
inline std::string describe(const Action& a) {
  std::string what;
  switch (a.kind) {
    case ActionKind::forward:
      what = "forward";
      break;
    case ActionKind::backward_input:
      what = "backward-input";
      break;
    case ActionKind::backward_weight:
      what = "backward-weight";
      break;
    case ActionKind::send:
      what = "send";
      break;
    case ActionKind::recv:
      what = "recv";
      break;
  }
  if (a.is_comm()) what += a.direction == Direction::activation ? " activation" : " gradient";
  what += " of microbatch " + std::to_string(a.microbatch) + ", chunk " + std::to_string(a.chunk);
  if (a.kind == ActionKind::send) what += " to rank " + std::to_string(a.peer);
  if (a.kind == ActionKind::recv) what += " from rank " + std::to_string(a.peer);
  return what + " (" + action_token(a) + ")";
}

struct StageSlot {
  int rank;
  int chunk;
};

struct Schedule {
  std::string name;
  int stages = 1;        // p: pipeline ranks
  int microbatches = 1;  // m
  int chunks = 1;        // v: model chunks per rank
  Placement placement = Placement::loop;
  bool local_learning = false;  // every stage has its own loss: no backward messages
  // A B directly followed by its own W is one full backward (one fused kernel): its gradient is
  // sent after the W. Without this flag every gradient is sent right after its B (zero-bubble
  // schedules, where W is deliberately off the critical path).
  bool full_backward = false;
  std::vector<std::vector<Action>> ranks;  // ranks[r] = rank r's actions, in program order

  int virtual_stages() const { return stages * chunks; }

  // Virtual stage (0 .. p*v-1, model order) held by `rank`'s chunk `chunk`.
  int virtual_stage(int rank, int chunk) const {
    if (placement == Placement::vee) return chunk == 0 ? rank : 2 * stages - 1 - rank;
    return chunk * stages + rank;
  }
  StageSlot locate(int stage) const {
    if (placement == Placement::vee)
      return stage < stages ? StageSlot{stage, 0} : StageSlot{2 * stages - 1 - stage, 1};
    return {stage % stages, stage / stages};
  }
  bool is_first(int rank, int chunk) const { return virtual_stage(rank, chunk) == 0; }
  bool is_last(int rank, int chunk) const { return virtual_stage(rank, chunk) == virtual_stages() - 1; }
  // Where rank/chunk's forward output goes (next virtual stage) and where its input gradient goes.
  StageSlot next_slot(int rank, int chunk) const { return locate(virtual_stage(rank, chunk) + 1); }
  StageSlot prev_slot(int rank, int chunk) const { return locate(virtual_stage(rank, chunk) - 1); }

  // Checks the shape fields (not the action lists: see verify()).
  void check_shape() const {
    if (stages < 1) TRELLIS_THROW("pipe schedule '", name, "': stages must be >= 1, got ", stages);
    if (microbatches < 1)
      TRELLIS_THROW("pipe schedule '", name, "': microbatches must be >= 1, got ", microbatches);
    if (chunks < 1) TRELLIS_THROW("pipe schedule '", name, "': chunks must be >= 1, got ", chunks);
    if (placement == Placement::vee && chunks != 2)
      TRELLIS_THROW("pipe schedule '", name, "': the vee placement needs exactly 2 chunks per rank, got ",
                    chunks);
    if (static_cast<int>(ranks.size()) != stages)
      TRELLIS_THROW("pipe schedule '", name, "': has action lists for ", ranks.size(),
                    " ranks but stages = ", stages);
  }
};

// The same schedule with only its compute actions (F/B/W), in the same order.
inline Schedule compute_only(Schedule s) {
  for (auto& list : s.ranks) {
    std::vector<Action> kept;
    for (const auto& a : list)
      if (a.is_compute()) kept.push_back(a);
    list = std::move(kept);
  }
  return s;
}

// Inserts the communication the compute actions need: a recv right before the F (B) that
// consumes a remote activation (gradient), a send right after the F (B) that produces one.
// Existing send/recv actions are dropped first, so the result depends only on the compute order.
// With buffered (asynchronous) sends this placement never adds a wait that the compute order does
// not already imply.
inline Schedule insert_communication(Schedule s) {
  s.check_shape();
  s = compute_only(std::move(s));
  for (int r = 0; r < s.stages; ++r) {
    std::vector<Action> out;
    out.reserve(s.ranks[r].size() * 2);
    Action pending_after_weight{};  // a full backward's gradient send, placed after its W
    bool has_pending = false;
    for (const auto& a : s.ranks[r]) {
      const int c = a.chunk;
      const bool valid_chunk = c >= 0 && c < s.chunks;
      if (!valid_chunk) {  // left for the verifier to report
        out.push_back(a);
        continue;
      }
      if (a.kind == ActionKind::forward) {
        if (!s.is_first(r, c)) {
          auto prev = s.prev_slot(r, c);
          if (prev.rank != r) out.push_back(recv_action(Direction::activation, a.microbatch, c, prev.rank));
        }
        out.push_back(a);
        if (!s.is_last(r, c)) {
          auto next = s.next_slot(r, c);
          if (next.rank != r) out.push_back(send_action(Direction::activation, a.microbatch, c, next.rank));
        }
      } else if (a.kind == ActionKind::backward_input && !s.local_learning) {
        if (!s.is_last(r, c)) {
          auto next = s.next_slot(r, c);
          if (next.rank != r) out.push_back(recv_action(Direction::gradient, a.microbatch, c, next.rank));
        }
        out.push_back(a);
        if (!s.is_first(r, c)) {
          auto prev = s.prev_slot(r, c);
          if (prev.rank != r) {
            const auto& list = s.ranks[r];
            const std::size_t i = static_cast<std::size_t>(&a - list.data());
            if (s.full_backward && i + 1 < list.size() &&
                list[i + 1] == backward_weight_action(a.microbatch, c)) {
              pending_after_weight = send_action(Direction::gradient, a.microbatch, c, prev.rank);
              has_pending = true;
            } else {
              out.push_back(send_action(Direction::gradient, a.microbatch, c, prev.rank));
            }
          }
        }
      } else if (a.kind == ActionKind::backward_weight && has_pending) {
        out.push_back(a);
        out.push_back(pending_after_weight);
        has_pending = false;
      } else {
        out.push_back(a);
      }
    }
    s.ranks[r] = std::move(out);
  }
  return s;
}

// Splits `layers` layers over `parts` consecutive chunks (virtual stages), as evenly as possible;
// the first `layers % parts` chunks get one layer more. Returns parts+1 boundaries: chunk i holds
// layers [bounds[i], bounds[i+1]). Every layer lands in exactly one chunk.
inline std::vector<int> split_layers(int layers, int parts) {
  if (parts < 1) TRELLIS_THROW("split_layers: parts must be >= 1, got ", parts);
  if (layers < parts)
    TRELLIS_THROW("split_layers: cannot split ", layers, " layers over ", parts,
                  " chunks: every chunk needs at least one layer");
  std::vector<int> bounds(static_cast<std::size_t>(parts) + 1, 0);
  const int base = layers / parts, extra = layers % parts;
  for (int i = 0; i < parts; ++i) bounds[i + 1] = bounds[i] + base + (i < extra ? 1 : 0);
  return bounds;
}

}  // namespace trellis::pipe
