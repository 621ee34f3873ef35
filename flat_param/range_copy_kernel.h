// flatshard/flat_param/range_copy_kernel.h — the range-copy CUDA kernel's interface (plain C++,
// no torch: included by range_copy_kernel.cu and flat_param/upcast.cpp, which checks tensors).
//
// Note [Range copies]: what a unit's hooks move between its flat buffers — the master shard
// cast into the gathered buffer, each parameter's gradient into the flat or master gradient,
// zeros where no gradient landed — as one launch with raw pointers: no tensor view per range,
// no ATen dispatch. Measured on one H200 (benchmarks/RESULTS.md "Host time per unit", the
// sampled host profile of 2026-12-03): ATen's copy_ (dispatch, TensorIterator) was about 40% of
// a gather's host time beyond its launch, and _foreach_copy_'s host side 56% of a per-Block
// unit's post-backward hook. Values are ATen's bit for bit: a same-dtype copy moves the bits, a
// widening one is exact, and a narrowing one rounds with the device conversions ATen's casts use
// on sm_80+ (__float2bfloat16, __float2half); tests/gpu_parity_test.cpp checks it against
// copy_ on the device. Each range gets one block per 4096 elements (range_copy_kernel.cu says
// why), so the launch's grid grows with the unit's size.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "flat_param/kernel_dtype.h"

namespace flatshard {
namespace kernels {

// n elements of `src` (of src_dtype) converted into `dst` (of dst_dtype); src null: zeros.
struct RangeCopy {
  const void* src;
  void* dst;
  int64_t n;
  KernelDtype src_dtype;
  KernelDtype dst_dtype;
};

// One launch copies up to this many ranges (the kernel takes them as its argument).
constexpr int kMaxRangesPerLaunch = 48;

// ranges[0, count), count <= kMaxRangesPerLaunch, disjoint destinations, enqueued on `stream`.
// Returns the launch error.
cudaError_t copy_ranges(const RangeCopy* ranges, int count, cudaStream_t stream);

}  // namespace kernels
}  // namespace flatshard
