// Schedule generators. Each returns a Schedule with its compute order and the communication
// inserted by insert_communication() (send right after the producer, recv right before the
// consumer or paired earlier with a send, so that every schedule here also runs with rendezvous
// sends: NCCL groups). References:
//   GPipe           Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
//                   Pipeline Parallelism" (2019): all forwards, then all backwards.
//   1F1B            Narayanan et al., "PipeDream" (2019) / Megatron-LM: p-1-r warm-up forwards,
//                   then one forward one backward.
//   interleaved     Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
//                   Clusters Using Megatron-LM" (2021): v chunks per rank in a loop placement;
//                   m must be a multiple of p.
//   ZB-H1, ZB-H2    Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): backward split
//   ZB-V            into B and W; W fills bubbles. ZB-H1 keeps 1F1B's rhythm and postpones r W
//                   passes on rank r (peak memory p, like 1F1B). ZB-H2 (at most 2p-1 microbatches
//                   in flight) and ZB-V (vee placement, at most 2p chunk activations = p
//                   microbatches of a rank's layers) come from the heuristic the paper describes:
//                   a greedy list scheduler (B first -- F first for ZB-V --, F only within the
//                   memory limit, W when nothing else is ready), simulated with t_F = t_B = t_W.
//   DualPipeV       DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), DualPipe; the "V"
//                   (cut-in-half) variant from deepseek-ai/DualPipe: vee placement, 8 phases per
//                   rank; an overlapped "F&B" pair is written as F then B here (no overlap).
//   local learning  PPLL-style (pipelined local learning): every virtual stage trains against its
//                   own auxiliary loss, so each rank runs F, B, W per microbatch and only
//                   activations travel (forward).
#pragma once

#include <algorithm>
#include <deque>
#include <limits>
#include <string>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/pipe/schedule.hpp"

namespace trellis::pipe {

namespace detail {

inline void check_pm(const char* what, int p, int m) {
  if (p < 1) TRELLIS_THROW(what, ": stages (p) must be >= 1, got ", p);
  if (m < 1) TRELLIS_THROW(what, ": microbatches (m) must be >= 1, got ", m);
}

inline Schedule empty_schedule(std::string name, int p, int m, int v, Placement placement) {
  Schedule s;
  s.name = std::move(name);
  s.stages = p;
  s.microbatches = m;
  s.chunks = v;
  s.placement = placement;
  s.ranks.assign(static_cast<std::size_t>(p), {});
  return s;
}

// Priority order for the greedy list scheduler.
struct GreedyPolicy {
  std::vector<int> activation_limit;  // per rank: F done and W not yet done, in chunk units
  double t_forward = 1, t_backward_input = 1, t_backward_weight = 1;
  bool forward_first = false;  // try F before B
  bool deepest_first = true;   // among chunks, the deepest virtual stage first
};

// Event-driven list scheduling on unit costs: whenever a rank is free it takes the first ready
// action in the order B, F (or F, B with forward_first; F only under the rank's activation limit),
// W (oldest first); among chunks the deepest virtual stage first. Ready means the inputs have been
// produced by then. The order each rank ends up with is the schedule; it is deadlock-free by
// construction (the simulated run is a witness).
inline void greedy_fill(Schedule& s, const GreedyPolicy& policy) {
  const int p = s.stages, m = s.microbatches, v = s.chunks, S = s.virtual_stages();
  const double never = std::numeric_limits<double>::infinity();
  auto idx = [&](int stage, int mb) { return static_cast<std::size_t>(stage) * m + mb; };
  std::vector<double> f_end(static_cast<std::size_t>(S) * m, never), b_end(f_end), w_end(f_end);
  std::vector<double> free_at(p, 0.0);
  std::vector<int> live(p, 0);
  std::vector<std::vector<int>> next_f(p, std::vector<int>(v, 0)), next_b(next_f);
  std::vector<std::deque<std::pair<int, int>>> pending_w(p);  // (mb, chunk) in B order
  std::vector<int> remaining(p, 3 * m * v);
  int total = 3 * m * v * p;
  double now = 0;
  while (total > 0) {
    bool progressed = false;
    for (int r = 0; r < p; ++r) {
      if (remaining[r] == 0 || free_at[r] > now) continue;
      // chunks ordered deepest virtual stage first
      std::vector<int> order(v);
      for (int c = 0; c < v; ++c) order[c] = c;
      std::sort(order.begin(), order.end(), [&](int a, int b) {
        return policy.deepest_first ? s.virtual_stage(r, a) > s.virtual_stage(r, b)
                                    : s.virtual_stage(r, a) < s.virtual_stage(r, b);
      });
      Action pick{};
      bool found = false;
      auto try_backward = [&] {
        for (int c : order) {
          int mb = next_b[r][c];
          if (mb >= m) continue;
          int st = s.virtual_stage(r, c);
          if (f_end[idx(st, mb)] > now) continue;
          if (!s.local_learning && st + 1 < S && b_end[idx(st + 1, mb)] > now) continue;
          pick = backward_input_action(mb, c);
          found = true;
          return;
        }
      };
      auto try_forward = [&] {
        if (live[r] >= policy.activation_limit[r]) return;
        for (int c : order) {
          int mb = next_f[r][c];
          if (mb >= m) continue;
          int st = s.virtual_stage(r, c);
          if (st > 0 && f_end[idx(st - 1, mb)] > now) continue;
          pick = forward_action(mb, c);
          found = true;
          return;
        }
      };
      if (policy.forward_first) {
        try_forward();
        if (!found) try_backward();
      } else {
        try_backward();
        if (!found) try_forward();
      }
      if (!found && !pending_w[r].empty()) {
        auto [mb, c] = pending_w[r].front();
        pick = backward_weight_action(mb, c);
        found = true;
      }
      if (!found) continue;
      const int st = s.virtual_stage(r, pick.chunk);
      double end = now;
      if (pick.kind == ActionKind::forward) {
        end += policy.t_forward;
        f_end[idx(st, pick.microbatch)] = end;
        ++next_f[r][pick.chunk];
        ++live[r];
      } else if (pick.kind == ActionKind::backward_input) {
        end += policy.t_backward_input;
        b_end[idx(st, pick.microbatch)] = end;
        ++next_b[r][pick.chunk];
        pending_w[r].emplace_back(pick.microbatch, pick.chunk);
      } else {
        end += policy.t_backward_weight;
        w_end[idx(st, pick.microbatch)] = end;
        pending_w[r].pop_front();
        --live[r];
      }
      free_at[r] = end;
      s.ranks[r].push_back(pick);
      --remaining[r];
      --total;
      progressed = true;
    }
    if (progressed) continue;
    // advance to the next time anything changes
    double next = never;
    for (int r = 0; r < p; ++r)
      if (remaining[r] > 0 && free_at[r] > now) next = std::min(next, free_at[r]);
    for (double t : f_end)
      if (t > now) next = std::min(next, t);
    for (double t : b_end)
      if (t > now) next = std::min(next, t);
    if (next == never)
      TRELLIS_THROW("pipe generator '", s.name,
                    "': the greedy scheduler is stuck (activation limit too small?)");
    now = next;
  }
}

inline void append_forward_backward(std::vector<Action>& list, int mb, int chunk) {
  list.push_back(backward_input_action(mb, chunk));
  list.push_back(backward_weight_action(mb, chunk));
}

}  // namespace detail

// GPipe: every rank runs all m forwards, then all m backwards (B then W), microbatch order.
inline Schedule gpipe(int p, int m) {
  detail::check_pm("gpipe", p, m);
  auto s = detail::empty_schedule("gpipe", p, m, 1, Placement::loop);
  s.full_backward = true;
  for (int r = 0; r < p; ++r) {
    for (int mb = 0; mb < m; ++mb) s.ranks[r].push_back(forward_action(mb));
    for (int mb = 0; mb < m; ++mb) detail::append_forward_backward(s.ranks[r], mb, 0);
  }
  return insert_communication(std::move(s));
}

// 1F1B (PipeDream-Flush): rank r runs min(p-1-r, m) warm-up forwards, then alternates one forward
// and one full backward, then drains the remaining backwards.
inline Schedule one_f_one_b(int p, int m) {
  detail::check_pm("1f1b", p, m);
  auto s = detail::empty_schedule("1f1b", p, m, 1, Placement::loop);
  s.full_backward = true;
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    const int warmup = std::min(p - 1 - r, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) list.push_back(forward_action(f));
    for (; f < m; ++f, ++b) {
      list.push_back(forward_action(f));
      detail::append_forward_backward(list, b, 0);
    }
    for (; b < m; ++b) detail::append_forward_backward(list, b, 0);
  }
  return insert_communication(std::move(s));
}

// Interleaved 1F1B (Megatron-LM): v chunks per rank, loop placement (virtual stage c*p + r).
// Microbatches go through the chunks in groups of p; m must be a multiple of p when v > 1.
// v == 1 is plain 1F1B.
inline Schedule interleaved_1f1b(int p, int m, int v) {
  detail::check_pm("interleaved_1f1b", p, m);
  if (v < 1) TRELLIS_THROW("interleaved_1f1b: chunks (v) must be >= 1, got ", v);
  if (v == 1) {
    auto s = one_f_one_b(p, m);
    s.name = "interleaved_1f1b";
    return s;
  }
  if (m % p != 0)
    TRELLIS_THROW("interleaved_1f1b: microbatches (m = ", m, ") must be a multiple of stages (p = ", p,
                  ") when v > 1, as in Megatron-LM's interleaved schedule");
  auto s = detail::empty_schedule("interleaved_1f1b", p, m, v, Placement::loop);
  s.full_backward = true;
  const int total = m * v;  // chunk-microbatch forwards per rank
  auto forward_of = [&](int k) {
    int chunk = (k / p) % v;
    int mb = (k / (p * v)) * p + k % p;
    return forward_action(mb, chunk);
  };
  auto backward_chunk_mb = [&](int k) {
    int chunk = v - 1 - (k / p) % v;
    int mb = (k / (p * v)) * p + k % p;
    return std::pair<int, int>{mb, chunk};
  };
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    int warmup = m == p ? total : std::min(total, (p - r - 1) * 2 + (v - 1) * p);
    int f = 0, b = 0;
    for (; f < warmup; ++f) list.push_back(forward_of(f));
    for (; f < total; ++f, ++b) {
      list.push_back(forward_of(f));
      auto [mb, c] = backward_chunk_mb(b);
      detail::append_forward_backward(list, mb, c);
    }
    for (; b < total; ++b) {
      auto [mb, c] = backward_chunk_mb(b);
      detail::append_forward_backward(list, mb, c);
    }
  }
  return insert_communication(std::move(s));
}

// ZB-H1: 1F1B's warm-up and rhythm with B and W apart; rank r postpones its first r W passes
// (they fill the tail), so every rank holds at most p microbatches: the peak memory of 1F1B.
inline Schedule zero_bubble_h1(int p, int m) {
  detail::check_pm("zb_h1", p, m);
  auto s = detail::empty_schedule("zb_h1", p, m, 1, Placement::loop);
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    const int warmup = std::min(p - 1 - r, m);
    int next_w = 0;
    for (int f = 0; f < warmup; ++f) list.push_back(forward_action(f));
    for (int i = 0; i < m; ++i) {
      if (warmup + i < m) list.push_back(forward_action(warmup + i));
      list.push_back(backward_input_action(i));
      if (i >= r) list.push_back(backward_weight_action(next_w++));
    }
    while (next_w < m) list.push_back(backward_weight_action(next_w++));
  }
  return insert_communication(std::move(s));
}

// ZB-H2: up to 2(p-r)-1 microbatches in flight on rank r (2p-1 on rank 0), which fills the
// warm-up bubble with forwards; W fills the tail.
inline Schedule zero_bubble_h2(int p, int m) {
  detail::check_pm("zb_h2", p, m);
  auto s = detail::empty_schedule("zb_h2", p, m, 1, Placement::loop);
  detail::GreedyPolicy policy;
  policy.activation_limit.assign(static_cast<std::size_t>(p), 2 * p - 1);
  detail::greedy_fill(s, policy);
  return insert_communication(std::move(s));
}

// ZB-V: two chunks per rank in the vee placement; at most 2p chunk activations per rank
// (p microbatches of a whole rank's layers: the memory of 1F1B).
inline Schedule zero_bubble_v(int p, int m) {
  detail::check_pm("zb_v", p, m);
  auto s = detail::empty_schedule("zb_v", p, m, 2, Placement::vee);
  detail::GreedyPolicy policy;
  policy.activation_limit.assign(static_cast<std::size_t>(p), 2 * p);
  policy.forward_first = true;  // keeps the V full; measured: reaches the start-up bound 3m + (p-1)/2
  detail::greedy_fill(s, policy);
  return insert_communication(std::move(s));
}

// DualPipeV: vee placement (chunk 0 goes down the ranks, chunk 1 comes back up); needs m >= 2p.
// Phases per rank r (deepseek-ai/DualPipe): F0 x 2(p-r-1); (F0 F1) x (r+1); (B1 W F1) x (p-r-1);
// (F0 B1 F1 B0) x (m-2p+r+1); (B1 F1 B0) x (p-r-1); (B1 B0) x (r+1), the second half with W
// deferred; (W B0) x (p-r-1); W x (r+1).
inline Schedule dualpipe_v(int p, int m) {
  detail::check_pm("dualpipe_v", p, m);
  if (m < 2 * p)
    TRELLIS_THROW("dualpipe_v: needs microbatches (m = ", m, ") >= 2 * stages (2p = ", 2 * p, ")");
  auto s = detail::empty_schedule("dualpipe_v", p, m, 2, Placement::vee);
  s.full_backward = true;
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    int next_f[2] = {0, 0}, next_b[2] = {0, 0};
    std::deque<std::pair<int, int>> weights;  // deferred W: (mb, chunk)
    auto F = [&](int c) { list.push_back(forward_action(next_f[c]++, c)); };
    auto B = [&](int c, bool defer_weight) {
      int mb = next_b[c]++;
      list.push_back(backward_input_action(mb, c));
      if (defer_weight)
        weights.emplace_back(mb, c);
      else
        list.push_back(backward_weight_action(mb, c));
    };
    auto W = [&] {
      if (weights.empty()) TRELLIS_THROW("dualpipe_v: internal error, no deferred W on rank ", r);
      auto [mb, c] = weights.front();
      weights.pop_front();
      list.push_back(backward_weight_action(mb, c));
    };
    for (int i = 0; i < 2 * (p - r - 1); ++i) F(0);
    for (int i = 0; i < r + 1; ++i) {
      F(0);
      F(1);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      B(1, true);
      W();
      F(1);
    }
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      F(0);
      B(1, false);
      F(1);
      B(0, false);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      B(1, false);
      F(1);
      B(0, false);
    }
    bool defer = false;
    const int step6 = r + 1;
    for (int i = 0; i < step6; ++i) {
      if (i == step6 / 2 && r % 2 == 1) defer = true;
      B(1, defer);
      if (i == step6 / 2 && r % 2 == 0) defer = true;
      B(0, defer);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      W();
      B(0, true);
    }
    while (!weights.empty()) W();
  }
  return insert_communication(std::move(s));
}

// Local learning (PPLL-style): each rank runs F, B, W per microbatch against its own loss; only
// activations are sent (forward), no gradient crosses a stage boundary.
inline Schedule local_learning(int p, int m) {
  detail::check_pm("local_learning", p, m);
  auto s = detail::empty_schedule("local_learning", p, m, 1, Placement::loop);
  s.local_learning = true;
  for (int r = 0; r < p; ++r)
    for (int mb = 0; mb < m; ++mb) {
      s.ranks[r].push_back(forward_action(mb));
      detail::append_forward_backward(s.ranks[r], mb, 0);
    }
  return insert_communication(std::move(s));
}

// All generators by name, for tests, benches and command lines. v is used by "interleaved_1f1b"
// only (the vee schedules always hold 2 chunks).
inline Schedule make_schedule(const std::string& name, int p, int m, int v = 1) {
  if (name == "gpipe") return gpipe(p, m);
  if (name == "1f1b") return one_f_one_b(p, m);
  if (name == "interleaved_1f1b") return interleaved_1f1b(p, m, v);
  if (name == "zb_h1") return zero_bubble_h1(p, m);
  if (name == "zb_h2") return zero_bubble_h2(p, m);
  if (name == "zb_v") return zero_bubble_v(p, m);
  if (name == "dualpipe_v") return dualpipe_v(p, m);
  if (name == "local_learning") return local_learning(p, m);
  TRELLIS_THROW("make_schedule: unknown schedule '", name,
                "' (known: gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_h2, zb_v, dualpipe_v, local_learning)");
}

inline std::vector<std::string> schedule_names() {
  return {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zb_v", "dualpipe_v", "local_learning"};
}

}  // namespace trellis::pipe
