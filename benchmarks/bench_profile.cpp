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
  const Explanation e = explain(*planning, g.plan, world, o.sharding);
  const TransformerShape shape = o.model.transformer_shape();
  const Workload w{o.batch, o.model.seq_len()};

  // Per-unit host cost (and, on cuda, the fixed part). cuda: the host time inside flatshard's
  // hooks (RunResult::hook_*_ms), forward and backward each fitted over the runs' unit counts.
  // Not the steps' issue time: in a device-bound run that grows with the host's waits for the
  // device (a full launch queue), not with its work — issue 20's GPU sweep (1B GPT, 4 seq)
  // fitted 568 us per unit from it where the hooks took about 110. cpu: host and compute are
  // serial, so the step time itself.
  double a = 0, b = 0;
  std::string host_how = "host per unit: default (one unit count only)";
  auto fit = [&](std::vector<double> RunResult::*series) {
    std::vector<std::pair<double, double>> points;
    for (const RunResult& run : results) {
      const std::vector<double>& y = run.*series;
      if (!run.step_ms.empty() && !y.empty())
        points.emplace_back(static_cast<double>(run.units), median(y));
    }
    const bool ok = fit_line(points, &a, &b) && b > 0;
    if (ok) host_how = "host per unit fitted over " + std::to_string(points.size()) + " runs";
    return ok ? b * 1e3 : -1.0;  // us per unit
  };
  if (cpu) {
    const double us = fit(&RunResult::step_ms);
    if (us > 0) {
      p.host_us_per_unit_forward = 0.4 * us;
      p.host_us_per_unit_backward = 0.6 * us;
    }
  } else {
    const double f = fit(&RunResult::hook_forward_ms);
    const double bw = fit(&RunResult::hook_backward_ms);
    if (f > 0 && bw > 0) {
      p.host_us_per_unit_forward = f;
      p.host_us_per_unit_backward = bw;
      host_how += " (time in flatshard's hooks)";
    } else {
      host_how = "host per unit: default (fewer than two unit counts with hook times)";
    }
  }
  const double per_unit_ms = (p.host_us_per_unit_forward + p.host_us_per_unit_backward) / 1e3;
  std::string step_how;
  if (!cpu) {
    // The model's own host work per step: issue time less the hooks' (bench_profile.h: from
    // the short-sequence probe when there is one; the full-length run's issue time can be a
    // wait for the device).
    const RunResult& h = host_probe && !host_probe->host_issue_ms.empty() ? *host_probe : r;
    const double hooks = h.hook_forward_ms.empty()
                             ? static_cast<double>(e.units.size()) * per_unit_ms
                             : median(h.hook_forward_ms) + median(h.hook_backward_ms);
    p.host_ms_per_step = std::max(0.0, median(h.host_issue_ms) - hooks);
    p.host_reference_layers = static_cast<double>(shape.n_layers);
    std::ostringstream how;
    how << "host_ms_per_step ("
        << (&h == host_probe ? "issue time less hooks at " + std::to_string(kHostProbeSeq) +
                                   " tokens per sequence: issued " +
                                   std::to_string(median(h.host_issue_ms)) + " ms, step " +
                                   std::to_string(median(h.step_ms)) + " ms"
                             : std::string("issue time less hooks of the calibration run"))
        << ")";
    step_how = how.str();
  }

  // cpu: collectives are timed (TimedCommunicator): a bandwidth-only model through the bytes
  // the calibration run sent (latency 0: the threads backend's cost is copying). One rank has
  // no peer to send to (an offloaded unit's reduction still counts its bytes and time): the
  // bus factors below are 0 there, a rate of 0 that no profile may hold; the defaults stay.
  std::string comm_how = "collectives: defaults";
  if (cpu && world > 1 && r.exposed_comm_share && *r.exposed_comm_share > 0 &&
      r.per_step.bytes > 0) {
    const double comm_ms = *r.exposed_comm_share * median(r.step_ms);
    const double gbps = static_cast<double>(r.per_step.bytes) / (comm_ms * 1e6);
    p.all_gather_latency_us = p.reduce_scatter_latency_us = p.all_reduce_latency_us = 0;
    // The cost model's bus factors: all-gather (W-1) x shard bytes, reduce-scatter (W-1)/W x
    // bytes, all-reduce 2 (W-1)/W x bytes; the measured rate is of bytes sent, so each gets
    // the rate scaled by its factor (one cost per byte sent, whatever the collective).
    p.all_gather_gbps = gbps * (world - 1);
    p.reduce_scatter_gbps = gbps * (world - 1) / world;
    p.all_reduce_gbps = gbps * 2 * (world - 1) / world;
    comm_how = "collectives: bandwidth from the timed communicator";
  }

  // Memory passes from the optimizer step.
  const double opt_ms = median(r.optimizer_ms);
  int64_t trainable = 0;
  for (const auto& u : e.units)
    trainable += (u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes) / 4;
  if (opt_ms > 0 && trainable > 0)
    p.memory_gbps = p.optimizer_bytes_per_param * static_cast<double>(trainable) / (opt_ms * 1e6);

  // Compute: what is left of the measured forward + backward (cpu: of the step, less the host
  // share of its units) after the predicted passes and exposed communication.
  const CostPrediction c = predict_cost(e, shape, w, p);
  const double measured =
      median(r.fwd_bwd_ms) - (cpu ? static_cast<double>(e.units.size()) * per_unit_ms : 0.0);
  const double compute_ms = measured - c.passes_ms - c.exposed_comm_ms;
  TORCH_CHECK(compute_ms > 0.05 * measured && c.compute_ms > 0, "--write-profile: run '", g.label,
              "' leaves no compute time to calibrate from ", "(measured ", measured,
              " ms, predicted passes ", c.passes_ms, " ms and exposed communication ",
              c.exposed_comm_ms, " ms)");
  p.compute_tflops = p.compute_tflops * c.compute_ms / compute_ms;

  // Offload (bench_profile.h): the CPU optimizer rate and the copy rates from the calibration
  // plan at level 1; with the one-unit plan at level 1 beside it (its copies overlap nothing),
  // the rates from that one and copy_rate_beside_compute from the calibration plan.
  std::string offload_how = "offload rates: defaults (no offload-1 run of the calibration plan)";
  auto find_run = [&](const std::string& label) -> int {
    for (size_t i = 0; i < results.size(); ++i)
      if (granularities[i].label == label && !results[i].step_ms.empty())
        return static_cast<int>(i);
    return -1;
  };
  const int off_cal = find_run(g.label + "+offload1");
  if (off_cal >= 0) {
    const int off_one = g.label == "model" ? -1 : find_run("model+offload1");
    auto explained = [&](int i) {
      return explain(*planning, granularities[static_cast<size_t>(i)].plan, world, o.sharding);
    };
    const Explanation eo = explained(off_cal);
    const RunResult& ro = results[static_cast<size_t>(off_cal)];
    MachineProfile q = p;
    // The CPU optimizer: its measured time less the device optimizer of units not offloaded, as
    // a rate over the parameters it steps, the median over every offload-1 run (each steps the
    // whole model on the host; the host's rate varies by 20-60% between runs: issue 20, 1x H200,
    // LLaMA 1B at 4 seq, 219-359 ms in one call).
    std::vector<double> rates;
    double cpu_ms = 0, params = 0;
    for (size_t i = 0; i < results.size(); ++i) {
      if (results[i].step_ms.empty() || offload_of(granularities[i]) != 1) continue;
      const CostPrediction c = predict_cost(explained(static_cast<int>(i)), shape, w, q);
      const double ms = median(results[i].optimizer_ms) - c.optimizer_ms;
      const double n = c.cpu_optimizer_ms * q.cpu_optimizer_params_per_s / 1e3;
      if (ms > 0 && n > 0) rates.push_back(n / ms * 1e3);
      if (static_cast<int>(i) == off_cal) {  // the calibration plan's, for the source line
        cpu_ms = ms;
        params = n;
      }
    }
    if (!rates.empty()) q.cpu_optimizer_params_per_s = median(rates);
    // The cost model's forward + backward of plan `x` at copy-rate scale `scale`.
    auto fwd_bwd = [&](const Explanation& x, double scale, double beside) {
      MachineProfile t = q;
      t.h2d_gbps = p.h2d_gbps * scale;
      t.d2h_gbps = p.d2h_gbps * scale;
      t.copy_rate_beside_compute = beside;
      const CostPrediction c2 = predict_cost(x, shape, w, t);
      return c2.gpu_ms - c2.optimizer_ms - c2.cpu_optimizer_ms;
    };
    std::ostringstream how;
    how << "offload: cpu_optimizer_params_per_s the median of " << rates.size()
        << " offload-1 runs ('" << ro.granularity << "': " << cpu_ms << " ms for " << params
        << " parameters)";
    // Copy rates: the prediction falls as they rise; bisect the common scale in log space until
    // it meets the measurement. Copies that hide entirely show no rate: defaults then.
    const Explanation rate_plan = off_one >= 0 ? explained(off_one) : eo;
    const RunResult& rate_run = off_one >= 0 ? results[static_cast<size_t>(off_one)] : ro;
    const double target = median(rate_run.fwd_bwd_ms);
    double lo = 1e-3, hi = 1e3;
    if (fwd_bwd(rate_plan, hi, 1) < target && fwd_bwd(rate_plan, lo, 1) > target) {
      for (int it = 0; it < 60; ++it) {
        const double mid = std::sqrt(lo * hi);
        (fwd_bwd(rate_plan, mid, 1) > target ? lo : hi) = mid;
      }
      q.h2d_gbps = p.h2d_gbps * hi;
      q.d2h_gbps = p.d2h_gbps * hi;
      how << ", h2d_gbps and d2h_gbps from '" << rate_run.granularity << "' (fwd+bwd " << target
          << " ms)";
      // copy_rate_beside_compute: the prediction falls as it rises; bisect it in (0, 1] to the
      // measurement. Faster than the full rate predicts: 1.
      if (off_one >= 0) {
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
      }
    } else {
      how << "; copy rates default ('" << rate_run.granularity << "' fwd+bwd " << target
          << " ms, predicted " << fwd_bwd(rate_plan, hi, 1) << " to " << fwd_bwd(rate_plan, lo, 1)
          << " ms over the rate range)";
    }
    p = q;
    offload_how = how.str();
  }

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
