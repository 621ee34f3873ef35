// flatshard/fsdp/runtime.h — state shared by the units of one ShardedModel (internal header).
//
// Execution order, prefetch, the backward-pass lifecycle and the streams. Owned by
// ShardedModel; units hold a reference. Single-threaded per rank (the forward thread and the
// autograd thread never run flatshard code concurrently for one model).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "fsdp/options.h"
#include "fsdp/step_guard.h"
#include "fsdp/trace.h"
#include "fsdp/unit.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

namespace detail {
// The module -> unit registry behind flatshard::call (fsdp/call.cpp). A module may enter at
// most one unit; registering it twice is an error naming the module.
void register_member(const torch::nn::Module* module, Unit* unit, const std::string& path);
void unregister_member(const torch::nn::Module* module);
}  // namespace detail

class Runtime {
 public:
  // `replicate`: the HSDP replicate group (collectives/sharding_mesh.h), or nullptr.
  Runtime(Communicator& comm, ShardingOptions options, Communicator* replicate = nullptr);

  Communicator& comm() { return comm_; }  // the shard group
  Communicator* replicate() const { return replicate_; }
  const ShardingOptions& options() const { return options_; }
  std::vector<std::unique_ptr<Unit>>& units() { return units_; }
  Tracer* tracer() const { return tracer_.get(); }  // nullptr unless tracing (fsdp/trace.h)

  // Streams. On CPU all three are the default CPU stream (collectives are synchronous).
  c10::Stream compute_stream() const;
  c10::Stream all_gather_stream() const { return all_gather_stream_; }
  c10::Stream reduce_scatter_stream() const { return reduce_scatter_stream_; }

  bool in_backward() const { return backward_active_; }
  bool requires_grad_sync() const { return requires_grad_sync_; }
  void set_requires_grad_sync(bool v) { requires_grad_sync_ = v; }

  // Hooks from units.
  void on_root_enter();              // every entry of the root unit (a new forward may begin)
  void on_outputs_hooked() { pending_backward_ = true; }
  void on_pre_forward(Unit& unit);   // first entry of `unit` in this forward
  void on_pre_backward(Unit& unit);  // first pre-backward of `unit` in this backward

  // Note [Reduce buffer lifetime]: a reduction reads buffers allocated on the compute stream
  // (the flat gradient, and the gradients whose copy into it was deferred to the reduction).
  // They are held here until the next reduction is issued (or backward ends), when the compute
  // stream first waits for `done`; only then are they released to the allocator. This bounds
  // pending reduce buffers to one unit's worth without recordStream.
  void hold_reduce_buffers(std::vector<at::Tensor> buffers, const StreamEvent* done);
  void release_reduce_buffers();

  // Runs when the autograd engine finishes a backward pass that touched our units.
  void finalize_backward();

 private:
  std::vector<std::string> unit_names() const;
  void prefetch(const std::vector<Unit*>& order, size_t from, int depth, bool for_backward);

  Communicator& comm_;
  Communicator* replicate_;  // HSDP: gradients are also averaged across it; nullptr: no HSDP
  ShardingOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;
  c10::Stream all_gather_stream_;      // all-gathers, so they overlap compute (GPU)
  // Gradient reductions (and, with HSDP, the replicate all-reduce right after each), overlapping
  // earlier layers' backward.
  c10::Stream reduce_scatter_stream_;
  std::vector<Unit*> forward_order_;       // units in first-entry order, this step
  std::vector<Unit*> last_forward_order_;  // the previous step's, drives forward prefetch
  std::vector<Unit*> backward_order_;      // reverse forward order without the root, this step
  std::vector<at::Tensor> reduce_buffers_;  // see Note [Reduce buffer lifetime]
  const StreamEvent* reduce_buffers_done_ = nullptr;
  bool backward_active_ = false;
  bool pending_backward_ = false;  // this step's forward armed a pre-backward hook
  bool requires_grad_sync_ = true;
  StepGuard step_guard_;  // optimizer misuse checks between steps (fsdp/step_guard.h)
  bool debug_order_ = false;  // FLATSHARD_DEBUG: cross-rank unit order check (fsdp/order_check.h)
  std::unique_ptr<Tracer> tracer_;  // declared last: destroyed (and written) first
};

}  // namespace flatshard
