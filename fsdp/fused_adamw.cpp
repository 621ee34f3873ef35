// flatshard/fsdp/fused_adamw.cpp — see fused_adamw.h for the contract.
#include "fsdp/fused_adamw.h"

#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>

#include <map>
#include <tuple>

namespace flatshard {

torch::Tensor FusedAdamW::step(LossClosure closure) {
  if (closure) return torch::optim::AdamW::step(std::move(closure));
  for (const auto& group : param_groups())
    for (const auto& p : group.params())
      if (p.grad().defined() && p.grad().is_sparse())
        return torch::optim::AdamW::step(nullptr);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (o.amsgrad()) return torch::optim::AdamW::step(nullptr);
  }
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    };
    // (device, dtype) -> lists: one fused launch each.
    std::map<std::tuple<int, int, int>, Lists> by_kind;
    // One step tensor per (device, step count), shared by the list entries that have it: with
    // per-parameter groups (shard views) a group holds many tensors at the same step, and each
    // made tensor is a host-side allocation and a fill launch.
    std::map<std::tuple<int, int, int64_t>, at::Tensor> step_tensors;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
      s.step(s.step() + 1);
      Lists& l = by_kind[{static_cast<int>(p.device().type()), p.device().index(),
                          static_cast<int>(p.scalar_type())}];
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      l.exp_avgs.push_back(s.exp_avg());
      l.exp_avg_sqs.push_back(s.exp_avg_sq());
      // The kernel takes the step count as a float32 tensor on the parameter's device.
      at::Tensor& st = step_tensors[{static_cast<int>(p.device().type()), p.device().index(),
                                     s.step()}];
      if (!st.defined())
        st = at::full({}, static_cast<double>(s.step()),
                      at::TensorOptions().dtype(at::kFloat).device(p.device()));
      l.steps.push_back(st);
    }
    for (auto& [kind, l] : by_kind) {
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{},
                        l.steps, o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()),
                        o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
      // The kernel writes in place but bumps no version counter (measured on torch 2.11, CPU);
      // code that detects a step by versions (flatshard's StepGuard, autograd's saved-tensor
      // checks) must see the write, as for any in-place op.
      for (auto* list : {&l.params, &l.exp_avgs, &l.exp_avg_sqs})
        for (auto& t : *list) t.unsafeGetTensorImpl()->bump_version();
    }
  }
  return {};
}

}  // namespace flatshard
