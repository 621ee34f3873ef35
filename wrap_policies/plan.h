// flatshard/wrap_policies/plan.h — the output of a wrap policy: which modules form which unit.
//
// A Plan is plain data: it can be printed, compared and tested without running anything.
// fully_shard() consumes it; it never changes the model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "support/dtype_name.h"  // GatherDtype

namespace flatshard {

// Per-unit sharding strategy (FSDP's names).
enum class ShardingStrategy {
  kFullShard,    // shard params; all-gather in forward, again in backward; reduce-scatter grads
  kShardGradOp,  // shard params; keep them gathered from forward to backward; reduce-scatter grads
  kNoShard,      // replicate params on every rank; all-reduce grads (the opt-out)
};
const char* to_string(ShardingStrategy s);

// Options a policy rule may set on the units it creates; unset fields take the
// ShardingOptions defaults given to fully_shard().
struct UnitOptions {
  std::optional<ShardingStrategy> strategy;
  std::optional<bool> reshard_after_forward;  // FULL_SHARD only; false behaves like SHARD_GRAD_OP
  // Activation checkpointing: the unit's forward runs without saving activations and is run
  // again in its backward (Note [Recompute], fsdp/recompute.h). Unset = off (ShardingOptions has
  // no default for it). Not allowed on the root unit, nor on a unit whose member modules
  // contain another unit's members (fully_shard and explain reject both, fsdp/resolve.h).
  std::optional<bool> recompute;
  // CPU offload level (Note [CPU offload], flat_param/offload.h): 0 off; 1 the fp32 master
  // shard, its gradient and the optimizer's state in host memory, the device keeping a
  // compute-dtype shard; 2 that shard on the host too. Unset: ShardingOptions::offload.
  std::optional<int> offload;
  // The all-gathers' wire format (flat_param/quantized_gather.h; spec words gather_param,
  // gather_fp8, gather_int8). Unset: MixedPrecision::gather_dtype. A sharded unit only: set to
  // fp8 or int8 on a NO_SHARD unit it is an error (fsdp/resolve.h).
  std::optional<GatherDtype> gather_dtype;
  bool operator==(const UnitOptions& o) const {
    return strategy == o.strategy && reshard_after_forward == o.reshard_after_forward &&
           recompute == o.recompute && offload == o.offload && gather_dtype == o.gather_dtype;
  }
  bool operator!=(const UnitOptions& o) const { return !(*this == o); }
};

struct UnitSpec {
  // Display name: the member module path ("blocks.3"), a range for grouped units
  // ("blocks.0-1"), or "<root>" for the root unit.
  std::string name;
  // Paths of the modules whose flatshard::call() enters this unit, in registration order.
  // Empty for the root unit (entered by ShardedModel itself / flatshard::call on the model).
  std::vector<std::string> module_paths;
  // Fully-qualified names of the parameters this unit owns, in model registration order.
  // Each parameter (by identity) is owned by exactly one unit.
  std::vector<std::string> param_names;
  int64_t numel = 0;  // sum of the owned parameters' numel (no padding)
  bool is_root = false;
  UnitOptions options;
};

struct Plan {
  // Units in model registration order (a proxy for execution order; the runtime records the
  // real order on the first step). The root unit is always present and always first.
  std::vector<UnitSpec> units;
  // Parameters that appear under several paths (tied weights): first path -> other paths.
  // They are owned by the innermost unit containing all their paths (often the root).
  std::vector<std::pair<std::string, std::vector<std::string>>> tied;

  // How many modules the policy matched (the root never counts), before grouping and before
  // dropping empty units. 0 means the policy matches nothing in this model: the plan is still
  // valid (the root unit owns everything) but a CLI may want to reject the policy.
  int64_t matched_modules = 0;
  // How many rules the policy had (make_plan sets it). 0: the root alone was asked for ('none',
  // flatshard-bench's 'model', root options only), so matching nothing is no typo.
  int64_t policy_rules = 0;
  // Display names of units the policy formed that own no parameter (a matched module without
  // parameters, or one whose parameters all belong to units nested inside it). They are left out
  // of `units`: a unit without a flat parameter would have nothing to gather.
  std::vector<std::string> empty_units;

  // Human-readable table: one line per unit (name, modules, params, numel, strategy with
  // " recompute" when set), then a summary line (units, total numel, tied parameters).
  std::string to_string() const;
  int64_t total_numel() const;
  int64_t match_count() const { return matched_modules; }
  // Likely mistakes in the policy found while making the plan, one sentence each: a rule that
  // matches no module because an earlier rule claims every module it would match (Note
  // [Shadowed rules], make_plan.cpp). fully_shard warns with them; explain() lists them.
  std::vector<std::string> warnings;
  // Set by make_plan only when the policy had rules and matched no module, for
  // unmatched_warning(): the policy's spec (Policy::to_spec), the model's type names as a
  // policy writes them (policy_type_name, each once, registration order, the root's left out)
  // and the root's children's paths.
  std::string policy_spec;
  std::vector<std::string> model_types;
  std::vector<std::string> top_level_paths;

  // The message for a plan whose policy had rules and matched no module, so the root unit
  // would hold the whole model: the policy, and the model's type names and top-level paths
  // (what the policy could have said), escaped for a terminal; "" otherwise (a policy without
  // rules, 'none', asks for the root alone). One text, used by fully_shard (an error unless
  // ShardingOptions::strict_plan is false, then a warning), explain() (a warning) and
  // flatshard-bench (an error).
  std::string unmatched_warning() const;
  // The unit named `name`, or nullptr.
  const UnitSpec* find(const std::string& name) const;
};

}  // namespace flatshard
