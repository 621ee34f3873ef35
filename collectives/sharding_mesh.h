// flatshard/collectives/sharding_mesh.h — the 2-D rank layout of hybrid sharding (HSDP).
//
// Contract
// - N ranks form R replicas of a shard group of S ranks (N = R * S). Global rank r = i * S + j
//   is rank j of shard group i and rank i of replicate group j. Shard groups are blocks of
//   consecutive ranks, so with one process per GPU and S = GPUs per node, a shard group is a
//   node: all-gathers and reduce-scatters stay on NVLink; only the replicate all-reduce of the
//   (1/S-sized) gradient shards crosses the network.
// - ShardingMesh names the two communicators of one rank. `replicate == nullptr` (or a
//   replicate group of one rank) is plain FULL_SHARD over `shard`. Neither is owned.
// - hsdp_shard_size(): an explicit size (> 0) wins; otherwise the launcher's ranks per node
//   (LaunchEnv::local_world_size: LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE/SLURM_TASKS_PER_NODE,
//   OMPI_COMM_WORLD_LOCAL_SIZE). Errors name the sizes, the variables and the rank.
// - Pure: no communication, no CUDA.
#pragma once

#include "collectives/communicator.h"
#include "collectives/launch_env.h"

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

struct ShardingMesh {
  Communicator* shard = nullptr;      // all-gather / reduce-scatter group (required)
  Communicator* replicate = nullptr;  // gradient all-reduce across replicas; nullptr: none

  ShardingMesh() = default;
  explicit ShardingMesh(Communicator& shard_group, Communicator* replicate_group = nullptr)
      : shard(&shard_group), replicate(replicate_group) {}
  // True when gradients must also be averaged across replicas.
  bool hybrid() const { return replicate != nullptr && replicate->world_size() > 1; }
  int replicate_size() const { return replicate ? replicate->world_size() : 1; }
  int replicate_rank() const { return replicate ? replicate->rank() : 0; }
  // Rank and size over all R * S ranks.
  int global_rank() const { return replicate_rank() * shard->world_size() + shard->rank(); }
  int global_size() const { return replicate_size() * shard->world_size(); }
  // Throws (naming the rank) unless `shard` is set and both groups share a device.
  void check() const;
};

}  // namespace flatshard
