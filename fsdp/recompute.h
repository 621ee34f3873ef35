// flatshard/fsdp/recompute.h — activation checkpointing of a unit's forward (internal header).
//
// Note [Recompute]
// A unit with the recompute option (UnitOptions::recompute, spec "recompute:type=Block" or
// "keep+recompute:...", resolved in fsdp/resolve.h) saves no activations of its members'
// forward: flatshard::call runs the member's forward under no-grad and hands its outputs to one
// autograd node, RecomputeFunction, whose inputs are the call's tensor arguments (after the
// mixed-precision cast, so the recompute sees the same casted inputs) and the member's
// parameters. The node saves only the tensor arguments (and the RNG states). Its backward runs
// the forward again with grad on detached copies of the arguments (requires_grad as the
// originals) and differentiates the recomputed outputs, with the incoming gradients, with
// respect to those copies and the parameters (torch::autograd::grad): it returns the arguments'
// and the parameters' gradients to the engine. Why gradients to the parameters through the node
// rather than a reentrant backward() that accumulates into them: the engine then runs each
// parameter's AccumulateGrad once per backward, after every use, as without recompute — so
// flatshard's GradReadyHook counts stay right when a member is called twice, when a unit has
// several members, and when two forwards are summed before one backward; a reentrant backward
// would fire the hooks once per call and reduce the unit before its last gradient.
//
// Collectives: the node's outputs get the unit's pre-backward as any unit output does (a
// pre-hook on this node, Note [Pre-backward hook], runtime.cpp), so in backward the unit's pre-backward unshards first (its one backward
// all-gather, or the kept buffer for SHARD_GRAD_OP / keep / NO_SHARD); the node finds the unit
// unsharded and recomputes on those parameters: no second all-gather, and none counted as a
// forward gather. The recompute calls the member's forward directly, not through call/enter, so
// no pre/post-forward bookkeeping runs again (member call counts, order recording, prefetch).
// The unit's post-backward (reduce-scatter, reshard) follows from its parameters' AccumulateGrad
// hooks as usual.
//
// RNG: like torch.utils.checkpoint, the default CPU generator's state — and, on a CUDA unit, the
// device's default CUDA generator's — is read before the first forward; the recompute sets it,
// runs, and restores the state it found, so dropout draws the same mask twice and the caller's
// random stream is unchanged by backward. With ranks as threads all ranks share the CPU
// generator: dropout is then not reproducible across ranks with or without recompute.
//
// Scope and limits:
// - Grad mode only. Under NoGradGuard / InferenceMode a recompute unit runs normally.
// - Only flatshard::call knows the arguments: entering a recompute unit through
//   flatshard::enter in grad mode throws (use call). The root cannot be recomputed (resolve.h).
// - Tensors that need gradients must reach the forward as arguments (at::Tensor or
//   std::vector<at::Tensor>) or as parameters of the member's module tree. Other arguments are
//   copied by value; a tensor hidden inside one (a struct holding tensors, a captured reference)
//   is a constant for the recompute: it gets no gradient.
// - Nested units: fully_shard and explain reject a recompute unit whose member contains another
//   unit's members (check_recompute_plan, resolve.h); a recompute unit nested inside an ordinary
//   unit is fine.
// - No double backward through a recomputed unit (the recompute runs with create_graph off).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "fsdp/unit_entry.h"

namespace flatshard {
namespace detail {


// The unit recomputes (Note [Recompute]) and grad mode is on: flatshard::call takes the
// recompute path.
bool recompute_active(const UnitEntry& e);
// flatshard::enter on a recompute unit in grad mode: throws, naming the unit.
[[noreturn]] void reject_enter_recompute(const UnitEntry& e);

// The member's forward on these tensor arguments, outputs flattened (OutputAdapter order).
using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Generator states read before a recomputed unit's forward.
struct RngStates {
  at::Tensor cpu;
  at::Tensor device;  // undefined unless the unit runs on CUDA
  c10::Device device_id{c10::kCPU};
};
RngStates save_rng_states(const UnitEntry& e);

// `outputs` came from `fn(inputs)` under no-grad; returns them as outputs of one
// RecomputeFunction node (undefined ones stay undefined) whose backward recomputes.
std::vector<at::Tensor> attach_recompute(const UnitEntry& e, const torch::nn::Module* member,
                                         std::vector<at::Tensor> inputs,
                                         std::vector<at::Tensor> outputs, RecomputeFn fn,
                                         RngStates rng);

}  // namespace detail
}  // namespace flatshard
