// plan::ScheduleCache: the pipeline schedules a search meets again and again, made once. A search
// over a large cluster times hundreds of thousands of layouts but only a few hundred schedules
// (name x pp x microbatches x chunks); making each schedule, inserting its communication and
// verifying it took most of the search's time when done per layout (perf, the 175B search). Each
// entry keeps the schedule prepared for simulation (pipe::prepare_for_simulation) and its
// simulation at unit costs (what the memory model reads: live microbatches per chunk).
#pragma once

#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "trellis/core/error.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::plan {

class ScheduleCache {
 public:
  struct Prepared {
    std::string refused;      // what the generator said when it refused pp and the microbatches
    pipe::Schedule schedule;  // with send/recv, verified
    pipe::Simulation unit;    // simulated at unit costs (its timeline dropped)
  };

  // The schedule c runs, prepared (or refused); null without a pipeline (pp = 1) or with a custom
  // schedule (its identity is its whole list: the callers make it themselves).
  const Prepared* find(const train::TrainerConfig& c) {
    if (c.pp <= 1 || c.custom_schedule) return nullptr;
    const int chunks = c.schedule == "interleaved_1f1b" ? c.virtual_chunks : 1;  // make_schedule reads it there only
    auto key = std::make_tuple(c.schedule, c.pp, c.microbatches, chunks);
    auto it = made_.find(key);
    if (it == made_.end()) {
      Prepared p;
      try {
        p.schedule = pipe::prepare_for_simulation(pipe::make_schedule(c.schedule, c.pp, c.microbatches, chunks));
        p.unit = pipe::simulate(p.schedule);
        p.unit.timeline = {};
      } catch (const Error& e) {
        p.refused = e.message();
      }
      it = made_.emplace(std::move(key), std::move(p)).first;
    }
    return &it->second;
  }
  // Whether c's generator refuses its pp and microbatches (train::config_problems' last check,
  // made once here: the search calls config_problems(c, false)).
  bool refuses(const train::TrainerConfig& c) {
    const Prepared* p = find(c);
    return p && !p->refused.empty();
  }
  // The prepared schedule of c (null as find), refusing to hand out a refused one.
  const Prepared* usable(const train::TrainerConfig& c) {
    const Prepared* p = find(c);
    TRELLIS_CHECK(!p || p->refused.empty(), "plan: schedule '", c.schedule, "' with pp ", c.pp, " and ", c.microbatches,
                  " microbatches: ", p ? p->refused : std::string{});
    return p;
  }
  std::size_t size() const { return made_.size(); }

 private:
  std::map<std::tuple<std::string, int, int, int>, Prepared> made_;
};

}  // namespace trellis::plan
