// GPU checkpoints: the CPU checkpoint tests' promises with CUDA master shards and optimizer
// state, over NCCL, one process per GPU (torchrun; world 1 and 2 alike, see tests/CMakeLists.txt).
// - A per-layer run trains 2 AdamW steps and saves sharded and full; each is loaded into fresh
//   models (other initial values) under other plans — two layers per unit, one unit, a NO_SHARD
//   unit among per-layer units — and the loaded full parameters must equal the saved ones bit
//   for bit (the load copies bytes; nothing is recomputed).
// - The optimizer state comes back too: one more step after the load, then the next loss, must
//   match the uninterrupted run within 1e-4 relative (another plan only changes summation order
//   in the reductions, cuBLAS fp32 without TF32; a lost moment or an off-by-one step count moves
//   it by > 1e-3).
// - The unsharded reference: rank 0 loads both checkpoints into a plain (unwrapped) GPT on its
//   GPU with load_full_into_module; equal to the saved parameters bit for bit.
// The checkpoint directory is rank 0's temporary directory, shared by path: the ranks must see
// one filesystem (one host here).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <optional>

#include "checkpoint/checkpoint.h"
#include "collectives/gather_bytes.h"
#include "collectives/nccl_communicator.h"
#include "fsdp/sharded_model.h"
#include "gpu_gpt_parity.h"
#include "nccl_test_main.h"
#include "temp_dir.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;

namespace {

NcclCommunicator* g_comm = nullptr;

using Params = std::map<std::string, at::Tensor>;

flatshard::Plan plan_of(torch::nn::Module& m, const std::string& spec) {
  return make_plan(m, spec.empty() ? Policy{} : parse_policy(spec));
}

// The mean over ranks of a one-element loss (collective).
double mean_loss(const at::Tensor& loss) {
  at::Tensor t = loss.detach().reshape({1}).clone();
  g_comm->all_reduce(t, ReduceOp::kAvg, g_comm->current_stream());
  return t.item<double>();
}

void train_step(gpt::GPT& model, torch::optim::AdamW& opt, int step) {
  opt.zero_grad();
  flatshard_test::gpu_parity_loss(model, g_comm->rank(), step, g_comm->device()).backward();
  opt.step();
}

// Loss of `step` (forward only), mean over ranks.
double eval_loss(gpt::GPT& model, int step) {
  at::NoGradGuard no_grad;
  return mean_loss(flatshard_test::gpu_parity_loss(model, g_comm->rank(), step, g_comm->device()));
}

// Every parameter of `want` in `got`, bit for bit (`got` may also list tied aliases).
std::string first_difference(const Params& want, const Params& got) {
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    if (it == got.end()) return "missing " + name;
    if (!at::equal(t, it->second))
      return name + " differs by " + std::to_string((t - it->second).abs().max().item<double>());
  }
  return "";
}

}  // namespace

TEST_CASE("GPU checkpoint: sharded and full saves reload into other plans", "[gpu][checkpoint]") {
  const c10::Device dev = g_comm->device();
  const int rank = g_comm->rank();
  std::optional<flatshard_test::TempDir> tmp;
  if (rank == 0) tmp.emplace();
  const std::string dir = all_gather_bytes(*g_comm, rank == 0 ? tmp->path() : "").front();
  const std::string sharded_dir = dir + "/sharded", full_dir = dir + "/full";

  Params saved;
  double uninterrupted = 0;
  {
    auto model = flatshard_test::gpu_parity_model(dev);
    auto fsdp = fully_shard(model.ptr(), plan_of(*model, "type=Block"), *g_comm);
    torch::optim::AdamW opt(fsdp->parameters(),
                            torch::optim::AdamWOptions(flatshard_test::kGpuParityLr));
    train_step(model, opt, 0);
    train_step(model, opt, 1);
    save_checkpoint(*fsdp, &opt, sharded_dir);
    CheckpointOptions full;
    full.kind = CheckpointKind::kFull;
    save_checkpoint(*fsdp, &opt, full_dir, full);
    saved = flatshard_test::to_cpu_map(fsdp->gather_full_params());
    train_step(model, opt, 2);
    uninterrupted = eval_loss(model, 3);
  }
  for (const std::string& from : {sharded_dir, full_dir})
    for (const char* spec : {"every=2,type=Block", "", "noshard:path=wpe;type=Block"}) {
      CAPTURE(from, spec);
      auto model = gpt::GPT(flatshard_test::gpu_parity_config(), /*seed=*/99);
      model->to(dev);
      auto fsdp = fully_shard(model.ptr(), plan_of(*model, spec), *g_comm);
      torch::optim::AdamW opt(fsdp->parameters(),
                              torch::optim::AdamWOptions(flatshard_test::kGpuParityLr));
      load_checkpoint(*fsdp, &opt, from);
      CHECK(first_difference(saved, flatshard_test::to_cpu_map(fsdp->gather_full_params())) == "");
      train_step(model, opt, 2);
      const double resumed = eval_loss(model, 3);
      CAPTURE(uninterrupted, resumed);
      CHECK(std::abs(resumed - uninterrupted) <= 1e-4 * std::abs(uninterrupted));
    }
  if (rank == 0)
    for (const std::string& from : {sharded_dir, full_dir}) {
      CAPTURE(from);
      auto plain = gpt::GPT(flatshard_test::gpu_parity_config(), /*seed=*/99);
      plain->to(dev);
      load_full_into_module(*plain, from);
      Params got;
      for (const auto& p : plain->named_parameters()) got[p.key()] = p.value().detach().cpu();
      CHECK(first_difference(saved, got) == "");
    }
  g_comm->barrier();  // rank 0 removes the directory only after every rank is done with it
}

int main(int argc, char** argv) {
  return flatshard_test::nccl_test_main("gpu_checkpoint_test", argc, argv, g_comm);
}
