// trellis train: checkpoints (safetensors + index, reshardable, crash-safe), data loading,
// metrics, progress display, loss-curve SVG, a saveable RNG, the GPT Trainer. Host-only.
#pragma once

#include "trellis/train/atomic_file.hpp"  // defines: AtomicFileWriter, ReadOnlyFile, fsync_directory
#include "trellis/train/checkpoint.hpp"   // defines: CheckpointWriter, commit_checkpoint, Checkpoint, Box
#include "trellis/train/checksum.hpp"     // defines: crc32c, Crc32c
#include "trellis/train/data.hpp"         // defines: TokenData, DataLoader, Batch, unigram_entropy
#include "trellis/train/generate.hpp"     // defines: Generator (text from a checkpoint, 1 rank)
#include "trellis/train/json.hpp"         // defines: json::Value, json::parse, json::dump
#include "trellis/train/loss_curve.hpp"   // defines: loss_curve_svg, write_loss_curve_svg
#include "trellis/train/metrics.hpp"      // defines: MetricsWriter, StepMetrics, gpt_flops_per_token
#include "trellis/train/progress.hpp"     // defines: ProgressBar, ProgressInfo
#include "trellis/train/rng.hpp"          // defines: Rng (xoshiro256**)
#include "trellis/train/safetensors.hpp"  // defines: SafetensorsWriter, SafetensorsFile
#include "trellis/train/train_state.hpp"  // defines: TrainState, save/load_train_state, adamw moments, gpt2_parameters
#include "trellis/train/trainer.hpp"      // defines: Trainer, TrainerConfig, StepResult, check_config
