#include "fsdp/resolve.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "collectives/env.h"

namespace flatshard {

ResolvedUnit resolve_unit(const UnitSpec& spec, const ShardingOptions& options,
                          int shard_world_size) {
  TORCH_CHECK(shard_world_size >= 1, "unit '", spec.name, "': world size must be >= 1, got ",
              shard_world_size);
  ResolvedUnit r;
  r.strategy = spec.options.strategy.value_or(options.strategy);
  const bool reshard = spec.options.reshard_after_forward.value_or(
      spec.is_root ? false : options.reshard_after_forward);
  r.reshard_after_forward = reshard && r.strategy == ShardingStrategy::kFullShard;
  r.recompute = spec.options.recompute.value_or(false);
  TORCH_CHECK(!(r.recompute && spec.is_root), "unit '", spec.name,
              "': recompute is not supported on the root unit (its forward is the whole "
              "model's); set it on the layers' units instead, e.g. recompute:type=Block");

  const auto& mp = options.mixed_precision;
  r.flat.sharded = r.strategy != ShardingStrategy::kNoShard;
  r.flat.param_dtype = mp.param_dtype;
  r.flat.reduce_dtype = mp.reduce_dtype.value_or(mp.param_dtype);
  r.flat.align = options.align;
  r.flat.sync_module_states = options.sync_module_states;
  r.flat.poison_padding = env::debug();
  const int offload = spec.options.offload.value_or(options.offload);
  TORCH_CHECK(offload >= 0 && offload <= 2, "unit '", spec.name, "': offload level must be 0, 1 "
              "or 2, got ", offload);
  r.flat.offload = r.flat.sharded ? offload : std::min(offload, 1);
  r.layout_world_size = r.flat.sharded ? shard_world_size : 1;
  return r;
}

void check_recompute_plan(const Plan& plan) {
  for (const UnitSpec& u : plan.units) {
    if (!u.options.recompute.value_or(false)) continue;
    for (const std::string& p : u.module_paths)
      for (const UnitSpec& v : plan.units) {
        if (&v == &u) continue;
        for (const std::string& q : v.module_paths)
          TORCH_CHECK(q.size() <= p.size() || q.compare(0, p.size() + 1, p + ".") != 0,
                      "unit '", u.name, "' is recomputed but its member module '", p,
                      "' contains module '", q, "' of unit '", v.name,
                      "': a unit nested inside a recompute unit is not supported (its forward "
                      "would run again inside the backward); recompute the inner unit "
                      "instead, or drop the rule that makes it a unit");
      }
  }
}

}  // namespace flatshard
