#include "flat_param/offload.h"

#include <algorithm>
#include <cstdlib>

#if FLATSHARD_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace flatshard {

namespace {

#if FLATSHARD_WITH_CUDA
// Note [Exact pinned allocations]
// Why not at::empty(pinned_memory=true): PyTorch's caching host allocator rounds every block up
// to a power of two (a 805 MB master shard takes a 1 GiB block) and keeps freed blocks cached.
// Offloaded state is the largest thing on the host — 8 B per parameter pinned, beside the
// optimizer's 8 — and its sizes are fixed for the run, so the rounding is pure loss (measured:
// 91 GiB RSS for 82 GB of state at 5.1 B parameters). Here the bytes are allocated exactly
// (page-aligned), registered with the driver (cudaHostRegister: page-locked, so copies are
// asynchronous DMA, and is_pinned() reports true) and unregistered and freed with the tensor.
// The price of no cache: each allocation pins pages, so FlatParam allocates these once and
// reuses them (master, gradient, staging), not per step.
void free_registered(void* p) {
  cudaHostUnregister(p);  // on teardown errors too: nothing to do about them in a deleter
  std::free(p);
}

at::Tensor registered_empty(int64_t numel, at::ScalarType dtype) {
  constexpr size_t kPage = 4096;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  if (bytes == 0) return at::empty({numel}, options);
  const size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  void* p = std::aligned_alloc(kPage, rounded);
  TORCH_CHECK(p != nullptr, "CPU offload: cannot allocate ", rounded,
              " bytes of host memory (the offloaded state does not fit the host)");
  const cudaError_t err = cudaHostRegister(p, rounded, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    std::free(p);
    (void)cudaGetLastError();  // clear it: the error is reported here, not at the next call
    TORCH_CHECK(false, "CPU offload: cudaHostRegister of ", rounded, " bytes failed: ",
                cudaGetErrorString(err), " (page-locked memory limit? see ulimit -l)");
  }
  return at::from_blob(p, {numel}, &free_registered, options);
}
#endif

}  // namespace

at::Tensor host_empty(int64_t numel, at::ScalarType dtype, c10::Device device) {
#if FLATSHARD_WITH_CUDA
  if (device.is_cuda()) return registered_empty(numel, dtype);
#endif
  (void)device;
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

void upload_to_device(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_INTERNAL_ASSERT(dst.numel() == src.numel(), "upload_to_device: ", dst.numel(), " vs ",
                        src.numel(), " elements");
  if (dst.device() == src.device()) {
    dst.copy_(src);
    return;
  }
  if (dst.scalar_type() == src.scalar_type()) {
    dst.copy_(src, /*non_blocking=*/true);
    return;
  }
  // copy_ across devices with a dtype change converts on the host first (a CPU pass and a
  // synchronous copy of a pageable temporary); stage the bytes as they are instead.
  at::Tensor staged = at::empty(src.sizes(), src.options().device(dst.device()));
  staged.copy_(src, /*non_blocking=*/true);
  dst.copy_(staged);
}

void upload_to_device_chunked(const at::Tensor& dst, const at::Tensor& src, int64_t chunk_numel) {
  TORCH_INTERNAL_ASSERT(chunk_numel > 0 && dst.dim() == 1 && src.dim() == 1,
                        "upload_to_device_chunked: 1-D tensors and a positive chunk");
  const int64_t n = src.numel();
  if (dst.device() == src.device() || dst.scalar_type() == src.scalar_type() || n <= chunk_numel)
    return upload_to_device(dst, src);
  for (int64_t b = 0; b < n; b += chunk_numel) {
    const int64_t len = std::min(chunk_numel, n - b);
    upload_to_device(dst.narrow(0, b, len), src.narrow(0, b, len));
  }
}

void download_to_host(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_INTERNAL_ASSERT(dst.numel() == src.numel(), "download_to_host: ", dst.numel(), " vs ",
                        src.numel(), " elements");
  dst.copy_(src, /*non_blocking=*/dst.device() != src.device());
}

}  // namespace flatshard
