// trellis shard: partitioned tensors over a device mesh (placements as types, the uneven-size
// rule, the compile-time transition table, redistribute/distribute/full_tensor). See docs/shard.md.
#pragma once

#include "trellis/shard/collectives.hpp"   // defines: Collectives<Host> (the per-space communication seam)
#include "trellis/shard/layout.hpp"        // defines: chunk, local_shape, local_offsets (the uneven rule)
#include "trellis/shard/local_ops.hpp"     // defines: LocalOps<Host> (the per-space copy seam)
#include "trellis/shard/placement.hpp"     // defines: Shard, Replicate, Partial, Placements
#include "trellis/shard/plan.hpp"          // defines: make_plan, plan_v, Step (compile-time table)
#include "trellis/shard/redistribute.hpp"  // defines: redistribute, distribute, full_tensor
#include "trellis/shard/sharded.hpp"       // defines: Sharded, mesh_traits
