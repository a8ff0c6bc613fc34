// The pipeline simulator: runs a schedule's action lists on costs instead of stages and returns
// step time, bubble fraction and peak activation memory per rank.
//
// Conventions (also in docs/pipe.md):
//  - Costs are for one microbatch through ONE RANK'S WHOLE SHARE of the layers (L/p layers); a
//    chunk action costs that divided by v (the rank holds v chunks of L/(p*v) layers each).
//  - Memory is counted in units of one microbatch's activations for one rank's whole share (the
//    unit of the 1F1B papers, where 1F1B's peak is p): an activation of one chunk is alive from
//    its F's start to its W's end and counts 1/v. peak_chunk_activations gives the raw count.
//  - Sends are asynchronous and cost nothing on the sender; the data arrives `comm` later. A recv
//    is posted where it stands; the F or B that consumes it waits until the data has arrived (as
//    the executor does), so where a receive is posted does not change the timeline.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/timeline.hpp"
#include "trellis/pipe/verify.hpp"

namespace trellis::pipe {

struct Costs {
  double forward = 1;          // t_F
  double backward_input = 1;   // t_B
  double backward_weight = 1;  // t_W
  double comm = 0;             // one point-to-point message, send to arrival
};

struct Simulation {
  double step_time = 0;
  double bubble_fraction = 0;               // 1 - compute / (p * step_time)
  double steady_bubble_fraction = 0;        // see TimelineStats
  std::vector<double> busy;                 // per rank
  std::vector<double> peak_memory;          // per rank, in rank-share microbatch units (see above)
  std::vector<int> peak_chunk_activations;  // per rank, raw count of live (mb, chunk) activations
  // [rank][chunk]: live microbatches of that chunk alone, at most (how many activation slots the
  // chunk needs: nn/activation_arena.hpp); their sum over chunks can exceed the rank's joint peak
  std::vector<std::vector<int>> peak_activations_by_chunk;
  double max_peak_memory = 0;
  int forward_messages = 0;   // activation messages between ranks
  int backward_messages = 0;  // gradient messages between ranks
  Timeline timeline;
};

// `schedule` ready to simulate: verified, with send/recv (insert_communication() where it has
// none). What simulate_with does first; a caller simulating one schedule many times (the planner's
// search) prepares it once and calls simulate_prepared.
inline Schedule prepare_for_simulation(const Schedule& schedule) {
  bool has_comm = false;
  for (const auto& list : schedule.ranks)
    for (const auto& a : list) has_comm = has_comm || a.is_comm();
  Schedule s = (!has_comm && schedule.stages > 1) ? insert_communication(schedule) : schedule;
  verify(s);
  return s;
}

// simulate_with on a schedule prepare_for_simulation() returned (not checked again).
template <class CostOf, class CommOf>
Simulation simulate_prepared(const Schedule& s, CostOf&& cost_of, CommOf&& comm_of);

// Simulates `s` with any cost per action: cost_of(rank, action) -> duration of a compute action
// (e.g. durations measured in a run, to replay it); comm_of(rank, send action) -> how long that
// message takes to arrive (or a number: the same for every message). The schedule is verified
// first; one without send/recv gets insert_communication().
template <class CostOf, class CommOf>
Simulation simulate_with(const Schedule& schedule, CostOf&& cost_of, CommOf&& comm_of) {
  return simulate_prepared(prepare_for_simulation(schedule), std::forward<CostOf>(cost_of), std::forward<CommOf>(comm_of));
}

template <class CostOf, class CommOf>
Simulation simulate_prepared(const Schedule& s, CostOf&& cost_of, CommOf&& comm_of) {
  const int p = s.stages;
  const double v = s.chunks;
  Simulation out;
  out.timeline.stages = p;
  out.peak_memory.assign(static_cast<std::size_t>(p), 0.0);
  out.peak_chunk_activations.assign(static_cast<std::size_t>(p), 0);
  out.peak_activations_by_chunk.assign(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(s.chunks), 0));
  std::vector<std::vector<int>> live_chunk = out.peak_activations_by_chunk;
  std::vector<double> clock(p, 0.0);
  std::vector<std::size_t> pc(p, 0);
  std::vector<int> live(p, 0);
  std::map<detail::MessageKey, double> arrival;
  std::vector<std::map<detail::MessageKey, Action>> posted(p);  // receives not yet consumed
  std::size_t remaining = 0;
  for (const auto& list : s.ranks) remaining += list.size();
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < s.ranks[r].size()) {
        const Action& a = s.ranks[r][pc[r]];
        if (a.kind == ActionKind::recv) {
          posted[r][detail::message_of(s, r, a)] = a;
        } else if (a.kind == ActionKind::send) {
          double latency = 0;
          if constexpr (std::is_arithmetic_v<std::remove_cvref_t<CommOf>>)
            latency = static_cast<double>(comm_of);
          else
            latency = static_cast<double>(comm_of(r, a));
          arrival[detail::message_of(s, r, a)] = clock[r] + latency;
          (a.direction == Direction::activation ? out.forward_messages : out.backward_messages)++;
          out.timeline.events.push_back({r, a, clock[r], clock[r]});
        } else {
          // the input a receive brings: (direction, microbatch, this virtual stage)
          const auto dir = a.kind == ActionKind::forward ? Direction::activation : Direction::gradient;
          const detail::MessageKey input{static_cast<int>(dir), a.microbatch, s.virtual_stage(r, a.chunk)};
          auto recv = a.kind == ActionKind::backward_weight ? posted[r].end() : posted[r].find(input);
          if (recv != posted[r].end()) {
            auto it = arrival.find(input);
            if (it == arrival.end()) break;
            const double start = clock[r];
            clock[r] = std::max(clock[r], it->second);
            out.timeline.events.push_back({r, recv->second, start, clock[r]});
            posted[r].erase(recv);
          }
          const double cost = static_cast<double>(cost_of(r, a));
          int& chunk_live = live_chunk[r][static_cast<std::size_t>(a.chunk)];
          if (a.kind == ActionKind::forward) {
            ++live[r];
            out.peak_chunk_activations[r] = std::max(out.peak_chunk_activations[r], live[r]);
            ++chunk_live;
            int& chunk_peak = out.peak_activations_by_chunk[r][static_cast<std::size_t>(a.chunk)];
            chunk_peak = std::max(chunk_peak, chunk_live);
          }
          out.timeline.events.push_back({r, a, clock[r], clock[r] + cost});
          clock[r] += cost;
          if (a.kind == ActionKind::backward_weight) {
            --live[r];
            --chunk_live;
          }
        }
        ++pc[r];
        --remaining;
        progress = true;
      }
    }
    if (!progress)
      TRELLIS_THROW("simulate: schedule '", s.name, "' is stuck (verify() should have caught this)");
  }
  auto stats = timeline_stats(out.timeline);
  out.step_time = stats.step_time;
  out.bubble_fraction = stats.bubble_fraction;
  out.steady_bubble_fraction = stats.steady_bubble_fraction;
  out.busy = stats.busy;
  for (int r = 0; r < p; ++r) {
    out.peak_memory[r] = out.peak_chunk_activations[r] / v;
    out.max_peak_memory = std::max(out.max_peak_memory, out.peak_memory[r]);
  }
  return out;
}

// Simulates `s` with the same cost for every action of a kind (see the conventions above).
inline Simulation simulate(const Schedule& schedule, const Costs& costs = {}) {
  const double v = schedule.chunks;
  auto cost_of = [&](int, const Action& a) {
    const double whole = a.kind == ActionKind::forward          ? costs.forward
                         : a.kind == ActionKind::backward_input ? costs.backward_input
                                                                : costs.backward_weight;
    return whole / v;
  };
  return simulate_with(schedule, cost_of, costs.comm);
}

}  // namespace trellis::pipe
