// flatshard/benchmarks/bench_profile.h — flatshard-bench --write-profile: the machine profile
// (planner/machine_profile.h) these runs measure, for flatshard-explain --profile and the advisor.
//
// Contract — what is measured, and from which run (everything else keeps its stated default,
// and the profile's "source" lists both):
// - The calibration run (calibration_run()): "layer" (else a layer run without offload, else
//   any layer run, else the first sharded run). Its plan is explained and costed
//   (planner/cost_model.h) with the profile so far.
// - memory_gbps: optimizer_bytes_per_param x trainable master elements per rank / the median
//   optimizer time of the calibration run (the AdamW pass is a pure per-parameter pass).
// - compute_tflops: the calibration run's FLOPs (the cost model's, recompute included) / (its
//   median fwd+bwd time - the predicted parameter passes and exposed communication).
// - Host time per unit, cuda: the host time inside flatshard's hooks (RunResult::hook_*_ms),
//   forward and backward each a least-squares slope against the runs' unit counts (fewer than
//   two distinct counts: the defaults).
// - Host time per step, cuda: from `host_probe`, the calibration plan run again on sequences of
//   kHostProbeSeq tokens (RunConfig::input_seq), where the device finishes each kernel before
//   the host issues the next: its issue time less its hooks' time. Not the full-length runs'
//   issue time: once more kernels are queued than the launch queue holds, the host waits for
//   the device inside the launches, and the issue time follows the device time instead of the
//   host's work (issue 20, LLaMA 1B at 4 seq: 78.7 ms issued for 125.6 ms on the device, and
//   1 seq predicted host-bound by 14-79%). Without a probe: the calibration run's issue time
//   less its hooks.
// - Offload, when a run is the calibration plan at offload level 1 (label "<cal>+offload1"):
//   cpu_optimizer_params_per_s from the optimizer time (less the predicted device optimizer of
//   units not offloaded) of every "+offload1" run, their median rate (the host's AdamW varies by
//   tens of percent from run to run). h2d_gbps = d2h_gbps: scaled (bisection on the cost model, copies in
//   the gather and reduction pipeline) until the predicted forward + backward of
//   "model+offload1" equals the measured one — one unit, whose copies overlap no compute — and
//   then copy_rate_beside_compute from "<cal>+offload1" (bisection: the prediction falls as it
//   rises; 1 when the full rate is already too slow). Without the one-unit run: the rates from
//   "<cal>+offload1", copy_rate_beside_compute 1. Copies the model hides entirely at every rate
//   leave the defaults (the source says so).
// - cpu: ranks are threads and collectives synchronous, so host and compute do not overlap:
//   host_overlap_norm 1 (a sum), host_ms_per_step 0, the per-unit cost the slope of the median
//   step time against units, split 40/60, compute from the calibration run's fwd+bwd time minus
//   its units' share; collective_staging 1 (the threads backend's staging copies); comm_overlap
//   0 and, from the timed communicator (exposed share x step time, bytes sent), a
//   bandwidth-only collective model (latency 0). No probe.
// - Not measured (defaults kept): collective latency and bandwidth on cuda (run
//   flatshard-collectives-bench and edit the file), activation_scale (1: the closed forms),
//   allocator_slack (0); the offload terms when no offload-1 calibration run exists.
// Throws c10::Error when no sharded run exists (nothing to calibrate from).
#pragma once

#include <string>
#include <vector>

#include "benchmarks/bench_granularity.h"
#include "benchmarks/bench_options.h"
#include "benchmarks/bench_run.h"
#include "planner/machine_profile.h"

namespace flatshard {
namespace bench {

// Tokens per sequence of the host-cost probe.
constexpr int64_t kHostProbeSeq = 64;

// Index of the calibration run in `results` (see above), -1 when no sharded run exists.
int calibration_run(const std::vector<Granularity>& granularities,
                    const std::vector<RunResult>& results);

// `host_probe`: the calibration plan on kHostProbeSeq-token sequences (cuda), or null.
MachineProfile measure_profile(const BenchOptions& o, int world,
                               const std::vector<Granularity>& granularities,
                               const std::vector<RunResult>& results,
                               const std::string& device_description,
                               const RunResult* host_probe = nullptr);

}  // namespace bench
}  // namespace flatshard
