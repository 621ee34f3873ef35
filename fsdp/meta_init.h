// flatshard/fsdp/meta_init.h — build a module tree without allocating its parameters.
//
//   flatshard::gpt::GPT model{nullptr};
//   { flatshard::MetaInit meta;  model = flatshard::gpt::GPT(cfg); }   // ~1 ms for 1B params
//   check_on_meta(*model);          // throws if some parameter was allocated for real
//   auto plan = make_plan(*model, policy);   explain(*model, plan, 8, opts, {});
//
// Why: a plan and its explanation (planner/explain.h) need only names, shapes, dtypes and tensor
// identities. Building a 1B-parameter model on CPU for that costs ~4 GB and ~15 s of init. And
// a model too large for one rank is built this way and initialised by fully_shard.
// LibTorch's C++ API has no "default device" (Python's `with torch.device("meta")` is a Python
// TorchFunctionMode), so MetaInit works one level lower, on the dispatcher's thread-local key
// sets: while it lives, the Meta backend key is included and BackendSelect excluded, so factory
// functions (at::empty, zeros, ones, ...) dispatch to their Meta kernels and return meta tensors
// whatever device their options name; in-place init ops (normal_, uniform_, fill_, zero_) on
// those tensors are shape-only no-ops. Meta is the highest-priority backend bit, which is what
// makes the included key win over the CPU key of the options.
//
// Contract
// - Thread-local and scoped: only this thread, only inside the scope. Nest-safe. Leaving the
//   scope restores the thread's whole key set as it was: the include guard alone does not (a
//   DispatchKeySet difference keeps backend bits, so the Meta bit stayed and every later op on
//   the thread failed with "found at least two devices, meta and cpu").
// - Only for constructing modules. Running a forward, reading values (item(), data_ptr()) or
//   copying data inside the scope is wrong: values of meta tensors do not exist.
// - Code that bypasses the dispatcher (e.g. at::detail::empty_cpu, from_blob) still allocates;
//   check_on_meta() finds parameters that did, so a future LibTorch change to the mechanism is an
//   error, not a silent 4 GB allocation.
// - The result can be planned and explained, and sharded: fully_shard then gives it memory and
//   values unit by unit on the communicator's device (Note [Deferred initialization],
//   fsdp/deferred_init.h). It cannot be trained or run before that.
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class MetaInit {
 public:
  MetaInit() = default;
  MetaInit(const MetaInit&) = delete;
  MetaInit& operator=(const MetaInit&) = delete;

 private:
  c10::impl::ForceDispatchKeyGuard restore_;  // first: saves the key set, restores it last
  c10::impl::IncludeDispatchKeyGuard include_meta_{c10::DispatchKey::Meta};
  c10::impl::ExcludeDispatchKeyGuard exclude_backend_select_{c10::DispatchKey::BackendSelect};
};

// Throws c10::Error naming the first parameter of `module` that is not a meta tensor.
void check_on_meta(const torch::nn::Module& module);

}  // namespace flatshard
