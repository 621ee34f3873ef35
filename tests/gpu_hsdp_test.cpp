// GPU HSDP: the reference GPT trained on 2 GPUs as 2x1 (replicate x shard: DDP-like, every
// unit all-reduced across the replicate group) and 1x2 (plain FULL_SHARD through the mesh
// API) must match one unsharded GPU over the union of the batches, with exact counters, and
// keep matching with device sleeps queued before every all-gather, every reduction (so the
// replicate all-reduce is late too) and the optimizer step. One process per GPU under torchrun
// (tests/CMakeLists.txt, FLATSHARD_GPU_TESTS); both meshes come from one store with distinct
// prefixes (collectives/nccl_mesh.h). Tolerances as gpu_parity_test (fp32, no TF32).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/optim/adamw.h>

#include <map>

#include "benchmarks/gpt.h"
#include "collectives/env.h"
#include "collectives/nccl_mesh.h"
#include "collectives/rendezvous.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
namespace g = flatshard::gpt;

namespace {

NcclMesh* g_2x1 = nullptr;  // 2 replicas of one GPU
NcclMesh* g_1x2 = nullptr;  // one shard group of 2 GPUs

struct Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> grads0, params;
  StepCounters counters;
  std::vector<UnitInfo> units;
};

g::GPTConfig config() {
  auto c = g::GPTConfig::preset("tiny");
  c.n_layers = 3;
  c.vocab = 301;
  c.d_model = 60;
  c.n_heads = 4;
  return c;
}
constexpr int kSteps = 5, kBatch = 2;
constexpr double kLr = 1e-2;

at::Tensor loss_on(g::GPT& model, int rank, int step, const c10::Device& dev) {
  auto [x, y] = g::synthetic_batch(model->config(), kBatch, /*seed=*/7, rank, step);
  x = x.to(dev);
  y = y.to(dev);
  return flatshard::enter(model, [&] { return model->loss(x, y); });
}

std::map<std::string, at::Tensor> to_cpu(const std::vector<std::pair<std::string, at::Tensor>>& v) {
  std::map<std::string, at::Tensor> m;
  for (auto& kv : v) m[kv.first] = kv.second.to(at::kCPU, at::kFloat);
  return m;
}

Run reference(int world, c10::Device dev) {
  auto model = g::GPT(config(), 3);
  model->to(dev);
  torch::optim::AdamW opt(g::unique_parameters(*model), torch::optim::AdamWOptions(kLr));
  Run r;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    at::Tensor total;
    for (int q = 0; q < world; ++q) {
      auto l = loss_on(model, q, step, dev);
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

Run sharded(NcclMesh& m, const std::string& spec, const ShardingOptions& opts, int64_t sleep) {
  const ShardingMesh mesh = m.mesh();
  const c10::Device dev = mesh.shard->device();
  auto model = g::GPT(config(), 3);
  model->to(dev);
  auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), mesh, opts);
  torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(kLr));
  Run r;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    fsdp->reset_counters();
    auto l = loss_on(model, mesh.global_rank(), step, dev);
    l.backward();
    auto lt = l.detach().reshape({1}).to(at::kFloat).contiguous();  // mean over all ranks
    mesh.shard->all_reduce(lt, ReduceOp::kAvg, mesh.shard->current_stream());
    if (mesh.replicate) mesh.replicate->all_reduce(lt, ReduceOp::kAvg, mesh.replicate->current_stream());
    r.losses.push_back(lt.item<double>());
    if (step == 0) r.grads0 = to_cpu(fsdp->gather_full_grads());
    if (sleep > 0) at::cuda::sleep(sleep);
    opt.step();
    r.counters = fsdp->counters();
  }
  r.params = to_cpu(fsdp->gather_full_params());
  r.units = fsdp->units();
  return r;
}

void require_fp32_parity(const Run& ref, const Run& got) {
  // Step-0 gradients first: a wrong reduction shows there before AdamW blurs it into the losses.
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
