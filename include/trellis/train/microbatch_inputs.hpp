// train::MicrobatchInputs: a dp rank's batch (train::Batch) as the token ids each microbatch's
// stages read. Without context parallelism they are pointers into the batch; with cp the rank's
// zig-zag positions of every row are copied out (nn/context_parallel.hpp), and with balanced
// documents the packed rows are reordered first (whole documents, equal causal work per cp rank).
// The document ids stay whole rows either way (the attention masks need every position's id).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "trellis/nn/context_parallel.hpp"
#include "trellis/nn/tensor_parallel.hpp"
#include "trellis/train/data.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::train {

class MicrobatchInputs {
 public:
  // Microbatch mb's ids: tokens and targets (shape.rows() each), document ids (full rows; empty
  // when the batch is not packed). Valid until the next cut() and while `b` lives.
  struct Views {
    std::vector<const std::int32_t*> tokens, targets, segments;
  };

  Views cut(const Batch& b, const TrainerConfig& cfg, const nn::TokenShape& shape) {
    const index_t per = shape.batch * cfg.seq;  // a microbatch's ids (full sequences)
    const std::int32_t* inputs = b.inputs.data();
    const std::int32_t* labels = b.targets.data();
    const std::int32_t* ids = b.segments.data();
    const std::vector<std::int32_t>*full_inputs = &b.inputs, *full_targets = &b.targets;
    if (cfg.cp_balance_documents && b.packed()) {  // rows reordered for equal work per cp rank
      balanced_[0] = b.inputs, balanced_[1] = b.targets;
      balanced_ids_ = nn::balance_documents(b.segments, cfg.seq, cfg.cp, {&balanced_[0], &balanced_[1]});
      ids = balanced_ids_.data(), full_inputs = &balanced_[0], full_targets = &balanced_[1];
    }
    if (cfg.cp > 1) {  // this rank's zig-zag positions of every row (the ids stay whole)
      local_inputs_ = local_positions(*full_inputs, cfg.seq, shape);
      local_targets_ = local_positions(*full_targets, cfg.seq, shape);
      inputs = local_inputs_.data();
      labels = local_targets_.data();
    }
    Views v;
    for (int mb = 0; mb < cfg.microbatches; ++mb) {
      v.tokens.push_back(inputs + mb * shape.rows());
      v.targets.push_back(labels + mb * shape.rows());
      if (b.packed()) v.segments.push_back(ids + mb * per);
    }
    return v;
  }

  // Rows (rows, seq) -> this cp rank's positions of each row (rows, shape.seq = seq / cp).
  static std::vector<std::int32_t> local_positions(const std::vector<std::int32_t>& full, index_t seq,
                                                   const nn::TokenShape& shape) {
    const index_t rows = static_cast<index_t>(full.size()) / seq, local = shape.seq;
    std::vector<std::int32_t> out(static_cast<std::size_t>(rows * local));
    for (index_t r = 0; r < rows; ++r)
      for (index_t p = 0; p < local; ++p)
        out[static_cast<std::size_t>(r * local + p)] = full[static_cast<std::size_t>(r * seq + shape.global_position(p))];
    return out;
  }

 private:
  std::vector<std::int32_t> local_inputs_, local_targets_;  // cp > 1: this rank's positions of the batch
  std::vector<std::int32_t> balanced_ids_, balanced_[2];    // cp_balance_documents: ids, inputs, targets reordered
};

}  // namespace trellis::train
