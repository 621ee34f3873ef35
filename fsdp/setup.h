// flatshard/fsdp/setup.h — fully_shard's setup, in named steps (internal header; FSDP2's
// _fsdp_init.py).
//
// setup_runtime() runs, in order: the inputs' checks (the plan starts with the root, no unit
// nested in a recompute unit, a policy that matched nothing is an error unless strict_plan is
// off), the model is not sharded already, the Runtime, the setup fingerprint agreed over the
// mesh, deferred initialization of a meta model's buffers (Note [Deferred initialization],
// fsdp/deferred_init.h), the buffers' cast and broadcast, one Unit per plan entry (resolved by
// fsdp/resolve.h), every parameter claimed, and the members registered for flatshard::call.
// Collective over every rank of the mesh. A failure throws and leaves nothing registered.
#pragma once

#include <memory>

#include "collectives/mesh.h"
#include "fsdp/options.h"
#include "fsdp/runtime.h"
#include "wrap_policies/plan.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {
namespace detail {

std::unique_ptr<Runtime> setup_runtime(const std::shared_ptr<torch::nn::Module>& model,
                                       const Plan& plan, const Mesh& mesh,
                                       ShardingOptions options);

}  // namespace detail
}  // namespace flatshard
