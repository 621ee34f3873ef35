// flatshard/fsdp/grad_scaler.cpp — see grad_scaler.h for the rules and the contract.
#include "fsdp/grad_scaler.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <utility>
#include <vector>

#include "collectives/agree.h"
#include "fsdp/sharded_model.h"

namespace flatshard {

namespace {

// Note [Loss scale range]: S is a normal fp32 value, so 1/S (<= 2^126) is finite in fp32. A
// subnormal S (1e-40) has a reciprocal of inf: the unscale would turn every finite gradient
// into inf or NaN after the inf check (which reads the gradients before they are unscaled) and
// the step would count as clean. update() never backs S off below kMinScale.
constexpr double kMinScale = static_cast<double>(std::numeric_limits<float>::min());  // 2^-126
constexpr double kMaxScale = static_cast<double>(std::numeric_limits<float>::max());
// The factors' bounds: one update moves S by at most 2^16 either way.
constexpr double kMaxGrowth = 65536.0;
constexpr double kMinBackoff = 1.0 / 65536.0;

bool valid_scale(double v) { return std::isfinite(v) && v >= kMinScale && v <= kMaxScale; }

// "a normal positive fp32 value in [1.17549e-38, 3.40282e+38] (...)": one wording for the option
// and the state.
std::string scale_rule() {
  return c10::str("a normal positive fp32 value in [", kMinScale, ", ", kMaxScale,
                  "] (below that its reciprocal overflows fp32 and every unscaled gradient "
                  "becomes inf or NaN)");
}

}  // namespace

void GradScalerState::check(const std::string& what) const {
  TORCH_CHECK(valid_scale(scale), what, ": scale must be ", scale_rule(), ", got ", scale);
  TORCH_CHECK(std::isfinite(growth_factor) && growth_factor > 1 && growth_factor <= kMaxGrowth,
              what, ": growth_factor must be in (1, 2^16 = ", kMaxGrowth, "], got ", growth_factor);
  TORCH_CHECK(std::isfinite(backoff_factor) && backoff_factor >= kMinBackoff && backoff_factor < 1,
              what, ": backoff_factor must be in [2^-16 = ", kMinBackoff, ", 1), got ",
              backoff_factor);
  TORCH_CHECK(growth_interval >= 1 && growth_interval <= std::numeric_limits<int32_t>::max(), what,
              ": growth_interval must be in [1, 2^31 - 1], got ", growth_interval);
  TORCH_CHECK(growth_tracker >= 0 && growth_tracker < growth_interval, what,
              ": growth_tracker must be in [0, growth_interval = ", growth_interval, "), got ",
              growth_tracker);
}

ShardedGradScaler::ShardedGradScaler(ShardedModel& model, GradScalerOptions options)
    : model_(model),
      enabled_(options.enabled),
      scale_(static_cast<float>(options.init_scale)),
      growth_factor_(options.growth_factor),
      backoff_factor_(options.backoff_factor),
      growth_interval_(options.growth_interval) {
  const std::string what = where("ShardedGradScaler") + ": GradScalerOptions";
  TORCH_CHECK(valid_scale(options.init_scale), what, ".init_scale must be ", scale_rule(), ", got ",
              options.init_scale);
  GradScalerState s;  // the constants' rules are the state's
  s.growth_factor = options.growth_factor;
  s.backoff_factor = options.backoff_factor;
  s.growth_interval = options.growth_interval;
  s.check(what);
  // Note [Offload step in backward]: that mode steps offloaded units on still-scaled gradients
  // before any rank knows whether one overflowed.
  TORCH_CHECK(!enabled_ || model.options().offload_step == OffloadStep::kAfterBackward, what,
              ": an enabled scaler cannot run with ShardingOptions::offload_step = ",
              model.options().offload_step == OffloadStep::kDelayed ? "OffloadStep::kDelayed"
                                                                     : "OffloadStep::kBackward",
              " (offloaded units step during backward, before the scaler unscales and checks "
              "their gradients); use the default offload_step");
}

std::string ShardedGradScaler::where(const char* call) const {
  return c10::str("ShardedGradScaler::", call, " (rank ", model_.mesh().global_rank(), ")");
}

at::Tensor ShardedGradScaler::scale(const at::Tensor& loss) const {
  if (!enabled_) return loss;
  TORCH_CHECK(loss.defined() && at::isFloatingType(loss.scalar_type()), where("scale"),
              ": the loss must be a floating-point tensor, got ",
              loss.defined() ? c10::toString(loss.scalar_type()) : "an undefined tensor");
  return loss * static_cast<double>(scale_);
}

void ShardedGradScaler::unscale_(torch::optim::Optimizer& opt) {
  if (!enabled_) return;
  const std::string what = where("unscale_");
  auto it = per_optimizer_.find(&opt);
  if (it != per_optimizer_.end()) {
    TORCH_CHECK(it->second.state != OptState::kUnscaled, what,
                ": unscale_() has already been called on this optimizer since the last update()");
    TORCH_CHECK(false, what, ": unscale_() is being called after step(); call update() first");
  }
  at::NoGradGuard no_grad;
  const Mesh& mesh = model_.mesh();
  const c10::Device device = mesh.device();
  // [found_inf, failed]: one all-reduce answers both "did any rank overflow" and "did any rank
  // fail here", so a local fault cannot leave the other ranks waiting in the collective.
  at::Tensor flags = at::zeros({2}, at::TensorOptions().dtype(at::kFloat).device(device));
  std::exception_ptr err;
  try {
    // Gradients grouped by device (offloaded masters keep theirs on the host): one fused
    // check-and-unscale per group, torch's kernel.
    std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> groups;
    size_t g = 0;
    for (const auto& group : opt.param_groups()) {
      size_t i = 0;
      for (const auto& p : group.params()) {
        const at::Tensor& grad = p.grad();
        if (grad.defined()) {
          TORCH_CHECK(grad.scalar_type() == at::kFloat && !grad.is_sparse(), what,
                      ": the gradient of optimizer parameter ", i, " of group ", g, " is ",
                      grad.is_sparse() ? "sparse " : "", grad.scalar_type(),
                      "; the scaler unscales dense fp32 gradients (build the optimizer on "
                      "ShardedModel::parameters() or named_parameters(), and leave "
                      "MixedPrecision::keep_low_precision_grads off: unscaling in ",
                      grad.scalar_type(), " would flush the small gradients the scale keeps)");
          auto at_device = std::find_if(groups.begin(), groups.end(),
                                        [&](const auto& e) { return e.first == grad.device(); });
          if (at_device == groups.end())
            at_device = groups.emplace(groups.end(), grad.device(), std::vector<at::Tensor>{});
          at_device->second.push_back(grad);
        }
        ++i;
      }
      ++g;
    }
    // 1/S in double, rounded to fp32 (torch: scale.double().reciprocal().float()).
    const float inv = static_cast<float>(1.0 / static_cast<double>(scale_));
    for (auto& [dev, grads] : groups) {
      const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
      at::Tensor found = at::zeros({1}, f32);
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, at::full({1}, inv, f32));
      // The kernel checks each gradient before multiplying it. With S < 1 (1/S > 1) a finite
      // scaled gradient can overflow once unscaled: check the unscaled values too (the kernel
      // with 1/S = 1 only checks), so a non-finite gradient never reaches a clean step. With
      // S >= 1, |g / S| <= |g|: nothing new can overflow, and no second pass is paid.
      if (inv > 1.0f)
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found, at::ones({1}, f32));
      flags.narrow(0, 0, 1).add_(found.to(device));
    }
  } catch (...) {
    err = std::current_exception();
    flags.fill_(0);
    flags[1] = 1.0;
  }
  all_reduce(mesh, flags, ReduceOp::kSum, mesh.shard().current_stream());
  const at::Tensor answer = flags.to(at::kCPU);
  const float* a = answer.data_ptr<float>();
  if (a[1] > 0) {
    // Some rank failed: every rank learns which and why, and throws the same way.
    agree(mesh, err, what);
    TORCH_INTERNAL_ASSERT(false, what, ": a rank reported a failure that agree() did not find");
  }
  per_optimizer_[&opt] = PerOptimizer{OptState::kUnscaled, a[0] > 0};
}

bool ShardedGradScaler::step(torch::optim::Optimizer& opt) {
  if (!enabled_) {
    opt.step();
    return true;
  }
  auto it = per_optimizer_.find(&opt);
  if (it != per_optimizer_.end())
    TORCH_CHECK(it->second.state != OptState::kStepped, where("step"),
                ": step() has already been called since the last update()");
  if (it == per_optimizer_.end()) {
    unscale_(opt);
    it = per_optimizer_.find(&opt);
  }
  it->second.state = OptState::kStepped;
  if (it->second.found_inf) return false;
  opt.step();
  return true;
}

void ShardedGradScaler::update() {
  if (!enabled_) return;
  TORCH_CHECK(!per_optimizer_.empty(), where("update"),
              ": no inf checks were recorded since the last update(); call step(optimizer) "
              "(or unscale_(optimizer)) first");
  bool found_inf = false;
  for (const auto& [opt, s] : per_optimizer_) found_inf = found_inf || s.found_inf;
  per_optimizer_.clear();
  // torch's _amp_update_scale_: fp32 scale times a double factor, rounded to fp32.
  if (found_inf) {
    // Note [Loss scale range]: held at 2^-126 rather than backed off into subnormals.
    scale_ = static_cast<float>(std::max(static_cast<double>(scale_) * backoff_factor_, kMinScale));
    growth_tracker_ = 0;
    return;
  }
  if (++growth_tracker_ == growth_interval_) {
    const float grown = static_cast<float>(static_cast<double>(scale_) * growth_factor_);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
}

GradScalerState ShardedGradScaler::state_dict() const {
  GradScalerState s;
  s.scale = static_cast<double>(scale_);
  s.growth_factor = growth_factor_;
  s.backoff_factor = backoff_factor_;
  s.growth_interval = growth_interval_;
  s.growth_tracker = growth_tracker_;
  return s;
}

void ShardedGradScaler::load_state_dict(const GradScalerState& state) {
  if (!enabled_) return;
  const std::string what = where("load_state_dict");
  TORCH_CHECK(per_optimizer_.empty(), what,
              ": called inside a step (after unscale_() or step(), before update()); load "
              "between steps");
  state.check(what);
  scale_ = static_cast<float>(state.scale);
  growth_factor_ = state.growth_factor;
  backoff_factor_ = state.backoff_factor;
  growth_interval_ = state.growth_interval;
  growth_tracker_ = state.growth_tracker;
}

}  // namespace flatshard
