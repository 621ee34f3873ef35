// flatshard/fsdp/buffers.h — a model's buffers at setup: cast per MixedPrecision::buffer_dtype,
// then made equal on every rank by a broadcast from rank 0 (fsdp/setup.cpp calls both,
// after the setup fingerprint agreed).
//
// Why: buffers (module.named_buffers(): running statistics, rotary inv_freq, masks) are not
// parameters, so no unit shards or gathers them; every rank keeps its whole copy and uses it as
// is. Without a sync, a rank that built a buffer differently (another seed, another file, a bug)
// trains with it silently. PyTorch FSDP broadcasts buffers from rank 0 under
// sync_module_states; so does flatshard. With sync off, the setup fingerprint compares buffer
// values instead (fsdp/fingerprint.h) and fails naming the buffer and the ranks.
//
// Contract
// - cast_buffers(): with a dtype, every floating-point buffer becomes that dtype (set_data: the
//   module's members see it); integer and bool buffers are left alone. nullopt: untouched.
// - broadcast_buffers(): collective over `comm` (every rank calls it with the same buffer names,
//   shapes and dtypes — the fingerprint guarantees it). Afterwards every buffer holds the values
//   of `comm`'s rank 0, bit for bit, whatever its dtype: all buffers travel in ONE broadcast of
//   a float32 tensor (float32 buffers as themselves, every other dtype as its bytes, each byte a
//   float — exact, see fingerprint.h's note on encoding). No collective when the model has no
//   buffers or `comm` has one rank. Throws, naming the buffer and the rank, for a buffer that
//   is not on `comm.device()`.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class Communicator;

void cast_buffers(torch::nn::Module& model, std::optional<c10::ScalarType> dtype);

void broadcast_buffers(torch::nn::Module& model, Communicator& comm);

}  // namespace flatshard
