// flatshard/checkpoint/optimizer_state.h — reading and restoring Adam / AdamW state (internal).
//
// LibTorch keeps an optimizer's per-parameter state in Optimizer::state(), keyed by the
// parameter's TensorImpl and created lazily by the first step(). For flatshard the parameters
// are the units' fp32 master tensors, so a unit's state has the master's shape and layout
// (padding included) and can be sliced exactly like it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "checkpoint/manifest.h"
#include "flat_param/flat_param.h"

namespace torch {
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace flatshard {

// Type, state fields and (first group's) hyperparameters. Throws for optimizers other than
// Adam and AdamW.
OptimizerRecord describe_optimizer(const torch::optim::Optimizer& opt);

// Throws unless the optimizer holds `flat`'s master or a shard view of one of its trainable
// parameters (nothing to hold for a unit without trainable parameters).
void check_optimizer_holds(const torch::optim::Optimizer& opt, const FlatParam& flat);

// The state of `param` as record.fields (undefined tensors where it has none); returns its
// step count (0: no state yet).
int64_t get_optimizer_state(const torch::optim::Optimizer& opt, const OptimizerRecord& record,
                            const at::Tensor& param, std::vector<at::Tensor>& fields);

// Replaces the state of `param`. step == 0 removes it (the optimizer re-creates it as zeros).
void set_optimizer_state(torch::optim::Optimizer& opt, const OptimizerRecord& record,
                         const at::Tensor& param, int64_t step, std::vector<at::Tensor> fields);

// A unit's optimizer state as if it were held for the whole master shard: the optimizer holds
// either master() (the state is the master's) or shard views of the unit's parameters (Note
// [Original-parameter views]: each view's state is placed at its range; ranges of views without
// state, padding and frozen parameters are zero). Throws if it holds neither for a unit with
// trainable parameters, or views whose step counts differ (naming them). Returns the step
// count (0: no state; always for a wholly frozen unit).
int64_t get_unit_optimizer_state(const torch::optim::Optimizer& opt, const OptimizerRecord& record,
                                 const FlatParam& flat, std::vector<at::Tensor>& fields);
// The inverse: `fields` are master-shaped; each held view gets its range (cloned).
void set_unit_optimizer_state(torch::optim::Optimizer& opt, const OptimizerRecord& record,
                              const FlatParam& flat, int64_t step,
                              const std::vector<at::Tensor>& fields);

}  // namespace flatshard
