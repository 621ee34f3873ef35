// flatshard/benchmarks/bench_granularity.h — the granularities flatshard-bench compares, from
// their names or wrap-policy specs to plans.
//
// Contract
// - split_granularities(): each --granularity flag is a comma list. Pieces that are a known
//   name ("local", "leaf", "layer", "every-K", "model", "noshard") stand alone; any other piece
//   is a policy spec and the pieces after it that are not known names continue it (joined by
//   ',' again), so "layer,every=2,type=Block" is ["layer", "every=2,type=Block"]. Empty pieces
//   are errors. Pieces of different flags never join.
// - resolve_granularity() maps a label to a Policy (names: see the --help footer in
//   bench_options.cpp) with the module types of `modules` (the model's family: layer = one unit
//   per layer type, leaf = one per leaf type) and makes its plan on `model` (pure; runs nothing). It throws UsageError
//   for an unknown name, a malformed spec (the parser's message, which names the column and the
//   token) and a policy that matches no module — except `model` and `local`, which match
//   nothing by design.
// - with_recompute() sets the recompute option on every non-root unit of a granularity's plan
//   (--recompute) and appends "+recompute" to its label; `local` and plans without non-root
//   units are returned unchanged.
#pragma once

#include <string>
#include <vector>

#include "fsdp/options.h"
#include "models/family.h"
#include "wrap_policies/plan.h"
#include "wrap_policies/policy.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {
namespace bench {

struct Granularity {
  std::string label;   // as the user wrote it: "layer", "every-2", or a policy spec
  bool local = false;  // the unsharded floor: no plan, one rank, no communication
  Policy policy;       // empty for local and model
  Plan plan;           // made on the planning model; every rank's model has the same tree
};

std::vector<std::string> split_granularities(const std::vector<std::string>& flags);

Granularity with_recompute(Granularity g);
// Every unit (the root too) at CPU offload `level` (Note [CPU offload]), "+offloadN" appended
// (and "+bwdstep" / "+delayed" for those offload steps: Note [Offload step in backward]);
// `local` and level 0 are returned unchanged.
Granularity with_offload(Granularity g, int level,
                         OffloadStep step = OffloadStep::kAfterBackward);
// The offload level with_offload() gave `g`'s plan (0: none, or local).
int offload_of(const Granularity& g);

Granularity resolve_granularity(const std::string& label, const torch::nn::Module& model,
                                const models::FamilyModules& modules);

}  // namespace bench
}  // namespace flatshard
