#include "collectives/communicator.h"

#include <ATen/ATen.h>
#if FLATSHARD_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace flatshard {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

c10::Stream Communicator::current_stream() const {
  const c10::Device d = device();
#if FLATSHARD_WITH_CUDA
  if (d.is_cuda()) return c10::cuda::getCurrentCUDAStream(d.index()).unwrap();
#endif
  return c10::Stream(c10::Stream::DEFAULT, d);
}

namespace detail {

void check_tensor(const char* call, int rank, const char* what, const at::Tensor& t,
                  c10::Device device, bool bytes_ok) {
  TORCH_CHECK(t.defined(), call, " (rank ", rank, "): ", what, " is an undefined tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf || (bytes_ok && t.scalar_type() == at::kByte),
              call, " (rank ", rank, "): ", what, " has dtype ", t.scalar_type(),
              "; supported dtypes are float32, bfloat16 and float16",
              bytes_ok ? " (and uint8 here)" : "");
  TORCH_CHECK(t.is_contiguous(), call, " (rank ", rank, "): ", what,
              " must be contiguous (sizes ", t.sizes(), ", strides ", t.strides(), ")");
  TORCH_CHECK(t.device() == device, call, " (rank ", rank, "): ", what, " is on ", t.device(),
              " but this communicator works on ", device);
}

void check_same_dtype(const char* call, int rank, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), call, " (rank ", rank,
              "): input dtype ", a.scalar_type(), " differs from output dtype ", b.scalar_type());
}

void check_all_gather(const char* call, int rank, int world, const at::Tensor& input,
                      const at::Tensor& output, c10::Device device) {
  check_tensor(call, rank, "input", input, device, /*bytes_ok=*/true);
  check_tensor(call, rank, "output", output, device, /*bytes_ok=*/true);
  check_same_dtype(call, rank, input, output);
  TORCH_CHECK(output.numel() == input.numel() * world, call, " (rank ", rank,
              "): output has ", output.numel(), " elements, expected input.numel() * world_size = ",
              input.numel(), " * ", world, " = ", input.numel() * world);
}

void check_reduce_scatter(const char* call, int rank, int world, const at::Tensor& input,
                          const at::Tensor& output, c10::Device device) {
  check_tensor(call, rank, "input", input, device);
  check_tensor(call, rank, "output", output, device);
  check_same_dtype(call, rank, input, output);
  TORCH_CHECK(input.numel() == output.numel() * world, call, " (rank ", rank, "): input has ",
              input.numel(), " elements, expected output.numel() * world_size = ", output.numel(),
              " * ", world, " = ", output.numel() * world);
}

}  // namespace detail
}  // namespace flatshard
