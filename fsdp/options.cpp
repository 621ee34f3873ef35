#include "fsdp/options.h"

#include <c10/core/StreamGuard.h>
#if FLATSHARD_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

namespace flatshard {

void device_sleep(const c10::Stream& stream, int64_t cycles) {
  if (cycles <= 0 || stream.device_type() == c10::DeviceType::CPU) return;
#if FLATSHARD_WITH_CUDA
  c10::StreamGuard guard(stream);
  at::cuda::sleep(cycles);
#endif
}

}  // namespace flatshard
