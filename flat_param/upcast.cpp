#include "flat_param/upcast.h"

#include <cstdint>

#include "collectives/env.h"

#if FLATSHARD_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace flatshard {
namespace kernels {
cudaError_t bf16_to_fp32(const void* in, float* out, int64_t n, cudaStream_t stream);
}  // namespace kernels
}  // namespace flatshard
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
