// trellis pipe: pipeline schedules as data (generators, text format), the verifier, the simulator,
// the executor over any Communicator, and pictures (SVG, Chrome trace).
#pragma once

#include "trellis/pipe/executor.hpp"  // defines: Stage, execute, ExecutionResult, merge_timelines
#include "trellis/pipe/generators.hpp"  // defines: gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_h1/h2/v, dualpipe_v, local_learning
#include "trellis/pipe/partition.hpp"   // defines: balanced_split, stage_times
#include "trellis/pipe/picture.hpp"   // defines: to_svg, to_chrome_trace
#include "trellis/pipe/schedule.hpp"  // defines: Action, Schedule, insert_communication, CommPlacement, split_layers
#include "trellis/pipe/simulate.hpp"  // defines: Costs, Simulation, simulate
#include "trellis/pipe/text.hpp"      // defines: parse_schedule, to_text
#include "trellis/pipe/timeline.hpp"  // defines: TimedAction, Timeline, timeline_stats
#include "trellis/pipe/verify.hpp"    // defines: verify, SendMode
