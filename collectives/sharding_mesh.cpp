#include "collectives/sharding_mesh.h"

#include <c10/util/Exception.h>

namespace flatshard {

HsdpLayout HsdpLayout::make(int world_size, int shard_size) {
  TORCH_CHECK(world_size >= 1, "HSDP layout: world size must be >= 1, got ", world_size);
  TORCH_CHECK(shard_size >= 1 && shard_size <= world_size && world_size % shard_size == 0,
              "HSDP layout: the shard-group size ", shard_size,
              " must divide the world size ", world_size, " (N = replicas x shard size)");
  return HsdpLayout{world_size / shard_size, shard_size};
}

int hsdp_shard_size(const LaunchEnv& env, int requested) {
  if (requested > 0) return HsdpLayout::make(env.world_size, requested).shard;
  const char* var = env.launcher == LaunchEnv::Launcher::kTorchrun ? "LOCAL_WORLD_SIZE"
                    : env.launcher == LaunchEnv::Launcher::kSlurm
                        ? "SLURM_NTASKS_PER_NODE (or a uniform SLURM_TASKS_PER_NODE)"
                        : "OMPI_COMM_WORLD_LOCAL_SIZE";
  TORCH_CHECK(env.local_world_size > 0, "HSDP (rank ", env.rank, "): no shard-group size given and ",
              to_string(env.launcher), " did not say how many ranks run per node (", var,
              " is unset); pass the shard-group size explicitly");
  TORCH_CHECK(env.world_size % env.local_world_size == 0, "HSDP (rank ", env.rank,
              "): ranks per node ", env.local_world_size, " (", var, ") does not divide the world size ",
              env.world_size, "; nodes with different rank counts need an explicit shard-group size");
  return env.local_world_size;
}

}  // namespace flatshard
