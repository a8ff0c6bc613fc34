// trellis plan: the planner -- a cluster description, a memory model and a cost model of the GPT
// trainer's layouts, and the search that picks the fastest layout that fits (docs/plan.md).
#pragma once

#include "trellis/plan/cluster.hpp"         // defines: Cluster, Device, Link, load_cluster, parse_cluster, to_json
#include "trellis/plan/cost_model.hpp"      // defines: Rates, cluster_rates, predict_step, StepCost
#include "trellis/plan/measured_rates.hpp"  // defines: MeasuredRates (Rates timed on this machine)
#include "trellis/plan/memory_model.hpp"    // defines: predict_memory, predict_peak_memory, MemoryEstimate
#include "trellis/plan/search.hpp"          // defines: search, SearchSpace, Plan, layouts, train_gpt_flags
#include "trellis/plan/stage_balance.hpp"   // defines: stage_costs, stage_speeds, StageSpeeds
