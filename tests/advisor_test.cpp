// The machine profile, the cost model's memory prediction and the plan advisor (fsdp/
// machine_profile.h, planner/cost_model.h, planner/advisor.h), label advisor.
//
// Independent references: the counting CPU allocator's measured peak of a real training step
// on CPU ranks (threads) for memory; hand-built profiles that make one cost term decisive for
// the losing reasons; parse_policy() for the suggested spec.
#include <torch/optim/adamw.h>
#include <catch2/catch.hpp>
#include <sstream>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "planner/advisor.h"
#include "fsdp/call.h"
#include "planner/cost_model.h"
#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "models/family.h"
#include "profiling/counting_allocator.h"
#include "rank_require.h"
#include "temp_dir.h"
#include "wrap_policies/plan.h"
#include "wrap_policies/spec.h"

#include <fstream>

using namespace flatshard;
// The reference families by descriptor (models/family.h).
using Family = const models::Family*;
const Family kGpt = &models::family("gpt"), kLlama = &models::family("llama");
using models::ModelConfig;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

std::shared_ptr<torch::nn::Module> build_meta(const ModelConfig& c, uint64_t seed) {
  MetaInit meta;
  return c.build(seed);
}

// One rank-average peak of a training step (the second: AdamW's state exists) of `spec` on
// `world` CPU ranks, as flatshard-bench measures it: the process peak from the start of the
// step minus the live bytes before the run, divided by the ranks.
int64_t measured_peak(const ModelConfig& c, const std::string& spec, int world, const Workload& w,
                      int prefetch = 1, int offload = 0) {
  auto& mem = profiling::CountingCpuAllocator::install();
  const int64_t before = mem.current_bytes();
  int64_t peak = 0;
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    auto model = build_meta(c, 3);
    ShardingOptions o;
    o.forward_prefetch = o.backward_prefetch = prefetch;
    o.offload = offload;
    auto fsdp = fully_shard(model, make_plan(*model, parse_policy(spec)), comm, o);
    torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(1e-3));
    std::vector<std::pair<at::Tensor, at::Tensor>> batches;
    for (int s = 0; s < 2; ++s) batches.push_back(c.synthetic_batch(w.batch, 7, comm.rank(), s));
    for (int s = 0; s < 2; ++s) {
      if (s == 1) {
        comm.barrier();
        if (comm.rank() == 0) mem.reset_peak();
        comm.barrier();
      }
      opt.zero_grad();
      const auto& b = batches[static_cast<size_t>(s)];
      at::Tensor loss = enter(model, [&] { return c.loss(*model, b.first, b.second); });
      loss.backward();
      opt.step();
    }
    comm.barrier();
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      peak = mem.peak_bytes();
    }
    comm.barrier();
  });
  return (peak - before) / world;
}

ModelConfig preset(Family f, const std::string& name, int64_t seq) {
  ModelConfig c = ModelConfig::preset(*f, name);
  c.seq_len() = seq;
  return c;
}

CostPrediction predicted(const ModelConfig& c, const std::string& spec, int world,
                         const Workload& w, int prefetch = 1, const MachineProfile& p = {}) {
  auto model = build_meta(c, 0);
  ShardingOptions o;
  o.forward_prefetch = o.backward_prefetch = prefetch;
  const Explanation e =
      explain(*model, make_plan(*model, parse_policy(spec)), MeshShape(world, 1), o);
  return predict_cost(e, c.transformer_shape(), w, p);
}

const Candidate& find(const Advice& a, const std::string& label, int prefetch = 1,
                      int offload = 0) {
  for (const auto& c : a.candidates)
    if (c.label == label && c.prefetch == prefetch && c.offload == offload) return c;
  FAIL("no candidate " << label << " prefetch " << prefetch << " offload " << offload);
  return a.candidates.front();
}

// A profile where nothing but what a test turns on costs time.
MachineProfile quiet_profile() {
  MachineProfile p;
  p.source = "test";
  p.host_ms_per_step = 0;
  p.host_us_per_unit_forward = p.host_us_per_unit_backward = 0;
  p.all_gather_latency_us = p.reduce_scatter_latency_us = p.all_reduce_latency_us = 0;
  p.all_gather_gbps = p.reduce_scatter_gbps = p.all_reduce_gbps = 1e6;
  p.compute_tflops = 0.05;  // CPU-like: compute dominates
  p.memory_gbps = 1e6;
  return p;
}

}  // namespace

TEST_CASE("machine profile: defaults round-trip; every invalid kind names key and file",
          "[advisor][profile]") {
  const MachineProfile d = MachineProfile::defaults();
  const MachineProfile back = parse_profile(d.to_json(), "defaults");
  CHECK(back.to_json() == d.to_json());
  CHECK(back.all_gather_gbps == 270);

  flatshard_test::TempDir dir;
  const std::string path = dir.path() + "/machine.json";
  MachineProfile m = d;
  m.source = "unit test";
  m.compute_tflops = 123.5;
  m.host_us_per_unit_forward = 7;
  save_profile(m, path);
  const MachineProfile loaded = load_profile(path);
  CHECK(loaded.compute_tflops == 123.5);
  CHECK(loaded.host_us_per_unit_forward == 7);
  CHECK(loaded.source == "unit test");
  // Keys left out keep their defaults.
  const MachineProfile partial = parse_profile(
      R"({"format": "flatshard-machine-profile", "version": 1, "memory_gbps": 10})", "p");
  CHECK(partial.memory_gbps == 10);
  CHECK(partial.h2d_gbps == d.h2d_gbps);

  const std::string head = R"({"format": "flatshard-machine-profile", "version": 1, )";
  struct Bad {
    std::string text, says;
  };
  const std::vector<Bad> bad = {
      {head + R"("compute_tflop": 5})", "unknown key 'compute_tflop'"},
      {head + R"("memory_gbps": -1})", "'memory_gbps' must be > 0"},
      {head + R"("memory_gbps": 0})", "'memory_gbps' must be > 0"},
      {head + R"("h2d_gbps": 1e400})", "number overflow"},
      {head + R"("h2d_gbps": 1e300})", "'h2d_gbps' must be > 0 and at most"},
      {head + R"("compute_tflops": "fast"})", "/compute_tflops: expected a number"},
      {head + R"("memory_gbps": 1, "memory_gbps": 2})", "duplicate key 'memory_gbps'"},
      {head + R"("memory_gbps": NaN})", "invalid JSON"},
      {R"({"version": 1})", "missing \"format\""},
      {R"({"format": "flatshard-machine-profile", "version": 2})", "unsupported version 2"},
      {R"({"format": "other", "version": 1})", "expected \"flatshard-machine-profile\""},
      {R"([1, 2])", "must be a JSON object"},
      {head + R"("source": 3})", "/source: expected a string"},
      {head + R"("copy_rate_beside_compute": 1.5})",
       "'copy_rate_beside_compute' must be in (0, 1], got 1.5"},
      {head + R"("copy_rate_beside_compute": 0})", "'copy_rate_beside_compute' must be > 0"},
      {head + R"("offload_overlap": 0.5})", "'offload_overlap' is retired: rerun flatshard-bench"},
  };
  for (const auto& b : bad) {
    CAPTURE(b.text);
    const std::string err = error_of([&] { parse_profile(b.text, "bad.json"); });
    CAPTURE(err);
    CHECK(err.find(b.says) != std::string::npos);
    CHECK(err.find("bad.json") != std::string::npos);
  }
  const std::string missing = error_of([&] { load_profile(dir.path() + "/nope.json"); });
  CAPTURE(missing);
  CHECK(missing.find("nope.json") != std::string::npos);
  CHECK(error_of([&] { load_profile(dir.path()); }).find("not a regular file") !=
        std::string::npos);
  {
    std::ofstream big(dir.path() + "/big.json");
    big << std::string((1 << 20) + 1, ' ');
  }
  CHECK(error_of([&] { load_profile(dir.path() + "/big.json"); }).find("more than a profile's") !=
        std::string::npos);
}

TEST_CASE("cost model: predicted peak against the counting allocator on CPU ranks",
          "[advisor][memory]") {
  // Tolerance: the closed forms count what autograd saves and what the runtime allocates; the
  // CPU kernels' own scratch (the flash-attention backward's buffers, reductions) and the
  // module's small tensors are not modelled. Stated, on CPU in fp32: at most 5% under the
  // measured peak (what AdvisorOptions::memory_margin covers) and at most 15% over it. The
  // measurement is the process peak of the rank threads / world, which equals the per-rank
  // peak only when the ranks peak at the same moment: their interleaving can only lower it
  // (the tiny GPT moved by 5% between runs), so the upper bound has the looser tolerance. The
  // tiny GPT, whose steps take milliseconds, interleaves most: under ctest -j2 its measured
  // peak fell 10% (3.07 MB in all of three runs, 3.38 idle), so its bound is 20%.
  struct Case {
    Family family;
    const char* preset;
    int64_t seq, batch;
    const char* spec;
    int world = 2;
  };
  const std::vector<Case> cases = {
      {kGpt, "tiny", 32, 4, "type=Block"},
      {kGpt, "tiny", 32, 4, "recompute:type=Block"},
      {kGpt, "small", 128, 2, "type=Block"},
      {kGpt, "small", 128, 2, "recompute:type=Block"},
      {kGpt, "small", 128, 2, "type=Linear|LayerNorm|Embedding"},
      {kGpt, "small", 128, 2, "none"},
      {kLlama, "small", 128, 2, "type=DecoderLayer"},
      {kLlama, "small", 128, 2, "recompute:type=DecoderLayer"},
      {kGpt, "small", 128, 2, "noshard:type=Block;root:noshard"},
      // One rank (no flat gradient, no collectives: Note [One-rank reduction]) and four.
      {kGpt, "small", 128, 2, "none", 1},
      {kGpt, "small", 128, 2, "type=Block", 1},
      {kGpt, "small", 128, 2, "none", 4},
      {kGpt, "small", 128, 2, "type=Block", 4},
      // SHARD_GRAD_OP keeps every layer gathered into its backward, where the head's gradient
      // (held for the root's reduction) then sits beside all of them: 5-10% under without it.
      {kGpt, "small", 128, 2, "grad_op:type=Block"},
      {kGpt, "small", 128, 2, "grad_op+recompute:type=Block", 4},
      // Two layers per unit: a backward gather's staging is counted where the gather is
      // issued, not beside the unit's own (not yet existing) flat gradient: 3.0% (world 2) and
      // 6.6% (world 4) over when it was; the bound for these is the issue's 5%.
      {kGpt, "small", 128, 2, "every=2,type=Block"},
      {kGpt, "small", 128, 2, "every=2,type=Block", 4},
  };
  for (const auto& c : cases) {
    const ModelConfig cfg = preset(c.family, c.preset, c.seq);
    const Workload w{c.batch, c.seq};
    const int world = c.world;
    MachineProfile cpu;
    cpu.collective_staging = 1;  // the threads backend (machine_profile.h)
    const CostPrediction p = predicted(cfg, c.spec, world, w, 1, cpu);
    // Interleaving only lowers the measurement: the largest of three runs for the tiny GPT.
    const bool tiny = std::string(c.preset) == "tiny";
    int64_t m = 0;
    for (int r = 0; r < (tiny ? 3 : 1); ++r)
      m = std::max(m, measured_peak(cfg, c.spec, world, w));
    const double err = static_cast<double>(p.peak_bytes - m) / static_cast<double>(m);
    CAPTURE(c.family->name(), c.preset, c.spec, p.peak_bytes, m, err, p.peak_at,
            p.to_string());

    CAPTURE(world);
    CHECK(err >= -0.05);
    CHECK(err <= (tiny ? 0.20 : 0.15));
    if (std::string(c.spec).rfind("every=", 0) == 0) CHECK(err <= 0.05);
  }
}

namespace {

AdvisorOptions advisor_for(const ModelConfig& c, const Workload& w, int64_t limit,
                           const MachineProfile& p) {
  AdvisorOptions a;
  a.memory_limit_bytes = limit;
  a.workload = w;
  a.shape = c.transformer_shape();
  a.profile = p;
  return a;
}

}  // namespace

TEST_CASE("advisor: over a sweep of budgets at world 2-4 the plan fits, predicted and measured",
          "[advisor][budget]") {
  // CPU profile: the threads backend stages collectives; compute at a CPU-like rate.
  MachineProfile cpu = quiet_profile();
  cpu.collective_staging = 1;
  cpu.host_us_per_unit_forward = cpu.host_us_per_unit_backward = 200;
  const ModelConfig cfg = preset(kGpt, "small", 128);
  const Workload w{2, 128};
  auto model = build_meta(cfg, 0);
  for (int world : {2, 3, 4}) {
    // Budgets from below the smallest candidate to above the largest.
    const Advice wide = suggest(*model, world, 1, {}, advisor_for(cfg, w, int64_t{1} << 40, cpu));
    int64_t lo = INT64_MAX, hi = 0;
    for (const auto& c : wide.candidates) {
      lo = std::min(lo, c.cost.peak_bytes);
      hi = std::max(hi, c.cost.peak_bytes);
    }
    int fitted = 0;
    for (double f : {0.8, 1.0, 1.15, 1.3, 1.6}) {
      const int64_t budget = static_cast<int64_t>(f * static_cast<double>(lo) / 0.95);
      const Advice a = suggest(*model, world, 1, {}, advisor_for(cfg, w, budget, cpu));
      CAPTURE(world, budget, lo, hi, a.to_string());
      if (!a.fits()) {
        // Nothing fits: then truly no candidate is under the usable budget.
        for (const auto& c : a.candidates) CHECK(c.cost.peak_bytes > 0.95 * budget);
        CHECK(!error_of([&] { a.best(); }).empty());
        continue;
      }
      ++fitted;
      const Candidate& b = a.best();
      CHECK(b.cost.peak_bytes <= budget);
      // Nothing that fits is faster by more than a tie (AdvisorOptions::tie_share).
      for (const auto& c : a.candidates)
        if (c.fits) CHECK(c.cost.step_ms >= b.cost.step_ms / (1 + 0.005));
      const int64_t measured = measured_peak(cfg, b.spec, world, w, b.prefetch);
      CAPTURE(b.label, b.prefetch, b.cost.peak_bytes, measured);
      CHECK(measured <= budget);
    }
    CHECK(fitted >= 3);
  }
}

TEST_CASE("advisor: the suggested spec round-trips through parse_policy", "[advisor][spec]") {
  for (Family f : {kGpt, kLlama}) {
    const ModelConfig cfg = preset(f, "small", 128);
    auto model = build_meta(cfg, 0);
    AdvisorOptions a = advisor_for(cfg, {2, 128}, int64_t{1} << 40, quiet_profile());
    a.extra_specs = {"noshard:path=lm_head;type=" + cfg.transformer_shape().layer_type};
    const Advice advice = suggest(*model, 2, 1, {}, a);
    REQUIRE(advice.fits());
    for (const auto& c : advice.candidates) {
      CAPTURE(c.label, c.spec);
      const Policy p = parse_policy(c.spec);
      CHECK(parse_policy(p.to_spec()).to_spec() == p.to_spec());
      // The plan the spec makes has the units the advisor costed.
      CHECK(static_cast<int64_t>(make_plan(*model, p).units.size()) == c.units);
    }
    CHECK(advice.best().command_line().find("--policy '" + advice.best().spec + "'") == 0);
  }
}

TEST_CASE("advisor: each losing reason, where it is the decisive one", "[advisor][reasons]") {
  const ModelConfig cfg = preset(kGpt, "small", 128);
  const Workload w{2, 128};
  auto model = build_meta(cfg, 0);
  const int64_t big = int64_t{1} << 40;
  auto run = [&](const MachineProfile& p, int world, int64_t limit,
                 std::vector<int> offload = {0}) {
    AdvisorOptions a = advisor_for(cfg, w, limit, p);
    a.offload_levels = std::move(offload);
    return suggest(*model, world, 1, {}, a);
  };
  SECTION("does not fit") {
    const Advice wide = run(quiet_profile(), 2, big);
    const Candidate& model_unit = find(wide, "model");
    const Candidate& leaf = find(wide, "leaf");
    REQUIRE(model_unit.cost.peak_bytes > leaf.cost.peak_bytes);
    // A budget between the two: the whole model as one unit does not fit, the leaves do.
    const int64_t limit = (model_unit.cost.peak_bytes + leaf.cost.peak_bytes) / 2 * 20 / 19;
    const Advice a = run(quiet_profile(), 2, limit);
    CAPTURE(a.to_string());
    REQUIRE(a.fits());
    CHECK(a.best().cost.peak_bytes <= limit);
    CHECK(find(a, "model").reason == LossReason::kDoesNotFit);
    CHECK(find(a, "model").why.find("limit") != std::string::npos);
  }
  SECTION("host-bound") {
    MachineProfile p = quiet_profile();
    p.host_us_per_unit_forward = p.host_us_per_unit_backward = 3000;  // 6 ms per unit
    const Advice a = run(p, 2, big);
    CAPTURE(a.to_string());
    const Candidate& leaf = find(a, "leaf");
    CHECK(leaf.cost.host_bound);
    CHECK(!a.best().cost.host_bound);
    CHECK(leaf.reason == LossReason::kHostBound);
  }
  SECTION("exposed all-gather") {
    MachineProfile p = quiet_profile();
    p.all_gather_latency_us = 20000;  // 20 ms per all-gather: more gathers, more exposed
    const Advice a = run(p, 2, big);
    CAPTURE(a.to_string());
    const Candidate& leaf = find(a, "leaf");
    CHECK(leaf.cost.exposed_all_gather_ms > a.best().cost.exposed_all_gather_ms);
    CHECK(leaf.reason == LossReason::kExposedAllGather);
  }
  SECTION("replication") {
    MachineProfile p = quiet_profile();
    p.all_reduce_gbps = 0.05;  // all-reduces of whole layers dominate
    const Advice a = run(p, 4, big);
    CAPTURE(a.to_string());
    const Candidate& noshard = find(a, "noshard");
    CHECK(noshard.cost.replicated_bytes > 0);
    CHECK(noshard.reason == LossReason::kReplication);
  }
  SECTION("recompute") {
    const Advice a = run(quiet_profile(), 2, big);
    CAPTURE(a.to_string());
    const Candidate& rc = find(a, "layer+recompute");
    CHECK(rc.cost.recompute_ms > 0);
    CHECK(rc.reason == LossReason::kRecompute);
  }
  SECTION("offload traffic") {
    MachineProfile p = quiet_profile();
    p.h2d_gbps = p.d2h_gbps = 0.001;
    const Advice a = run(p, 2, big, {0, 1});
    CAPTURE(a.to_string());
    CHECK(a.best().offload == 0);
    const Candidate& off = find(a, "layer", 1, 1);
    CHECK(off.cost.offload_ms > 0);
    CHECK(off.cost.host_bytes > 0);
    CHECK(off.cost.peak_bytes < find(a, "layer", 1, 0).cost.peak_bytes);
    CHECK(off.reason == LossReason::kOffloadTraffic);
  }
  SECTION("per-parameter passes") {
    // bf16 compute: every all-gather is preceded by a cast of the master (6 B per element);
    // resharding after forward casts twice per step, SHARD_GRAD_OP once.
    MachineProfile p = quiet_profile();
    p.memory_gbps = 0.05;
    ShardingOptions bf16;
    bf16.mixed_precision.param_dtype = at::kBFloat16;
    AdvisorOptions o = advisor_for(cfg, w, big, p);
    o.include_leaf = o.include_noshard = o.include_model = false;
    const Advice a = suggest(*model, 2, 1, bf16, o);
    CAPTURE(a.to_string());
    CHECK(a.best().label == "grad_op");
    const Candidate& layer = find(a, "layer");
    CHECK(layer.cost.passes_ms > a.best().cost.passes_ms);
    CHECK(layer.reason == LossReason::kParameterPasses);
  }
  SECTION("not faster: prefetch 2 costs the same time and more memory") {
    const Advice a = run(quiet_profile(), 2, big);
    CAPTURE(a.to_string());
    const Candidate& best = a.best();
    const Candidate& deeper = find(a, best.label, best.prefetch == 1 ? 2 : 1);
    CHECK(deeper.reason == LossReason::kNotFaster);
    CHECK(deeper.cost.peak_bytes >= best.cost.peak_bytes);
  }
}

TEST_CASE("advisor: bad inputs are errors with their values", "[advisor][errors]") {
  const ModelConfig cfg = preset(kGpt, "tiny", 32);
  auto model = build_meta(cfg, 0);
  auto err = [&](const std::function<void(AdvisorOptions&)>& change, int world = 2) {
    AdvisorOptions a = advisor_for(cfg, {1, 32}, int64_t{1} << 30, quiet_profile());
    change(a);
    return error_of([&] { suggest(*model, world, 1, {}, a); });
  };
  CHECK(err([](AdvisorOptions& a) {
          a.memory_limit_bytes = 0;
        }).find("memory_limit_bytes must be > 0, got 0") != std::string::npos);
  CHECK(err([](AdvisorOptions& a) {
          a.prefetch_depths = {-1};
        }).find("prefetch depth must be in [0, 64], got -1") != std::string::npos);
  CHECK(err([](AdvisorOptions& a) {
          a.offload_levels = {3};
        }).find("offload level must be 0, 1 or 2, got 3") != std::string::npos);
  CHECK(err([](AdvisorOptions& a) {
          a.extra_specs = {"type=Block;;"};
        }).find("spec 'type=Block;;'") != std::string::npos);
  CHECK(err([](AdvisorOptions& a) { a.workload.batch = 0; }).find("batch 0") != std::string::npos);
  CHECK(err([](AdvisorOptions& a) {
          a.profile.copy_rate_beside_compute = 0;  // a profile built in code, not parsed
        }).find("copy_rate_beside_compute must be in (0, 1], got 0") != std::string::npos);
  CHECK(err([](AdvisorOptions&) {}, 0).find("world 0") != std::string::npos);
}

TEST_CASE("cost model: step terms against closed forms", "[advisor][time]") {
  // GPT small at its own seq_len: the model's flops_per_token() (models/gpt.h, an independent
  // closed form) at the profile's rate is the whole compute term.
  const ModelConfig cfg = preset(kGpt, "small", 128);
  const Workload w{2, 128};
  MachineProfile p = quiet_profile();
  p.compute_tflops = 0.01;
  const double tokens = static_cast<double>(w.tokens());
  const double expect_ms = tokens * cfg.flops_per_token() / (p.compute_tflops * 1e9);
  const CostPrediction layer = predicted(cfg, "type=Block", 2, w, 1, p);
  CHECK(layer.compute_ms == Approx(expect_ms).epsilon(1e-9));
  CHECK(layer.recompute_ms == 0);
  const CostPrediction leaf = predicted(cfg, "type=Linear|LayerNorm|Embedding", 2, w, 1, p);
  CHECK(leaf.compute_ms == Approx(expect_ms).epsilon(1e-9));
  // Recompute: one more forward of every layer, a third of its training FLOPs
  // (6 N_layer + 12 d T per token -> 2 N_layer + 4 d T).
  const auto s = cfg.transformer_shape();
  const double layer_fwd = tokens * (2.0 * s.layer_matmul_params + 4.0 * s.d_model * 128) *
                           s.n_layers / (p.compute_tflops * 1e9);
  const CostPrediction rc = predicted(cfg, "recompute:type=Block", 2, w, 1, p);
  CHECK(rc.recompute_ms == Approx(layer_fwd).epsilon(1e-9));
  CHECK(rc.compute_ms == Approx(expect_ms + layer_fwd).epsilon(1e-9));

  // Collectives: with no prefetch nothing hides, so every all-gather is exposed:
  // latency + (W-1) x shard bytes / bandwidth each.
  MachineProfile c = quiet_profile();
  c.all_gather_latency_us = 100;
  c.all_gather_gbps = 1;
  auto model = build_meta(cfg, 0);
  ShardingOptions o;
  o.forward_prefetch = o.backward_prefetch = 0;
  const int world = 3;
  const Explanation e =
      explain(*model, make_plan(*model, parse_policy("type=Block")), MeshShape(world, 1), o);
  double gathers = 0;
  for (const auto& u : e.units)
    gathers += (u.per_step.forward_all_gathers + u.per_step.backward_all_gathers) *
               (0.1 + (world - 1) * static_cast<double>(u.all_gather_bytes) / 1e6);
  const CostPrediction none = predict_cost(e, s, w, c);
  CHECK(none.exposed_all_gather_ms == Approx(gathers).epsilon(1e-9));
  // With prefetch 1 some of it hides behind compute.
  const CostPrediction one = predicted(cfg, "type=Block", world, w, 1, c);
  CHECK(one.exposed_all_gather_ms < none.exposed_all_gather_ms);

  // Host-bound: host > GPU time; the step is the overlap norm of the two (p = 1: the sum).
  MachineProfile h = quiet_profile();
  h.host_us_per_unit_forward = 1e6;  // 1 s per unit and pass
  h.host_overlap_norm = 1;
  const CostPrediction hb = predicted(cfg, "type=Block", 2, w, 1, h);
  CHECK(hb.host_bound);
  CHECK(hb.host_ms == Approx(5 * 1000.0));
  CHECK(hb.step_ms == Approx(hb.host_ms + hb.gpu_ms));
}

TEST_CASE("cost model: offload terms, level 1 and 2", "[advisor][offload]") {
  const ModelConfig cfg = preset(kGpt, "tiny", 32);
  auto model = build_meta(cfg, 0);
  ShardingOptions o;
  o.mixed_precision.param_dtype = at::kBFloat16;
  const Explanation e =
      explain(*model, make_plan(*model, parse_policy("type=Block")), MeshShape(2, 1), o);
  const UnitExplanation& block = e.units[1];  // blocks.0: FULL_SHARD, reshards after forward
  REQUIRE(block.reshard_after_forward);
  const int64_t shard = block.shard_numel;
  const OffloadTerms one = offload_terms(block, 1, at::kBFloat16);
  CHECK(one.device_bytes_saved == 4 * shard + 8 * shard);  // master + AdamW moments
  CHECK(one.host_bytes == 16 * shard);                     // + the gradient
  CHECK(one.resident_bytes == 2 * shard);                  // the bf16 shard
  CHECK(one.h2d_bytes == 4 * shard);                       // once per step
  CHECK(one.d2h_bytes == 4 * shard);
  CHECK(one.cpu_optimizer_params == shard);
  const OffloadTerms two = offload_terms(block, 2, at::kBFloat16);
  CHECK(two.resident_bytes == 0);
  CHECK(two.h2d_bytes == 2 * 4 * shard);  // before the forward and the backward gather
  CHECK(offload_terms(block, 0, at::kBFloat16).host_bytes == 0);
  // NO_SHARD uploads into the unsharded buffer it keeps anyway: no compute shard beside it.
  const Explanation ns =
      explain(*model, make_plan(*model, parse_policy("noshard:type=Block;root:noshard")),
              MeshShape(2, 1), o);
  REQUIRE(ns.units[1].strategy == ShardingStrategy::kNoShard);
  CHECK(offload_terms(ns.units[1], 1, at::kBFloat16).resident_bytes == 0);
  CHECK(offload_terms(ns.units[1], 1, at::kBFloat16).host_bytes == 16 * ns.units[1].shard_numel);
  // In the prediction: the persistent device state shrinks by exactly the saved bytes.
  const auto s = cfg.transformer_shape();
  const CostPrediction p0 = predict_cost(e, s, {1, 32}, quiet_profile(), 0);
  const CostPrediction p1 = predict_cost(e, s, {1, 32}, quiet_profile(), 1);
  int64_t saved = 0, resident = 0, host = 0;
  for (const auto& u : e.units) {
    const OffloadTerms t = offload_terms(u, 1, at::kBFloat16);
    saved += t.device_bytes_saved;
    resident += t.resident_bytes;
    host += t.host_bytes;
  }
  CHECK(p1.persistent_bytes == p0.persistent_bytes - saved + resident);
  CHECK(p1.host_bytes == host);
  CHECK(error_of([&] {
          predict_cost(e, s, {1, 32}, quiet_profile(), 3);
        }).find("offload level must be 0, 1 or 2, got 3") != std::string::npos);
}

TEST_CASE("cost model: offload as explain resolves it; CPU ranks hold device and host alike",
          "[advisor][offload]") {
  const ModelConfig cfg = preset(kGpt, "small", 128);
  const Workload w{2, 128};
  MachineProfile cpu;
  cpu.collective_staging = 1;
  auto model = build_meta(cfg, 0);
  // Per block; one unit (its reduction holds the parameters' own gradients, the flat gradient,
  // the reduced shard and its fp32 copy at once); NO_SHARD (no compute shard kept beside the
  // unsharded buffer; level 2 resolves to 1).
  for (const std::string spec : {"type=Block", "none", "noshard:type=Block;root:noshard"})
  for (int level : {1, 2}) {
    CAPTURE(spec, level);
    const Plan plan = make_plan(*model, parse_policy(spec));
    // explain's per-unit level (ShardingOptions::offload) and predict_cost's argument agree,
    // and the host bytes are explain's own count (MemoryEstimate::host_bytes).
    ShardingOptions o;
    o.offload = level;
    const Explanation e = explain(*model, plan, MeshShape(2, 1), o);
    const Explanation e0 = explain(*model, plan, MeshShape(2, 1), {});
    const CostPrediction a = predict_cost(e, cfg.transformer_shape(), w, cpu);
    const CostPrediction b = predict_cost(e0, cfg.transformer_shape(), w, cpu, level);
    CHECK(a.peak_bytes == b.peak_bytes);
    CHECK(a.host_bytes == e.memory.host_bytes);
    // On CPU ranks "host" and "device" are the same memory: the counting allocator sees the
    // predicted device peak plus the offloaded state.
    const int64_t m = measured_peak(cfg, spec, 2, w, 1, level);
    const double err =
        static_cast<double>(a.peak_bytes + a.host_bytes - m) / static_cast<double>(m);
    CAPTURE(a.peak_bytes, a.host_bytes, m, err, a.to_string());
    CHECK(err >= -0.05);
    CHECK(err <= 0.15);
  }
}

TEST_CASE("cost model: offload copies ride the gather and reduction pipeline",
          "[advisor][offload]") {
  // World 1, bf16, copies on their streams (comm_overlap 1, the GPU's case).
  const ModelConfig cfg = preset(kGpt, "small", 128);
  const Workload w{2, 128};
  const auto s = cfg.transformer_shape();
  auto model = build_meta(cfg, 0);
  ShardingOptions o;
  o.mixed_precision.param_dtype = at::kBFloat16;
  o.offload = 1;
  MachineProfile p = quiet_profile();
  p.h2d_gbps = 0.5;
  p.d2h_gbps = 0.25;
  p.cpu_optimizer_params_per_s = 1e8;
  auto cost = [&](const std::string& spec, const MachineProfile& prof) {
    const Explanation e =
        explain(*model, make_plan(*model, parse_policy(spec)), MeshShape(1, 1), o);
    double copies = 0, cpu = 0, root_copies = 0;
    for (const auto& u : e.units) {
      const OffloadTerms t = offload_terms(u, u.offload, at::kBFloat16);
      const double ms = t.h2d_bytes / (prof.h2d_gbps * 1e6) + t.d2h_bytes / (prof.d2h_gbps * 1e6);
      copies += ms;
      if (u.is_root) root_copies = ms;
      cpu += t.cpu_optimizer_params / prof.cpu_optimizer_params_per_s * 1e3;
    }
    return std::make_tuple(predict_cost(e, s, w, prof), copies, cpu, root_copies);
  };
  SECTION("one unit: its upload precedes all compute, its download follows it: all exposed") {
    const auto [c, copies, cpu, root] = cost("none", p);
    CHECK(c.cpu_optimizer_ms == Approx(cpu).epsilon(1e-9));
    CHECK(c.offload_ms - c.cpu_optimizer_ms == Approx(copies).epsilon(1e-9));
    CHECK(root == Approx(copies).epsilon(1e-12));
  }
  SECTION("per layer, compute far longer than any copy: only the root's upload and download") {
    MachineProfile slow = p;
    slow.compute_tflops = 1e-4;
    const auto [c, copies, cpu, root] = cost("type=Block", slow);
    REQUIRE(root < copies / 2);
    CHECK(c.offload_ms - c.cpu_optimizer_ms == Approx(root).epsilon(1e-9));
  }
  SECTION("copies slowed beside compute: hidden while the compute outlasts them, linear where not") {
    // Compute far longer than any copy, even at a tenth of the copy rate: still the root's alone.
    MachineProfile slow = p;
    slow.compute_tflops = 1e-4;
    slow.copy_rate_beside_compute = 0.1;
    const auto [c, copies, cpu, root] = cost("type=Block", slow);
    CHECK(c.offload_ms - c.cpu_optimizer_ms == Approx(root).epsilon(1e-9));
    // Compute a third of the copies: each block's upload outlasts the forward beside it, and
    // the downloads queue behind the backward, so each copy exposes its time less `beside` x
    // the compute beside it: the exposure is linear in `beside`, and more than at the full rate.
    MachineProfile mid = p;
    const auto [full, copies1, cpu1, root1] = cost("type=Block", mid);
    mid.compute_tflops = p.compute_tflops * (full.compute_ms / (copies1 / 3));
    auto exposed = [&](double beside) {
      MachineProfile x = mid;
      x.copy_rate_beside_compute = beside;
      const auto [q, cq, uq, rq] = cost("type=Block", x);
      return q.offload_ms - q.cpu_optimizer_ms;
    };
    const double e25 = exposed(0.25), e50 = exposed(0.5), e75 = exposed(0.75), e100 = exposed(1);
    CAPTURE(e25, e50, e75, e100, copies1, root1);
    CHECK(e25 > e50);
    CHECK(e50 > e75);
    CHECK(e75 > e100);
    CHECK(e100 > root1);
    CHECK(e25 < copies1);
    CHECK(e25 - e50 == Approx(e50 - e75).epsilon(1e-6));
  }
}

TEST_CASE("cost model: the CPU step during backward hides behind the backward that is left",
          "[advisor][offload]") {
  // Note [Offload step in backward]: per layer at level 1 the CPU steps overlap the backward
  // after the first reduction and the uploads leave the forward. Closed forms at both ends:
  // compute far longer than the CPU step hides it whole; compute far shorter hides none of it.
  const ModelConfig cfg = preset(kGpt, "small", 128);
  const Workload w{2, 128};
  const auto s = cfg.transformer_shape();
  auto model = build_meta(cfg, 0);
  const Plan plan = make_plan(*model, parse_policy("type=Block"));
  ShardingOptions after;
  after.mixed_precision.param_dtype = at::kBFloat16;
  after.offload = 1;
  ShardingOptions during = after;
  during.offload_step = OffloadStep::kBackward;
  MachineProfile p = quiet_profile();
  p.cpu_optimizer_params_per_s = 1e8;
  auto both = [&](const MachineProfile& prof) {
    return std::make_pair(predict_cost(explain(*model, plan, MeshShape(1, 1), after), s, w, prof),
                          predict_cost(explain(*model, plan, MeshShape(1, 1), during), s, w, prof));
  };
  SECTION("slow compute: the CPU step is hidden, only the copies' exposure is left") {
    MachineProfile slow = p;
    slow.compute_tflops = 1e-4;
    const auto [a, b] = both(slow);
    REQUIRE(a.cpu_optimizer_ms > 0);
    CHECK(b.cpu_optimizer_ms == Approx(a.cpu_optimizer_ms));  // the same work, another time
    CHECK(b.offload_ms <= a.offload_ms - a.cpu_optimizer_ms + 1e-9);
    CHECK(b.step_ms < a.step_ms);
  }
  SECTION("fast compute: nothing to hide behind, the CPU step stays exposed") {
    MachineProfile fast = p;
    fast.compute_tflops = 1e6;
    const auto [a, b] = both(fast);
    CHECK(b.offload_ms >= b.cpu_optimizer_ms);
    CHECK(b.offload_ms <= a.offload_ms + 1e-9);
  }
  SECTION("without offload the mode changes nothing") {
    ShardingOptions plain = during;
    plain.offload = 0;
    const Explanation e = explain(*model, plan, MeshShape(1, 1), plain);
    ShardingOptions plain_after = after;
    plain_after.offload = 0;
    CHECK(predict_cost(e, s, w, p).step_ms ==
          predict_cost(explain(*model, plan, MeshShape(1, 1), plain_after), s, w, p).step_ms);
  }
}

TEST_CASE("cost model: recompute costs host time too", "[advisor][time]") {
  const ModelConfig cfg = preset(kGpt, "small", 128);
  const Workload w{2, 128};
  const int64_t L = cfg.transformer_shape().n_layers;
  MachineProfile p = quiet_profile();
  p.host_us_per_unit_forward = 1000;  // 1 ms per unit in forward hooks, 3 ms in backward
  p.host_us_per_unit_backward = 3000;
  p.host_ms_per_step = 8.0 * static_cast<double>(L);  // 8 ms per layer
  p.host_reference_layers = static_cast<double>(L);
  const CostPrediction plain = predicted(cfg, "type=Block", 2, w, 1, p);
  const CostPrediction rc = predicted(cfg, "recompute:type=Block", 2, w, 1, p);
  // Each recomputed block runs its forward hooks again (1 ms) and issues its forward again:
  // the forward share 1 / (1 + 3) of its 8 ms.
  CHECK(rc.host_ms - plain.host_ms == Approx(static_cast<double>(L) * (1.0 + 8.0 / 4)));
  // A recomputed leaf re-runs only its own module: the hooks.
  const CostPrediction leaf = predicted(cfg, "type=Linear|LayerNorm|Embedding", 2, w, 1, p);
  const CostPrediction leaf_rc =
      predicted(cfg, "recompute:type=Linear|LayerNorm|Embedding", 2, w, 1, p);
  auto model = build_meta(cfg, 0);
  const Explanation e =
      explain(*model, make_plan(*model, parse_policy("recompute:type=Linear|LayerNorm|Embedding")),
              MeshShape(2, 1), {});
  int recomputed = 0;
  for (const auto& u : e.units) recomputed += u.recompute ? 1 : 0;
  REQUIRE(recomputed > static_cast<int>(L));
  CHECK(leaf_rc.host_ms - leaf.host_ms == Approx(recomputed * 1.0));
}

TEST_CASE("cost model: a recomputed LLaMA RMSNorm keeps only its input", "[advisor][memory]") {
  // RMSNorm saves its fp32 copy (4 d), its cast output (d e) and the statistic (4 B) per token;
  // recomputed, only its input (d e): 4 d + 4 less per norm, two per layer. A recomputed Linear
  // saves its input either way, so recomputing the Linears changes nothing.
  const ModelConfig cfg = preset(kLlama, "small", 128);
  const Workload w{2, 128};
  const auto s = cfg.transformer_shape();
  MachineProfile p = quiet_profile();
  const std::string leaf = "type=Linear|RMSNorm|Embedding";
  const CostPrediction plain = predicted(cfg, leaf, 1, w, 1, p);
  const CostPrediction norms =
      predicted(cfg, "recompute:type=RMSNorm;type=Linear|Embedding", 1, w, 1, p);
  const CostPrediction linears =
      predicted(cfg, "recompute:type=Linear;type=RMSNorm|Embedding", 1, w, 1, p);
  CAPTURE(plain.to_string(), norms.to_string());
  REQUIRE(plain.peak_at == norms.peak_at);
  const double per_token = 2.0 * (4.0 * s.d_model + 4) * s.n_layers;
  CHECK(plain.activation_bytes - norms.activation_bytes ==
        Approx(per_token * static_cast<double>(w.tokens())));
  CHECK(linears.activation_bytes == plain.activation_bytes);
}

namespace {

// A GPT with a big root (vocabulary `vocab`, two blocks, recompute per block) at world 1 and
// offload `level`: the prediction (CPU ranks: host bytes are the same memory) against the
// counting allocator. World 1 is deterministic, so the callers' bounds are tight.
struct BigRoot {
  CostPrediction cost;
  double err = 0;
};
BigRoot big_root(int64_t vocab, const Workload& w, int level) {
  ModelConfig cfg = preset(kGpt, "small", w.seq);
  cfg.vocab() = vocab;
  cfg.n_layers() = 2;
  const std::string spec = "recompute:type=Block";
  ShardingOptions o;
  o.offload = level;
  auto model = build_meta(cfg, 0);
  const Explanation e = explain(*model, make_plan(*model, parse_policy(spec)), MeshShape(1, 1), o);
  MachineProfile cpu;
  cpu.collective_staging = 1;
  BigRoot r;
  r.cost = predict_cost(e, cfg.transformer_shape(), w, cpu);
  const int64_t m = measured_peak(cfg, spec, 1, w, 1, level);
  r.err = static_cast<double>(r.cost.peak_bytes + r.cost.host_bytes - m) / static_cast<double>(m);
  return r;
}

}  // namespace

TEST_CASE("cost model: from the loss's backward on, the root's flat gradient and the first "
          "backward prefetch are alive", "[advisor][memory][offload]") {
  // The root's pre-backward hook sits on the loss: at the step's first backward moment the
  // root's flat gradient is allocated (offloaded: the general path even at one rank) and the
  // first unit of backward is gathered. Many tokens make the loss's backward the peak. Without
  // the two the prediction was 67.4 MiB (5.4%) under at offload 1.
  for (int level : {0, 1}) {
    CAPTURE(level);
    const BigRoot r = big_root(32768, {8, 256}, level);
    CAPTURE(r.cost.to_string(), r.err);
    CHECK(r.cost.peak_at == "loss backward");
    CHECK(std::abs(r.err) <= 0.01);
  }
}

TEST_CASE("cost model: at one rank a unit's reduction holds its parameters' gradients beside "
          "the fresh master gradient", "[advisor][memory]") {
  // Note [One-rank reduction]: the gradients autograd wrote are copied into the unit's master
  // gradient, allocated at the reduction, and released after the copy. Few tokens make the
  // root's reduction the peak. Without the parameters' own gradients: 7.4% under.
  const BigRoot r = big_root(16384, {4, 64}, 0);
  CAPTURE(r.cost.to_string(), r.err);
  CHECK(r.cost.peak_at == "reduction of <root>");
  CHECK(std::abs(r.err) <= 0.01);
}

TEST_CASE("advisor: 'host-bound' only where host time exceeds GPU time; small margins say so",
          "[advisor][reasons][issue33]") {
  // The advisor once printed "host-bound: 87.49 ms vs 86.30 ms ... (host 30.15 ms beside GPU
  // 86.28 ms)": the excess was the overlap's, the host far below the GPU. Sweep the host cost
  // per unit so that leaf-like plans pass from hidden host work to host-bound.
  const ModelConfig cfg = preset(kGpt, "small", 128);
  auto model = build_meta(cfg, 0);
  int overhead = 0, bound = 0, small_margin = 0;
  for (double host_us : {5.0, 20.0, 50.0, 100.0, 200.0, 400.0, 800.0, 3000.0}) {
    MachineProfile p = quiet_profile();
    p.host_us_per_unit_forward = p.host_us_per_unit_backward = host_us;
    const Advice a = suggest(*model, 2, 1, {}, advisor_for(cfg, {2, 128}, int64_t{1} << 40, p));
    for (const auto& c : a.candidates) {
      CAPTURE(host_us, c.label, c.prefetch, c.why);
      if (c.reason == LossReason::kHostBound) {
        ++bound;
        CHECK(c.cost.host_bound);
        CHECK(c.cost.host_ms > c.cost.gpu_ms);
        CHECK(c.why.find("ms > GPU") != std::string::npos);
      }
      if (c.reason == LossReason::kHostOverhead) {
        ++overhead;
        CHECK_FALSE(c.cost.host_bound);
        CHECK(c.why.find("not host-bound") != std::string::npos);
      }
      const double margin = (c.cost.step_ms - a.best().cost.step_ms) / a.best().cost.step_ms;
      if (c.fits && c.reason != LossReason::kNone && c.reason != LossReason::kNotFaster) {
        const bool said = c.why.find("within the prediction's error") != std::string::npos;
        CHECK(said == (margin < 0.05));
        small_margin += said ? 1 : 0;
      }
    }
  }
  CHECK(bound > 0);
  CHECK(overhead > 0);
  CHECK(small_margin > 0);
}

TEST_CASE("advisor table: rows that differ only in prefetch depth are listed once",
          "[advisor][issue33]") {
  Advice a;
  a.memory_limit_bytes = int64_t{1} << 30;
  a.memory_margin = 0.05;
  a.workload = {1, 32};
  auto candidate = [](const std::string& label, int prefetch, double step, int64_t peak) {
    Candidate c;
    c.label = label;
    c.spec = "type=Block";
    c.prefetch = prefetch;
    c.units = 3;
    c.fits = true;
    c.cost.step_ms = step;
    c.cost.peak_bytes = peak;
    c.reason = LossReason::kNotFaster;
    c.why = "same";
    return c;
  };
  a.candidates = {candidate("model", 1, 10.0, 1000), candidate("layer", 1, 11.0, 900),
                  candidate("model", 2, 10.0, 1000), candidate("layer", 2, 11.0, 901)};
  a.candidates[0].reason = LossReason::kNone;
  a.candidates[0].why = "fits and is predicted fastest";
  const std::string table = a.to_string();
  CAPTURE(table);
  auto rows_of = [&](const std::string& label) {
    int n = 0;
    std::istringstream is(table);
    for (std::string line; std::getline(is, line);)
      n += line.rfind(label + " ", 0) == 0 ? 1 : 0;
    return n;
  };
  CHECK(rows_of("model") == 1);  // same prediction at depths 1 and 2: one row "1,2"
  CHECK(table.find("\nmodel ") != std::string::npos);
  CHECK(table.substr(table.find("\nmodel ")).find(" 1,2 ") < table.substr(table.find("\nmodel ")).find('\n', 1));
  CHECK(rows_of("layer") == 2);  // the peaks differ by a byte: two rows
}
