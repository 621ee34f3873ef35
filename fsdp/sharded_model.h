// flatshard/fsdp/sharded_model.h — fully_shard(): turn a torch::nn::Module into sharded units.
//
//   auto plan  = flatshard::make_plan(*model, flatshard::Policy::by_type({"Block"}));
//   auto fsdp  = flatshard::fully_shard(model, plan, comm);          // comm: Communicator&
//   torch::optim::AdamW opt(fsdp->parameters(), ...);                  // fp32 master shards
//   auto loss  = flatshard::call(model, x, y);  ... loss.backward();  opt.step();
//
// Contract
// - Collective: every rank calls fully_shard with the same plan and options, on models with the
//   same parameter shapes. Parameters must already be on comm.device() — or all on the meta
//   device (built under flatshard::MetaInit): then fully_shard materialises and initialises
//   the model unit by unit on comm.device() (ShardingOptions::init, by default the model's
//   own InitializesItself), never holding more than the rank's shards and one unit's full
//   parameters (Note [Deferred initialization], fsdp/deferred_init.h); with
//   ShardingOptions::load each rank reads its shards' values from a file instead (Note [Loading
//   into shards]).
// - The model is changed in place: each planned parameter becomes a view of its unit's flat
//   buffer (storage freed while sharded; reading it then throws naming it, fsdp/call.h).
//   Modules run unchanged; parents enter units through flatshard::call (fsdp/call.h), and the
//   training loop enters the root the same way. A model (or part of one) already sharded is
//   rejected before anything is built. A plan whose policy matched no module fails, naming the
//   model's types and top-level paths (ShardingOptions::strict_plan = false: warns); a rule
//   that matches nothing because earlier rules claim its modules warns (Plan::warnings).
// - The optimizer must be built on parameters() (fp32 master shards: one tensor per fully
//   trainable unit, per-parameter views for units with frozen parameters) or on
//   named_parameters() (per-parameter views of every unit, for parameter groups). Gradients arrive
//   there averaged over ranks, after backward returns.
// - Frozen parameters (requires_grad false before fully_shard) may share units with trainable
//   ones: no gradient is computed or reduced for them, they are no optimizer parameters, their
//   values never change (Note [Frozen parameters], fsdp/unit.cpp). requires_grad is fixed at setup.
// - Parameters unused in a step get zero gradients (like FSDP's flat parameters).
// - The ShardedModel must outlive every forward/backward through the model and must be
//   destroyed on every rank (it unregisters the units). Not copyable.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/sharding_mesh.h"
#include "fsdp/options.h"
#include "fsdp/trace.h"
#include "fsdp/unit.h"
#include "wrap_policies/plan.h"
#include "wrap_policies/policy.h"

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace flatshard {

class FusedAdamW;
class Runtime;

struct StepCounters {
  UnitCounters total;
  std::vector<UnitCounters> per_unit;  // in plan order
};

class ShardedModel {
 public:
  ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan, Communicator& comm,
               ShardingOptions options);
  // HSDP: shard within mesh.shard(), average gradients across mesh.replicate() too.
  ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan, const ShardingMesh& mesh,
               ShardingOptions options);
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  // The optimizer's parameters (fp32): per non-empty unit whose parameters all train, its master
  // shard (one tensor: the fused one-launch path); per unit mixing frozen and trainable
  // parameters, the non-empty shard views of its trainable ones; nothing for a wholly frozen
  // unit (Note [Frozen parameters]). An optimizer on these never moves a frozen value.
  std::vector<at::Tensor> parameters() const;
  // Per original parameter (plan order, tied aliases once, under their first name): this rank's
  // part of its fp32 master shard, 1-D, possibly empty, requires_grad as the parameter (FSDP's
  // use_orig_params; Note [Original-parameter views], flat_param/flat_param.h). For parameter
  // groups by name:
  //   for (auto& [name, p] : fsdp->named_parameters())
  //     if (p.requires_grad()) (no_decay(name) ? plain : decayed).push_back(p);
  // Calling it switches every unit to keeping the views' .grad current (a few host ops per
  // parameter per step); build the optimizer on either these views or parameters(), not both.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters();
  // Throws if `opt` holds a tensor that is not one of parameters() (naming it: the model's
  // original parameter by name, or its group/index); warns (TORCH_WARN) naming the units whose
  // master it lacks. Local, no collectives (fsdp/optimizer_check.cpp). Without this call, a
  // StepGuard warns after many reduced steps that changed no master (fsdp/step_guard.h).
  void check_optimizer(const torch::optim::Optimizer& opt) const;
  // The fused optimizer attaches itself (flatshard::attach, optim/attach.h: the checks and
  // their order are there); this hands it the units, check_optimizer (run on it first) and the
  // offload stepper. What it takes on:
  // - ShardingOptions::offload_step = kBackward or kDelayed (Note [Offload step in backward],
  //   fsdp/offload_step.h): the optimizer flatshard steps offloaded units with during backward.
  //   Its step() then steps only the rest, after waiting for those steps (kBackward; kDelayed
  //   does not wait: Note [Delayed offload step]).
  // - NO_SHARD units below fp32 (Note [Compute copy in the step], optim/fused_adamw.h): its
  //   step() writes their compute-dtype copies in the same pass, so their next gather recasts
  //   nothing (any offload_step; FLATSHARD_STEP_COMPUTE_COPY=0 turns it off).
  // Throws when the model has neither. Keep using `opt` as usual (step, zero_grad, schedulers).
  void attach_optimizer(std::shared_ptr<FusedAdamW> opt);
  // Waits for the CPU optimizer steps flatshard runs (offload_step = kBackward or kDelayed; a
  // no-op otherwise). Everything in this class that reads masters or gradients, and the
  // checkpoint functions, call it; code reading master() or the optimizer's state directly
  // must too.
  void wait_offload_steps() const;
  // wait_offload_steps(), and with offload_step = kDelayed the next forward reads the newest
  // masters instead of the one-step-stale device copies (before evaluating the trained model;
  // checkpoint loads call it). The step after it is not delayed. A wait otherwise.
  void sync_offload_params();
  const Plan& plan() const { return plan_; }
  const ShardingOptions& options() const;
  std::vector<UnitInfo> units() const;
  // The shard group (all ranks without HSDP): gathers, clipping and checkpoints use it.
  Communicator& comm() const { return comm_; }
  const ShardingMesh& mesh() const { return mesh_; }
  // The wrapped module (checkpoints read its buffers and parameter order).
  torch::nn::Module& module() const { return *model_; }
  // The units in plan order, for code that walks their flat parameters (checkpoint/).
  size_t num_units() const;
  const Unit& unit(size_t i) const;
  Unit& unit(size_t i);

  StepCounters counters() const;
  void reset_counters();

  // Gradient accumulation: with sync off, backward keeps accumulating into the units' flat
  // gradients without communicating (SHARD/FULL units keep them unsharded-size in memory);
  // the next backward with sync on reduces the sum.
  void set_requires_gradient_sync(bool sync);

  // Clips the global gradient norm across all shards and units (replicated units counted
  // once) like torch.nn.utils.clip_grad_norm_; returns the total norm before clipping.
  // Collective. With HSDP over the shard group only: replicas hold identical gradients, so
  // the shard group's norm already is the global one. With tensor parallelism
  // (fsdp/tensor_parallel.h) split parameters are summed over the tp group, replicated ones
  // counted once. error_if_nonfinite (torch's option of
  // that name): a NaN or infinite total throws on every rank, naming the first unit (plan
  // order) whose gradient is non-finite, and leaves the gradients unchanged.
  double clip_grad_norm_(double max_norm, bool error_if_nonfinite = false);

  // Collective: the full fp32 value of every planned parameter, by original name, on every
  // rank (gathered from the master shards; with HSDP within the shard group). Tied
  // parameters appear under each of their names.
  std::vector<std::pair<std::string, at::Tensor>> gather_full_params() const;
  // Collective: the same for the master gradients (zeros where a unit has none yet), in their
  // dtype (Note [Low-precision master gradient], flat_param/collective_plan.h).
  std::vector<std::pair<std::string, at::Tensor>> gather_full_grads() const;

  // Tracing (fsdp/trace.h; ShardingOptions::trace or FLATSHARD_TRACE). All are no-ops when off.
  // The optimizer step in the trace:  { auto t = fsdp->trace_optimizer_step(); opt.step(); }
  TraceScope trace_optimizer_step();
  // Writes the trace file now (it is also written when the ShardedModel is destroyed) and
  // returns its path; "" when tracing to a file is off. Waits for pending GPU events.
  std::string write_trace();
  Tracer* tracer() const;  // nullptr when off

 private:
  std::vector<std::pair<std::string, at::Tensor>> gather_full(bool grads) const;

  std::shared_ptr<torch::nn::Module> model_;
  Plan plan_;
  Mesh mesh_;           // the rank layout (collectives/mesh.h)
  Communicator& comm_;  // mesh_.shard()
  std::unique_ptr<Runtime> runtime_;
  // Expires with this model: what attach_optimizer hands an optimizer checks it (Note [Compute
  // copy in the step]).
  std::shared_ptr<char> alive_ = std::make_shared<char>(0);
};

std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Plan& plan, Communicator& comm,
                                          ShardingOptions options = {});
// Same, with the plan made from `policy` (make_plan).
std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Policy& policy, Communicator& comm,
                                          ShardingOptions options = {});
// Hybrid sharding (HSDP, collectives/mesh.h): every unit is sharded within
// mesh.shard() (all-gather, reduce-scatter) and its gradient shard averaged across
// mesh.replicate() (one all-reduce per unit per step, on the reduce-scatter stream); NO_SHARD
// units all-reduce over both groups. Gradients are the mean over all R * S ranks. Collective
// over all of them; plan and options as above.
std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Plan& plan, const ShardingMesh& mesh,
                                          ShardingOptions options = {});
std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Policy& policy, const ShardingMesh& mesh,
                                          ShardingOptions options = {});

}  // namespace flatshard
