// CUDA graph step on one GPU (fsdp/cuda_graph.h, Note [CUDA graph step]): a tiny GPT trained 5
// steps eagerly and 5 steps through a CudaGraphStep (2 eager warmup steps, then capture + replay,
// then replays) from the same init and batches, FusedAdamW stepping eagerly after each, per-leaf
// and per-layer units, fp32 and bf16 compute. One process, world 1 (torchrun --nproc-per-node 1),
// NCCL watchdog off (the graph requires it).
//
// Tolerance: a replay runs the captured kernels on the same inputs, so the results are expected
// bitwise equal (the test logs whether they are and the largest differences). It requires less,
// so that a nondeterministic kernel (atomics in an attention or embedding backward) cannot fail
// it: fp32 losses within 1e-5 relative and master parameters within gpu_gpt_parity.h's rtol 1e-3
// / atol 2e-4 (what sharded vs unsharded meets); bf16 losses within 1e-3 relative and parameters
// within atol 3e-2 (more than the 2 * lr one AdamW step can move an element whose gradient's
// sign a rounding flips). A wrong graph — stale inputs (every step a new batch), gradients
// added instead of set, a missing stream join — is far outside these.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>

#include "collectives/nccl_communicator.h"
#include "fsdp/call.h"
#include "fsdp/cuda_graph.h"
#include "fsdp/sharded_model.h"
#include "gpu_gpt_parity.h"
#include "nccl_test_main.h"
#include "optim/fused_adamw.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;

namespace {

NcclCommunicator* g_comm = nullptr;
constexpr int kSteps = 5;

struct Trained {
  std::vector<double> losses;
  std::vector<at::Tensor> masters;  // fsdp.parameters() after the last step, on the CPU
  int64_t replay_hook_ns = -1;      // hook host time of the last step (graph runs only)
  bool captured = false;
};

std::pair<at::Tensor, at::Tensor> batch(gpt::GPT& model, int step) {
  auto [x, y] = gpt::synthetic_batch(model->config(), flatshard_test::kGpuParityBatch,
                                     /*seed=*/7, /*rank=*/0, step);
  return {x.to(g_comm->device()), y.to(g_comm->device())};
}

Trained train(const std::string& spec, const ShardingOptions& opts, bool graph) {
  auto model = flatshard_test::gpu_parity_model(g_comm->device());
  auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), *g_comm, opts);
  auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(),
                                          torch::optim::AdamWOptions(flatshard_test::kGpuParityLr));
  const auto units = fsdp->units();
  if (std::any_of(units.begin(), units.end(), [](const UnitInfo& u) { return u.step_copy; }))
    fsdp->attach_optimizer(opt);
  auto loss_of = [&](const std::vector<at::Tensor>& in) {
    return flatshard::enter(model, [&] { return model->loss(in[0], in[1]); });
  };
  std::unique_ptr<CudaGraphStep> step;
  if (graph) {
    auto [x0, y0] = batch(model, 0);
    step = std::make_unique<CudaGraphStep>(*fsdp, std::vector<at::Tensor>{x0, y0}, loss_of);
  }
  Trained t;
  for (int s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    fsdp->reset_counters();
    auto [x, y] = batch(model, s);
    at::Tensor loss;
    if (step) {
      loss = step->run({x, y});
    } else {
      loss = loss_of({x, y});
      loss.backward();
    }
    t.losses.push_back(loss.item<double>());
    opt->step();
    if (step) {
      const UnitCounters c = fsdp->counters().total;
      t.replay_hook_ns = c.host_forward_ns + c.host_backward_ns;
    }
  }
  c10::cuda::device_synchronize();
  for (const at::Tensor& p : fsdp->parameters()) t.masters.push_back(p.detach().cpu());
  t.captured = step && step->captured();
  return t;
}

void require_parity(const Trained& eager, const Trained& graph, double loss_rtol, double rtol,
                    double atol) {
  bool bitwise = true;
  REQUIRE(eager.losses.size() == graph.losses.size());
  for (size_t i = 0; i < eager.losses.size(); ++i) {
    CAPTURE(i, eager.losses[i], graph.losses[i]);
    bitwise = bitwise && eager.losses[i] == graph.losses[i];
    CHECK(std::abs(eager.losses[i] - graph.losses[i]) <=
          loss_rtol * (1 + std::abs(eager.losses[i])));
  }
  REQUIRE(eager.masters.size() == graph.masters.size());
  double max_diff = 0;
  for (size_t i = 0; i < eager.masters.size(); ++i) {
    const double diff = (eager.masters[i] - graph.masters[i]).abs().max().item<double>();
    max_diff = std::max(max_diff, diff);
    CAPTURE(i, diff);
    bitwise = bitwise && at::equal(eager.masters[i], graph.masters[i]);
    CHECK(at::allclose(graph.masters[i], eager.masters[i], rtol, atol));
  }
  std::fprintf(stderr,
               "gpu_cuda_graph_test:   losses eager %.9g .. %.9g, graph %.9g .. %.9g; "
               "largest parameter difference %.3g; bitwise equal: %s\n",
               eager.losses.front(), eager.losses.back(), graph.losses.front(), graph.losses.back(),
               max_diff, bitwise ? "yes" : "no");
}

}  // namespace

TEST_CASE("cuda graph: 5 replayed steps equal 5 eager steps", "[gpu][cuda_graph]") {
  const std::pair<const char*, const char*> plans[] = {
      {"per-leaf", "type=Linear|LayerNorm|Embedding"}, {"per-layer", "type=Block"}};
  for (const auto& [name, spec] : plans) {
    for (const bool bf16 : {false, true}) {
      CAPTURE(name, bf16);
      ShardingOptions opts;
      if (bf16) opts.mixed_precision.param_dtype = at::kBFloat16;
      std::fprintf(stderr, "gpu_cuda_graph_test: %s, %s\n", name, bf16 ? "bf16" : "fp32");
      const Trained eager = train(spec, opts, false);
      const Trained graph = train(spec, opts, true);
      CHECK(graph.captured);
      // A replay runs no hook: the last step's hook host time is zero.
      CHECK(graph.replay_hook_ns == 0);
      if (bf16)
        require_parity(eager, graph, 1e-3, 0, 3e-2);
      else
        require_parity(eager, graph, 1e-5, 1e-3, 2e-4);
    }
  }
}

TEST_CASE("cuda graph: a changed input shape is a clear error", "[gpu][cuda_graph]") {
  auto model = flatshard_test::gpu_parity_model(g_comm->device());
  auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), *g_comm);
  auto [x, y] = batch(model, 0);
  CudaGraphStep step(*fsdp, {x, y}, [&](const std::vector<at::Tensor>& in) {
    return flatshard::enter(model, [&] { return model->loss(in[0], in[1]); });
  });
  for (int s = 0; s < 3; ++s) (void)step.run({x, y});  // 2 warmup, then capture + replay
  REQUIRE(step.captured());
  const at::Tensor longer = at::cat({x, x}, 0);
  std::string error;
  try {
    (void)step.run({longer, y});
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  CAPTURE(error);
  CHECK(error.find("input 0 is [4, ") != std::string::npos);
  CHECK(error.find("captured for [2, ") != std::string::npos);
  CHECK(error.find("fixed shapes") != std::string::npos);
  // The object still replays after the refused call.
  CHECK(std::isfinite(step.run({x, y}).item<double>()));
}

int main(int argc, char** argv) {
  // Note [CUDA graph step]: the watchdog must be off (the environment may not say so).
  setenv("FLATSHARD_NCCL_WATCHDOG", "0", /*overwrite=*/1);
  return flatshard_test::nccl_test_main("gpu_cuda_graph_test", argc, argv, g_comm);
}
