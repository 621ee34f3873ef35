// flatshard/profiling/counting_allocator.cpp — see counting_allocator.h for the contract.
#include "profiling/counting_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>

namespace flatshard {
namespace profiling {

namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};

void add_bytes(int64_t n) {
  const int64_t now = g_current.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Each block starts with a header holding its size, so the deleter needs nothing but the data
// pointer. That keeps context == data, which ATen's raw_allocate()/raw_deallocate() require
// (oneDNN's bf16 kernels allocate scratch that way). One alignment unit keeps data aligned.
constexpr size_t kHeader = c10::gAlignment;
static_assert(kHeader >= sizeof(int64_t), "header must hold the size");

void raw_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof(bytes));
  g_current.fetch_sub(bytes, std::memory_order_relaxed);
  c10::free_cpu(base);
}

// Allocates with c10::alloc_cpu/free_cpu, as LibTorch's default CPU allocator does (aligned,
// and it honours the same environment knobs).
class Counting final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::kCPU);
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &raw_delete, cpu);
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof(bytes));
    add_bytes(bytes);
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &raw_delete, cpu);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

CountingCpuAllocator& CountingCpuAllocator::install() {
  static CountingCpuAllocator counters;
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: storages allocated through it may be freed during static destruction.
    static Counting* counting = new Counting();
    c10::SetCPUAllocator(counting, std::numeric_limits<uint8_t>::max());
  });
  return counters;
}

int64_t CountingCpuAllocator::current_bytes() const {
  return g_current.load(std::memory_order_relaxed);
}

int64_t CountingCpuAllocator::peak_bytes() const { return g_peak.load(std::memory_order_relaxed); }

void CountingCpuAllocator::reset_peak() {
  g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace profiling
}  // namespace flatshard
