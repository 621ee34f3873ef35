#include "fsdp/resolve.h"

#include <c10/util/Exception.h>

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

  const auto& mp = options.mixed_precision;
  r.flat.sharded = r.strategy != ShardingStrategy::kNoShard;
  r.flat.param_dtype = mp.param_dtype;
  r.flat.reduce_dtype = mp.reduce_dtype.value_or(mp.param_dtype);
  r.flat.align = options.align;
  r.flat.sync_module_states = options.sync_module_states;
  r.flat.poison_padding = env::debug();
  r.layout_world_size = r.flat.sharded ? shard_world_size : 1;
  return r;
}

}  // namespace flatshard
