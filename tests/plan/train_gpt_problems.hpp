// What train_gpt says of a planned layout, for the planner's tests: its flag checks (e.g. --overlap
// needs --tp > 1) and train::config_problems, on the model's flags (seq = context) followed by the
// layout's (plan::train_gpt_flags); a Mixture-of-Experts model's --experts, --topk, --moe-every,
// --capacity with the model's.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "train_gpt/flags.hpp"
#include "trellis/plan/search.hpp"

namespace plan_test {

inline std::vector<std::string> train_gpt_problems(const trellis::train::TrainerConfig& c) {
  const auto& m = c.model;
  std::vector<std::string> args = {"--layers", std::to_string(m.layers), "--heads", std::to_string(m.heads),
                                   "--width", std::to_string(m.width), "--vocab", std::to_string(m.vocab),
                                   "--context", std::to_string(c.seq), "--batch", std::to_string(c.batch)};
  if (m.moe_every > 0) {  // a Mixture-of-Experts model's flags (train_gpt_flags gives --ep)
    for (const std::string& w : {std::string("--experts"), std::to_string(m.experts), std::string("--topk"),
                                 std::to_string(m.moe_topk), std::string("--moe-every"), std::to_string(m.moe_every)})
      args.push_back(w);
    if (c.options.moe_capacity > 0) {
      std::ostringstream cap;
      cap << c.options.moe_capacity;
      args.push_back("--capacity");
      args.push_back(cap.str());
    }
  }
  std::istringstream words(trellis::plan::train_gpt_flags(c));
  for (std::string w; words >> w;) args.push_back(w);
  return train_gpt::problems(train_gpt::parse_flags(args));
}

}  // namespace plan_test
