// flatshard/fsdp/unit.h — one sharding unit: a flat parameter, its state machine and its hooks.
//
// Life of a unit in one training step (FULL_SHARD). The runtime (fsdp/runtime.h) is entered by
// flatshard::call and by autograd, records the order, prefetches, and calls the unit; the unit
// does its own collectives with what its UnitContext (fsdp/unit_context.h) gives it and never
// calls back up:
//   pre_forward   : kSharded -> unshard (one all-gather, or the prefetched one) -> kUnsharded
//   post_forward  : (the runtime hooks the outputs for pre-backward) after the last member call,
//                   reshard
//   pre_backward  : unshard again (one all-gather, or the prefetched one); flat grad prepared
//                   (with sync on, gradients are copied into it by the reduction, off the
//                   compute stream)
//   post_backward : when every parameter's AccumulateGrad has run (the unit's own GradReadyHook,
//                   unit-local) or at the end of backward (the runtime, for parameters that got
//                   no gradient): one reduce-scatter into the master shard's grad, then reshard.
// SHARD_GRAD_OP keeps the unit unsharded from forward to the end of its backward. NO_SHARD keeps
// it unsharded always and all-reduces gradients instead.
// Units are created by fully_shard() from resolve_unit()'s settings (fsdp/resolve.h) and driven
// by the runtime; users only read their info and counters.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flat_param/flat_param.h"
#include "fsdp/options.h"
#include "fsdp/resolve.h"
#include "fsdp/stream_event.h"
#include "fsdp/trace.h"
#include "fsdp/unit_context.h"
#include "wrap_policies/plan.h"

namespace torch {
namespace nn {
class Module;
}
namespace autograd {
struct Node;
}
}  // namespace torch

namespace flatshard {

struct AttachTarget;   // optim/attach.h
class TensorParallel;  // fsdp/tensor_parallel.h

enum class UnitState { kSharded, kUnsharded };

// What ShardedModel::units() reports of one unit (Unit::info()).
struct UnitInfo {
  std::string name;
  ShardingStrategy strategy;
  bool reshard_after_forward;
  int64_t numel;         // real parameter elements
  int64_t padded_numel;  // flat buffer elements
  int64_t shard_numel;   // elements of this rank's master shard
  size_t num_params;
  // Keeps a device compute copy an attached FusedAdamW writes in its step (Note [Compute copy
  // in the step], optim/fused_adamw.h): NO_SHARD below fp32, or sharded with
  // ShardingOptions::keep_compute_shard (Note [Kept compute shard]); not offloaded.
  bool step_copy;
};

// Collectives issued by one unit since the last reset.
struct UnitCounters {
  int64_t forward_all_gathers = 0;
  int64_t backward_all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;     // NO_SHARD units (with HSDP: over the shard, then replicate group)
  // HSDP: all-reduces of sharded units' gradient shards across the replicate group (one per
  // reduce-scatter when there are replicas; 0 without HSDP).
  int64_t replicate_all_reduces = 0;
  // fp8 gathers' amax all-reduces over the shard group, one per gather (flat_param/
  // quantized_gather.h); their bytes are in `bytes`, as part of the gather's.
  int64_t gather_all_reduces = 0;
  int64_t bytes = 0;  // bytes this rank sent into those collectives (replicate ones included)
  int64_t replicate_bytes = 0;  // of which across the replicate group (inter-node with HSDP)
  // Host time inside this unit's hooks (HookClock below): forward = pre- and post-forward (the
  // prefetches they issue included), backward = pre-backward, the gradient hooks and the
  // reduction. What the machine profile's host cost per unit is fitted from
  // (benchmarks/bench_profile.cpp): unlike a step's issue time it does not grow when the host
  // waits for a full device queue.
  int64_t host_forward_ns = 0;
  int64_t host_backward_ns = 0;
  UnitCounters& operator+=(const UnitCounters& o);
};

class Unit {
 public:
  // `settings`: resolve_unit(spec, ...); `context` outlives the unit (the runtime owns both).
  // `fill` / `load_ranges`: deferred or loaded values for meta parameters (FlatParam's
  // contract; fsdp/deferred_init.h).
  Unit(int index, UnitSpec spec, const ResolvedUnit& settings,
       std::vector<const torch::nn::Module*> members, std::vector<ParamRef> params,
       const UnitContext& context, const std::function<void()>& fill = {},
       const FlatParam::RangeFill& load_ranges = {});
  ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  int index() const { return index_; }
  const std::string& name() const { return spec_.name; }
  const UnitSpec& spec() const { return spec_; }
  ShardingStrategy strategy() const { return strategy_; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  // Note [Recompute] (fsdp/recompute.h): forward run without saving activations, again in
  // backward.
  bool recompute() const { return recompute_; }
  // A recompute unit's member `member`: the distinct parameters of its module tree (the unit's
  // own and any tied ones it reads), the leaves the recompute differentiates. Empty otherwise.
  const std::vector<at::Tensor>& recompute_leaves(const torch::nn::Module* member) const;
  bool is_root() const { return spec_.is_root; }
  UnitState state() const { return state_; }
  FlatParam& flat() { return *flat_; }
  const FlatParam& flat() const { return *flat_; }
  const std::vector<const torch::nn::Module*>& members() const { return members_; }
  const UnitCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = UnitCounters{}; }
  void add_host_ns(bool backward, int64_t ns) {
    (backward ? counters_.host_backward_ns : counters_.host_forward_ns) += ns;
  }
  // What the tracer records about this unit (fsdp/trace.h).
  const TraceUnit& trace_info() const { return trace_info_; }

  // --- asked by the ShardedModel (fsdp/sharded_model.h), which never reaches the flat
  // parameter itself ---------------------------------------------------------------------
  UnitInfo info() const;
  // This unit's part of ShardedModel::parameters(): its master shard when every parameter
  // trains; the non-empty shard views of the trainable ones when it mixes frozen and
  // trainable; nothing when none trains or it holds no element (Note [Frozen parameters]).
  std::vector<at::Tensor> optimizer_params() const;
  // This unit's part of ShardedModel::named_parameters(): per parameter its name and shard view
  // (Note [Original-parameter views]); from now on the unit keeps the views' .grad current.
  std::vector<std::pair<std::string, at::Tensor>> named_shard_views();
  // This unit's term of clip_grad_norm_'s total, written into `out` (a zero 0-dim fp32 tensor
  // on the device): the squared norm in fp32 of this rank's master gradient, the views' .grad
  // absorbed first (zero_grad on the views since the reduction), as the global norm counts it:
  // a NO_SHARD unit's on shard rank 0 only; with tensor parallelism (`tp`,
  // fsdp/tensor_parallel.h) on tp ranks other than 0 only its split parameters' parts. Nothing
  // when there is no gradient. Local (the caller sums over the ranks).
  void grad_norm_sq(const at::Tensor& out, const TensorParallel* tp);
  // Scales the master gradient by `coef` in place (Note [Low-precision master gradient]: below
  // fp32 in fp32, rounded once). No-op without a gradient.
  void scale_grad(double coef);
  // Collective over the shard group: appends, per parameter, its name and full value gathered
  // from the master shards (`grads`: from the master gradient, the views' .grad absorbed first;
  // zeros of its dtype when there is none), a new tensor of the parameter's shape.
  void gather_full(bool grads, std::vector<std::pair<std::string, at::Tensor>>& out);
  // What this unit hands a FusedAdamW that attaches itself (optim/attach.h): its flat parameter.
  void offer_to(AttachTarget& target) const;

  // --- driven by the runtime (fsdp/runtime.h) -------------------------------------------
  // Marks the unit entered in this forward / its backward begun; true the first time per step.
  bool mark_called_in_forward();
  bool mark_pre_backward();
  // A member's forward is about to run: unshard (NO_SHARD: re-cast the master into the compute
  // copy on the first member call), then order the compute stream after the all-gather.
  void pre_forward(const torch::nn::Module* member);
  // A member's forward ran: after the unit's last member call, reshard if it reshards after
  // forward or if no backward will come (`grad_enabled`: the runtime passes whether it hooked
  // this call's outputs for backward; false under NoGradGuard or when none requires grad).
  void post_forward(const torch::nn::Module* member, bool grad_enabled);
  void pre_backward();         // unshard again; prepare the flat gradient
  void post_backward();        // reduce (if syncing) + reshard; idempotent per backward
  // Gradient sync for the following backward passes (ShardedModel::set_requires_gradient_sync).
  void set_requires_grad_sync(bool sync) { requires_grad_sync_ = sync; }

  // Gathers the parameters if sharded (counted as a forward or backward all-gather); the
  // runtime's prefetch calls it for units ahead of the one running.
  void unshard(bool for_backward);
  // Orders the compute stream after this unit's pending all-gather (no-op if none).
  void wait_unsharded();
  void reshard();
  // End of a backward pass: clears per-step state.
  void reset_step_state();

  // Note [Frozen parameters]: a unit without trainable parameters gets no AccumulateGrad
  // hook; the runtime wraps the inputs of its calls that require grad and reports each one in
  // forward (backward=false) and when its gradient is computed (true): after the last, the
  // unit's backward no longer reads its parameters and it post-backwards (reshards) at once
  // instead of staying gathered until the end of backward.
  void on_frozen_input(bool backward);
  // Throws if a parameter's requires_grad differs from what it was at setup.
  void check_trainable_unchanged(int rank) const;

  // Note [CUDA graph step] (fsdp/cuda_graph.h): autograd runs an AccumulateGrad node on the
  // stream current when the node was made, and the unit keeps its parameters' nodes alive from
  // fully_shard on. This drops them and hooks fresh ones, made on the current stream (an old
  // node still referenced by a live autograd graph is reused as it is).
  void rehook_grad_accumulators();

  // --- driven by autograd: the unit's own GradReadyHook (unit-local) ----------------------
  void on_grad_accumulated(size_t param_index);  // one parameter's AccumulateGrad finished

  bool called_in_forward() const { return called_in_forward_; }
  bool post_backward_done() const { return post_backward_done_; }

 private:
  bool has_collectives() const { return flat_->layout().padded_numel > 0; }

  int index_;
  UnitSpec spec_;
  ShardingStrategy strategy_;
  bool reshard_after_forward_;
  bool recompute_;
  std::vector<const torch::nn::Module*> members_;
  std::vector<std::vector<at::Tensor>> recompute_leaves_;  // per member; recompute units only
  const UnitContext& ctx_;  // streams, tracer, communicators, reduce buffers (runtime-owned)
  std::unique_ptr<FlatParam> flat_;
  TraceUnit trace_info_;  // filled once the flat parameter exists
  UnitState state_ = UnitState::kSharded;
  UnitCounters counters_;

  // Recorded on the all-gather stream after unshard(); the compute stream waits on it before
  // the parameters are read.
  StreamEvent all_gather_done_;
  bool all_gather_pending_ = false;
  // Recorded on the compute stream when the unit reshards; the all-gather stream waits on it
  // so memory freed to its pool is not rewritten while compute still reads it.
  StreamEvent compute_done_;
  // Scratch: orders a side stream after the compute stream's queued work.
  StreamEvent scratch_;
  // Recorded on the reduce-scatter stream after this unit's reduction.
  StreamEvent reduce_done_;

  // AccumulateGrad nodes of our parameters, held so the post hooks we add stay installed
  // (autograd caches them only weakly).
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;
  std::vector<uintptr_t> hook_keys_;
  void hook_grad_accumulators();  // fills the two above, one GradReadyHook per trainable one

  bool requires_grad_sync_ = true;  // set by the runtime between steps

  // Per-step state (reset at the end of backward).
  int64_t member_calls_ = 0;      // flatshard::call entries in this forward
  bool called_in_forward_ = false;
  bool pre_backward_done_ = false;
  int64_t grads_ready_ = 0;       // AccumulateGrad post hooks fired in this backward
  int64_t frozen_inputs_pending_ = 0;  // frozen unit: wrapped inputs whose gradient is not out
  bool post_backward_done_ = false;
};

// Times one hook of `unit` into its counters (host_forward_ns / host_backward_ns), from
// construction to destruction. A hook run inside another one on the same thread (the reduction
// a gradient hook triggers) is counted once, in the outer one.
class HookClock {
 public:
  HookClock(Unit& unit, bool backward);
  ~HookClock();
  HookClock(const HookClock&) = delete;
  HookClock& operator=(const HookClock&) = delete;

 private:
  Unit* unit_;  // nullptr: nested, not counted
  bool backward_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace flatshard
