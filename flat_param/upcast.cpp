#include "flat_param/upcast.h"

#include <cstdint>
#include <optional>

#include "collectives/env.h"

#if FLATSHARD_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace flatshard {
namespace kernels {
cudaError_t bf16_to_fp32(const void* in, float* out, int64_t n, cudaStream_t stream);
}  // namespace kernels
}  // namespace flatshard
#include "flat_param/range_copy_kernel.h"
#endif

namespace flatshard {

bool uses_upcast_kernel(const at::Tensor& t) {
#if FLATSHARD_WITH_CUDA_KERNELS
  static const bool enabled = env::upcast_kernel();  // read once: it is on the per-unit path
  return enabled && t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
#else
  (void)t;
  return false;
#endif
}

at::Tensor to_float(const at::Tensor& t) {
#if FLATSHARD_WITH_CUDA_KERNELS
  if (uses_upcast_kernel(t)) {
    at::Tensor out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
    const cudaError_t e = kernels::bf16_to_fp32(
        t.data_ptr(), out.data_ptr<float>(), t.numel(),
        c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
    TORCH_CHECK(e == cudaSuccess, "flatshard: bf16 -> fp32 kernel launch failed on ", t.device(),
                ": ", cudaGetErrorString(e));
    return out;
  }
#endif
  return t.to(at::kFloat);
}

void copy_to_float(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_INTERNAL_ASSERT(dst.scalar_type() == at::kFloat && dst.numel() == src.numel(),
                        "copy_to_float: ", dst.scalar_type(), " destination of ", dst.numel(),
                        " elements for ", src.numel());
#if FLATSHARD_WITH_CUDA_KERNELS
  if (uses_upcast_kernel(src) && dst.is_contiguous() && dst.device() == src.device() &&
      reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0) {
    const cudaError_t e = kernels::bf16_to_fp32(
        src.data_ptr(), dst.data_ptr<float>(), src.numel(),
        c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
    TORCH_CHECK(e == cudaSuccess, "flatshard: bf16 -> fp32 kernel launch failed on ",
                src.device(), ": ", cudaGetErrorString(e));
    return;
  }
#endif
  dst.copy_(src.reshape(dst.sizes()));
}

}  // namespace flatshard

namespace flatshard {

// Note [Grouped gradient copies]
// A unit's reduction starts by moving each parameter's gradient into one buffer: the flat
// gradient (the collective's input; Note [Flat gradient without zero-fill]) or, at one rank,
// straight into the fp32 master gradient (Note [One-rank reduction]), then zeroes what no
// gradient reached. Per parameter that was a launch each — a Block of 12 parameters paid ~12
// launches of host time in its post-backward hook, the hook the seed's ZeRO-3 user saw the GPU
// wait for. ATen's multi-tensor _foreach_copy_ (the fast path behind PyTorch's foreach
// optimizers; it converts dtypes) does all of a unit's copies in one launch, _foreach_zero_ all
// its zero-fills in another. Same values: a copy is a copy (bf16 -> fp32 is exact). Where the
// fast path does not apply (CPU, mixed dtypes in a list) ATen runs the per-tensor loop itself.
// Only for lists of kMinGrouped tensors or more: a grouped launch costs more host time than
// one or two plain ones (1× H200, 1B GPT, 1 seq, one process each: per-Block units 37.8 ms per
// step grouped vs 41.3 per tensor, but per-leaf units — 2 tensors each — 51.9 vs 48.5 ms, with
// 44.6 vs 37.8 ms of host time; benchmarks/history.md "Issues 34, 35 on the GPU").
// FLATSHARD_GROUPED_GRAD_COPY=0 restores the per-parameter launches for A/B runs.

namespace {
constexpr size_t kMinGrouped = 4;
bool grouped(size_t n) {
  static const bool on = env::grouped_grad_copy();  // read once: it is on the per-unit path
  return on && n >= kMinGrouped;
}
}  // namespace

void copy_all(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs) {
  TORCH_INTERNAL_ASSERT(dsts.size() == srcs.size(), "copy_all: ", dsts.size(), " destinations for ",
                        srcs.size(), " sources");
  if (dsts.empty()) return;
  // 1-D sources (the one-rank path's) are used as they are: a view per tensor is host time.
  auto flat = [](const at::Tensor& t) { return t.dim() == 1 ? t : t.reshape({-1}); };
  if (grouped(dsts.size())) {
    std::vector<at::Tensor> flats;
    flats.reserve(srcs.size());
    for (const auto& s : srcs) flats.push_back(flat(s));
    at::_foreach_copy_(dsts, flats);
    return;
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (dsts[i].scalar_type() == at::kFloat) {
      copy_to_float(dsts[i], srcs[i]);
    } else {
      dsts[i].copy_(flat(srcs[i]));
    }
  }
}

void zero_all(const std::vector<at::Tensor>& ts) {
  if (ts.empty()) return;
  if (grouped(ts.size())) {
    at::_foreach_zero_(ts);
    return;
  }
  for (const auto& t : ts) t.zero_();
}

RangeCopies::RangeCopies(const at::Tensor& dst) : dst_(dst) {
  TORCH_INTERNAL_ASSERT(dst.dim() == 1, "RangeCopies: a ", dst.dim(), "-D destination");
}

void RangeCopies::copy(int64_t offset, const at::Tensor& src) {
  const int64_t n = src.numel();
  TORCH_INTERNAL_ASSERT(offset >= 0 && offset + n <= dst_.numel(), "RangeCopies: [", offset, ", ",
                        offset + n, ") outside a destination of ", dst_.numel());
  ranges_.push_back(Range{offset, n, src, 0, true});
}

void RangeCopies::copy(int64_t offset, const at::Tensor& src, int64_t src_offset, int64_t n) {
  TORCH_INTERNAL_ASSERT(offset >= 0 && n >= 0 && offset + n <= dst_.numel() && src.dim() == 1 &&
                            src_offset >= 0 && src_offset + n <= src.numel(),
                        "RangeCopies: [", offset, ", ", offset + n, ") of ", dst_.numel(),
                        " from [", src_offset, ", ", src_offset + n, ") of ", src.numel());
  ranges_.push_back(Range{offset, n, src, src_offset, false});
}

void RangeCopies::zero(int64_t offset, int64_t n) {
  TORCH_INTERNAL_ASSERT(offset >= 0 && n >= 0 && offset + n <= dst_.numel(), "RangeCopies: [",
                        offset, ", ", offset + n, ") outside a destination of ", dst_.numel());
  ranges_.push_back(Range{offset, n, at::Tensor(), 0, false});
}

std::optional<kernels::KernelDtype> kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kernels::KernelDtype::kFloat32;
    case at::kBFloat16:
      return kernels::KernelDtype::kBFloat16;
    case at::kHalf:
      return kernels::KernelDtype::kFloat16;
    default:
      return std::nullopt;
  }
}

namespace {
// The destination's dtype when ranges into `dst` go through the kernel, else nullopt.
std::optional<kernels::KernelDtype> range_kernel_dtype(const at::Tensor& dst) {
#if FLATSHARD_WITH_CUDA_KERNELS
  static const bool on = env::range_copy_kernel();  // read once: it is on the per-unit path
  if (on && dst.is_cuda() && dst.is_contiguous()) return kernel_dtype(dst.scalar_type());
#else
  (void)dst;
#endif
  return std::nullopt;
}
}  // namespace

bool RangeCopies::uses_kernel(const at::Tensor& dst) { return range_kernel_dtype(dst).has_value(); }

void RangeCopies::run() {
  std::vector<at::Tensor> dsts, srcs, zeros;
  auto by_views = [&](const Range& r) {
    if (!r.src.defined()) {
      zeros.push_back(dst_.narrow(0, r.offset, r.n));
      return;
    }
    dsts.push_back(dst_.narrow(0, r.offset, r.n));
    srcs.push_back(r.whole ? r.src : r.src.narrow(0, r.src_offset, r.n));
  };
#if FLATSHARD_WITH_CUDA_KERNELS
  if (const std::optional<kernels::KernelDtype> dst_dtype = range_kernel_dtype(dst_)) {
    kernels::RangeCopy batch[kernels::kMaxRangesPerLaunch];
    int count = 0;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dst_.device().index()).stream();
    auto flush = [&] {
      if (count == 0) return;
      const cudaError_t e = kernels::copy_ranges(batch, count, stream);
      TORCH_CHECK(e == cudaSuccess, "flatshard: range copy kernel launch failed on ",
                  dst_.device(), ": ", cudaGetErrorString(e));
      count = 0;
    };
    char* base = ranges_.empty() ? nullptr : static_cast<char*>(dst_.data_ptr());
    const int64_t dst_size = static_cast<int64_t>(dst_.element_size());
    for (const Range& r : ranges_) {
      if (r.n == 0) continue;
      kernels::RangeCopy k{nullptr, base + r.offset * dst_size, r.n, *dst_dtype, *dst_dtype};
      if (r.src.defined()) {
        const std::optional<kernels::KernelDtype> src_dtype = kernel_dtype(r.src.scalar_type());
        if (!src_dtype || r.src.device() != dst_.device() || !r.src.is_contiguous()) {
          by_views(r);
          continue;
        }
        k.src = static_cast<const char*>(r.src.const_data_ptr()) +
                r.src_offset * static_cast<int64_t>(r.src.element_size());
        k.src_dtype = *src_dtype;
      }
      batch[count++] = k;
      if (count == kernels::kMaxRangesPerLaunch) flush();
    }
    flush();
  } else  // NOLINT(readability/braces): the views below are the other branch
#endif
  {
    for (const Range& r : ranges_)
      if (r.n > 0) by_views(r);
  }
  copy_all(dsts, srcs);
  zero_all(zeros);
  ranges_.clear();
}

}  // namespace flatshard
