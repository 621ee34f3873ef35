// flatshard/flat_param/upcast.h — a tensor's fp32 copy, fast for CUDA bf16.
//
// Contract: to_float(t) returns t itself when it is fp32 (like Tensor::to), else a new contiguous
// fp32 tensor equal to t (bitwise: bf16 -> fp32 is exact), allocated and written on the current
// stream of t's device. For a contiguous,
// 16-byte-aligned CUDA bf16 tensor it uses flatshard's vectorized kernel when the build has
// CUDA kernels (FLATSHARD_WITH_CUDA_KERNELS; see Note [Vectorized upcast] in
// upcast_kernel.cu) unless FLATSHARD_UPCAST_KERNEL=0; otherwise t.to(at::kFloat).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <optional>
#include <vector>

#include "flat_param/kernel_dtype.h"

namespace flatshard {

at::Tensor to_float(const at::Tensor& t);

// True when to_float() would use the vectorized kernel for `t`.
bool uses_upcast_kernel(const at::Tensor& t);

// Writes `src` converted to fp32 into `dst` (fp32, src's element count, src's device) on the
// current stream: the vectorized kernel when uses_upcast_kernel(src) and `dst` is contiguous
// and 16-byte aligned, else dst.copy_(src) (flattened). Bitwise equal either way.
void copy_to_float(const at::Tensor& dst, const at::Tensor& src);

}  // namespace flatshard

namespace flatshard {

// Note [Grouped gradient copies] (upcast.cpp): dsts[i] = srcs[i] for every i (same element
// counts; each dst 1-D and contiguous, a src of any shape, read flattened), converting dtypes,
// on the current stream. One grouped ATen launch (_foreach_copy_) per call of 4 pairs or more
// when FLATSHARD_GROUPED_GRAD_COPY is on (default), else copy_to_float / copy_ per pair.
// Bitwise equal either way.
void copy_all(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs);
// Zeroes every tensor of `ts`, grouped the same way (_foreach_zero_).
void zero_all(const std::vector<at::Tensor>& ts);

// The kernels' name for `t` (flat_param/kernel_dtype.h); nullopt for a dtype they do not take.
std::optional<kernels::KernelDtype> kernel_dtype(at::ScalarType t);

// Note [Range copies] (flat_param/range_copy_kernel.h): copies into, and zero-fills of, ranges
// of one contiguous 1-D destination, issued together by run() on the current stream of its
// device. When the build has CUDA kernels, FLATSHARD_RANGE_COPY_KERNEL is on (default) and the
// destination is a contiguous CUDA fp32/bf16/fp16 tensor, every range whose source is a
// contiguous CUDA tensor of those dtypes on the same device goes into one launch per 48 ranges,
// with no view and no ATen dispatch. The rest (CPU, other dtypes, non-contiguous sources) runs
// as views through copy_all / zero_all, which is also everything when the kernel is off.
// Bitwise equal either way. The sources must stay alive until the stream has run the copies (as
// for any copy_ on a stream).
class RangeCopies {
 public:
  // Whether ranges into `dst` (with eligible sources) go through the kernel.
  static bool uses_kernel(const at::Tensor& dst);

  explicit RangeCopies(const at::Tensor& dst);
  // dst[offset, offset + src.numel()) = src, read flattened.
  void copy(int64_t offset, const at::Tensor& src);
  // dst[offset, offset + n) = src[src_offset, src_offset + n); `src` is 1-D and contiguous.
  void copy(int64_t offset, const at::Tensor& src, int64_t src_offset, int64_t n);
  // dst[offset, offset + n) = 0.
  void zero(int64_t offset, int64_t n);
  // Issues what was added, once.
  void run();

 private:
  struct Range {
    int64_t offset, n;
    at::Tensor src;  // undefined: a zero-fill
    int64_t src_offset;
    bool whole;  // src read flattened from its start (copy(offset, src))
  };
  const at::Tensor& dst_;
  c10::SmallVector<Range, 16> ranges_;  // a unit's ranges without a heap allocation
};

}  // namespace flatshard
