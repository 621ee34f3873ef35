// flatshard/benchmarks/bench_cuda.h — the CUDA side of flatshard-bench: one granularity's run on
// this process's GPU. The rank itself (NCCL communicator, device hooks, device queries) is
// cli/cuda_rank.h's, shared with flatshard-train.
//
// Contract
// - run_on_cuda() runs one granularity on this rank. `local` runs on rank 0 only (the others
//   wait at a barrier). Peak memory is this process's device peak minus its live bytes at the
//   start of the run. Returns this rank's result (rank 0's is the one reported).
#pragma once

#include "benchmarks/bench_run.h"
#include "cli/cuda_rank.h"
#include "collectives/communicator.h"

namespace flatshard {
namespace bench {

using cli::cuda_device_count;
using cli::cuda_device_memory;
using cli::cuda_device_name;
using cli::cuda_unavailable_reason;
using cli::CudaRank;
using cli::open_cuda_rank;

RunResult run_on_cuda(const RunConfig& config, const Granularity& granularity,
                      Communicator& comm, const DeviceHooks& hooks, const ProgressFn& progress);

}  // namespace bench
}  // namespace flatshard
