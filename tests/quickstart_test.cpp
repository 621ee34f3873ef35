// The README's quick start, compiled and run as printed (so the documentation cannot rot):
// tests/CMakeLists.txt copies the block out of README.md into readme_quickstart.inc, which is
// compiled here at file scope; 2 ranks as threads train the tiny GPT with a per-layer plan and
// the loss it prints must fall. The fine-tuning example below (docs/fine-tuning.md) is kept in
// sync by hand.
#include <catch2/catch.hpp>

#include "readme_quickstart.inc"  // void train(flatshard::Communicator&)

#include <torch/optim/adamw.h>

#include <cstdio>
#include <iostream>
#include <sstream>
#include <map>
#include <mutex>

#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "optim/fused_adamw.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

namespace {
std::mutex g_mu;
constexpr int kSteps = 40;


std::vector<double> g_finetune_losses;
std::map<std::string, at::Tensor> g_frozen_after;

// --- docs/fine-tuning.md (keep in sync) --------------------------------------------------------
void finetune(flatshard::Communicator& comm) {
  auto model = flatshard::gpt::GPT(flatshard::gpt::GPTConfig::preset("tiny"), /*seed=*/0);
  for (auto& p : model->named_parameters())            // frozen: positions, q/k/v
    if (p.key().find("wpe") == 0 || p.key().find(".attn.qkv.") != std::string::npos)
      p.value().requires_grad_(false);
  auto fsdp = flatshard::fully_shard(model.ptr(), flatshard::parse_policy("type=Block"), comm);
  std::vector<at::Tensor> decay, no_decay;             // no weight decay on norms and biases
  for (auto& [name, p] : fsdp->named_parameters())
    if (p.requires_grad())
      (name.find("bias") != std::string::npos || name.find("ln") != std::string::npos
           ? no_decay : decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(3e-3).weight_decay(0.1)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(3e-3).weight_decay(0)));
  flatshard::FusedAdamW opt(std::move(groups), torch::optim::AdamWOptions(3e-3));
  fsdp->check_optimizer(opt);                          // names a foreign or missing parameter
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = flatshard::gpt::synthetic_batch(model->config(), 8, /*seed=*/1, comm.rank(), step);
    opt.zero_grad();
    auto loss = flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
    loss.backward();
    opt.step();                                        // one fused launch per group
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(g_mu);
      g_finetune_losses.push_back(loss.item<double>());
    }
  }
  auto full = fsdp->gather_full_params();
  if (comm.rank() == 0)
    for (auto& [name, t] : full) g_frozen_after[name] = t;
}
// -----------------------------------------------------------------------------------------------
}  // namespace

TEST_CASE("README quick start trains", "[quickstart]") {
  std::ostringstream out;
  std::streambuf* previous = std::cout.rdbuf(out.rdbuf());  // what the block prints (rank 0)
  try {
    flatshard::run_ranks(2, train);
  } catch (...) {
    std::cout.rdbuf(previous);
    throw;
  }
  std::cout.rdbuf(previous);
  const std::string text = out.str();
  INFO(text);
  CHECK(text.find("units: 4, total numel: 167680, tied params: 0") != std::string::npos);
  std::vector<double> losses;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    int step = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %d loss %lf", &step, &loss) == 2) losses.push_back(loss);
  }
  REQUIRE(losses.size() == 4);  // steps 0, 13, 26, 39
  // ln(512) = 6.24 at the start; the synthetic language is learnable.
  REQUIRE(losses.back() < losses.front() - 1.0);
}

TEST_CASE("README fine-tuning trains the unfrozen part only", "[quickstart]") {
  flatshard::run_ranks(2, finetune);
  REQUIRE(g_finetune_losses.size() == static_cast<size_t>(kSteps));
  CAPTURE(g_finetune_losses.front(), g_finetune_losses.back());
  REQUIRE(g_finetune_losses.back() < g_finetune_losses.front() - 0.5);
  auto fresh = flatshard::gpt::GPT(flatshard::gpt::GPTConfig::preset("tiny"), /*seed=*/0);
  int frozen = 0, moved = 0;
  for (auto& p : fresh->named_parameters()) {
    CAPTURE(p.key());
    const bool is_frozen =
        p.key().find("wpe") == 0 || p.key().find(".attn.qkv.") != std::string::npos;
    const bool same = at::equal(g_frozen_after.at(p.key()), p.value());
    if (is_frozen) {
      REQUIRE(same);  // weight decay 0.1 is on for this group's neighbours: never applied here
      ++frozen;
    } else {
      moved += same ? 0 : 1;
    }
  }
  REQUIRE(frozen > 0);
  REQUIRE(moved > 0);
}
