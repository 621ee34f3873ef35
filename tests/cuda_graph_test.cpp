// CudaGraphStep's guards on the CPU (fsdp/cuda_graph.h, Note [CUDA graph step]): a model the
// graph cannot capture is refused before anything runs, with every reason at once, each naming
// its value and the fix. The capture itself needs a GPU: gpu_cuda_graph_test.cpp.
#include <catch2/catch.hpp>

#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/cuda_graph.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
namespace g = flatshard::gpt;

namespace {

struct Refusal {
  std::string reasons;  // cuda_graph_step_refusal()
  std::string error;    // what the constructor threw ("" if it did not)
};

// Rank 0's refusal and constructor error for a tiny GPT sharded by `spec` over `world` CPU
// ranks with `options`; `views`: named_parameters() is called first.
Refusal refusal(int world, const ShardingOptions& options, bool views = false,
                const std::string& spec = "type=Block") {
  Refusal out;
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), comm, options);
    if (views) (void)fsdp->named_parameters();
    auto [x, y] = g::synthetic_batch(model->config(), 2, 3, comm.rank(), 0);
    Refusal r;
    r.reasons = cuda_graph_step_refusal(*fsdp);
    try {
      CudaGraphStep step(*fsdp, {x, y}, [&](const std::vector<at::Tensor>& in) {
        return flatshard::enter(model, [&] { return model->loss(in[0], in[1]); });
      });
    } catch (const c10::Error& e) {
      r.error = e.what_without_backtrace();
    }
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out = r;
    }
  });
  return out;
}

}  // namespace

TEST_CASE("cuda graph: a CPU model is refused, naming its device", "[cuda_graph]") {
  const Refusal r = refusal(1, ShardingOptions{});
  CAPTURE(r.reasons, r.error);
  CHECK(r.reasons.find("the model is on cpu") != std::string::npos);
  CHECK(r.reasons.find("CUDA device") != std::string::npos);
  CHECK(r.reasons.find("ranks") == std::string::npos);  // world 1 is fine
  CHECK(r.error.find("cannot be captured") != std::string::npos);
  CHECK(r.error.find("the model is on cpu") != std::string::npos);
}

TEST_CASE("cuda graph: world 2, tracing and named_parameters are refused together",
          "[cuda_graph]") {
  const auto dir = std::filesystem::temp_directory_path() / "flatshard_cuda_graph_test";
  std::filesystem::create_directories(dir);
  ShardingOptions o;
  o.trace.path = (dir / "t{rank}.json").string();
  const Refusal r = refusal(2, o, /*views=*/true);
  CAPTURE(r.reasons, r.error);
  CHECK(r.reasons.find("the model is on cpu") != std::string::npos);
  CHECK(r.reasons.find("the mesh has 2 ranks: only world 1") != std::string::npos);
  CHECK(r.reasons.find("tracing is on") != std::string::npos);
  CHECK(r.reasons.find("named_parameters() was called") != std::string::npos);
  // The constructor reports the same list.
  CHECK(r.error.find("the mesh has 2 ranks") != std::string::npos);
  CHECK(r.error.find("tracing is on") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("cuda graph: recompute units are refused, naming the unit", "[cuda_graph]") {
  const Refusal r = refusal(1, ShardingOptions{}, false, "recompute:type=Block");
  CAPTURE(r.reasons);
  CHECK(r.reasons.find("recomputes its forward in backward") != std::string::npos);
  CHECK(r.reasons.find("unit 'blocks.0'") != std::string::npos);
}

TEST_CASE("cuda graph: re-made AccumulateGrad nodes still reduce every gradient", "[cuda_graph]") {
  // Unit::rehook_grad_accumulators (what CudaGraphStep does so autograd accumulates on its
  // stream) drops the nodes fully_shard hooked and hooks new ones: a step after it must give
  // the master gradients a step without it gives, bit for bit (a lost hook would leave a unit
  // unreduced until the end of backward or with no gradient at all).
  std::vector<at::Tensor> grads[2];
  for (const bool rehook : {false, true}) {
    run_ranks(1, [&](Communicator& comm) {
      auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
      auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), comm);
      auto [x, y] = g::synthetic_batch(model->config(), 2, 3, comm.rank(), 0);
      auto step = [&, &x = x, &y = y] {
        for (auto& p : fsdp->parameters()) p.mutable_grad() = at::Tensor();
        flatshard::enter(model, [&] { return model->loss(x, y); }).backward();
      };
      step();  // a step before, as CudaGraphStep's caller may have run
      if (rehook)
        for (size_t i = 0; i < fsdp->num_units(); ++i) fsdp->unit(i).rehook_grad_accumulators();
      step();
      for (auto& p : fsdp->parameters()) grads[rehook].push_back(p.grad().clone());
    });
  }
  REQUIRE(grads[0].size() == grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    CAPTURE(i);
    REQUIRE(grads[1][i].defined());
    CHECK(at::equal(grads[0][i], grads[1][i]));
  }
}
