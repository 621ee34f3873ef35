// flatshard/profiling/kernel_profile.h — where a step's device time goes, kernel by kernel.
//
// flatshard-bench --kernel-profile records a few extra steps after the measured ones with the
// PyTorch profiler (Kineto over CUPTI: every kernel, memcpy and memset on every stream, with
// device timestamps) and summarises them per step: the device's busy time, how much of it is
// communication (NCCL kernels) and how much of that overlaps compute, and the kernel time by
// category and by kernel name. Comparing a sharded row with the local floor row names the
// kernels a sharded step adds and the ones that run slower beside communication.
//
// Contract
// - summarize_kernels() is pure: records in, per-step figures out (durations divided by
//   `steps`). Unions are over all streams; `overlap_ms` is the time at least one NCCL kernel
//   and at least one other activity run together.
// - kernel_category() maps a kernel name to one of: nccl, attention, gemm, optimizer, norm/reduce,
//   elementwise, memcpy/memset, other (first match in that order, case-insensitive keywords).
// - start_kernel_profile() / stop_kernel_profile() wrap the PyTorch profiler (CUDA activity
//   only); stop returns the device activities recorded since start. One profile at a time per
//   process; both throw c10::Error when the profiler is unavailable or misused.
#pragma once

#include <cstdint>
#include <cstddef>
#include <string>
#include <vector>

namespace flatshard {
namespace profiling {

struct KernelRecord {
  std::string name;
  int64_t stream = 0;
  uint64_t start_ns = 0, end_ns = 0;
};

struct KernelGroup {
  std::string name;   // category or kernel name
  double count = 0;   // launches per step
  double ms = 0;      // summed duration per step
};

struct KernelProfile {
  int steps = 0;
  double span_ms = 0;     // first start to last end, per step
  double busy_ms = 0;     // union of all device activity, per step
  double compute_ms = 0;  // union of non-NCCL activity
  double comm_ms = 0;     // union of NCCL kernels
  double overlap_ms = 0;  // NCCL and other activity at the same time
  std::vector<KernelGroup> categories;  // by summed time, largest first
  std::vector<KernelGroup> kernels;     // kernel names, largest first, at most top_n
  // Per stream: name "stream N", count = activities, ms = union of their intervals, per step;
  // busiest first.
  std::vector<KernelGroup> streams;
};

std::string kernel_category(const std::string& name);
KernelProfile summarize_kernels(const std::vector<KernelRecord>& records, int steps,
                                size_t top_n = SIZE_MAX);

void start_kernel_profile();
std::vector<KernelRecord> stop_kernel_profile();

}  // namespace profiling
}  // namespace flatshard
