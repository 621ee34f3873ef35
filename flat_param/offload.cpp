#include "flat_param/offload.h"

namespace flatshard {

at::Tensor host_empty(int64_t numel, at::ScalarType dtype, c10::Device device) {
  auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  if (device.is_cuda()) options = options.pinned_memory(true);
  return at::empty({numel}, options);
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

void download_to_host(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_INTERNAL_ASSERT(dst.numel() == src.numel(), "download_to_host: ", dst.numel(), " vs ",
                        src.numel(), " elements");
  dst.copy_(src, /*non_blocking=*/dst.device() != src.device());
}

}  // namespace flatshard
