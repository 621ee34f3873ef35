// flatshard/fsdp/fused_adamw.cpp — see fused_adamw.h for the contract.
#include "fsdp/fused_adamw.h"

#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <unordered_set>

namespace flatshard {

namespace {

// Where the fused kernel cannot step: AdamW::step() does.
bool needs_fallback(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (const auto& group : groups) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (o.amsgrad()) return true;
    for (const auto& p : group.params())
      if (p.grad().defined() && p.grad().is_sparse()) return true;
  }
  return false;
}

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  if (before_step_) before_step_();
  if (stepped_early_.empty()) {
    if (closure) return torch::optim::AdamW::step(std::move(closure));
    if (needs_fallback(param_groups())) return torch::optim::AdamW::step(nullptr);
    fused_step(nullptr);
    return {};
  }
  auto early = std::move(stepped_early_);
  stepped_early_.clear();
  TORCH_CHECK(!closure, "FusedAdamW: step(closure) after step_params(): the closure would "
              "re-evaluate the loss for parameters already stepped");
  TORCH_CHECK(!needs_fallback(param_groups()),
              "FusedAdamW: step() after step_params(): amsgrad and sparse gradients have no fused "
              "step");
  for (const auto& group : param_groups())
    for (const auto& p : group.params()) {
      auto it = early.find(p.unsafeGetTensorImpl());
      if (it == early.end() || !p.grad().defined()) continue;
      TORCH_CHECK(p.grad()._version() == it->second,
                  "FusedAdamW: the gradient of a parameter of ", p.numel(),
                  " elements was modified (gradient clipping? unscaling?) after that parameter "
                  "was already stepped during backward (offload_step = backward, Note [Offload "
                  "step in backward]); the change cannot count. Clip with the default "
                  "offload_step (after backward), or do not modify gradients in this mode");
    }
  fused_step([&](const at::Tensor& p) { return early.count(p.unsafeGetTensorImpl()) == 0; });
  return {};
}

void FusedAdamW::step_params(const std::vector<at::Tensor>& params) {
  run_step(capture_step(params));
  for (const auto& p : params)
    if (p.grad().defined()) stepped_early_[p.unsafeGetTensorImpl()] = p.grad()._version();
}

FusedAdamW::CapturedStep FusedAdamW::capture_step(const std::vector<at::Tensor>& params) const {
  return capture_located(located(params));
}

std::vector<FusedAdamW::Located> FusedAdamW::located(const std::vector<at::Tensor>& params) const {
  std::unordered_set<const c10::TensorImpl*> wanted;
  for (const auto& p : params) wanted.insert(p.unsafeGetTensorImpl());
  std::vector<Located> out;
  const auto& groups = param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params())
      if (wanted.count(p.unsafeGetTensorImpl())) out.push_back(Located{g, p});
  TORCH_CHECK(out.size() == wanted.size(), "FusedAdamW::step_params: ", wanted.size() - out.size(),
              " of ", wanted.size(), " tensors are not parameters of this optimizer");
  return out;
}

FusedAdamW::CapturedStep FusedAdamW::capture_located(const std::vector<Located>& params) const {
  CapturedStep out;
  size_t last = SIZE_MAX;
  for (const Located& l : params) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups()[l.group].options());
    const at::Tensor& grad = l.param.grad();
    TORCH_CHECK(!o.amsgrad() && !(grad.defined() && grad.is_sparse()),
                "FusedAdamW::step_params: amsgrad and sparse gradients have no fused step");
    if (!grad.defined()) continue;
    if (l.group != last) {
      out.groups.emplace_back();
      out.groups.back().options = o;
      last = l.group;
    }
    CapturedStep::Group& g = out.groups.back();
    g.params.push_back(l.param);
    g.grads.push_back(grad);
    g.versions.push_back(static_cast<int64_t>(grad._version()));
  }
  return out;
}

void FusedAdamW::mark_stepped_early(const CapturedStep& step, int64_t own_writes) {
  for (const auto& g : step.groups)
    for (size_t i = 0; i < g.params.size(); ++i)
      stepped_early_[g.params[i].unsafeGetTensorImpl()] = g.versions[i] + own_writes;
}

void FusedAdamW::run_step(const CapturedStep& step) {
  at::NoGradGuard no_grad;
  for (const auto& g : step.groups) step_lists(g.options, g.params, g.grads);
}

void FusedAdamW::fused_step(const std::function<bool(const at::Tensor&)>& take) {
  at::NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    std::vector<at::Tensor> params, grads;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || (take && !take(p))) continue;
      params.push_back(p);
      grads.push_back(p.grad());
    }
    if (!params.empty())
      step_lists(static_cast<const torch::optim::AdamWOptions&>(group.options()), params, grads);
  }
}

void FusedAdamW::step_lists(const torch::optim::AdamWOptions& o,
                            const std::vector<at::Tensor>& params,
                            const std::vector<at::Tensor>& grads) {
  struct Lists {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  };
  // (device, dtype) -> lists: one fused launch each.
  std::map<std::tuple<int, int, int>, Lists> by_kind;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    // One step tensor per (device, step count), shared by the list entries that have it: with
    // per-parameter groups (shard views) a group holds many tensors at the same step, and each
    // made tensor is a host-side allocation and a fill launch.
    std::map<std::tuple<int, int, int64_t>, at::Tensor> step_tensors;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
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
      l.grads.push_back(grads[i]);
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

}  // namespace flatshard
