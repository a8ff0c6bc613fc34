// trellis train: checkpoints (safetensors + index, reshardable, crash-safe), data loading,
// metrics, a saveable RNG, the GPT Trainer. Host-only. File formats: trellis/io.hpp; progress
// display and loss curves: trellis/report.hpp.
#pragma once

#include "trellis/train/checkpoint.hpp"   // defines: CheckpointWriter, commit_checkpoint, Checkpoint
#include "trellis/train/checkpoint_box.hpp"  // defines: Box, split_box, flat_range_boxes
#include "trellis/train/checkpoint_model.hpp"  // defines: save_model_config, check_model_config
#include "trellis/train/data.hpp"         // defines: TokenData, DataLoader, Batch, unigram_entropy
#include "trellis/train/generate.hpp"     // defines: Generator (text from a checkpoint, 1 rank)
#include "trellis/train/hf_gpt2.hpp"      // defines: export_hf_gpt2, HfGpt2File, hf_gpt2_config_json
#include "trellis/train/metrics.hpp"      // defines: MetricsWriter, StepMetrics, gpt_flops_per_token, loss_curves_from_metrics
#include "trellis/train/rng.hpp"          // defines: Rng (xoshiro256**)
#include "trellis/train/train_state.hpp"  // defines: TrainState, save/load_train_state, adamw moments, gpt2_parameters
#include "trellis/train/trainer.hpp"      // defines: Trainer
#include "trellis/train/trainer_config.hpp"  // defines: TrainerConfig, StepResult, check_config, config_problems
