// flatshard/benchmarks/bench_profile.h — flatshard-bench --write-profile: the machine profile
// (fsdp/machine_profile.h) these runs measure, for flatshard-explain --profile and the advisor.
//
// Contract — what is measured, and from which run (everything else keeps its stated default,
// and the profile's "source" lists both):
// - The calibration run: "layer" (else a layer run without offload, else any layer run, else
//   the first sharded run). Its plan is explained and costed (fsdp/cost_model.h) with the profile
//   so far.
// - memory_gbps: optimizer_bytes_per_param x trainable master elements per rank / the median
//   optimizer time of the calibration run (the AdamW pass is a pure per-parameter pass).
// - compute_tflops: the calibration run's FLOPs (the cost model's, recompute included) / (its
//   median fwd+bwd time - the predicted parameter passes and exposed communication).
// - Host time, cuda: a least-squares line through (units, median host issue time) over every
//   run (local counts as 0 units): intercept -> host_ms_per_step (host_reference_layers = the
//   model's layers), slope -> host_us_per_unit_{forward,backward} split 40/60 as the defaults;
//   with fewer than two distinct unit counts the per-unit defaults stay and host_ms_per_step is
//   the calibration run's host time minus its units' share.
// - cpu: ranks are threads and collectives synchronous, so host and compute do not overlap:
//   host_overlap_norm 1 (a sum), host_ms_per_step 0, the per-unit cost the slope of the median
//   step time against units (as above), compute from the calibration run's fwd+bwd time minus
//   its units' share; collective_staging 1 (the threads backend's staging copies); comm_overlap
//   0 and, from the timed communicator (exposed share x step time, bytes sent), a
//   bandwidth-only collective model (latency 0).
// - Not measured (defaults kept): collective latency and bandwidth on cuda (run
//   flatshard-collectives-bench and edit the file), offload copy rates and the CPU optimizer,
//   activation_scale (1: the closed forms), allocator_slack (0).
// Throws c10::Error when no sharded run exists (nothing to calibrate from).
#pragma once

#include <string>
#include <vector>

#include "benchmarks/bench_granularity.h"
#include "benchmarks/bench_options.h"
#include "benchmarks/bench_run.h"
#include "fsdp/machine_profile.h"

namespace flatshard {
namespace bench {

MachineProfile measure_profile(const BenchOptions& o, int world,
                               const std::vector<Granularity>& granularities,
                               const std::vector<RunResult>& results,
                               const std::string& device_description);

}  // namespace bench
}  // namespace flatshard
