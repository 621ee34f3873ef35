// flatshard/fsdp/resolve.h — one unit's settings from its plan entry and the options.
//
// The only place where a UnitSpec plus ShardingOptions become a unit's strategy, whether it
// reshards after forward, its FlatParamConfig and the world size its flat buffer is laid out
// over. fully_shard() (fsdp/setup.cpp) builds each Unit from it and explain() (explain.cpp)
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
//   through enter() with a closure whose tensor inputs are unknown) — whether asked for with
//   `root:recompute` (the root's options) or with a recompute rule that matches the root
//   module, e.g. `recompute:type=GPT` on a GPT: a rule never matches the root (make_plan), so
//   such a rule alone forms no unit and the model would train without recompute behind a mere
//   "matched no module" warning; check_recompute_policy() makes that an error naming the unit.
//   check_recompute_plan() rejects a recompute unit whose member modules contain another
//   unit's members.
// - FlatParamConfig: sharded unless NO_SHARD; gather dtype = mixed_precision.gather_dtype on
//   sharded units (NO_SHARD: param, it gathers nothing), the plan's option when set (fp8 or int8
//   on NO_SHARD: an error naming the unit); param dtype = mixed_precision.param_dtype; reduce
//   dtype = mixed_precision.reduce_dtype, else the param dtype; align and sync_module_states from
//   the options; padding poisoned when FLATSHARD_DEBUG is on (collectives/env.h).
// - offload: the plan's unit option, else ShardingOptions::offload; 0, 1 or 2 (else an error
//   naming the unit); level 2 on a NO_SHARD unit is level 1 (its compute copy is always held;
//   Note [CPU offload], flat_param/offload.h).
// - layout world size: the shard group's size for sharded units, 1 for NO_SHARD (replicated);
//   FlatParam derives the same from config.sharded (Unit asserts they agree).
// Pure: no collectives, no tensors; the model is not read (check_recompute_policy reads the root
// module's type name and parameter count only).
#pragma once

#include "flat_param/flat_param.h"
#include "fsdp/options.h"
#include "wrap_policies/plan.h"
#include "wrap_policies/policy.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

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

// Throws c10::Error naming the unit '<root>' and the rule when a rule of `policy` that sets
// recompute matches the root module `model` (all its terms hold there) and `plan` (made from
// them) recomputes no unit: the recompute asked for would silently not happen. A rule that also
// recomputes other units (e.g. `recompute:size>=1000`) is fine: the root is never a rule's unit.
void check_recompute_policy(const Policy& policy, const torch::nn::Module& model,
                            const Plan& plan);

}  // namespace flatshard
