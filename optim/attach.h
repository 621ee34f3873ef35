// flatshard/optim/attach.h — a FusedAdamW attaching itself to a sharded model's units.
//
// Contract
// - ShardedModel::attach_optimizer (fsdp/sharded_model.h) forwards here: what an attached
//   optimizer takes on is decided in optim/, which sees the model only as what lies below it,
//   its units' flat parameters (flat_param/), plus what only the model can do, handed in as
//   functions (dependencies point downward: docs/design.md "Layers and folders").
// - What it takes on: Note [Compute copy in the step] (optim/fused_adamw.h): per unit that
//   keeps a device compute copy (a StepCopy: FlatParam::gather_plan().extras().step), its
//   master and non-empty shard views paired with their parts of the copy, written in the step
//   while the model lives (FLATSHARD_STEP_COMPUTE_COPY=0: none); and where the model steps
//   offloaded units itself (offload_step = backward or delayed: Note [Offload step in
//   backward], fsdp/offload_step.h), target.attach_offload(opt).
// - Checks, in this order, each error naming the rank: a null optimizer; a model with neither
//   compute copies nor offload steps (nothing to attach to); target.check(*opt) (the model's
//   check_optimizer); set_compute_copies()'s checks; attach_offload's (amsgrad). Replaces an
//   earlier attachment of `opt` to the same model. Local: no collectives.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "optim/fused_adamw.h"

namespace flatshard {

class FlatParam;  // flat_param/flat_param.h

// What a model hands an attaching FusedAdamW.
struct AttachTarget {
  int rank = 0;                          // this rank, for messages
  std::vector<const FlatParam*> units;   // each unit's flat parameter, in plan order
  std::weak_ptr<const void> alive;       // expires with the model: its copies are never current
  std::function<void(const FusedAdamW&)> check;  // the model's optimizer check (may throw)
  // Note [Offload step in backward]: hands the optimizer to the model's CPU stepper (which
  // also makes its step() wait for the stepper as the mode needs); empty when the model steps
  // nothing itself.
  std::function<void(const std::shared_ptr<FusedAdamW>&)> attach_offload;
};

// `opt` attaches itself to `target` (see the contract). Throws c10::Error as listed there.
void attach(const std::shared_ptr<FusedAdamW>& opt, const AttachTarget& target);

}  // namespace flatshard
