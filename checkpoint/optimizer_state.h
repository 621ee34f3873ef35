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

namespace torch {
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace flatshard {

// Type, state fields and (first group's) hyperparameters. Throws for optimizers other than
// Adam and AdamW.
OptimizerRecord describe_optimizer(const torch::optim::Optimizer& opt);

// Throws unless `param` (same TensorImpl) is in one of the optimizer's parameter groups.
void check_optimizer_holds(const torch::optim::Optimizer& opt, const at::Tensor& param,
                           const std::string& unit);

// The state of `param` as record.fields (undefined tensors where it has none); returns its
// step count (0: no state yet).
int64_t get_optimizer_state(const torch::optim::Optimizer& opt, const OptimizerRecord& record,
                            const at::Tensor& param, std::vector<at::Tensor>& fields);

// Replaces the state of `param`. step == 0 removes it (the optimizer re-creates it as zeros).
void set_optimizer_state(torch::optim::Optimizer& opt, const OptimizerRecord& record,
                         const at::Tensor& param, int64_t step, std::vector<at::Tensor> fields);

}  // namespace flatshard
