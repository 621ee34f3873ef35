// Parity harness: train the same model sharded on N ranks (threads) and unsharded on one rank
// over the union of the ranks' batches, and compare losses and final parameters.
//
// Why these match: each rank's loss is a mean over its local batch of equal size, and flatshard
// averages gradients over ranks, so the sharded gradient equals the gradient of the mean loss
// over the union batch — the reference's. Only float summation order differs.
#pragma once

#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <map>
#include <mutex>

#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "optim/fused_adamw.h"
#include "fsdp/sharded_model.h"

namespace flatshard_test {

// A hand-written plan: each listed module path is a unit; every parameter belongs to the unit
// with the longest path prefixing its name, else to the root. An independent reference for
// the policy code.
inline flatshard::Plan manual_plan(
    torch::nn::Module& model, const std::vector<std::vector<std::string>>& units,
    const std::vector<flatshard::UnitOptions>& options = {}, flatshard::UnitOptions root = {}) {
  flatshard::Plan plan;
  flatshard::UnitSpec r;
  r.name = "<root>";
  r.is_root = true;
  r.options = root;
  plan.units.push_back(r);
  for (size_t i = 0; i < units.size(); ++i) {
    flatshard::UnitSpec u;
    u.name = units[i].front();
    u.module_paths = units[i];
    if (i < options.size()) u.options = options[i];
    plan.units.push_back(u);
  }
  for (auto& p : model.named_parameters()) {
    size_t best = 0, best_len = 0;
    for (size_t i = 1; i < plan.units.size(); ++i)
      for (auto& path : plan.units[i].module_paths)
        if (p.key().rfind(path + ".", 0) == 0 && path.size() + 1 > best_len) {
          best = i;
          best_len = path.size() + 1;
        }
    plan.units[best].param_names.push_back(p.key());
    plan.units[best].numel += p.value().numel();
  }
  return plan;
}

struct ParityRun {
  std::vector<double> losses;                  // per step: mean over ranks of local losses
  std::map<std::string, at::Tensor> params;    // final full parameters
  std::map<std::string, at::Tensor> grads;     // full gradients of step 0, before clipping
  flatshard::StepCounters last_step_counters;  // rank 0, last step
};

struct ParitySpec {
  int world = 2;
  int steps = 5;
  int micro_batches = 1;                 // gradient accumulation: micro-batches per step
  bool no_sync_accumulation = false;     // sync only on the last micro-batch
  double clip = 0.0;                     // > 0: clip_grad_norm_ before the step
  double lr = 1e-2, weight_decay = 0.1;
  flatshard::ShardingOptions options;
  // Fine-tuning: parameters this names are frozen (requires_grad false) before sharding, on
  // both sides. The reference optimizer holds only the trainable ones.
  std::function<bool(const std::string&)> frozen;
  // Parameter groups by name (named_parameters()): when set, names it accepts form a second
  // AdamW group without weight decay at half the learning rate, on both sides.
  std::function<bool(const std::string&)> no_decay;
  bool fused_adamw = false;  // sharded side: flatshard::FusedAdamW instead of AdamW
  // Reference side, Note [Delayed offload step] (fsdp/offload_step.h): the parameters it names
  // are one step stale in forward and backward (step k reads the values of after step k-2).
  std::function<bool(const std::string&)> delayed;
  // Reference side: rewrites the parameters' values in place before each step's forward (the
  // quantized gathers' quantize-dequantize, tests/quantized_gather_test.cpp); the step's
  // gradients are taken there and the optimizer updates the values from before it.
  std::function<void(torch::nn::Module&)> before_use;
  // Builds the model on CPU with deterministic parameters.
  std::function<std::shared_ptr<torch::nn::Module>()> make_model;
  // Plan for a freshly built model.
  std::function<flatshard::Plan(torch::nn::Module&)> plan;
  // Loss of `model` (entered through flatshard::call) on the batch of (rank, step, micro).
  std::function<at::Tensor(const std::shared_ptr<torch::nn::Module>&, int rank, int step, int micro)> loss;
};

// Freezes the parameters s.frozen names.
inline void apply_freeze(const ParitySpec& s, torch::nn::Module& model) {
  if (!s.frozen) return;
  for (auto& p : model.named_parameters())
    if (s.frozen(p.key())) p.value().requires_grad_(false);
}

// The two AdamW groups of ParitySpec::no_decay over (name, tensor) pairs; trainable ones only.
inline std::vector<torch::optim::OptimizerParamGroup> param_groups(
    const ParitySpec& s, const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> decay, plain;
  for (auto& [name, p] : named)
    if (p.requires_grad()) (s.no_decay(name) ? plain : decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(s.lr).weight_decay(s.weight_decay)));
  groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(s.lr / 2).weight_decay(0)));
  return groups;
}

inline ParityRun run_reference(const ParitySpec& s) {
  auto model = s.make_model();
  apply_freeze(s, *model);
  // Each distinct tensor once: LibTorch lists a tied parameter under every name, and AdamW
  // would update it twice per step. Frozen ones not at all.
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& p : model->named_parameters()) {
    bool seen = false;
    for (auto& q : params) seen = seen || q.unsafeGetTensorImpl() == p.value().unsafeGetTensorImpl();
    if (!seen && p.value().requires_grad()) {
      params.push_back(p.value());
      named.emplace_back(p.key(), p.value());
    }
  }
  auto owned = s.no_decay ? std::make_unique<torch::optim::AdamW>(param_groups(s, named),
                                                                 torch::optim::AdamWOptions(s.lr))
                          : std::make_unique<torch::optim::AdamW>(
                                params, torch::optim::AdamWOptions(s.lr).weight_decay(s.weight_decay));
  torch::optim::AdamW& opt = *owned;
  ParityRun out;
  // Note [Delayed offload step]: `stale` holds the delayed parameters' values of one step before.
  std::vector<std::pair<at::Tensor, at::Tensor>> stale;  // (parameter, its stale value)
  if (s.delayed)
    for (auto& [name, p] : named)
      if (s.delayed(name)) stale.emplace_back(p, p.detach().clone());
  for (int step = 0; step < s.steps; ++step) {
    opt.zero_grad();
    std::vector<at::Tensor> current;
    for (auto& [p, old] : stale) {
      at::NoGradGuard no_grad;
      current.push_back(p.detach().clone());
      p.detach().copy_(old);
    }
    std::vector<at::Tensor> all = model->parameters(), unquantized;  // s.before_use's undo
    if (s.before_use) {
      at::NoGradGuard no_grad;
      for (auto& p : all) unquantized.push_back(p.detach().clone());
      s.before_use(*model);
    }
    double loss_sum = 0;
    for (int m = 0; m < s.micro_batches; ++m) {
      // The union batch: mean over ranks of the per-rank mean losses.
      at::Tensor total;
      for (int r = 0; r < s.world; ++r) {
        at::Tensor l = s.loss(model, r, step, m);
        total = total.defined() ? total + l : l;
      }
      total = total / s.world;
      loss_sum += total.item<double>();
      total.backward();
    }
    out.losses.push_back(loss_sum / s.micro_batches);
    for (size_t i = 0; i < stale.size(); ++i) {  // the step applies to the newest values
      at::NoGradGuard no_grad;
      stale[i].first.detach().copy_(current[i]);
      stale[i].second = current[i];
    }
    for (size_t i = 0; i < unquantized.size(); ++i) {
      at::NoGradGuard no_grad;
      all[i].detach().copy_(unquantized[i]);
    }
    // Parameters that got no gradient get zeros, as flat parameters do.
    for (auto& p : params)
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    if (step == 0)
      for (auto& p : model->named_parameters())
        out.grads[p.key()] = p.value().grad().defined() ? p.value().grad().clone()
                                                        : at::zeros_like(p.value());
    if (s.clip > 0) {
      std::vector<at::Tensor> grads;
      double sq = 0;
      for (auto& p : params) sq += p.grad().pow(2).sum().item<double>();
      const double coef = s.clip / (std::sqrt(sq) + 1e-6);
      if (coef < 1)
        for (auto& p : params) p.mutable_grad().mul_(coef);
    }
    opt.step();
  }
  for (auto& p : model->named_parameters()) out.params[p.key()] = p.value().detach().clone();
  return out;
}

// One rank's part of a sharded parity run: trains `fsdp` (built on `model`) for s.steps on
// rank `rank`'s batches. Collective: every rank of `fsdp`'s groups calls it. Returns this rank's
// mean loss per step, its counters of the last step and the gathered full step-0 gradients and
// final parameters.
struct RankRun {
  std::vector<double> losses;
  flatshard::StepCounters last_step_counters;
  std::vector<std::pair<std::string, at::Tensor>> grads0, params;
};

inline RankRun train_sharded_rank(const ParitySpec& s,
                                  const std::shared_ptr<torch::nn::Module>& model,
                                  flatshard::ShardedModel& fsdp, int rank) {
  std::shared_ptr<torch::optim::AdamW> owned;
  const auto options = torch::optim::AdamWOptions(s.lr).weight_decay(s.weight_decay);
  if (s.no_decay) {
    auto groups = param_groups(s, fsdp.named_parameters());
    owned = s.fused_adamw ? std::make_shared<flatshard::FusedAdamW>(std::move(groups), options)
                          : std::make_shared<torch::optim::AdamW>(std::move(groups), options);
  } else {
    owned = s.fused_adamw ? std::make_shared<flatshard::FusedAdamW>(fsdp.parameters(), options)
                          : std::make_shared<torch::optim::AdamW>(fsdp.parameters(), options);
  }
  torch::optim::AdamW& opt = *owned;
  fsdp.check_optimizer(opt);
  // Note [Offload step in backward]: flatshard steps offloaded units during backward.
  if (s.options.offload_step != flatshard::OffloadStep::kAfterBackward)
    fsdp.attach_optimizer(std::dynamic_pointer_cast<flatshard::FusedAdamW>(owned));
  RankRun r;
  for (int step = 0; step < s.steps; ++step) {
    opt.zero_grad();
    fsdp.reset_counters();
    double loss_sum = 0;
    for (int m = 0; m < s.micro_batches; ++m) {
      if (s.no_sync_accumulation) fsdp.set_requires_gradient_sync(m + 1 == s.micro_batches);
      at::Tensor l = s.loss(model, rank, step, m);
      loss_sum += l.item<double>();
      l.backward();
    }
    if (step == 0) r.grads0 = fsdp.gather_full_grads();
    if (s.clip > 0) fsdp.clip_grad_norm_(s.clip);
    opt.step();
    r.losses.push_back(loss_sum / s.micro_batches);
    r.last_step_counters = fsdp.counters();
  }
  r.params = fsdp.gather_full_params();
  return r;
}

inline ParityRun run_sharded(const ParitySpec& s) {
  ParityRun out;
  out.losses.assign(s.steps, 0.0);
  std::mutex mu;
  flatshard::run_ranks(s.world, [&](flatshard::Communicator& comm) {
    auto model = s.make_model();
    apply_freeze(s, *model);
    auto fsdp = flatshard::fully_shard(model, s.plan(*model), comm, s.options);
    RankRun r = train_sharded_rank(s, model, *fsdp, comm.rank());
    std::lock_guard<std::mutex> lock(mu);
    for (int step = 0; step < s.steps; ++step) out.losses[step] += r.losses[step] / s.world;
    if (comm.rank() == 0) {
      out.last_step_counters = r.last_step_counters;
      for (auto& kv : r.grads0) out.grads[kv.first] = kv.second;
      for (auto& kv : r.params) out.params[kv.first] = kv.second;
    }
  });
  return out;
}

// fp32 tolerances of a parity comparison; each test states why its values are right for it.
struct ParityTolerance {
  double loss_rel = 1e-5;                     // |dloss| <= loss_rel * (1 + |loss|)
  double grad_rtol = 1e-4, grad_atol = 1e-6;  // step-0 gradients
  double param_rtol = 1e-4, param_atol = 2e-4;  // final parameters
};

// Losses per step, step-0 gradients (first: AdamW is invariant to a constant gradient scale, so
// a wrong average would hide in the parameters) and final parameters, by name.
inline void require_parity(const ParityRun& ref, const ParityRun& got, const ParityTolerance& tol = {}) {
  REQUIRE(ref.losses.size() == got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    CAPTURE(i, ref.losses[i], got.losses[i]);
    REQUIRE(std::abs(ref.losses[i] - got.losses[i]) <= tol.loss_rel * (1 + std::abs(ref.losses[i])));
  }
  REQUIRE(ref.grads.size() == got.grads.size());
  for (auto& kv : ref.grads) {
    CAPTURE(kv.first);
    REQUIRE(got.grads.count(kv.first));
    CAPTURE((got.grads.at(kv.first) - kv.second).abs().max().item<double>());
    REQUIRE(at::allclose(got.grads.at(kv.first), kv.second, tol.grad_rtol, tol.grad_atol));
  }
  REQUIRE(ref.params.size() == got.params.size());
  for (auto& kv : ref.params) {
    CAPTURE(kv.first);
    REQUIRE(got.params.count(kv.first));
    const at::Tensor& g = got.params.at(kv.first);
    REQUIRE(g.sizes() == kv.second.sizes());
    CAPTURE((g - kv.second).abs().max().item<double>());
    REQUIRE(at::allclose(g, kv.second, tol.param_rtol, tol.param_atol));
  }
}

}  // namespace flatshard_test
