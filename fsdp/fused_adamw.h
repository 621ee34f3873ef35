// flatshard/fsdp/fused_adamw.h — AdamW whose step is one fused ATen kernel per device and dtype.
//
// Why: torch::optim::AdamW (the C++ API) updates one parameter at a time with about ten
// element-wise kernels each (decay, two moment updates, sqrt, divide, add, addcdiv), reading and
// writing every element several times: on the 1B GPT's fp32 master shards that is ~10 ms of a
// ~117 ms step on an H200 (benchmarks/RESULTS.md). ATen's `_fused_adamw_` (the kernel behind
// PyTorch's `AdamW(fused=True)`) reads parameter, gradient and both moments once and writes
// three of them once. flatshard's flat master shards make the lists short: one tensor per unit.
//
// Contract
// - A drop-in torch::optim::AdamW: same options, same AdamWParamState (so checkpoints, state_dict
//   and the optimizer checks see an AdamW), same update rule (decoupled weight decay, bias
//   correction), equal to AdamW's result up to float rounding.
// - step() groups the parameters that have a gradient by (device, dtype) within each parameter
//   group and calls `_fused_adamw_` once per group. The step count stays the int64 in
//   AdamWParamState; the kernel reads it from a float tensor made per step on the device.
// - Falls back to AdamW::step() for what the fused kernel does not do: amsgrad, sparse
//   gradients, closures.
// - Works on CPU and CUDA (ATen has both kernels).
#pragma once

#include <torch/optim/adamw.h>

#include <vector>

namespace flatshard {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace flatshard
