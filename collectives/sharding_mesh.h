// flatshard/collectives/sharding_mesh.h — the 2-D rank layout of hybrid sharding (HSDP).
//
// Contract
// - N ranks form R replicas of a shard group of S ranks (N = R * S). Global rank r = i * S + j
//   is rank j of shard group i and rank i of replicate group j. Shard groups are blocks of
//   consecutive ranks, so with one process per GPU and S = GPUs per node, a shard group is a
//   node: all-gathers and reduce-scatters stay on NVLink; only the replicate all-reduce of the
//   (1/S-sized) gradient shards crosses the network.
// - The mesh itself (the two communicators of one rank, global ranks) is collectives/mesh.h;
//   `replicate == nullptr` (or a replicate group of one rank) is plain FULL_SHARD over `shard`.
// - hsdp_shard_size(): an explicit size (> 0) wins; otherwise the launcher's ranks per node
//   (LaunchEnv::local_world_size: LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE/SLURM_TASKS_PER_NODE,
//   OMPI_COMM_WORLD_LOCAL_SIZE). Errors name the sizes, the variables and the rank.
// - Pure: no communication, no CUDA.
#pragma once

#include "collectives/communicator.h"
#include "collectives/launch_env.h"
#include "collectives/mesh.h"

namespace flatshard {

struct HsdpLayout {
  int replicate = 1;  // R: number of shard groups (replicas)
  int shard = 1;      // S: ranks per shard group

  // Checks world_size == R * S for shard_size S (> 0, dividing world_size).
  static HsdpLayout make(int world_size, int shard_size);
  int world_size() const { return replicate * shard; }
  int shard_group(int rank) const { return rank / shard; }  // == the rank in its replicate group
  int shard_rank(int rank) const { return rank % shard; }   // == which replicate group
  int global_rank(int shard_group, int shard_rank) const { return shard_group * shard + shard_rank; }
};

// The shard-group size for HSDP: `requested` if > 0, else env.local_world_size.
int hsdp_shard_size(const LaunchEnv& env, int requested = 0);

// The HSDP mesh is a Mesh (collectives/mesh.h) of a shard and a replicate group; the name stays
// for callers that build it as ShardingMesh(shard, &replicate).
using ShardingMesh = Mesh;

}  // namespace flatshard
