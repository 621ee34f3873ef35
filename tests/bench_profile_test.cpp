// flatshard-bench --write-profile's fit (benchmarks/bench_profile.h) against a known machine: the
// runs are synthesised from the cost model (planner/cost_model.h) under a profile whose constants
// the test chooses, and the fit must give those constants back — per-unit host cost from the
// hook times, the fixed host cost from the short-sequence probe, compute and memory rates, the
// CPU optimizer rate, the copy rates from the one-unit plan and copy_rate_beside_compute from the
// per-layer plan. No device is used: measure_profile() only explains and costs plans.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "benchmarks/bench_granularity.h"
#include "benchmarks/bench_options.h"
#include "benchmarks/bench_profile.h"
#include "benchmarks/bench_run.h"
#include "planner/cost_model.h"
#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "fsdp/meta_init.h"
#include "models/family.h"

namespace fb = flatshard::bench;
using namespace flatshard;

namespace {

fb::BenchOptions options() {
  std::vector<std::string> args = {"flatshard-bench", "--preset", "small", "--seq", "128",
                                   "--batch", "2", "--steps", "1"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  fb::BenchOptions o = fb::parse_command_line(static_cast<int>(argv.size()), argv.data()).options;
  // What a cuda run costs: bf16 compute, the device branch of the fit. Nothing here touches a
  // device.
  o.device = fb::DeviceKind::kCuda;
  o.sharding.mixed_precision.param_dtype = at::kBFloat16;
  return o;
}

// The machine the runs come from.
MachineProfile truth(int64_t layers) {
  MachineProfile t;
  t.compute_tflops = 50;
  t.memory_gbps = 800;
  t.host_ms_per_step = 7;
  t.host_reference_layers = static_cast<double>(layers);
  t.host_us_per_unit_forward = 30;
  t.host_us_per_unit_backward = 50;
  t.h2d_gbps = t.d2h_gbps = 0.2;  // slow enough that every plan's copies show
  t.copy_rate_beside_compute = 0.4;
  t.cpu_optimizer_params_per_s = 1e8;
  return t;
}

struct Runs {
  std::vector<fb::Granularity> grans;
  std::vector<fb::RunResult> results;
};

// One synthetic run per label, timed as `t` predicts (one measured step each).
Runs synthesise(const fb::BenchOptions& o, const MachineProfile& t,
                const std::vector<std::pair<std::string, int>>& labels) {
  std::shared_ptr<torch::nn::Module> planning;
  {
    MetaInit meta;
    planning = o.model.build(o.seed);
  }
  const auto& modules = o.model.family().modules();
  Runs r;
  for (const auto& [label, level] : labels) {
    fb::Granularity g =
        fb::with_offload(fb::resolve_granularity(label, *planning, modules), level);
    const Explanation e = explain(*planning, g.plan, MeshShape(1, 1), o.sharding);
    const CostPrediction c =
        predict_cost(e, o.model.transformer_shape(), {o.batch, o.model.seq_len()}, t);
    fb::RunResult run;
    run.granularity = g.label;
    run.units = static_cast<int64_t>(e.units.size());
    const double units = static_cast<double>(e.units.size());
    run.fwd_bwd_ms = {c.gpu_ms - c.optimizer_ms - c.cpu_optimizer_ms};
    run.optimizer_ms = {c.optimizer_ms + c.cpu_optimizer_ms};
    run.step_ms = {c.step_ms};
    run.hook_forward_ms = {units * t.host_us_per_unit_forward / 1e3};
    run.hook_backward_ms = {units * t.host_us_per_unit_backward / 1e3};
    // A device-bound issue time (the host waiting in a full launch queue): what the fit must
    // not take for host work.
    run.host_issue_ms = {c.step_ms * 0.9};
    r.grans.push_back(std::move(g));
    r.results.push_back(std::move(run));
  }
  return r;
}

// The probe: the calibration plan on short sequences, issue time = host work.
fb::RunResult probe_of(const fb::RunResult& cal, const MachineProfile& t) {
  fb::RunResult p = cal;
  p.host_issue_ms = {t.host_ms_per_step + cal.hook_forward_ms[0] + cal.hook_backward_ms[0]};
  return p;
}

}  // namespace

TEST_CASE("bench profile: the fit gives back the machine the runs came from",
          "[advisor][profile]") {
  const fb::BenchOptions o = options();
  const int64_t layers = o.model.transformer_shape().n_layers;
  const MachineProfile t = truth(layers);
  const Runs r = synthesise(o, t, {{"layer", 0}, {"leaf", 0}, {"model", 0}, {"layer", 1},
                                   {"model", 1}});
  REQUIRE(fb::calibration_run(r.grans, r.results) == 0);
  const fb::RunResult probe = probe_of(r.results[0], t);
  const MachineProfile p = fb::measure_profile(o, 1, r.grans, r.results, "test", &probe);
  CAPTURE(p.to_string());
  CHECK(p.host_us_per_unit_forward == Approx(t.host_us_per_unit_forward).epsilon(1e-6));
  CHECK(p.host_us_per_unit_backward == Approx(t.host_us_per_unit_backward).epsilon(1e-6));
  CHECK(p.host_ms_per_step == Approx(t.host_ms_per_step).epsilon(1e-6));
  CHECK(p.host_reference_layers == Approx(static_cast<double>(layers)));
  CHECK(p.memory_gbps == Approx(t.memory_gbps).epsilon(1e-6));
  CHECK(p.compute_tflops == Approx(t.compute_tflops).epsilon(1e-6));
  CHECK(p.cpu_optimizer_params_per_s == Approx(t.cpu_optimizer_params_per_s).epsilon(1e-6));
  CHECK(p.h2d_gbps == Approx(t.h2d_gbps).epsilon(1e-6));
  CHECK(p.d2h_gbps == Approx(t.d2h_gbps).epsilon(1e-6));
  CHECK(p.copy_rate_beside_compute == Approx(t.copy_rate_beside_compute).epsilon(1e-6));
  CHECK(p.source.find("at 64 tokens per sequence") != std::string::npos);
  CHECK(p.source.find("copy_rate_beside_compute from 'layer+offload1'") != std::string::npos);

  SECTION("the CPU optimizer rate: the median over the offload-1 runs, an outlier ignored") {
    Runs three = synthesise(o, t, {{"layer", 0}, {"leaf", 0}, {"model", 0}, {"layer", 1},
                                   {"leaf", 1}, {"model", 1}});
    three.results[3].optimizer_ms = {three.results[3].optimizer_ms[0] * 1.6};  // layer+offload1
    const MachineProfile q =
        fb::measure_profile(o, 1, three.grans, three.results, "test", &probe);
    CHECK(q.cpu_optimizer_params_per_s == Approx(t.cpu_optimizer_params_per_s).epsilon(1e-6));
    CHECK(q.source.find("the median of 3 offload-1 runs") != std::string::npos);
  }
  SECTION("without the probe: the calibration run's issue time less its hooks") {
    const MachineProfile q = fb::measure_profile(o, 1, r.grans, r.results, "test");
    const fb::RunResult& cal = r.results[0];
    CHECK(q.host_ms_per_step ==
          Approx(cal.host_issue_ms[0] - cal.hook_forward_ms[0] - cal.hook_backward_ms[0]));
    CHECK(q.source.find("issue time less hooks of the calibration run") != std::string::npos);
  }
  SECTION("without the one-unit plan: the rates from the per-layer plan, the full rate beside compute") {
    const Runs part = synthesise(o, [&] {
      MachineProfile u = t;
      u.copy_rate_beside_compute = 1;
      return u;
    }(), {{"layer", 0}, {"leaf", 0}, {"layer", 1}});
    const MachineProfile q = fb::measure_profile(o, 1, part.grans, part.results, "test");
    CHECK(q.h2d_gbps == Approx(t.h2d_gbps).epsilon(1e-6));
    CHECK(q.copy_rate_beside_compute == 1);
  }
  SECTION("copies that hide entirely show no rate: the defaults stay, and the source says so") {
    MachineProfile fast = t;
    fast.h2d_gbps = fast.d2h_gbps = 1e6;
    const Runs hidden = synthesise(o, fast, {{"layer", 0}, {"leaf", 0}, {"layer", 1}});
    // Measured faster than any rate can explain.
    std::vector<fb::RunResult> res = hidden.results;
    res[2].fwd_bwd_ms = {res[0].fwd_bwd_ms[0] * 0.5};
    const MachineProfile q = fb::measure_profile(o, 1, hidden.grans, res, "test");
    CHECK(q.h2d_gbps == MachineProfile::defaults().h2d_gbps);
    CHECK(q.source.find("copy rates default") != std::string::npos);
  }
}

TEST_CASE("bench profile: one CPU rank writes a profile that loads", "[advisor][profile]") {
  // One rank's timed communicator still counts an offloaded unit's reduction (bytes and time),
  // but has no peer: the collective rates must stay the defaults, not (W - 1) x rate = 0, which
  // flatshard-explain refuses ("'all_gather_gbps' must be > 0").
  fb::BenchOptions o = options();
  o.device = fb::DeviceKind::kCpu;
  o.sharding.mixed_precision.param_dtype = at::kFloat;
  // One unit count (no per-unit fit: cpu fits it from step times, which these synthetic runs,
  // timed as a GPU would, do not model) and a CPU's compute rate, so the default host cost
  // per unit leaves compute to calibrate from.
  MachineProfile t = truth(4);
  t.compute_tflops = 0.05;
  Runs r = synthesise(o, t, {{"layer", 0}, {"layer", 1}});
  for (auto& run : r.results) {
    run.exposed_comm_share = 0.1;
    run.per_step.bytes = 1 << 20;
  }
  const MachineProfile p = fb::measure_profile(o, 1, r.grans, r.results, "test");
  CAPTURE(p.to_json());
  CHECK(p.all_gather_gbps == MachineProfile::defaults().all_gather_gbps);
  CHECK(p.source.find("collectives: defaults") != std::string::npos);
  CHECK_NOTHROW(parse_profile(p.to_json(), "the written profile"));
}

TEST_CASE("bench profile: nothing sharded to calibrate from is an error", "[advisor][profile]") {
  const fb::BenchOptions o = options();
  const Runs r = synthesise(o, truth(4), {{"layer", 0}});
  std::vector<fb::RunResult> res = r.results;
  res[0].step_ms.clear();  // the one sharded run measured nothing
  CHECK(fb::calibration_run(r.grans, res) == -1);
  try {
    fb::measure_profile(o, 1, r.grans, res, "test");
    FAIL("no error");
  } catch (const c10::Error& e) {
    CHECK(std::string(e.what()).find("needs at least one sharded run") != std::string::npos);
  }
}
