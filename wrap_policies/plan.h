// flatshard/wrap_policies/plan.h — the output of a wrap policy: which modules form which unit.
//
// A Plan is plain data: it can be printed, compared and tested without running anything.
// fully_shard() consumes it; it never changes the model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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
  bool operator==(const UnitOptions& o) const {
    return strategy == o.strategy && reshard_after_forward == o.reshard_after_forward;
  }
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

  // Human-readable table: one line per unit (name, modules, params, numel, strategy).
  std::string to_string() const;
  int64_t total_numel() const;
};

}  // namespace flatshard
