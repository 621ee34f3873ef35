// The README's quick start, compiled and run (so the documentation cannot rot): 2 ranks as
// threads train the tiny GPT with a per-layer plan; the loss must fall.
#include <catch2/catch.hpp>

#include <torch/optim/adamw.h>

#include <iostream>
#include <mutex>

#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

namespace {
std::mutex g_mu;
std::vector<double> g_losses;
constexpr int kSteps = 40;

// --- README quick start (keep in sync) ---------------------------------------------------------
void train(flatshard::Communicator& comm) {            // one call per rank
  auto model = flatshard::gpt::GPT(flatshard::gpt::GPTConfig::preset("tiny"), /*seed=*/0);
  // In the model:  x = flatshard::call(blocks_[i], x);   instead of  blocks_[i]->forward(x)
  auto plan = flatshard::make_plan(*model, flatshard::parse_policy("type=Block;noshard:path=lm_head"));
  if (comm.rank() == 0) std::cout << plan.to_string();  // units, params, strategies; runs nothing
  flatshard::ShardingOptions opts;                     // FULL_SHARD, fp32, prefetch 1
  auto fsdp = flatshard::fully_shard(model.ptr(), plan, comm, opts);
  torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(3e-3));  // fp32 shards
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = flatshard::gpt::synthetic_batch(model->config(), 8, /*seed=*/1, comm.rank(), step);
    opt.zero_grad();
    auto loss = flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
    loss.backward();                 // one reduce-scatter per unit, gradients averaged over ranks
    fsdp->clip_grad_norm_(1.0);      // global norm across shards
    opt.step();
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(g_mu);
      g_losses.push_back(loss.item<double>());
    }
  }
}
// -----------------------------------------------------------------------------------------------
}  // namespace

TEST_CASE("README quick start trains", "[quickstart]") {
  flatshard::run_ranks(2, train);
  REQUIRE(g_losses.size() == static_cast<size_t>(kSteps));
  CAPTURE(g_losses.front(), g_losses.back());
  // ln(512) = 6.24 at the start; the synthetic language is learnable.
  REQUIRE(g_losses.back() < g_losses.front() - 1.0);
}
