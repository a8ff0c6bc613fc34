// trellis optim: AdamW state and update, learning-rate schedules, global-norm gradient clipping,
// ZeRO-1 partitioning. Host-only; the update math is kernels/adamw_host.hpp.
#pragma once

#include "trellis/optim/adamw.hpp"        // defines: AdamW, AdamWState, adamw_m_name/adamw_v_name
#include "trellis/optim/clip.hpp"         // defines: global_grad_norm, clip_factor, clip_grad_norm, sum_over, LocalSum
#include "trellis/optim/lr_schedule.hpp"  // defines: ConstantLR, WarmupCosine
#include "trellis/optim/zero.hpp"         // defines: FlatLayout, pack_flat, zero1_partition, pieces_in
