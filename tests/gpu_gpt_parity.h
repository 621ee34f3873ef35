// flatshard/tests/gpu_gpt_parity.h — the GPT parity subject of the GPU tests (gpu_parity_test,
// gpu_hsdp_test): the model, the unsharded reference, a sharded training loop and the fp32
// comparison. The CPU tests' counterpart is gpt_parity_spec.h + parity_util.h.
//
// - The model: the reference GPT with 3 layers, vocab 301 and d_model 60 (odd sizes: flat
//   parameters need padding at world size 2), seed 3; rank r trains on synthetic_batch(seed 7,
//   rank r), 2 sequences per step, 5 AdamW steps at lr 1e-2.
// - reference(world, dev): one unsharded model on `dev` trained on the mean loss over the
//   batches of ranks 0..world-1: the sharded run over `world` ranks must match it.
// - train_sharded(): the same steps on a ShardedModel; `mean_over_ranks` averages the
//   one-element loss tensor over every rank in place (a collective: every rank calls it).
//   `sleep_before_step` > 0 queues a device sleep on the compute stream before each optimizer
//   step (the stress tests).
// - require_fp32_parity(): step-0 gradients first (a wrong reduction shows there before AdamW
//   blurs it into the losses), then losses, then final parameters; every mismatch is reported
//   (CHECK). Tolerances: only summation order differs (cuBLAS fp32 without TF32): losses 1e-4
//   relative, gradients rtol 1e-3 / atol 1e-5, parameters rtol 1e-3 / atol 2e-4.
#pragma once

#include <algorithm>

#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/call.h"
#include "optim/fused_adamw.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"

namespace flatshard_test {

struct GpuRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> grads0, params;
  flatshard::StepCounters counters;
  std::vector<flatshard::UnitInfo> units;
};

inline flatshard::gpt::GPTConfig gpu_parity_config() {
  auto c = flatshard::gpt::GPTConfig::preset("tiny");
  c.n_layers = 3;
  c.vocab = 301;
  c.d_model = 60;
  c.n_heads = 4;
  return c;
}
constexpr int kGpuParitySteps = 5, kGpuParityBatch = 2;
constexpr uint64_t kGpuParityModelSeed = 3;
constexpr double kGpuParityLr = 1e-2;

inline flatshard::gpt::GPT gpu_parity_model(const c10::Device& dev) {
  auto model = flatshard::gpt::GPT(gpu_parity_config(), kGpuParityModelSeed);
  model->to(dev);
  return model;
}

inline at::Tensor gpu_parity_loss(flatshard::gpt::GPT& model, int rank, int step,
                                  const c10::Device& dev) {
  auto [x, y] = flatshard::gpt::synthetic_batch(model->config(), kGpuParityBatch, /*seed=*/7,
                                                rank, step);
  x = x.to(dev);
  y = y.to(dev);
  return flatshard::enter(model, [&] { return model->loss(x, y); });
}

inline std::map<std::string, at::Tensor> to_cpu_map(
    const std::vector<std::pair<std::string, at::Tensor>>& v) {
  std::map<std::string, at::Tensor> m;
  for (auto& kv : v) m[kv.first] = kv.second.to(at::kCPU, at::kFloat);
  return m;
}

inline GpuRun gpu_parity_reference(int world, const c10::Device& dev) {
  auto model = gpu_parity_model(dev);
  torch::optim::AdamW opt(flatshard::gpt::unique_parameters(*model),
                          torch::optim::AdamWOptions(kGpuParityLr));
  GpuRun r;
  for (int step = 0; step < kGpuParitySteps; ++step) {
    opt.zero_grad();
    at::Tensor total;
    for (int q = 0; q < world; ++q) {
      auto l = gpu_parity_loss(model, q, step, dev);
      total = total.defined() ? total + l : l;
    }
    total = total / world;
    r.losses.push_back(total.item<double>());
    total.backward();
    if (step == 0)
      for (auto& p : model->named_parameters())
        r.grads0[p.key()] = p.value().grad().defined() ? p.value().grad().cpu()
                                                       : at::zeros_like(p.value()).cpu();
    opt.step();
  }
  for (auto& p : model->named_parameters()) r.params[p.key()] = p.value().detach().cpu();
  return r;
}

inline GpuRun train_sharded(flatshard::gpt::GPT& model, flatshard::ShardedModel& fsdp, int rank,
                            const c10::Device& dev,
                            const std::function<void(at::Tensor&)>& mean_over_ranks,
                            int64_t sleep_before_step, bool fused = false) {
  // Note [Offload step in backward]: that mode steps through an attached FusedAdamW.
  const bool step_in_backward =
      fsdp.options().offload_step != flatshard::OffloadStep::kAfterBackward;
  std::shared_ptr<torch::optim::AdamW> owned;
  if (fused || step_in_backward) {
    auto f = std::make_shared<flatshard::FusedAdamW>(fsdp.parameters(),
                                                     torch::optim::AdamWOptions(kGpuParityLr));
    // Note [Compute copy in the step]: the step writes NO_SHARD units' compute copies.
    const auto units = fsdp.units();
    const bool copies = std::any_of(units.begin(), units.end(),
                                    [](const flatshard::UnitInfo& u) { return u.step_copy; });
    if (step_in_backward || copies) fsdp.attach_optimizer(f);
    owned = f;
  } else {
    owned = std::make_shared<torch::optim::AdamW>(fsdp.parameters(),
                                                  torch::optim::AdamWOptions(kGpuParityLr));
  }
  torch::optim::AdamW& opt = *owned;
  GpuRun r;
  for (int step = 0; step < kGpuParitySteps; ++step) {
    opt.zero_grad();
    fsdp.reset_counters();
    auto l = gpu_parity_loss(model, rank, step, dev);
    l.backward();
    // Mean loss over ranks (a one-element collective; also checks the communicators are healthy).
    auto lt = l.detach().reshape({1}).to(at::kFloat).contiguous();
    mean_over_ranks(lt);
    r.losses.push_back(lt.item<double>());
    if (step == 0) r.grads0 = to_cpu_map(fsdp.gather_full_grads());
    if (sleep_before_step > 0) at::cuda::sleep(sleep_before_step);  // on the compute stream
    opt.step();
    r.counters = fsdp.counters();
  }
  r.params = to_cpu_map(fsdp.gather_full_params());
  r.units = fsdp.units();
  return r;
}

inline void require_fp32_parity(const GpuRun& ref, const GpuRun& got) {
  for (auto& kv : ref.grads0) {
    CAPTURE(kv.first, (got.grads0.at(kv.first) - kv.second).abs().max().item<double>());
    CHECK(at::allclose(got.grads0.at(kv.first), kv.second, 1e-3, 1e-5));
  }
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    CAPTURE(i, ref.losses[i], got.losses[i]);
    CHECK(std::abs(ref.losses[i] - got.losses[i]) <= 1e-4 * (1 + std::abs(ref.losses[i])));
  }
  for (auto& kv : ref.params) {
    CAPTURE(kv.first, (got.params.at(kv.first) - kv.second).abs().max().item<double>());
    CHECK(at::allclose(got.params.at(kv.first), kv.second, 1e-3, 2e-4));
  }
}

}  // namespace flatshard_test
