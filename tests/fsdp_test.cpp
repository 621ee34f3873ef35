// fully_shard on a small residual network: collective counts per unit and parity with
// unsharded training for every strategy, plan shape and world size 1..4.
#include <catch2/catch.hpp>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "parity_util.h"
#include "rank_require.h"
#include "tiny_net.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

constexpr int64_t kIn = 5, kD = 7, kLayers = 4, kBatch = 3;

ParitySpec tiny_spec(int world, bool repeat_first = false, bool with_unused = false) {
  ParitySpec s;
  s.world = world;
  s.make_model = [=] {
    auto m = TinyNet(kIn, kD, kLayers, repeat_first, with_unused);
    init_params(*m, 1234);
    return std::static_pointer_cast<torch::nn::Module>(m.ptr());
  };
  s.loss = [](const std::shared_ptr<torch::nn::Module>& m, int rank, int step, int micro) {
    auto gen = at::detail::createCPUGenerator(1000 * step + 100 * micro + rank);
    auto x = at::randn({kBatch, kIn}, gen);
    auto y = at::randn({kBatch, 3}, gen);
    auto net = std::static_pointer_cast<TinyNetImpl>(m);
    return at::mse_loss(flatshard::call(net, x).to(at::kFloat), y);
  };
  return s;
}

std::vector<std::vector<std::string>> layer_units() {
  std::vector<std::vector<std::string>> u;
  for (int i = 0; i < kLayers; ++i) u.push_back({"blocks." + std::to_string(i)});
  return u;
}

std::vector<std::vector<std::string>> leaf_units() {
  std::vector<std::vector<std::string>> u = {{"inp"}};
  for (int i = 0; i < kLayers; ++i)
    for (const char* leaf : {"ln", "fc1", "fc2"})
      u.push_back({"blocks." + std::to_string(i) + "." + leaf});
  u.push_back({"head"});
  return u;
}

std::vector<std::vector<std::string>> every2_units() {
  std::vector<std::vector<std::string>> u;
  for (int i = 0; i < kLayers; i += 2)
    u.push_back({"blocks." + std::to_string(i), "blocks." + std::to_string(i + 1)});
  return u;
}

// fp32 parity tolerance: the sharded run sums gradients in another order (reduce over ranks
// vs one batched matmul); differences are a few ulps per step, which AdamW can amplify to
// ~lr * 1e-4 on near-zero second moments over 5 steps. 5e-5 absolute is far below the
// per-step parameter change (lr = 1e-2), so a real bug (a missing or doubled gradient) fails.
const ParityTolerance kTol = [] {
  ParityTolerance t;
  t.param_atol = 5e-5;
  return t;
}();

}  // namespace

TEST_CASE("per-layer FULL_SHARD: one all-gather per unit in forward, one all-gather plus one "
          "reduce-scatter in backward",
          "[fsdp][counters]") {
  auto s = tiny_spec(2);
  s.steps = 2;
  s.plan = [](torch::nn::Module& m) { return manual_plan(m, layer_units()); };
  auto got = run_sharded(s);
  const auto& c = got.last_step_counters;
  REQUIRE(c.per_unit.size() == kLayers + 1);
  // Root: gathered once in forward, kept for backward (its backward starts right away).
  CHECK(c.per_unit[0].forward_all_gathers == 1);
  CHECK(c.per_unit[0].backward_all_gathers == 0);
  CHECK(c.per_unit[0].reduce_scatters == 1);
  for (int i = 1; i <= kLayers; ++i) {
    CAPTURE(i);
    CHECK(c.per_unit[i].forward_all_gathers == 1);
    CHECK(c.per_unit[i].backward_all_gathers == 1);
    CHECK(c.per_unit[i].reduce_scatters == 1);
    CHECK(c.per_unit[i].all_reduces == 0);
  }
  CHECK(c.total.forward_all_gathers == kLayers + 1);
  CHECK(c.total.backward_all_gathers == kLayers);
  CHECK(c.total.reduce_scatters == kLayers + 1);
}

TEST_CASE("SHARD_GRAD_OP skips the backward all-gather; NO_SHARD all-reduces", "[fsdp][counters]") {
  auto s = tiny_spec(2);
  s.steps = 2;
  s.plan = [](torch::nn::Module& m) {
    UnitOptions grad_op{ShardingStrategy::kShardGradOp, {}};
    UnitOptions noshard{ShardingStrategy::kNoShard, {}};
    return manual_plan(m, layer_units(), {grad_op, noshard, grad_op, noshard});
  };
  auto c = run_sharded(s).last_step_counters;
  for (int i : {1, 3}) {
    CHECK(c.per_unit[i].forward_all_gathers == 1);
    CHECK(c.per_unit[i].backward_all_gathers == 0);
    CHECK(c.per_unit[i].reduce_scatters == 1);
  }
  for (int i : {2, 4}) {
    CHECK(c.per_unit[i].forward_all_gathers == 0);
    CHECK(c.per_unit[i].backward_all_gathers == 0);
    CHECK(c.per_unit[i].reduce_scatters == 0);
    CHECK(c.per_unit[i].all_reduces == 1);
  }
}

TEST_CASE("sharded training matches unsharded training", "[fsdp][parity]") {
  struct PlanCase {
    const char* name;
    std::function<std::vector<std::vector<std::string>>()> units;
  };
  std::vector<PlanCase> plans = {{"per-leaf", leaf_units},
                                 {"per-layer", layer_units},
                                 {"every-2", every2_units},
                                 {"whole-model", [] { return std::vector<std::vector<std::string>>{}; }}};
  for (int world = 1; world <= 4; ++world)
    for (auto& pc : plans)
      for (const char* mode : {"full", "grad_op", "mixed"}) {
        CAPTURE(world, pc.name, mode);
        auto s = tiny_spec(world);
        const std::string m = mode;
        s.plan = [&pc, m](torch::nn::Module& model) {
          auto units = pc.units();
          std::vector<UnitOptions> opts;
          for (size_t i = 0; i < units.size(); ++i) {
            UnitOptions o;
            if (m == "grad_op") o.strategy = ShardingStrategy::kShardGradOp;
            if (m == "mixed" && i % 2 == 1) o.strategy = ShardingStrategy::kNoShard;
            opts.push_back(o);
          }
          UnitOptions root;
          if (m == "grad_op") root.strategy = ShardingStrategy::kShardGradOp;
          if (m == "mixed" && units.empty()) root.strategy = ShardingStrategy::kNoShard;
          return manual_plan(model, units, opts, root);
        };
        require_parity(run_reference(s), run_sharded(s), kTol);
      }
}

TEST_CASE("Pre-backward hook: the hook on the outputs' nodes and the PreBackward identity give "
          "the same training", "[fsdp][parity]") {
  // Note [Pre-backward hook] (fsdp/runtime.cpp). Per-leaf units nest in the root, whose output
  // is the head unit's output node as is (one node, two units: the root's pre-backward first);
  // a unit called twice; SHARD_GRAD_OP. Each mode must match the unsharded reference, and the
  // two modes each other bit for bit with the same collectives.
  for (int world : {1, 2, 3})
    for (const char* plan : {"per-leaf", "per-layer", "repeat"}) {
      CAPTURE(world, plan);
      const bool repeat = std::string(plan) == "repeat";
      auto s = tiny_spec(world, repeat);
      s.steps = 3;
      const bool leaf = std::string(plan) == "per-leaf";
      s.plan = [leaf](torch::nn::Module& m) {
        return manual_plan(m, leaf ? leaf_units() : layer_units());
      };
      ParityRun runs[2];
      for (int hook : {0, 1}) {
        setenv("FLATSHARD_PRE_BACKWARD_HOOK", hook ? "1" : "0", 1);  // read by each Runtime
        runs[hook] = run_sharded(s);
      }
      unsetenv("FLATSHARD_PRE_BACKWARD_HOOK");
      const ParityRun ref = run_reference(s);
      for (const ParityRun& r : runs) require_parity(ref, r, kTol);
      // (run_sharded averages the ranks' losses in the order the threads finish: not bitwise.)
      for (size_t k = 0; k < runs[0].losses.size(); ++k)
        CHECK(runs[0].losses[k] == Approx(runs[1].losses[k]).epsilon(1e-12));
      for (const auto& [name, p] : runs[0].params) {
        CAPTURE(name);
        CHECK(at::equal(p, runs[1].params.at(name)));
      }
      const auto &c0 = runs[0].last_step_counters, &c1 = runs[1].last_step_counters;
      REQUIRE(c0.per_unit.size() == c1.per_unit.size());
      for (size_t i = 0; i < c0.per_unit.size(); ++i) {
        CAPTURE(i);
        CHECK(c0.per_unit[i].forward_all_gathers == c1.per_unit[i].forward_all_gathers);
        CHECK(c0.per_unit[i].backward_all_gathers == c1.per_unit[i].backward_all_gathers);
        CHECK(c0.per_unit[i].reduce_scatters == c1.per_unit[i].reduce_scatters);
      }
    }
}

TEST_CASE("gradient accumulation, with and without communication per micro-batch",
          "[fsdp][parity]") {
  for (bool no_sync : {false, true}) {
    CAPTURE(no_sync);
    auto s = tiny_spec(3);
    s.micro_batches = 3;
    s.no_sync_accumulation = no_sync;
    s.plan = [](torch::nn::Module& m) {
      return manual_plan(m, layer_units(), {{}, {ShardingStrategy::kNoShard, {}}, {ShardingStrategy::kShardGradOp, {}}});
    };
    auto got = run_sharded(s);
    require_parity(run_reference(s), got, kTol);
    // The last micro-batch syncs: one reduce-scatter per sharded unit in the step either way
    // with no_sync; three without.
    CHECK(got.last_step_counters.per_unit[1].reduce_scatters == (no_sync ? 1 : 3));
    CHECK(got.last_step_counters.per_unit[2].all_reduces == (no_sync ? 1 : 3));
  }
}

TEST_CASE("gradient-norm clipping across shards matches clipping the full gradient",
          "[fsdp][parity]") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    auto s = tiny_spec(world);
    s.clip = 0.05;  // well below the observed norms, so clipping is active every step
    s.plan = [](torch::nn::Module& m) {
      return manual_plan(m, layer_units(), {{}, {ShardingStrategy::kNoShard, {}}});
    };
    require_parity(run_reference(s), run_sharded(s), kTol);
  }
}

TEST_CASE("unused parameters and a unit called twice in one forward", "[fsdp][parity]") {
  for (int world : {1, 2, 4}) {
    CAPTURE(world);
    auto s = tiny_spec(world, /*repeat_first=*/true, /*with_unused=*/true);
    s.plan = [](torch::nn::Module& m) {
      auto units = leaf_units();
      units.push_back({"unused"});
      auto layers = layer_units();
      units.insert(units.end(), layers.begin(), layers.end());
      return manual_plan(m, units);
    };
    auto got = run_sharded(s);
    require_parity(run_reference(s), got, kTol);
  }
  // Counters of the repeated unit: two all-gathers in forward (one per call).
  auto s = tiny_spec(2, true, false);
  s.steps = 1;
  s.plan = [](torch::nn::Module& m) { return manual_plan(m, layer_units()); };
  auto c = run_sharded(s).last_step_counters;
  CHECK(c.per_unit[1].forward_all_gathers == 2);
  CHECK(c.per_unit[1].backward_all_gathers == 1);
  CHECK(c.per_unit[1].reduce_scatters == 1);
}

TEST_CASE("calling a sharded unit without flatshard::call fails clearly", "[fsdp][errors]") {
  run_ranks(2, [](Communicator& comm) {
    auto net = TinyNet(kIn, kD, 2);
    init_params(*net, 1);
    auto plan = manual_plan(*net, layer_units().size() > 2 ? std::vector<std::vector<std::string>>{{"blocks.0"}, {"blocks.1"}} : layer_units());
    auto fsdp = fully_shard(net.ptr(), plan, comm);
    // (tests/misuse_test.cpp covers each kind of first use in a child process.)
    RANK_REQUIRE_THROWS_WITH(net->typed[0]->forward(at::randn({2, kD})),
                             Catch::Contains("parameter 'blocks.0.ln.weight' of unit 'blocks.0'") &&
                                 Catch::Contains("flatshard::call(module, args...)"));
  });
}

TEST_CASE("mixed precision: bf16 parameters and compute, fp32 or bf16 reduction", "[fsdp][bf16]") {
  // Against the fp32 reference: bf16 rounds to 8 mantissa bits (~0.4% per rounding); through
  // this 4-block network the step-0 gradients stay within a few percent (relative L2 per
  // parameter) and the losses within 2%. A gradient that is lost, doubled or mis-cast fails
  // by far more.
  for (auto reduce : {at::kFloat, at::kBFloat16}) {
    CAPTURE(reduce);
    auto s = tiny_spec(2);
    s.options.mixed_precision.param_dtype = at::kBFloat16;
    s.options.mixed_precision.reduce_dtype = reduce;
    s.plan = [](torch::nn::Module& m) {
      return manual_plan(m, layer_units(), {{}, {ShardingStrategy::kNoShard, {}}});
    };
    auto ref = run_reference(s);
    auto got = run_sharded(s);
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      CAPTURE(i, ref.losses[i], got.losses[i]);
      REQUIRE(std::abs(ref.losses[i] - got.losses[i]) <= 2e-2 * std::abs(ref.losses[i]));
    }
    for (auto& kv : ref.grads) {
      REQUIRE(got.grads.at(kv.first).scalar_type() == at::kFloat);  // master grads stay fp32
      const double denom = kv.second.norm().item<double>();
      const double rel = (got.grads.at(kv.first) - kv.second).norm().item<double>() / denom;
      CAPTURE(kv.first, rel);
      REQUIRE(rel < 3e-2);
    }
  }
}

TEST_CASE("FLATSHARD_DEBUG: NaN padding and the order check leave parity intact", "[fsdp][parity]") {
  // With padding poisoned, any read of padding (a view off by a few elements, a reduction over
  // the whole flat buffer) would turn losses or parameters into NaN.
  setenv("FLATSHARD_DEBUG", "1", 1);
  auto s = tiny_spec(3);
  s.plan = [](torch::nn::Module& m) {
    return manual_plan(m, leaf_units(), {{}, {ShardingStrategy::kNoShard, {}}});
  };
  s.options.mixed_precision.param_dtype = at::kFloat;
  auto got = run_sharded(s);
  unsetenv("FLATSHARD_DEBUG");
  require_parity(run_reference(s), got, kTol);
}

namespace {

// Added after flatshard's own post hook on a parameter's AccumulateGrad, so it runs after
// FlatParam::accept_grad: records the parameter's .grad as accept_grad left it (undefined once
// the unit's last gradient has triggered its reduction).
struct SeeGrad : torch::autograd::FunctionPostHook {
  SeeGrad(at::Tensor p, std::vector<at::Tensor>* out) : param(std::move(p)), seen(out) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (param.grad().defined()) seen->push_back(param.grad());
    return outputs;
  }
  at::Tensor param;
  std::vector<at::Tensor>* seen;
};

}  // namespace

TEST_CASE("with gradient sync on, units leave the gradient copies to the reduction", "[fsdp]") {
  // Note [Flat gradient without zero-fill]: synced, accept_grad() leaves .grad alone (the
  // gradients of one unit are separate tensors); unsynced, it moves them into the flat gradient
  // (views of one storage), where a following synced pass accumulates in place.
  run_ranks(2, [](Communicator& comm) {
    std::vector<at::Tensor> seen;
    auto net = TinyNet(kIn, kD, kLayers);
    init_params(*net, 1);
    auto fsdp = fully_shard(net.ptr(), manual_plan(*net, layer_units()), comm);
    const auto block = net->typed[1]->parameters();  // the unit "blocks.1"
    RANK_REQUIRE(block.size() == 6);
    for (const auto& p : block)
      torch::autograd::impl::grad_accumulator(p)->add_post_hook(
          std::make_unique<SeeGrad>(p, &seen));
    // Returns {pairs of recorded gradients, of which sharing a storage}.
    auto pass = [&](bool sync) {
      seen.clear();
      fsdp->set_requires_gradient_sync(sync);
      flatshard::call(net, at::randn({kBatch, kIn})).sum().backward();
      // Synced, the last gradient in triggers the reduction, which clears .grad.
      RANK_REQUIRE(seen.size() == (sync ? block.size() - 1 : block.size()));
      std::pair<int, int> pairs{0, 0};
      for (size_t a = 0; a < seen.size(); ++a)
        for (size_t b = a + 1; b < seen.size(); ++b) {
          ++pairs.first;
          pairs.second += seen[a].storage().is_alias_of(seen[b].storage()) ? 1 : 0;
        }
      return pairs;
    };
    auto p = pass(/*sync=*/true);
    RANK_CHECK(p.second == 0);
    p = pass(/*sync=*/false);
    RANK_CHECK(p.second == p.first);
    p = pass(/*sync=*/true);  // after an unsynced pass: in place into the flat gradient
    RANK_CHECK(p.second == p.first);
    p = pass(/*sync=*/true);
    RANK_CHECK(p.second == 0);
  });
}
