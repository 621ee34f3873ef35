// flatshard/benchmarks/bench_cuda.h — the CUDA side of flatshard-bench: one rank per process
// and GPU, NCCL communicator, device-synchronised timing and caching-allocator memory stats.
//
// Contract
// - cuda_unavailable_reason() is "" when this build can run --device cuda, else why not (no
//   CUDA in LibTorch, or the NCCL backend header collectives/nccl_communicator.h missing from
//   the tree this was built from). cuda_device_count() is 0 then.
// - open_cuda_rank() is collective over the launched processes: the NCCL communicator from the
//   launcher's environment (NcclCommunicator::from_env: device cuda:LOCAL_RANK made current)
//   and the device hooks: synchronize = device synchronize; memory = the CUDA caching
//   allocator's allocated bytes (current, peak, reset_peak) of that device.
//   close() shuts the communicator down collectively; call it on every rank before exiting.
// - run_on_cuda() runs one granularity on this rank. `local` runs on rank 0 only (the others
//   wait at a barrier). Peak memory is this process's device peak minus its live bytes at the
//   start of the run. Returns this rank's result (rank 0's is the one reported).
#pragma once

#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "benchmarks/bench_run.h"
#include "collectives/communicator.h"

namespace flatshard {
namespace bench {

std::string cuda_unavailable_reason();
int cuda_device_count();
// "NVIDIA H200" for device `index` ("" without CUDA).
std::string cuda_device_name(int index);
// Total memory of device `index` in bytes; nullopt without CUDA or when the query fails.
std::optional<int64_t> cuda_device_memory(int index);

struct CudaRank {
  std::shared_ptr<Communicator> comm;
  DeviceHooks hooks;
  std::function<void()> close;
};

CudaRank open_cuda_rank(int local_rank);

RunResult run_on_cuda(const RunConfig& config, const Granularity& granularity,
                      Communicator& comm, const DeviceHooks& hooks, const ProgressFn& progress);

}  // namespace bench
}  // namespace flatshard
