// flatshard/fsdp/runtime.h — drives the units of one ShardedModel (internal header).
//
// Execution order, prefetch, the backward-pass lifecycle, the streams and the reduce-buffer
// holder. Owned by ShardedModel. Control goes one way (CONTRIBUTING.md 4, FSDP2's state ->
// param group): flatshard::call (fsdp/call.cpp), the pre-backward hooks on units' output nodes
// (Note [Pre-backward hook], runtime.cpp) and the end-of-backward callback enter the runtime, the runtime calls the units, and a unit gets only its UnitContext
// (fsdp/unit_context.h) — never the runtime. The one exception is unit-local work: a unit's
// GradReadyHook reduces that unit when its last gradient is in, and a FrozenInput node tells its
// unit when its inputs' gradients are out. Single-threaded per rank (the forward thread and the
// autograd thread never run flatshard code concurrently for one model).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "collectives/mesh.h"
#include "fsdp/options.h"
#include "fsdp/reduce_buffers.h"
#include "fsdp/step_guard.h"
#include "fsdp/trace.h"
#include "fsdp/unit.h"
#include "fsdp/unit_context.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class OffloadLifecycle;
class Runtime;
struct StepLease;

namespace detail {
// The module -> (runtime, unit) registry behind flatshard::call (fsdp/call.cpp). A module may
// enter at most one unit; registering it twice is an error naming the module.
void register_member(const torch::nn::Module* module, Runtime* runtime, Unit* unit,
                     const std::string& path);
void unregister_member(const torch::nn::Module* module);
}  // namespace detail

class Runtime {
 public:
  // `mesh`: the model's rank layout (collectives/mesh.h); copied, its groups are not owned.
  Runtime(const Mesh& mesh, ShardingOptions options);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Communicator& comm() { return mesh_.shard(); }  // the shard group
  const Mesh& mesh() const { return mesh_; }
  const ShardingOptions& options() const { return options_; }
  std::vector<std::unique_ptr<Unit>>& units() { return units_; }
  Tracer* tracer() const { return tracer_.get(); }  // nullptr unless tracing (fsdp/trace.h)
  // What every unit of this model is built with (streams, tracer, reduce buffers).
  const UnitContext& unit_context() const { return *ctx_; }

  // Streams. On CPU all three are the default CPU stream (collectives are synchronous).
  c10::Stream compute_stream() const;
  c10::Stream all_gather_stream() const { return all_gather_stream_; }
  c10::Stream reduce_scatter_stream() const { return reduce_scatter_stream_; }

  bool in_backward() const { return backward_active_; }
  bool requires_grad_sync() const { return requires_grad_sync_; }
  void set_requires_grad_sync(bool v);  // and on every unit, for the next backward passes

  // --- entered by flatshard::call (fsdp/call.cpp) ---------------------------------------
  // Before a member of `unit` runs: a new step may begin (root), the unit's first entry in this
  // forward is recorded and may prefetch the next units, then the unit unshards and waits.
  void pre_forward(Unit& unit, const torch::nn::Module* member);
  // After it ran: hooks the outputs for pre-backward (replacing them with identity views whose
  // backward enters pre_backward below), then the unit reshards per its strategy.
  void post_forward(Unit& unit, const torch::nn::Module* member, std::vector<at::Tensor>& outputs);

  // A tensor argument of a call into `unit` (after the mixed-precision cast): for a unit with no
  // trainable parameter, in grad mode, an input that requires grad is wrapped in an identity
  // whose backward tells the unit its gradient is out (Note [Frozen parameters]); else `t`.
  at::Tensor wrap_input(Unit& unit, const at::Tensor& t);

  // --- entered by autograd --------------------------------------------------------------
  // The backward of `unit`'s hooked outputs: the first one of a backward queues
  // finalize_backward; the unit's first one prefetches the next units; then the unit unshards.
  void pre_backward(Unit& unit);
  // Runs when the autograd engine finishes a backward pass that touched our units.
  void finalize_backward();
  // Note [CPU offload]'s lifecycle over the units (fsdp/offload_step.h): the runtime calls it at
  // its hook points; the ShardedModel for its waits, the optimizer's attachment and clipping.
  OffloadLifecycle& offload() const { return *offload_; }

  // Note [Forward without backward]: every autograd node this step's forward hooked is gone
  // and no backward began (an eval forward that forgot NoGradGuard, its outputs dropped).
  // Called from StepLease's destructor; `step` is the step the lease was made in.
  void on_step_graph_released(uint64_t step);

 private:
  void on_root_enter();                 // every entry of the root unit (a new forward may begin)
  void on_first_forward_entry(Unit& unit);  // records the order; forward prefetch
  void on_first_pre_backward(Unit& unit);   // backward order, end-of-backward; backward prefetch
  // Note [Pre-backward hook] (runtime.cpp); `first_node`: the autograd sequence number when the
  // call entered. True: some were hooked.
  bool hook_outputs(Unit& unit, std::vector<at::Tensor>& outputs, uint64_t first_node);
  // The one end of a step (after its backward, or a forward that can have none): reshards
  // every unit, resets their step state and the runtime's.
  void end_step();
  std::vector<std::string> unit_names() const;
  void prefetch(const std::vector<Unit*>& order, size_t from, int depth, bool for_backward);

  Mesh mesh_;  // the rank layout every unit's collectives run over (UnitContext::mesh)
  Communicator& comm_;  // mesh_.shard(): the group this runtime's order checks and messages use
  ShardingOptions options_;
  c10::Stream all_gather_stream_;      // all-gathers, so they overlap compute (GPU)
  // Gradient reductions (and, with HSDP, the replicate all-reduce right after each), overlapping
  // earlier layers' backward.
  c10::Stream reduce_scatter_stream_;
  ReduceBuffers reduce_buffers_;  // Note [Reduce buffer lifetime] (fsdp/reduce_buffers.h)
  // Built once the tracer exists; declared before units_, which refer to it, so it outlives them.
  std::optional<UnitContext> ctx_;
  std::vector<std::unique_ptr<Unit>> units_;
  // Note [CPU offload]'s lifecycle; its stepper's worker steps units' masters, so it is
  // destroyed (and waits) before units_; UnitContext holds its raw pointer.
  std::unique_ptr<OffloadLifecycle> offload_;
  std::vector<Unit*> forward_order_;       // units in first-entry order, this step
  std::vector<Unit*> last_forward_order_;  // the previous step's, drives forward prefetch
  std::vector<Unit*> backward_order_;      // reverse forward order without the root, this step
  bool backward_active_ = false;
  bool pending_backward_ = false;  // this step's forward armed a pre-backward hook
  bool requires_grad_sync_ = true;
  // Note [Forward without backward]: the step's lease, shared by every PreBackward node of the
  // step; when the last node dies before a backward began, the step closes. `step_` counts
  // closed steps, so a lease outliving its step (the graph freed after backward) does nothing.
  // Atomic: a node may die on an autograd thread after its backward (then it only reads).
  std::weak_ptr<StepLease> lease_;
  std::atomic<uint64_t> step_{0};
  int call_depth_ = 0;             // flatshard::call / enter frames of this model on the stack
  // Note [Pre-backward hook]: per frame, the autograd sequence number when it entered.
  std::vector<uint64_t> call_first_node_;
  bool env_pre_backward_hook_ = true;  // FLATSHARD_PRE_BACKWARD_HOOK, read once
  bool release_deferred_ = false;  // the lease died inside a call: close when the frames unwind
  // What leases hold instead of `this`, so a graph outliving the ShardedModel finds it gone.
  std::shared_ptr<Runtime*> self_handle_;
  StepGuard step_guard_;  // optimizer misuse checks between steps (fsdp/step_guard.h)
  bool debug_order_ = false;  // FLATSHARD_DEBUG: cross-rank unit order check (fsdp/order_check.h)
  std::unique_ptr<Tracer> tracer_;  // declared last: destroyed (and written) first
};

}  // namespace flatshard
