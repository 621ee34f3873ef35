// GPU HSDP: the reference GPT trained on 2 GPUs as 2x1 (replicate x shard: DDP-like, every
// unit all-reduced across the replicate group) and 1x2 (plain FULL_SHARD through the mesh
// API) must match one unsharded GPU over the union of the batches, with exact counters, and
// keep matching with device sleeps queued before every all-gather, every reduction (so the
// replicate all-reduce is late too) and the optimizer step. One process per GPU under torchrun
// (tests/CMakeLists.txt, FLATSHARD_GPU_TESTS); both meshes come from one store with distinct
// prefixes (collectives/nccl_mesh.h). Model, reference and tolerances: gpu_gpt_parity.h.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "collectives/env.h"
#include "collectives/nccl_mesh.h"
#include "collectives/rendezvous.h"
#include "fsdp/sharded_model.h"
#include "gpu_gpt_parity.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;

namespace {

NcclMesh* g_2x1 = nullptr;  // 2 replicas of one GPU
NcclMesh* g_1x2 = nullptr;  // one shard group of 2 GPUs

using Run = flatshard_test::GpuRun;
using flatshard_test::require_fp32_parity;

Run reference(int world, c10::Device dev) { return flatshard_test::gpu_parity_reference(world, dev); }

Run sharded(NcclMesh& m, const std::string& spec, const ShardingOptions& opts, int64_t sleep) {
  const ShardingMesh mesh = m.mesh();
  const c10::Device dev = mesh.shard().device();
  auto model = flatshard_test::gpu_parity_model(dev);
  auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), mesh, opts);
  auto mean_over_all_ranks = [&mesh](at::Tensor& t) {
    mesh.shard().all_reduce(t, ReduceOp::kAvg, mesh.shard().current_stream());
    if (Communicator* r = mesh.replicate()) r->all_reduce(t, ReduceOp::kAvg, r->current_stream());
  };
  return flatshard_test::train_sharded(model, *fsdp, mesh.global_rank(), dev, mean_over_all_ranks,
                                       sleep);
}

const char* kPlans[] = {"type=Block", "noshard:path=lm_head|blocks.1*;type=Block",
                        "noshard:path=lm_head|blocks.1*;type=Linear|LayerNorm|Embedding"};

}  // namespace

TEST_CASE("GPU HSDP fp32 parity, 2x1 and 1x2", "[gpu][hsdp][parity]") {
  const Run ref = reference(2, g_2x1->shard->device());
  for (NcclMesh* m : {g_2x1, g_1x2})
    for (const char* spec : kPlans) {
      CAPTURE(m->layout.replicate, m->layout.shard, spec);
      auto got = sharded(*m, spec, ShardingOptions{}, 0);
      require_fp32_parity(ref, got);
      int64_t sharded_units = 0;
      for (size_t u = 0; u < got.units.size(); ++u) {
        if (got.units[u].padded_numel == 0) continue;
        const bool noshard = got.units[u].strategy == ShardingStrategy::kNoShard;
        sharded_units += !noshard;
        CHECK(got.counters.per_unit[u].replicate_all_reduces ==
              (!noshard && m->layout.replicate > 1 ? 1 : 0));
      }
      CHECK(got.counters.total.replicate_all_reduces == (m->layout.replicate > 1 ? sharded_units : 0));
    }
}

TEST_CASE("GPU HSDP parity under injected device sleeps", "[gpu][hsdp][stress]") {
  const Run ref = reference(2, g_2x1->shard->device());
  ShardingOptions opts;
  opts.debug_sleep_before_all_gather_cycles = 20'000'000;
  opts.debug_sleep_before_reduce_cycles = 20'000'000;
  opts.forward_prefetch = 2;
  opts.backward_prefetch = 2;
  for (NcclMesh* m : {g_2x1, g_1x2}) {
    CAPTURE(m->layout.replicate, m->layout.shard);
    require_fp32_parity(ref, sharded(*m, kPlans[1], opts, 20'000'000));
  }
}

int main(int argc, char** argv) {
  const LaunchEnv env = LaunchEnv::from_env();
  const auto dev = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  c10::cuda::set_device(dev.index());
  auto store = create_store(env, env::store_timeout());
  const NcclOptions opts = NcclOptions::from_env();
  // torchrun --standalone sets LOCAL_WORLD_SIZE: the default shard group is the node.
  if (env.world_size != 2 || hsdp_shard_size(env) != 2) {
    std::fprintf(stderr, "gpu_hsdp_test needs 2 processes on one node (got %s)\n",
                 env.describe().c_str());
    return 2;
  }
  NcclMesh a = make_hsdp_groups(store, env.rank, env.world_size, 1, dev, opts, "hsdp-2x1");
  NcclMesh b = make_hsdp_groups(store, env.rank, env.world_size, 2, dev, opts, "hsdp-1x2");
  g_2x1 = &a;
  g_1x2 = &b;
  const int rc = Catch::Session().run(argc, argv);
  b.shutdown();
  a.shutdown();
  return rc;
}
