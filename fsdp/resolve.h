// flatshard/fsdp/resolve.h — one unit's settings from its plan entry and the options.
//
// The only place where a UnitSpec plus ShardingOptions become a unit's strategy, whether it
// reshards after forward, its FlatParamConfig and the world size its flat buffer is laid out
// over. fully_shard() (sharded_model.cpp) builds each Unit from it and explain() (explain.cpp)
// predicts from it, so the two agree by construction, not by keeping copies in step.
//
// Rules
// - strategy: the plan's unit option, else ShardingOptions::strategy.
// - reshard_after_forward: the plan's unit option, else ShardingOptions::reshard_after_forward,
//   except that the root defaults to false (its backward starts right after the forward ends);
//   then true only for FULL_SHARD (SHARD_GRAD_OP keeps its parameters until backward by
//   definition, NO_SHARD never frees them).
// - recompute: the plan's unit option, else off (Note [Recompute], fsdp/recompute.h). On the
//   root unit it is an error (its forward is the whole model's: the outermost call, entered
//   through enter() with a closure whose tensor inputs are unknown); check_recompute_plan()
//   rejects a recompute unit whose member modules contain another unit's members.
// - FlatParamConfig: sharded unless NO_SHARD; param dtype = mixed_precision.param_dtype; reduce
//   dtype = mixed_precision.reduce_dtype, else the param dtype; align and sync_module_states from
//   the options; padding poisoned when FLATSHARD_DEBUG is on (collectives/env.h).
// - offload: the plan's unit option, else ShardingOptions::offload; 0, 1 or 2 (else an error
//   naming the unit); level 2 on a NO_SHARD unit is level 1 (its compute copy is always held;
//   Note [CPU offload], flat_param/offload.h).
// - layout world size: the shard group's size for sharded units, 1 for NO_SHARD (replicated);
//   FlatParam derives the same from config.sharded (Unit asserts they agree).
// Pure: no collectives, no tensors; the model is not read.
#pragma once

#include "flat_param/flat_param.h"
#include "fsdp/options.h"
#include "wrap_policies/plan.h"

namespace flatshard {

struct ResolvedUnit {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool reshard_after_forward = false;  // true only for FULL_SHARD units
  bool recompute = false;              // forward recomputed in backward (Note [Recompute])
  FlatParamConfig flat;                // what the unit's FlatParam is built with
  int layout_world_size = 1;           // ranks the flat buffer is padded and sharded over
};

// `shard_world_size`: ranks of the shard group (all ranks without HSDP); must be >= 1.
ResolvedUnit resolve_unit(const UnitSpec& spec, const ShardingOptions& options,
                          int shard_world_size);

// Throws c10::Error naming both units when a recompute unit's member module contains (is an
// ancestor of) a member of another unit: the recompute would run that unit's forward again
// inside a backward, outside its pre/post-forward (Note [Recompute]). Pure: reads paths only.
void check_recompute_plan(const Plan& plan);

}  // namespace flatshard
