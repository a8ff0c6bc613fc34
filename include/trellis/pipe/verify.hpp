// The schedule verifier: rejects a broken schedule before anything runs, with a message that names
// the rank, the action and what it waits for. Checks, in order:
//   1. shape and ranges (microbatch, chunk, peer);
//   2. every rank runs each of its F, B, W exactly once per microbatch and chunk;
//   3. every send/recv is one the data flow needs, and every send has its receive (peer,
//      microbatch, chunk, direction) and vice versa; with rendezvous sends also that each rank
//      receives a peer's messages in the order the peer sends them (NCCL has no tags: it matches
//      the messages between two ranks in the order they are posted);
//   4. each action's inputs exist when it runs, in its own rank's order: F of a chunk needs the
//      previous stage's activation (a recv, or the local F when the previous stage is on the same
//      rank), B needs its F and the output gradient, W needs its B, a send needs its producer;
//   5. no deadlock: the ranks are run abstractly with blocking receives and either buffered sends
//      (asynchronous, as the executor does them) or rendezvous sends (a send completes only when
//      the receiver has posted the matching recv). A run of consecutive send/recv actions is posted
//      at once, like a batched point-to-point call (Megatron's send_forward_recv_backward), and the
//      executor does the same (with isend it waits for a receive only at its consumer, later than
//      assumed here, which cannot add a deadlock). A deadlock is reported with the cycle of waits.
#pragma once

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/pipe/schedule.hpp"

namespace trellis::pipe {

enum class SendMode : std::uint8_t {
  buffered,    // sends never block (isend): what the executor does
  rendezvous,  // a send blocks until its receive is posted, and messages between two ranks match
               // in the order posted (NCCL's point-to-point; MPI_Ssend)
};

struct VerifyOptions {
  SendMode mode = SendMode::buffered;
};

namespace detail {

[[noreturn]] inline void schedule_error(const Schedule& s, int rank, const std::string& msg) {
  TRELLIS_THROW("pipe schedule '", s.name, "': rank ", rank, ": ", msg);
}

inline std::string expected_partner(const Schedule& s, int rank, const Action& a) {
  const int vs = s.virtual_stage(rank, a.chunk);
  if (a.kind == ActionKind::send) {
    const int consumer = a.direction == Direction::activation ? vs + 1 : vs - 1;
    auto slot = s.locate(consumer);
    return action_token(recv_action(a.direction, a.microbatch, slot.chunk, rank));
  }
  const int producer = a.direction == Direction::activation ? vs - 1 : vs + 1;
  auto slot = s.locate(producer);
  return action_token(send_action(a.direction, a.microbatch, slot.chunk, rank));
}

}  // namespace detail

// The message a send or recv action belongs to: (direction, microbatch, consuming virtual stage);
// a send and its receive have the same key.
using MessageKey = detail::MessageKey;
inline MessageKey message_key(const Schedule& s, int rank, const Action& a) {
  return detail::message_of(s, rank, a);
}

// Throws trellis::Error describing the first problem found; returns normally for a good schedule.
inline void verify(const Schedule& s, const VerifyOptions& options = {}) {
  s.check_shape();
  const int p = s.stages, m = s.microbatches, v = s.chunks;

  // 1. ranges
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Action& a = s.ranks[r][i];
      auto where = [&] { return "action " + std::to_string(i) + " (" + action_token(a) + ")"; };
      if (a.microbatch < 0 || a.microbatch >= m)
        detail::schedule_error(s, r,
                               where() + ": microbatch " + std::to_string(a.microbatch) +
                                   " is out of range [0, " + std::to_string(m) + ")");
      if (a.chunk < 0 || a.chunk >= v)
        detail::schedule_error(s, r,
                               where() + ": chunk " + std::to_string(a.chunk) + " is out of range [0, " +
                                   std::to_string(v) + ")");
      if (a.is_comm() && (a.peer < 0 || a.peer >= p || a.peer == r))
        detail::schedule_error(s, r,
                               where() + ": peer " + std::to_string(a.peer) + " is not another rank of [0, " +
                                   std::to_string(p) + ")");
    }

  // 2. every compute action exactly once
  for (int r = 0; r < p; ++r) {
    std::map<std::tuple<int, int, int>, int> count;  // (kind, mb, chunk)
    for (const auto& a : s.ranks[r])
      if (a.is_compute()) ++count[{static_cast<int>(a.kind), a.microbatch, a.chunk}];
    for (int c = 0; c < v; ++c)
      for (int mb = 0; mb < m; ++mb)
        for (ActionKind k : {ActionKind::forward, ActionKind::backward_input, ActionKind::backward_weight}) {
          int n = count[{static_cast<int>(k), mb, c}];
          Action a{k, mb, c};
          if (n == 0) detail::schedule_error(s, r, describe(a) + " never runs");
          if (n > 1) detail::schedule_error(s, r, describe(a) + " runs " + std::to_string(n) + " times");
        }
  }

  // 3. communication: needed by the data flow, and matched
  std::map<detail::MessageKey, std::pair<int, Action>> sends, recvs;  // key -> (rank, action)
  for (int r = 0; r < p; ++r)
    for (const auto& a : s.ranks[r]) {
      if (!a.is_comm()) continue;
      const bool grad = a.direction == Direction::gradient;
      if (grad && s.local_learning)
        detail::schedule_error(s, r,
                               describe(a) + ": a local-learning schedule sends no gradients between stages");
      bool ok = true;
      if (a.kind == ActionKind::send) {
        if (grad ? s.is_first(r, a.chunk) : s.is_last(r, a.chunk))
          ok = false;
        else
          ok = (grad ? s.prev_slot(r, a.chunk) : s.next_slot(r, a.chunk)).rank == a.peer;
      } else {
        if (grad ? s.is_last(r, a.chunk) : s.is_first(r, a.chunk))
          ok = false;
        else
          ok = (grad ? s.next_slot(r, a.chunk) : s.prev_slot(r, a.chunk)).rank == a.peer;
      }
      if (!ok)
        detail::schedule_error(s, r,
                               describe(a) + " does not follow the data flow of the " +
                                   (s.placement == Placement::vee ? "vee" : "loop") + " placement");
      auto& table = a.kind == ActionKind::send ? sends : recvs;
      auto key = detail::message_of(s, r, a);
      if (table.count(key)) detail::schedule_error(s, r, describe(a) + " appears twice");
      table[key] = {r, a};
    }
  for (const auto& [key, ra] : sends)
    if (!recvs.count(key))
      detail::schedule_error(s, ra.first,
                             describe(ra.second) + " has no matching receive: rank " +
                                 std::to_string(ra.second.peer) + " never runs " +
                                 detail::expected_partner(s, ra.first, ra.second));
  for (const auto& [key, ra] : recvs)
    if (!sends.count(key))
      detail::schedule_error(s, ra.first,
                             describe(ra.second) + " has no matching send: rank " +
                                 std::to_string(ra.second.peer) + " never runs " +
                                 detail::expected_partner(s, ra.first, ra.second));
  if (options.mode == SendMode::rendezvous)
    for (int from = 0; from < p; ++from)
      for (int to = 0; to < p; ++to) {
        std::vector<Action> sent, received;
        for (const auto& a : s.ranks[from])
          if (a.kind == ActionKind::send && a.peer == to) sent.push_back(a);
        for (const auto& a : s.ranks[to])
          if (a.kind == ActionKind::recv && a.peer == from) received.push_back(a);
        for (std::size_t i = 0; i < sent.size() && i < received.size(); ++i)
          if (detail::message_of(s, from, sent[i]) != detail::message_of(s, to, received[i]))
            detail::schedule_error(s, to,
                                   describe(received[i]) + " is received where rank " + std::to_string(from) +
                                       " sends " + action_token(sent[i]) +
                                       ": with rendezvous sends (NCCL) the messages between two ranks match in "
                                       "the order they are posted, so they must be received in the order sent");
      }

  // 4. inputs exist, in each rank's own order
  for (int r = 0; r < p; ++r) {
    std::set<std::pair<int, int>> f_done, b_done, recv_act, recv_grad;  // (mb, chunk)
    std::vector<Action> all = s.ranks[r];
    auto later_or_never = [&](const Action& need) {
      for (const auto& x : all)
        if (x == need) return std::string(", which comes later in rank ") + std::to_string(r) + "'s list";
      return std::string(", which rank ") + std::to_string(r) + " never runs";
    };
    auto fail = [&](const Action& a, const Action& need) {
      detail::schedule_error(
          s, r, describe(a) + " runs before its input: it needs " + describe(need) + later_or_never(need));
    };
    for (const auto& a : s.ranks[r]) {
      const std::pair<int, int> key{a.microbatch, a.chunk};
      switch (a.kind) {
        case ActionKind::forward: {
          if (!s.is_first(r, a.chunk)) {
            auto prev = s.prev_slot(r, a.chunk);
            if (prev.rank == r) {
              if (!f_done.count({a.microbatch, prev.chunk}))
                fail(a, forward_action(a.microbatch, prev.chunk));
            } else if (!recv_act.count(key)) {
              fail(a, recv_action(Direction::activation, a.microbatch, a.chunk, prev.rank));
            }
          }
          f_done.insert(key);
          break;
        }
        case ActionKind::backward_input: {
          if (!f_done.count(key)) fail(a, forward_action(a.microbatch, a.chunk));
          if (!s.local_learning && !s.is_last(r, a.chunk)) {
            auto next = s.next_slot(r, a.chunk);
            if (next.rank == r) {
              if (!b_done.count({a.microbatch, next.chunk}))
                fail(a, backward_input_action(a.microbatch, next.chunk));
            } else if (!recv_grad.count(key)) {
              fail(a, recv_action(Direction::gradient, a.microbatch, a.chunk, next.rank));
            }
          }
          b_done.insert(key);
          break;
        }
        case ActionKind::backward_weight:
          if (!b_done.count(key)) fail(a, backward_input_action(a.microbatch, a.chunk));
          break;
        case ActionKind::send:
          if (a.direction == Direction::activation && !f_done.count(key))
            fail(a, forward_action(a.microbatch, a.chunk));
          if (a.direction == Direction::gradient && !b_done.count(key))
            fail(a, backward_input_action(a.microbatch, a.chunk));
          break;
        case ActionKind::recv:
          (a.direction == Direction::activation ? recv_act : recv_grad).insert(key);
          break;
      }
    }
  }

  // 5. deadlock: run the ranks abstractly. A run of consecutive send/recv actions is posted at
  // once (like a batched point-to-point call); the rank then waits for the run's receives
  // (buffered) or for all of its operations (rendezvous: a send is done only once its receive is
  // posted).
  const bool rendezvous = options.mode == SendMode::rendezvous;
  std::vector<std::size_t> pc(p, 0);
  std::set<detail::MessageKey> send_posted, recv_posted;
  auto run_end = [&](int r) {
    std::size_t e = pc[r];
    while (e < s.ranks[r].size() && s.ranks[r][e].is_comm()) ++e;
    return e;
  };
  auto op_done = [&](int r, const Action& a) {
    const auto key = detail::message_of(s, r, a);
    if (a.kind == ActionKind::send) return !rendezvous || recv_posted.count(key) > 0;
    return send_posted.count(key) > 0;
  };
  auto blocked_op = [&](int r) -> const Action* {  // first operation of r's current run not done
    for (std::size_t i = pc[r]; i < run_end(r); ++i)
      if (!op_done(r, s.ranks[r][i])) return &s.ranks[r][i];
    return nullptr;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < s.ranks[r].size()) {
        if (s.ranks[r][pc[r]].is_compute()) {
          ++pc[r];
          progress = true;
          continue;
        }
        const std::size_t end = run_end(r);
        for (std::size_t i = pc[r]; i < end; ++i) {
          const Action& a = s.ranks[r][i];
          auto& posted = a.kind == ActionKind::send ? send_posted : recv_posted;
          progress = posted.insert(detail::message_of(s, r, a)).second || progress;
        }
        if (blocked_op(r)) break;
        pc[r] = end;
        progress = true;
      }
    }
  }
  bool done = true;
  for (int r = 0; r < p; ++r) done = done && pc[r] == s.ranks[r].size();
  if (done) return;

  // name the cycle of waits, starting from the first blocked rank
  int start = 0;
  while (pc[start] == s.ranks[start].size()) ++start;
  std::vector<int> path;
  std::vector<int> seen(p, -1);
  int r = start;
  while (r >= 0 && seen[r] < 0 && pc[r] < s.ranks[r].size()) {
    seen[r] = static_cast<int>(path.size());
    path.push_back(r);
    r = blocked_op(r)->peer;
  }
  std::ostringstream msg;
  msg << "deadlock (" << (rendezvous ? "rendezvous" : "buffered") << " sends): ";
  const std::size_t first = (r >= 0 && seen[r] >= 0) ? static_cast<std::size_t>(seen[r]) : 0;
  for (std::size_t i = first; i < path.size(); ++i) {
    const int q = path[i];
    const Action* op = blocked_op(q);
    msg << (i > first ? "; " : "") << "rank " << q << " waits at action " << (op - s.ranks[q].data()) << ", "
        << describe(*op) << ", for rank " << op->peer;
    const int peer = op->peer;
    if (pc[peer] == s.ranks[peer].size()) {
      msg << " (which has finished)";
    } else {
      const Action* at_peer = blocked_op(peer);
      msg << " (which is blocked at " << action_token(at_peer ? *at_peer : s.ranks[peer][pc[peer]]) << ")";
    }
  }
  if (r >= 0 && seen[r] >= 0) msg << " -- a cycle of waits";
  detail::schedule_error(s, path[first], msg.str());
}

// True when verify() accepts the schedule in the given mode (for quick checks; use verify() to get
// the reason).
inline bool is_valid(const Schedule& s, const VerifyOptions& options = {}) {
  try {
    verify(s, options);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace trellis::pipe
