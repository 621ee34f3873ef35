// flatshard/cli/cuda_rank.h — the CUDA side of a tool's rank (flatshard-bench, flatshard-train):
// one rank per process and GPU, its NCCL communicator, device synchronisation, timing marks and
// caching-allocator memory stats; and DeviceHooks, the device side of any rank (CPU included).
//
// Contract
// - cuda_unavailable_reason() is "" when this build can run --device cuda, else why not (no
//   CUDA in LibTorch, or the NCCL backend header collectives/nccl_communicator.h missing from
//   the tree this was built from). cuda_device_count() is 0 then.
// - open_cuda_rank() is collective over the launched processes: the NCCL communicator from the
//   launcher's environment (NcclCommunicator::from_env(program): device cuda:LOCAL_RANK made
//   current) and the device hooks: synchronize = device synchronize; memory = the CUDA caching
//   allocator's allocated bytes (current, peak, reset_peak) of that device; marks = CUDA events
//   on the current stream. close() shuts the communicator down collectively; call it on every
//   rank before exiting. Without CUDA it throws c10::Error with cuda_unavailable_reason().
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "collectives/communicator.h"

namespace flatshard {
namespace cli {

// The device side of a rank.
struct DeviceHooks {
  c10::Device device{c10::kCPU};
  std::function<void()> synchronize = [] {};  // waits for queued device work
  std::function<int64_t()> memory_current;    // live bytes; null: memory not measured
  std::function<int64_t()> memory_peak;       // peak live bytes since the last reset
  std::function<void()> memory_reset_peak;
  // Phase marks on the device's work queue: mark(i), i in [0, kMarks), notes when the device
  // reaches this point of the queued work; after synchronize(), elapsed_ms(a, b) is the time
  // from mark a to mark b. Null: host clock (right for CPU, where work is synchronous).
  static constexpr int kMarks = 3;
  std::function<void(int)> mark;
  std::function<double(int, int)> elapsed_ms;
  // Warn at every synchronizing device call while on (cuda: c10's sync debug mode); null: none.
  std::function<void(bool)> sync_debug;
};

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

// `program`: the tool's name, the store key prefix of its NCCL unique ids.
CudaRank open_cuda_rank(int local_rank, const std::string& program);

}  // namespace cli
}  // namespace flatshard
