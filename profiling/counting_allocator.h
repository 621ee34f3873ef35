// flatshard/profiling/counting_allocator.h — a c10 CPU allocator that counts live bytes.
//
// Why: LibTorch has no CPU memory statistics (only the CUDA caching allocator keeps them), and
// flatshard-bench wants the peak memory of a CPU run. The CPU allocator sees every CPU storage
// ATen allocates, including resizes of flat buffers (they allocate through the storage's
// allocator).
//
// Contract
// - install() makes a counting allocator the process's CPU allocator (c10::SetCPUAllocator,
//   highest priority). It allocates with c10::alloc_cpu/free_cpu like LibTorch's default CPU
//   allocator, plus a small header holding the size, and supports the raw interface. Idempotent;
//   never uninstalled, because storages may outlive any scope. Storages allocated before
//   install() are not counted, and neither are their frees (they keep their own deleter).
// - current_bytes()/peak_bytes() are process-wide, all threads together: with ranks as threads
//   a run's peak covers every rank (divide by the world size for a per-rank average).
// - reset_peak() sets the peak to the current live bytes. Thread safe (atomics).
// - Memory ATen takes outside the allocator (oneDNN scratch, thread-local buffers) is invisible.
#pragma once

#include <cstdint>

namespace flatshard {
namespace profiling {

class CountingCpuAllocator {
 public:
  // Installs the wrapper on first use and returns the counters.
  static CountingCpuAllocator& install();

  int64_t current_bytes() const;
  int64_t peak_bytes() const;
  void reset_peak();

 private:
  CountingCpuAllocator() = default;
};

}  // namespace profiling
}  // namespace flatshard
