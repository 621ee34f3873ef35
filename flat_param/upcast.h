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

#include <vector>

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

}  // namespace flatshard
