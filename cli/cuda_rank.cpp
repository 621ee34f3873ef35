// flatshard/cli/cuda_rank.cpp — see cuda_rank.h for the contract.
#include "cli/cuda_rank.h"

#include <ATen/ATen.h>

#include <c10/util/Exception.h>

#include <array>
#include <memory>

#if FLATSHARD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

// The NCCL backend is compiled only with the CUDA path (FLATSHARD_WITH_CUDA); without it the
// tools still build and --device cuda reports why it cannot run. This is the one switch.
#if FLATSHARD_WITH_CUDA && __has_include("collectives/nccl_communicator.h")
#define FLATSHARD_CLI_HAS_NCCL 1
#include "collectives/nccl_communicator.h"
#else
#define FLATSHARD_CLI_HAS_NCCL 0
#endif

namespace flatshard {
namespace cli {

std::string cuda_unavailable_reason() {
#if !FLATSHARD_WITH_CUDA
  return "--device cuda: this flatshard build has no CUDA (LibTorch without CUDA, or "
         "-DFLATSHARD_WITH_CUDA=OFF)";
#elif !FLATSHARD_CLI_HAS_NCCL
  return "--device cuda: this build has no NCCL backend yet (collectives/nccl_communicator.h "
         "is missing from the source tree); rebuild once it is merged";
#else
  return "";
#endif
}

int cuda_device_count() {
#if FLATSHARD_WITH_CUDA
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;
#endif
}

std::string cuda_device_name(int index) {
#if FLATSHARD_WITH_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) == cudaSuccess) return prop.name;
  (void)cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
#endif
  return "";
}

std::optional<int64_t> cuda_device_memory(int index) {
#if FLATSHARD_WITH_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) == cudaSuccess)
    return static_cast<int64_t>(prop.totalGlobalMem);
  (void)cudaGetLastError();
#else
  (void)index;
#endif
  return std::nullopt;
}

// --- the wiring point of the NCCL backend ------------------------------------------------------
CudaRank open_cuda_rank(int local_rank, const std::string& program) {
#if FLATSHARD_CLI_HAS_NCCL
  std::shared_ptr<NcclCommunicator> nccl = NcclCommunicator::from_env(program);
  CudaRank r;
  r.comm = nccl;  // shared with close(), which needs the concrete type for shutdown()
  r.close = [nccl] { nccl->shutdown(); };
  const auto index = static_cast<c10::DeviceIndex>(local_rank);
  r.hooks.device = c10::Device(c10::kCUDA, index);
  // The caching allocator initialises on its first allocation; its stats calls assert before.
  (void)at::empty({1}, at::TensorOptions().device(r.hooks.device));
  r.hooks.synchronize = [] { c10::cuda::device_synchronize(); };
  using c10::CachingDeviceAllocator::StatType;
  auto stat = [index] {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index)
        .allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)];
  };
  // Phase marks: timing events on the current (compute) stream. Work on flatshard's side
  // streams is included where the compute stream waits for it (the end of backward does).
  struct Marks {
    std::array<cudaEvent_t, DeviceHooks::kMarks> ev{};
    Marks() {
      for (auto& e : ev) C10_CUDA_CHECK(cudaEventCreate(&e));
    }
    ~Marks() {
      for (auto& e : ev) (void)cudaEventDestroy(e);
    }
  };
  auto marks = std::make_shared<Marks>();
  r.hooks.mark = [marks, index](int i) {
    C10_CUDA_CHECK(cudaEventRecord(marks->ev.at(static_cast<size_t>(i)),
                                   c10::cuda::getCurrentCUDAStream(index).stream()));
  };
  r.hooks.elapsed_ms = [marks](int a, int b) {
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, marks->ev.at(static_cast<size_t>(a)),
                                        marks->ev.at(static_cast<size_t>(b))));
    return static_cast<double>(ms);
  };
  r.hooks.sync_debug = [](bool on) {
    c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_WARN
                                                      : c10::cuda::SyncDebugMode::L_DISABLED);
  };
  r.hooks.memory_current = [stat] { return stat().current; };
  r.hooks.memory_peak = [stat] { return stat().peak; };
  r.hooks.memory_reset_peak = [index] {
    c10::cuda::CUDACachingAllocator::resetPeakStats(index);
  };
  return r;
#else
  (void)program;
  TORCH_CHECK(false, cuda_unavailable_reason(), " (local rank ", local_rank, ")");
#endif
}

}  // namespace cli
}  // namespace flatshard
