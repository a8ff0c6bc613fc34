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

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <tuple>
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

  // Bound on stages * chunks (check_shape), so that virtual stage numbers and their neighbours
  // (+-1) fit in an int.
  static constexpr int max_virtual_stages = 1 << 30;

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
    if (static_cast<std::int64_t>(stages) * chunks > max_virtual_stages)  // virtual_stage() is int arithmetic
      TRELLIS_THROW("pipe schedule '", name, "': ", stages, " stages x ", chunks, " chunks is more than ",
                    max_virtual_stages, " virtual stages");
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

namespace detail {

// Identifies one message: direction, microbatch, consuming virtual stage (a send and its receive
// have the same key).
using MessageKey = std::tuple<int, int, int>;

inline MessageKey message_of(const Schedule& s, int rank, const Action& a) {
  const int vs = s.virtual_stage(rank, a.chunk);
  int consumer = vs;
  if (a.kind == ActionKind::send) consumer = a.direction == Direction::activation ? vs + 1 : vs - 1;
  return {static_cast<int>(a.direction), a.microbatch, consumer};
}

// A recv right before the F (B) that consumes a remote activation (gradient), a send right after
// the F (B) that produces one (after the W of a full backward).
inline Schedule communication_at_use(Schedule s) {
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

// When each rank starts each compute action if the schedule runs with unit costs, buffered sends
// and instant messages: starts[r][k] for compute k, starts[r][n] = infinity after the last one;
// sent[key] = when each message leaves. False when the run does not finish (an order verify()
// rejects).
inline bool unit_cost_run(const Schedule& s, std::vector<std::vector<double>>& starts,
                          std::map<MessageKey, double>& sent) {
  const int p = s.stages;
  std::vector<std::size_t> pc(p, 0);
  std::vector<double> clock(p, 0.0);
  starts.assign(static_cast<std::size_t>(p), {});
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r)
      for (; pc[r] < s.ranks[r].size(); ++pc[r], progress = true) {
        const Action& a = s.ranks[r][pc[r]];
        if (a.kind == ActionKind::recv) {
          auto it = sent.find(message_of(s, r, a));
          if (it == sent.end()) break;
          clock[r] = std::max(clock[r], it->second);
        } else if (a.kind == ActionKind::send) {
          sent[message_of(s, r, a)] = clock[r];
        } else {
          starts[r].push_back(clock[r]);
          clock[r] += 1;
        }
      }
  }
  for (int r = 0; r < p; ++r) {
    if (pc[r] < s.ranks[r].size()) return false;
    starts[r].push_back(std::numeric_limits<double>::infinity());
  }
  return true;
}

// Moves receives earlier so that the schedule also runs when every send waits for its receive
// and messages between two ranks match in the order posted (rendezvous: NCCL groups). First each
// rank's receives from one peer are put in the order the peer sends them. Then the ranks run
// abstractly as verify() runs them in rendezvous mode; whenever all are stuck, each send still
// waiting for a receive its peer has not reached gets that receive moved to where the peer stands
// (into the run of comm actions it is blocked at), unless the message leaves later in the
// unit-cost run than the peer's next compute starts there. Hence the unit-cost timeline does not
// change, and no cycle of waits is left: with every movable receive moved, each rank in a chain of
// waits stands at a run whose next compute starts strictly later (unit-cost run) than that of the
// rank it waits for. An order that already runs with rendezvous sends is left exactly as it is.
// Lists verify() would reject (duplicates, an order stuck with buffered sends) are left alone.
inline void pair_for_rendezvous(Schedule& s) {
  const int p = s.stages;
  std::vector<std::vector<double>> starts;
  std::map<MessageKey, double> sent;
  if (!unit_cost_run(s, starts, sent)) return;
  // slots[r][k]: the comm actions before rank r's compute k (k == n: after its last compute)
  std::vector<std::vector<Action>> computes(p);
  std::vector<std::vector<std::vector<Action>>> slots(p);
  std::map<MessageKey, std::pair<int, std::size_t>> recv_at;  // key -> (rank, slot)
  std::map<MessageKey, std::size_t> sent_as;                  // key -> index in the sender's list
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < s.ranks[r].size(); ++i)
      if (s.ranks[r][i].kind == ActionKind::send && !sent_as.emplace(message_of(s, r, s.ranks[r][i]), i).second)
        return;  // duplicate: verify()
  // (receiver, sender) -> the messages between them: (index in the sender's list, key)
  std::map<std::pair<int, int>, std::vector<std::pair<std::size_t, MessageKey>>> streams;
  for (int r = 0; r < p; ++r) {
    slots[r].emplace_back();
    for (const Action& a : s.ranks[r]) {
      if (a.is_compute()) {
        computes[r].push_back(a);
        slots[r].emplace_back();
        continue;
      }
      const auto key = message_of(s, r, a);
      if (a.kind == ActionKind::recv) {
        if (!sent_as.count(key) || !recv_at.emplace(key, std::pair{r, computes[r].size()}).second) return;
        streams[{r, a.peer}].emplace_back(sent_as[key], key);
      }
      slots[r].back().push_back(a);
    }
  }
  auto move_recv = [&](const MessageKey& key, std::size_t to) {
    auto& where = recv_at[key];  // (rank, slot); not a structured binding: clang 14 cannot capture one
    const int q = where.first;
    std::size_t& slot = where.second;
    auto& from = slots[q][slot];
    auto it = std::find_if(from.begin(), from.end(), [&](const Action& a) {
      return a.kind == ActionKind::recv && message_of(s, q, a) == key;
    });
    slots[q][to].push_back(*it);
    from.erase(it);
    slot = to;
  };
  // NCCL has no tags: messages between two ranks match in the order they are posted. So a receive
  // goes no later than that of a message its peer sends afterwards (its data leaves first).
  for (auto& stream : streams) {
    auto& messages = stream.second;
    std::sort(messages.begin(), messages.end());
    std::size_t latest = std::numeric_limits<std::size_t>::max();
    for (auto it = messages.rbegin(); it != messages.rend(); ++it) {
      if (recv_at[it->second].second > latest) move_recv(it->second, latest);
      latest = recv_at[it->second].second;
    }
  }
  std::vector<std::size_t> at(p, 0);  // the slot each rank stands at
  std::set<MessageKey> send_posted, recv_posted;
  for (;;) {
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < p; ++r)
        for (;;) {
          bool done = true;
          for (const Action& a : slots[r][at[r]]) {
            const auto key = message_of(s, r, a);
            (a.kind == ActionKind::send ? send_posted : recv_posted).insert(key);
            done = done && (a.kind == ActionKind::send ? recv_posted : send_posted).count(key) > 0;
          }
          if (!done || at[r] == computes[r].size()) break;
          ++at[r];
          progress = true;
        }
    }
    std::vector<std::pair<MessageKey, int>> moves;  // (message, receiving rank)
    bool finished = true;
    for (int r = 0; r < p; ++r)
      for (const Action& a : slots[r][at[r]]) {
        const auto key = message_of(s, r, a);
        const bool waiting = a.kind == ActionKind::send ? !recv_posted.count(key) : !send_posted.count(key);
        finished = finished && !waiting;
        if (a.kind != ActionKind::send || !waiting || !recv_at.count(key)) continue;
        const int q = recv_at[key].first;
        if (starts[q][at[q]] >= sent[key]) moves.emplace_back(key, q);
      }
    if (finished) break;
    if (moves.empty()) return;  // not expected for an order that runs with buffered sends
    // earlier messages from the same peer are received already (its sends complete in order),
    // so the order of each stream holds
    for (const auto& [key, q] : moves) {
      move_recv(key, at[q]);
      recv_posted.insert(key);
    }
  }
  for (int r = 0; r < p; ++r) {
    std::vector<Action> out;
    for (std::size_t k = 0; k < slots[r].size(); ++k) {
      // sends first, then receives by peer, each peer's in the order it sends them
      std::stable_sort(slots[r][k].begin(), slots[r][k].end(), [&](const Action& a, const Action& b) {
        auto order = [&](const Action& x) {
          return x.kind == ActionKind::send ? std::pair{-1, std::size_t{0}}
                                            : std::pair{x.peer, sent_as[message_of(s, r, x)]};
        };
        return order(a) < order(b);
      });
      out.insert(out.end(), slots[r][k].begin(), slots[r][k].end());
      if (k < computes[r].size()) out.push_back(computes[r][k]);
    }
    s.ranks[r] = std::move(out);
  }
}

}  // namespace detail

// Where insert_communication() puts the receives (sends always go right after their producer).
enum class CommPlacement : std::uint8_t {
  // right before the consumer, then moved earlier where the ranks would otherwise wait for each
  // other's receives: passes verify() with buffered and with rendezvous sends (any order that
  // passes with buffered sends). The moved receive pairs with a send, as Megatron's
  // send_forward_recv_forward does.
  paired,
  // right before the consumer only: the fewest receive buffers alive; some orders (interleaved,
  // vee) then need buffered sends.
  at_use,
};

// Inserts the communication the compute order needs; existing send/recv actions are dropped
// first, so the result depends only on the compute order. Neither placement adds a wait to the
// unit-cost run (t_F = t_B = t_W, instant messages) that the compute order does not imply.
inline Schedule insert_communication(Schedule s, CommPlacement placement = CommPlacement::paired) {
  s.check_shape();
  s = detail::communication_at_use(std::move(s));
  for (const auto& list : s.ranks)
    for (const auto& a : list)
      if (a.microbatch < 0 || a.microbatch >= s.microbatches || a.chunk < 0 || a.chunk >= s.chunks)
        return s;  // left for the verifier to report
  if (placement == CommPlacement::paired) detail::pair_for_rendezvous(s);
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
