// flatshard/optim/fused_adamw.cpp — see fused_adamw.h for the contract.
#include "optim/fused_adamw.h"

#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <tuple>
#include <unordered_set>

#include "collectives/env.h"
#include "flat_param/upcast.h"

#if FLATSHARD_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "optim/adamw_kernel.h"
#endif

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

// Note [Host compute copy] (fused_adamw.h): per block of a tensor, three parallel passes: the
// gradient upcast into fp32 scratch, the fused kernel, the parameter cast into the copy. Blocks
// of 4 Mi elements keep the scratch (16 MiB) and the block's parameter in the host's cache
// between passes, and each pass is one parallel region over all threads. Measured on the
// 16-core H200 host, 50 M elements, on a fresh thread as the stepper's
// (benchmarks/fused_adamw_bench.cpp; RESULTS.md "Offload"): 17 ms, against 12 ms for the fp32
// step alone (whose gradient upcast and copy cast then run on the device, and whose PCIe bytes
// are twice these) and 120 ms for the fused kernel per 64 Ki-element chunk inside one parallel
// region (the first version: per-call overhead in every thread). A multiple of every vector
// width, so blocks split no vector: the kernel's element-wise result does not depend on the
// split.
constexpr int64_t kMixedBlock = int64_t{1} << 22;

// A plain fp32 CUDA step (fp32 gradient, no copy) of at least this many elements runs the
// one-pass kernel, one launch per tensor; smaller ones stay in ATen's fused multi-tensor launch,
// where one launch covers many tensors (a model's biases and norms) and host time would
// otherwise grow with their count (Note [One-pass AdamW kernel]).
constexpr int64_t kKernelMinNumel = int64_t{1} << 20;

// Note [One-pass AdamW kernel] (optim/adamw_kernel.h): whether the kernel is built and on and
// would step parameter `p` (CUDA fp32); the step of such a parameter goes through kernel_step().
bool kernel_takes(const at::Tensor& p) {
#if FLATSHARD_WITH_CUDA_KERNELS
  static const bool enabled = env::adamw_kernel();  // read once: it is on the per-step path
  return enabled && p.is_cuda() && p.scalar_type() == at::kFloat;
#else
  (void)p;
  return false;
#endif
}

// Steps `p` and writes `c` (if defined) in one launch on the current stream when kernel_takes(p)
// and the tensors are what the kernel takes (on p's device, contiguous, fp32 moments, an fp32 /
// bf16 / fp16 gradient — Note [Low-precision master gradient] —, a bf16 / fp16 copy or none);
// false leaves it to the caller.
bool kernel_step(const torch::optim::AdamWOptions& o, const at::Tensor& p, const at::Tensor& g,
                 const at::Tensor& m, const at::Tensor& v, const at::Tensor& c, int64_t step) {
#if FLATSHARD_WITH_CUDA_KERNELS
  auto fits = [&](const at::Tensor& t) {
    return t.is_cuda() && t.device() == p.device() && t.is_contiguous() && t.numel() == p.numel();
  };
  auto half = [](at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; };
  // Note [Low-precision moments]: fp32 or bf16 moments, both alike.
  const bool moments_ok = (m.scalar_type() == at::kFloat || m.scalar_type() == at::kBFloat16) &&
                          v.scalar_type() == m.scalar_type();
  if (!kernel_takes(p) || (c.defined() && !(half(c.scalar_type()) && fits(c))) || !moments_ok ||
      !(g.scalar_type() == at::kFloat || half(g.scalar_type())) || !fits(p) || !fits(g) ||
      !fits(m) || !fits(v))
    return false;
  const kernels::AdamwStep s{static_cast<float>(o.lr()),
                             static_cast<float>(std::get<0>(o.betas())),
                             static_cast<float>(std::get<1>(o.betas())),
                             static_cast<float>(o.weight_decay()), static_cast<float>(o.eps()),
                             static_cast<float>(step)};
  const cudaError_t e = kernels::adamw_step_with_copy(
      p.data_ptr<float>(), g.data_ptr(), *kernel_dtype(g.scalar_type()), m.data_ptr(),
      v.data_ptr(), *kernel_dtype(m.scalar_type()), c.defined() ? c.data_ptr() : nullptr,
      c.defined() ? *kernel_dtype(c.scalar_type()) : kernels::KernelDtype::kBFloat16, p.numel(), s,
      c10::cuda::getCurrentCUDAStream(p.device().index()).stream());
  TORCH_CHECK(e == cudaSuccess, "FusedAdamW: the one-pass AdamW kernel failed to launch on ",
              p.device(), " (", p.numel(), " elements): ", cudaGetErrorString(e));
  return true;
#else
  (void)o, (void)p, (void)g, (void)m, (void)v, (void)c, (void)step;
  return false;
#endif
}

void mixed_step(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params,
                const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& steps,
                const std::vector<int64_t>& counts, const std::vector<at::Tensor>& copies,
                at::Tensor& scratch, std::mutex& scratch_mu) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  auto fused = [&](const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                   const at::Tensor& v, const at::Tensor& st) {
    if (m.scalar_type() == p.scalar_type()) {
      at::_fused_adamw_({p}, {g}, {m}, {v}, /*max_exp_avg_sqs=*/{}, {st}, o.lr(), beta1, beta2,
                        o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
      return;
    }
    // Note [Low-precision moments]: upcast (exact), step in the parameter's dtype, round back.
    const at::Tensor mw = m.to(p.scalar_type()), vw = v.to(p.scalar_type());
    at::_fused_adamw_({p}, {g}, {mw}, {vw}, /*max_exp_avg_sqs=*/{}, {st}, o.lr(), beta1, beta2,
                      o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
    m.copy_(mw);
    v.copy_(vw);
  };
  at::NoGradGuard no_grad;  // in-place writes to parameters: nothing for autograd to record
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor &p = params[i], &g = grads[i], &m = exp_avgs[i], &v = exp_avg_sqs[i],
                     &c = copies[i];
    const bool flat_cpu = p.device().is_cpu() && p.dim() == 1 && p.is_contiguous() &&
                          g.is_contiguous() && m.is_contiguous() && v.is_contiguous() &&
                          (!c.defined() || c.is_contiguous());
    if (!flat_cpu) {  // CUDA (or a shape the blocks do not cover): whole tensors, same values
      if (kernel_step(o, p, g, m, v, c, counts[i])) continue;
      fused(p, g.to(p.scalar_type()), m, v, steps[i]);
      if (c.defined()) c.copy_(p.reshape(c.sizes()));
      continue;
    }
    const bool upcast = g.scalar_type() != p.scalar_type();
    // The scratch block is shared by steps on other threads (an offload worker's); CUDA steps
    // above take no lock, so a device step never waits behind a host one.
    std::lock_guard<std::mutex> lock(scratch_mu);
    for (int64_t b = 0; b < p.numel(); b += kMixedBlock) {
      const int64_t len = std::min(kMixedBlock, p.numel() - b);
      const at::Tensor pb = p.narrow(0, b, len);
      at::Tensor gb = g.narrow(0, b, len);
      if (upcast) {
        if (!scratch.defined() || scratch.scalar_type() != p.scalar_type() || scratch.numel() < len)
          scratch = at::empty({std::min(kMixedBlock, p.numel())}, p.options());
        at::Tensor s = scratch.narrow(0, 0, len);
        s.copy_(gb);
        gb = s;
      }
      fused(pb, gb, m.narrow(0, b, len), v.narrow(0, b, len), steps[i]);
      if (c.defined()) c.narrow(0, b, len).copy_(pb);
    }
  }
}

}  // namespace

void FusedAdamW::set_moments_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "FusedAdamW::set_moments_dtype: the moments of fp32 parameters can be kept in "
              "float32 or bfloat16, got ", dtype);
  moments_dtype_ = dtype;
}

at::ScalarType FusedAdamW::moments_dtype_for(const at::Tensor& p) const {
  return p.scalar_type() == at::kFloat ? moments_dtype_ : p.scalar_type();
}

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

FusedAdamW::CapturedStep FusedAdamW::capture_located(const std::vector<Located>& params,
                                                     const TensorOf& grad_of,
                                                     const TensorOf& copy_of) const {
  CapturedStep out;
  size_t last = SIZE_MAX;
  for (const Located& l : params) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups()[l.group].options());
    const at::Tensor grad = grad_of ? grad_of(l.param) : l.param.grad();
    TORCH_CHECK(!o.amsgrad() && !(grad.defined() && grad.is_sparse()),
                "FusedAdamW::step_params: amsgrad and sparse gradients have no fused step");
    if (!grad.defined()) continue;
    TORCH_CHECK(grad.numel() == l.param.numel() && at::isFloatingType(grad.scalar_type()) &&
                    c10::elementSize(grad.scalar_type()) <= c10::elementSize(l.param.scalar_type()),
                "FusedAdamW: a gradient of ", grad.numel(), " elements of ", grad.scalar_type(),
                " for a parameter of ", l.param.numel(), " of ", l.param.scalar_type());
    if (l.group != last) {
      out.groups.emplace_back();
      out.groups.back().options = o;
      last = l.group;
    }
    CapturedStep::Group& g = out.groups.back();
    g.params.push_back(l.param);
    g.grads.push_back(grad);
    g.versions.push_back(static_cast<int64_t>(grad._version()));
    if (copy_of) {
      g.copies.resize(g.params.size() - 1);
      g.copies.push_back(copy_of(l.param));
    }
  }
  for (auto& g : out.groups)
    if (!g.copies.empty()) g.copies.resize(g.params.size());
  return out;
}

void FusedAdamW::mark_stepped_early(const CapturedStep& step, int64_t own_writes) {
  for (const auto& g : step.groups)
    for (size_t i = 0; i < g.params.size(); ++i)
      stepped_early_[g.params[i].unsafeGetTensorImpl()] = g.versions[i] + own_writes;
}

void FusedAdamW::run_step(const CapturedStep& step) {
  at::NoGradGuard no_grad;
  for (const auto& g : step.groups) step_lists(g.options, g.params, g.grads, g.copies);
}

void FusedAdamW::fused_step(const std::function<bool(const at::Tensor&)>& take) {
  at::NoGradGuard no_grad;
  // Note [Compute copy in the step]: a set's copies are written only if they hold the values
  // the step starts from; `wrote`: the sets this step wrote a copy of.
  std::vector<char> current(copy_sets_.size()), wrote(copy_sets_.size());
  for (size_t i = 0; i < copy_sets_.size(); ++i) current[i] = copy_sets_[i].current();
  for (auto& group : param_groups()) {
    std::vector<at::Tensor> params, grads, copies;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || (take && !take(p))) continue;
      params.push_back(p);
      grads.push_back(p.grad());
      if (copy_of_.empty()) continue;
      auto it = copy_of_.find(p.unsafeGetTensorImpl());
      const bool write = it != copy_of_.end() && current[it->second.first];
      copies.resize(params.size() - 1);
      copies.push_back(write ? it->second.second : at::Tensor());
      if (write) wrote[it->second.first] = 1;
    }
    if (!params.empty())
      step_lists(static_cast<const torch::optim::AdamWOptions&>(group.options()), params, grads,
                 copies);
  }
  for (size_t i = 0; i < copy_sets_.size(); ++i)
    if (wrote[i]) copy_sets_[i].written();
}

void FusedAdamW::set_compute_copies(std::vector<ComputeCopies> sets) {
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, at::Tensor>> copy_of;
  for (size_t i = 0; i < sets.size(); ++i) {
    TORCH_CHECK(sets[i].current && sets[i].written,
                "FusedAdamW::set_compute_copies: set ", i, " lacks current() or written()");
    for (const auto& [p, c] : sets[i].tensors) {
      TORCH_CHECK(p.defined() && c.defined() && p.numel() == c.numel() &&
                      p.device() == c.device() && at::isFloatingType(c.scalar_type()) &&
                      c10::elementSize(c.scalar_type()) < c10::elementSize(p.scalar_type()),
                  "FusedAdamW::set_compute_copies: set ", i, " pairs a parameter of ",
                  p.defined() ? p.numel() : 0, " elements of ",
                  p.defined() ? p.scalar_type() : at::kFloat, " with a copy of ",
                  c.defined() ? c.numel() : 0, " of ", c.defined() ? c.scalar_type() : at::kFloat,
                  " (same element count and device, a narrower floating dtype)");
      copy_of[p.unsafeGetTensorImpl()] = {i, c};
    }
  }
  copy_sets_ = std::move(sets);
  copy_of_ = std::move(copy_of);
}

void FusedAdamW::step_lists(const torch::optim::AdamWOptions& o,
                            const std::vector<at::Tensor>& params,
                            const std::vector<at::Tensor>& grads,
                            const std::vector<at::Tensor>& copies) {
  struct Lists {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    std::vector<int64_t> counts;  // the step counts of `steps`
  };
  // Per tensor: a lower-precision gradient or a copy to write (Note [Host compute copy]), or a
  // CUDA fp32 step the one-pass kernel takes (Note [One-pass AdamW kernel]).
  Lists mixed;
  std::vector<at::Tensor> mixed_copies;
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
        s->exp_avg(at::zeros_like(p, p.options().dtype(moments_dtype_for(p)),
                                  at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, p.options().dtype(moments_dtype_for(p)),
                                     at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
      s.step(s.step() + 1);
      // Note [Low-precision moments]: state made or loaded in another dtype takes this one
      // (bf16 -> fp32 exact; fp32 -> bf16 the rounding the next store would do).
      const at::ScalarType md = moments_dtype_for(p);
      if (s.exp_avg().scalar_type() != md) s.exp_avg(s.exp_avg().to(md));
      if (s.exp_avg_sq().scalar_type() != md) s.exp_avg_sq(s.exp_avg_sq().to(md));
      const at::Tensor copy = copies.empty() ? at::Tensor() : copies[i];
      const bool is_mixed = copy.defined() || grads[i].scalar_type() != p.scalar_type() ||
                            md != p.scalar_type() ||
                            (kernel_takes(p) && p.numel() >= kKernelMinNumel);
      if (is_mixed) mixed_copies.push_back(copy);
      Lists& l = is_mixed ? mixed
                          : by_kind[{static_cast<int>(p.device().type()), p.device().index(),
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
      l.counts.push_back(s.step());
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
  if (mixed.params.empty()) return;
  mixed_step(o, mixed.params, mixed.grads, mixed.exp_avgs, mixed.exp_avg_sqs, mixed.steps,
             mixed.counts, mixed_copies, mixed_scratch_, scratch_mu_);
  for (auto* list : {&mixed.params, &mixed.exp_avgs, &mixed.exp_avg_sqs, &mixed_copies})
    for (auto& t : *list)
      if (t.defined()) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace flatshard
