// flatshard/benchmarks/bench_profile.cpp — see bench_profile.h for what is measured.
#include "benchmarks/bench_profile.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <ctime>
#include <set>
#include <sstream>

#include "planner/cost_model.h"
#include "planner/explain.h"
#include "fsdp/meta_init.h"

namespace flatshard {
namespace bench {

namespace {

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

// Least squares y = a + b x; false with fewer than two distinct x.
bool fit_line(const std::vector<std::pair<double, double>>& xy, double* a, double* b) {
  std::set<double> xs;
  for (const auto& p : xy) xs.insert(p.first);
  if (xs.size() < 2) return false;
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = static_cast<double>(xy.size());
  for (const auto& [x, y] : xy) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  *b = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  *a = (sy - *b * sx) / n;
  return true;
}

}  // namespace

int calibration_run(const std::vector<Granularity>& granularities,
                    const std::vector<RunResult>& results) {
  TORCH_CHECK(granularities.size() == results.size(), "calibration_run: ", granularities.size(),
              " granularities but ", results.size(), " results");
  // "layer" itself, else a layer run without offload, else a layer run, else the first sharded.
  int cal = -1, best_rank = 4;
  for (size_t i = 0; i < results.size(); ++i) {
    if (granularities[i].local || results[i].step_ms.empty()) continue;
    const std::string& l = granularities[i].label;
    const bool layer = l.rfind("layer", 0) == 0;
    const int rank = l == "layer"                                      ? 0
                     : layer && l.find("offload") == std::string::npos ? 1
                     : layer                                           ? 2
                                                                       : 3;
    if (rank < best_rank) {
      best_rank = rank;
      cal = static_cast<int>(i);
    }
  }
  return cal;
}

namespace {

// What every step of measure_profile reads: the calibration run and its plan, explained.
struct Calibration {
  const BenchOptions& o;
  int world;
  const std::vector<Granularity>& granularities;
  const std::vector<RunResult>& results;
  std::shared_ptr<torch::nn::Module> planning;  // the model on meta, for explain
  const Granularity& g;                         // the calibration run's granularity
  const RunResult& r;                           // and its result
  Explanation e;
  TransformerShape shape;
  Workload w;
  bool cpu;

  Explanation explained(size_t i) const {
    return explain(*planning, granularities[i].plan, MeshShape(world, 1), o.sharding);
  }
  // The index of the run labelled `label` that has steps, or -1.
  int find_run(const std::string& label) const {
    for (size_t i = 0; i < results.size(); ++i)
      if (granularities[i].label == label && !results[i].step_ms.empty())
        return static_cast<int>(i);
    return -1;
  }
};

// Per-unit host cost (and, on cuda, the fixed part). cuda: the host time inside flatshard's
// hooks (RunResult::hook_*_ms), forward and backward each fitted over the runs' unit counts.
// Not the steps' issue time: in a device-bound run that grows with the host's waits for the
// device (a full launch queue), not with its work — issue 20's GPU sweep (1B GPT, 4 seq)
// fitted 568 us per unit from it where the hooks took about 110. cpu: host and compute are
// serial, so the step time itself. Returns how (for the profile's source line).
std::string fit_host_per_unit(const Calibration& c, MachineProfile& p) {
  std::string how = "host per unit: default (one unit count only)";
  auto fit = [&](std::vector<double> RunResult::*series) {
    std::vector<std::pair<double, double>> points;
    for (const RunResult& run : c.results) {
      const std::vector<double>& y = run.*series;
      if (!run.step_ms.empty() && !y.empty())
        points.emplace_back(static_cast<double>(run.units), median(y));
    }
    double a = 0, b = 0;
    const bool ok = fit_line(points, &a, &b) && b > 0;
    if (ok) how = "host per unit fitted over " + std::to_string(points.size()) + " runs";
    return ok ? b * 1e3 : -1.0;  // us per unit
  };
  if (c.cpu) {
    const double us = fit(&RunResult::step_ms);
    if (us > 0) {
      p.host_us_per_unit_forward = 0.4 * us;
      p.host_us_per_unit_backward = 0.6 * us;
    }
    return how;
  }
  const double f = fit(&RunResult::hook_forward_ms);
  const double bw = fit(&RunResult::hook_backward_ms);
  if (f > 0 && bw > 0) {
    p.host_us_per_unit_forward = f;
    p.host_us_per_unit_backward = bw;
    return how + " (time in flatshard's hooks)";
  }
  return "host per unit: default (fewer than two unit counts with hook times)";
}

// cuda only: the model's own host work per step, issue time less the hooks' (bench_profile.h:
// from the short-sequence probe when there is one; the full-length run's issue time can be a
// wait for the device). Returns how.
std::string fit_host_per_step(const Calibration& c, const RunResult* host_probe,
                              MachineProfile& p) {
  const double per_unit_ms = (p.host_us_per_unit_forward + p.host_us_per_unit_backward) / 1e3;
  const RunResult& h = host_probe && !host_probe->host_issue_ms.empty() ? *host_probe : c.r;
  const double hooks = h.hook_forward_ms.empty()
                           ? static_cast<double>(c.e.units.size()) * per_unit_ms
                           : median(h.hook_forward_ms) + median(h.hook_backward_ms);
  p.host_ms_per_step = std::max(0.0, median(h.host_issue_ms) - hooks);
  p.host_reference_layers = static_cast<double>(c.shape.n_layers);
  std::ostringstream how;
  how << "host_ms_per_step ("
      << (&h == host_probe ? "issue time less hooks at " + std::to_string(kHostProbeSeq) +
                                 " tokens per sequence: issued " +
                                 std::to_string(median(h.host_issue_ms)) + " ms, step " +
                                 std::to_string(median(h.step_ms)) + " ms"
                           : std::string("issue time less hooks of the calibration run"))
      << ")";
  return how.str();
}

// cpu: collectives are timed (TimedCommunicator): a bandwidth-only model through the bytes
// the calibration run sent (latency 0: the threads backend's cost is copying). One rank has
// no peer to send to (an offloaded unit's reduction still counts its bytes and time): the
// bus factors below are 0 there, a rate of 0 that no profile may hold; the defaults stay.
std::string fit_collectives(const Calibration& c, MachineProfile& p) {
  const RunResult& r = c.r;
  const int world = c.world;
  if (!(c.cpu && world > 1 && r.exposed_comm_share && *r.exposed_comm_share > 0 &&
        r.per_step.bytes > 0))
    return "collectives: defaults";
  const double comm_ms = *r.exposed_comm_share * median(r.step_ms);
  const double gbps = static_cast<double>(r.per_step.bytes) / (comm_ms * 1e6);
  p.all_gather_latency_us = p.reduce_scatter_latency_us = p.all_reduce_latency_us = 0;
  // The cost model's bus factors: all-gather (W-1) x shard bytes, reduce-scatter (W-1)/W x
  // bytes, all-reduce 2 (W-1)/W x bytes; the measured rate is of bytes sent, so each gets
  // the rate scaled by its factor (one cost per byte sent, whatever the collective).
  p.all_gather_gbps = gbps * (world - 1);
  p.reduce_scatter_gbps = gbps * (world - 1) / world;
  p.all_reduce_gbps = gbps * 2 * (world - 1) / world;
  return "collectives: bandwidth from the timed communicator";
}

// Memory passes from the optimizer step; compute from what is left of the measured forward +
// backward (cpu: of the step, less the host share of its units) after the predicted passes and
// exposed communication.
void fit_memory_and_compute(const Calibration& c, MachineProfile& p) {
  const double opt_ms = median(c.r.optimizer_ms);
  int64_t trainable = 0;
  for (const auto& u : c.e.units)
    trainable += (u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes) / 4;
  if (opt_ms > 0 && trainable > 0)
    p.memory_gbps = p.optimizer_bytes_per_param * static_cast<double>(trainable) / (opt_ms * 1e6);

  const double per_unit_ms = (p.host_us_per_unit_forward + p.host_us_per_unit_backward) / 1e3;
  const CostPrediction pred = predict_cost(c.e, c.shape, c.w, p);
  const double measured =
      median(c.r.fwd_bwd_ms) - (c.cpu ? static_cast<double>(c.e.units.size()) * per_unit_ms : 0.0);
  const double compute_ms = measured - pred.passes_ms - pred.exposed_comm_ms;
  TORCH_CHECK(compute_ms > 0.05 * measured && pred.compute_ms > 0, "--write-profile: run '",
              c.g.label, "' leaves no compute time to calibrate from ", "(measured ", measured,
              " ms, predicted passes ", pred.passes_ms, " ms and exposed communication ",
              pred.exposed_comm_ms, " ms)");
  p.compute_tflops = p.compute_tflops * pred.compute_ms / compute_ms;
}

// The CPU optimizer: its measured time less the device optimizer of units not offloaded, as a
// rate over the parameters it steps, the median over every offload-1 run (each steps the whole
// model on the host; the host's rate varies by 20-60% between runs: issue 20, 1x H200, LLaMA
// 1B at 4 seq, 219-359 ms in one call). Sets q.cpu_optimizer_params_per_s; returns how.
std::string fit_cpu_optimizer(const Calibration& c, size_t off_cal, MachineProfile& q) {
  std::vector<double> rates;
  double cpu_ms = 0, params = 0;
  for (size_t i = 0; i < c.results.size(); ++i) {
    if (c.results[i].step_ms.empty() || offload_of(c.granularities[i]) != 1) continue;
    const CostPrediction pred = predict_cost(c.explained(i), c.shape, c.w, q);
    const double ms = median(c.results[i].optimizer_ms) - pred.optimizer_ms;
    const double n = pred.cpu_optimizer_ms * q.cpu_optimizer_params_per_s / 1e3;
    if (ms > 0 && n > 0) rates.push_back(n / ms * 1e3);
    if (i == off_cal) {  // the calibration plan's, for the source line
      cpu_ms = ms;
      params = n;
    }
  }
  if (!rates.empty()) q.cpu_optimizer_params_per_s = median(rates);
  std::ostringstream how;
  how << "offload: cpu_optimizer_params_per_s the median of " << rates.size()
      << " offload-1 runs ('" << c.results[off_cal].granularity << "': " << cpu_ms << " ms for "
      << params << " parameters)";
  return how.str();
}

// Copy rates: the prediction falls as they rise; bisect the common scale in log space until it
// meets the measurement of the one-unit plan (`off_one`, -1: the calibration plan's own), then
// copy_rate_beside_compute in (0, 1] to the calibration plan's (`off_cal`). Copies that hide
// entirely show no rate: defaults then. `p` holds the defaults the scale applies to.
std::string fit_copy_rates(const Calibration& c, int off_cal, int off_one, const MachineProfile& p,
                           MachineProfile& q) {
  // The cost model's forward + backward of plan `x` at copy-rate scale `scale`.
  auto fwd_bwd = [&](const Explanation& x, double scale, double beside) {
    MachineProfile t = q;
    t.h2d_gbps = p.h2d_gbps * scale;
    t.d2h_gbps = p.d2h_gbps * scale;
    t.copy_rate_beside_compute = beside;
    const CostPrediction c2 = predict_cost(x, c.shape, c.w, t);
    return c2.gpu_ms - c2.optimizer_ms - c2.cpu_optimizer_ms;
  };
  const Explanation eo = c.explained(static_cast<size_t>(off_cal));
  const RunResult& ro = c.results[static_cast<size_t>(off_cal)];
  const Explanation rate_plan = off_one >= 0 ? c.explained(static_cast<size_t>(off_one)) : eo;
  const RunResult& rate_run = off_one >= 0 ? c.results[static_cast<size_t>(off_one)] : ro;
  const double target = median(rate_run.fwd_bwd_ms);
  std::ostringstream how;
  double lo = 1e-3, hi = 1e3;
  if (!(fwd_bwd(rate_plan, hi, 1) < target && fwd_bwd(rate_plan, lo, 1) > target)) {
    how << "; copy rates default ('" << rate_run.granularity << "' fwd+bwd " << target
        << " ms, predicted " << fwd_bwd(rate_plan, hi, 1) << " to " << fwd_bwd(rate_plan, lo, 1)
        << " ms over the rate range)";
    return how.str();
  }
  for (int it = 0; it < 60; ++it) {
    const double mid = std::sqrt(lo * hi);
    (fwd_bwd(rate_plan, mid, 1) > target ? lo : hi) = mid;
  }
  q.h2d_gbps = p.h2d_gbps * hi;
  q.d2h_gbps = p.d2h_gbps * hi;
  how << ", h2d_gbps and d2h_gbps from '" << rate_run.granularity << "' (fwd+bwd " << target
      << " ms)";
  if (off_one < 0) return how.str();
  // copy_rate_beside_compute: the prediction falls as it rises; bisect it in (0, 1] to the
  // measurement. Faster than the full rate predicts: 1.
  const double measured = median(ro.fwd_bwd_ms);
  double b_lo = 1e-3, b_hi = 1;
  if (fwd_bwd(eo, hi, b_hi) < measured) {
    if (fwd_bwd(eo, hi, b_lo) <= measured) {
      b_hi = b_lo;
    } else {
      for (int it = 0; it < 60; ++it) {
        const double mid = 0.5 * (b_lo + b_hi);
        (fwd_bwd(eo, hi, mid) > measured ? b_lo : b_hi) = mid;
      }
    }
  }
  q.copy_rate_beside_compute = b_hi;
  how << ", copy_rate_beside_compute from '" << ro.granularity << "' (fwd+bwd " << measured
      << " ms)";
  return how.str();
}

// Offload (bench_profile.h): the CPU optimizer rate and the copy rates from the calibration
// plan at level 1; with the one-unit plan at level 1 beside it (its copies overlap nothing),
// the rates from that one and copy_rate_beside_compute from the calibration plan. Returns how.
std::string fit_offload(const Calibration& c, MachineProfile& p) {
  const int off_cal = c.find_run(c.g.label + "+offload1");
  if (off_cal < 0) return "offload rates: defaults (no offload-1 run of the calibration plan)";
  const int off_one = c.g.label == "model" ? -1 : c.find_run("model+offload1");
  MachineProfile q = p;
  std::string how = fit_cpu_optimizer(c, static_cast<size_t>(off_cal), q);
  how += fit_copy_rates(c, off_cal, off_one, p, q);
  p = q;
  return how;
}

}  // namespace

MachineProfile measure_profile(const BenchOptions& o, int world,
                               const std::vector<Granularity>& granularities,
                               const std::vector<RunResult>& results,
                               const std::string& device_description,
                               const RunResult* host_probe) {
  const int cal = calibration_run(granularities, results);
  TORCH_CHECK(cal >= 0,
              "--write-profile needs at least one sharded run (a granularity other "
              "than local) to calibrate from");
  const bool cpu = o.device == DeviceKind::kCpu;
  MachineProfile p = MachineProfile::defaults();
  if (cpu) {
    p.collective_staging = 1;
    p.comm_overlap = 0;
    p.host_overlap_norm = 1;
    p.host_ms_per_step = 0;
  }
  std::shared_ptr<torch::nn::Module> planning;
  {
    MetaInit meta;
    planning = o.model.build(o.seed);
  }
  const Granularity& g = granularities[static_cast<size_t>(cal)];
  const RunResult& r = results[static_cast<size_t>(cal)];
  const Calibration c{o,
                      world,
                      granularities,
                      results,
                      planning,
                      g,
                      r,
                      explain(*planning, g.plan, MeshShape(world, 1), o.sharding),
                      o.model.transformer_shape(),
                      Workload{o.batch, o.model.seq_len()},
                      cpu};

  const std::string host_how = fit_host_per_unit(c, p);
  const std::string step_how = cpu ? "" : fit_host_per_step(c, host_probe, p);
  const std::string comm_how = fit_collectives(c, p);
  fit_memory_and_compute(c, p);
  const std::string offload_how = fit_offload(c, p);

  std::ostringstream src;
  src << "flatshard-bench " << utc_now() << ", " << device_description << ", "
      << o.model.family().name() << " " << o.preset << " batch " << o.batch << " seq "
      << o.model.seq_len() << ", calibrated on '" << g.label
      << "'; measured: compute_tflops, memory_gbps (optimizer step), " << host_how
      << (cpu ? " (cpu: host and compute serial)" : ", " + step_how) << "; " << comm_how << "; "
      << offload_how << "; defaults: activation_scale, allocator_slack";
  p.source = src.str();
  return p;
}

}  // namespace bench
}  // namespace flatshard
