// GPU tensor parallelism over NCCL (issue 51 item 6): the GPU parity GPT (gpu_gpt_parity.h: 3
// layers, 4 heads, d_model 60) parallelized with its family's tp plan at tp 2 x shard 1 on the
// NCCL mesh's tp group (collectives/nccl_mesh.h make_mesh_groups: 2 processes, one GPU each)
// against the same model unsharded on one GPU over the same batch (the two ranks of a tp group
// share it; their data rank is the shard coordinate, 0):
// - step-0 loss within 1e-5 relative, step-0 gradients (each rank's TP-local slice of the
//   reference's: TensorParallel::local_slice) and the parameters after 5 AdamW steps within
//   gpu_gpt_parity.h's fp32 tolerances (only the summation order differs);
// - TensorParallel::counters() equal to explain()'s prediction (planner/explain.h) for one
//   step, and to five times it after five;
// - the same under injected device sleeps before every all-gather and reduction and the
//   optimizer step (a missing stream wait on the tp collectives breaks parity there).
// One process per GPU under torchrun (tests/CMakeLists.txt, FLATSHARD_GPU_TESTS); labelled
// "hsdp" with gpu_hsdp_test so tools/gpu_check.sh's 2-GPU step (hsdp) runs it and the
// gpu_tests step, which may have one GPU, skips it.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cmath>
#include <cstdio>

#include "collectives/env.h"
#include "collectives/launch_env.h"
#include "collectives/nccl_mesh.h"
#include "collectives/rendezvous.h"
#include "fsdp/sharded_model.h"
#include "fsdp/tensor_parallel.h"
#include "gpu_gpt_parity.h"
#include "models/family.h"
#include "planner/explain.h"
#include "wrap_policies/spec.h"
#include "wrap_policies/tp_plan.h"

using namespace flatshard;

namespace {

NcclMesh* g_tp2 = nullptr;  // shard 1 x tp 2

using Run = flatshard_test::GpuRun;

const char* kPolicy = "type=Block";

std::string gpt_tp_plan() { return gpt::GPTConfig::family().modules().tp_plan; }

struct TpRun {
  Run run;
  TpCounters first_step, all_steps;
  std::map<std::string, at::Tensor> ref_grads0, ref_params;  // the reference's local slices
};

TpRun tp_sharded(NcclMesh& m, const Run& ref, const ShardingOptions& opts, int64_t sleep) {
  const Mesh mesh = m.mesh();
  const c10::Device dev = mesh.device();
  auto model = flatshard_test::gpu_parity_model(dev);
  auto par = parallelize(model.ptr(), parse_tp_plan(gpt_tp_plan()), mesh);
  auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(kPolicy)), mesh, opts);
  TpRun out;
  // One counted forward and backward first: it changes no parameter, and training's first
  // zero_grad drops its gradients.
  par->reset_counters();
  flatshard_test::gpu_parity_loss(model, /*rank=*/0, /*step=*/0, dev).backward();
  out.first_step = par->counters();
  par->reset_counters();
  // Both tp ranks hold the loss of the one batch: the mean over the tp group is that loss.
  auto mean_over_tp = [&mesh](at::Tensor& t) {
    mesh.tp()->all_reduce(t, ReduceOp::kAvg, mesh.tp()->current_stream());
  };
  // Data rank: the shard coordinate (0), not the tp rank.
  out.run = flatshard_test::train_sharded(model, *fsdp, mesh.coord(MeshDim::kShard), dev,
                                          mean_over_tp, sleep);
  out.all_steps = par->counters();
  for (const auto& [name, g] : ref.grads0) out.ref_grads0[name] = par->local_slice(name, g);
  for (const auto& [name, p] : ref.params) out.ref_params[name] = par->local_slice(name, p);
  return out;
}

void require_tp_parity(const Run& ref, const TpRun& got) {
  REQUIRE(got.run.losses.size() == ref.losses.size());
  CHECK(std::abs(got.run.losses[0] - ref.losses[0]) <= 1e-5 * std::abs(ref.losses[0]));
  for (size_t i = 1; i < ref.losses.size(); ++i) {
    CAPTURE(i, got.run.losses[i], ref.losses[i]);
    CHECK(std::abs(got.run.losses[i] - ref.losses[i]) <= 1e-4 * std::abs(ref.losses[i]));
  }
  REQUIRE(got.run.grads0.size() == got.ref_grads0.size());
  for (const auto& [name, want] : got.ref_grads0) {
    CAPTURE(name);
    const at::Tensor& g = got.run.grads0.at(name);
    REQUIRE(g.sizes() == want.sizes());
    CAPTURE((g - want).abs().max().item<double>());
    CHECK(at::allclose(g, want, /*rtol=*/1e-3, /*atol=*/1e-5));
  }
  for (const auto& [name, want] : got.ref_params) {
    CAPTURE(name);
    const at::Tensor& p = got.run.params.at(name);
    REQUIRE(p.sizes() == want.sizes());
    CAPTURE((p - want).abs().max().item<double>());
    CHECK(at::allclose(p, want, /*rtol=*/1e-3, /*atol=*/2e-4));
  }
}

void require_counters(const TpRun& got) {
  // explain() of the model as it is before parallelize(), at the same mesh, per step.
  auto fresh = flatshard_test::gpu_parity_model(c10::Device(c10::kCPU));
  const Explanation e = explain(*fresh, make_plan(*fresh, parse_policy(kPolicy)),
                                MeshShape(1, 1, 2), ShardingOptions{}, std::nullopt, {},
                                parse_tp_plan(gpt_tp_plan()));
  const int64_t tokens = flatshard_test::kGpuParityBatch * flatshard_test::gpu_parity_config().seq_len;
  const TpCounters want = e.tp.counters(tokens, at::kFloat);
  // The closed form: per layer 2 forward (attn.proj, mlp.proj) and 2 backward (qkv, fc)
  // all-reduces of d_model per token.
  const int64_t layers = 3, d = 60;
  CHECK(want.forward_all_reduces == 2 * layers);
  CHECK(want.backward_all_reduces == 2 * layers);
  CHECK(want.forward_bytes == 2 * layers * tokens * d * 4);
  CHECK(got.first_step == want);
  const int64_t n = flatshard_test::kGpuParitySteps;
  CHECK(got.all_steps.forward_all_reduces == n * want.forward_all_reduces);
  CHECK(got.all_steps.backward_all_reduces == n * want.backward_all_reduces);
  CHECK(got.all_steps.forward_bytes == n * want.forward_bytes);
  CHECK(got.all_steps.backward_bytes == n * want.backward_bytes);
}

}  // namespace

TEST_CASE("GPU TP: tp 2 x shard 1 over NCCL matches one GPU; counters equal explain",
          "[gpu][tp][parity]") {
  const Run ref = flatshard_test::gpu_parity_reference(1, g_tp2->tp->device());
  const TpRun got = tp_sharded(*g_tp2, ref, ShardingOptions{}, 0);
  require_tp_parity(ref, got);
  require_counters(got);
}

TEST_CASE("GPU TP parity under injected device sleeps", "[gpu][tp][stress]") {
  const Run ref = flatshard_test::gpu_parity_reference(1, g_tp2->tp->device());
  ShardingOptions opts;
  opts.debug_sleep_before_all_gather_cycles = 20'000'000;
  opts.debug_sleep_before_reduce_cycles = 20'000'000;
  opts.forward_prefetch = 2;
  opts.backward_prefetch = 2;
  require_tp_parity(ref, tp_sharded(*g_tp2, ref, opts, 20'000'000));
}

int main(int argc, char** argv) {
  const LaunchEnv env = LaunchEnv::from_env();
  if (env.world_size != 2) {
    std::fprintf(stderr, "gpu_tp_test needs 2 processes, one GPU each (got %s)\n",
                 env.describe().c_str());
    return 2;
  }
  const auto dev = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  c10::cuda::set_device(dev.index());
  auto store = create_store(env, env::store_timeout());
  const NcclOptions opts = NcclOptions::from_env();
  NcclMesh m = make_mesh_groups(store, env.rank, env.world_size, MeshShape(1, 1, 2), dev, opts,
                                "tp-1x1x2");
  g_tp2 = &m;
  const int rc = Catch::Session().run(argc, argv);
  m.shutdown();
  return rc;
}
