// flatshard/fsdp/buffers.cpp — see buffers.h for the contract.
#include "fsdp/buffers.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <vector>

#include "collectives/communicator.h"

namespace flatshard {

void cast_buffers(torch::nn::Module& model, std::optional<c10::ScalarType> dtype) {
  if (!dtype) return;
  at::NoGradGuard no_grad;
  for (auto& item : model.named_buffers(/*recurse=*/true)) {
    at::Tensor& b = item.value();
    if (b.defined() && at::isFloatingType(b.scalar_type()) && b.scalar_type() != *dtype)
      b.set_data(b.to(*dtype));
  }
}

void broadcast_buffers(torch::nn::Module& model, Communicator& comm) {
  if (comm.world_size() == 1) return;
  at::NoGradGuard no_grad;
  struct Slot {
    at::Tensor buffer;
    int64_t offset, numel;  // in floats of the packed tensor
    bool as_bytes;          // not float32: travels as its bytes, one float per byte
  };
  std::vector<Slot> slots;
  int64_t total = 0;
  for (auto& item : model.named_buffers(/*recurse=*/true)) {
    const at::Tensor& b = item.value();
    if (!b.defined()) continue;
    TORCH_CHECK(b.device() == comm.device(), "fully_shard: buffer '", item.key(), "' is on ",
                b.device(), " but the communicator of rank ", comm.rank(), " works on ",
                comm.device(), "; move the model there before sharding it");
    const bool as_bytes = b.scalar_type() != at::kFloat;
    const int64_t n = as_bytes ? b.numel() * static_cast<int64_t>(b.element_size()) : b.numel();
    slots.push_back(Slot{b, total, n, as_bytes});
    total += n;
  }
  if (total == 0) return;

  auto bytes_of = [](const at::Tensor& t) {  // a contiguous uint8 view of t's values
    return t.contiguous().view({-1}).view(at::kByte);
  };
  at::Tensor packed =
      at::empty({total}, at::TensorOptions().dtype(at::kFloat).device(comm.device()));
  for (const Slot& s : slots) {
    at::Tensor dst = packed.narrow(0, s.offset, s.numel);
    dst.copy_(s.as_bytes ? bytes_of(s.buffer).to(at::kFloat) : s.buffer.reshape({-1}));
  }
  comm.broadcast(packed, 0, comm.current_stream());
  for (const Slot& s : slots) {
    const at::Tensor src = packed.narrow(0, s.offset, s.numel);
    if (s.as_bytes) {
      const at::Tensor bytes = src.to(at::kByte);
      s.buffer.copy_(bytes.view(s.buffer.scalar_type()).view(s.buffer.sizes()));
    } else {
      s.buffer.copy_(src.view(s.buffer.sizes()));
    }
  }
}

}  // namespace flatshard
