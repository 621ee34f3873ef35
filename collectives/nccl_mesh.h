// flatshard/collectives/nccl_mesh.h — HSDP process groups over NCCL (CUDA builds only).
//
// Contract
// - make_hsdp_groups(...) is collective over all N = R * S processes of the job: every process
//   creates its shard-group communicator (S ranks, NCCL ranks = shard ranks) and then, when
//   R > 1, its replicate-group communicator (R ranks), from the one rendezvous store. Groups
//   use distinct store prefixes ("<prefix>/shard<i>", "<prefix>/replicate<j>") because
//   NcclCommunicator::create() has the group's rank 0 publish the NCCL ids under
//   "<prefix>/nccl_ids/<n>", n counting creations per prefix in this process: every member of
//   a group creates it in the same order, so members agree on n.
// - Each NcclCommunicator holds two NCCL communicators (one per lane); the replicate group's
//   gradient all-reduce runs on its reduce-scatter lane, issued on the runtime's reduce-scatter
//   stream, so it overlaps the shard group's all-gathers and later layers' backward.
// - With R == 1 there is no replicate communicator (plain FULL_SHARD over the node);
//   with S == 1 the shard group has one rank (replicated training, like DDP).
// - make_mesh_groups(...) adds tensor parallelism: N = R * S * T processes, global rank
//   r = (i * S + j) * T + k (collectives/mesh.h); every process creates its shard group, then its
//   replicate group (R > 1), then its tp group (T > 1: T consecutive ranks, one node's NVLink
//   domain), under "<prefix>/shard<g>", "<prefix>/replicate<g>", "<prefix>/tp<g>" where g is the
//   group's lowest global rank.
// - shutdown() shuts every group down (collective, see NcclCommunicator::shutdown()).
#pragma once

#include "collectives/nccl_communicator.h"
#include "collectives/sharding_mesh.h"

#include <memory>
#include <string>

namespace flatshard {

struct NcclMesh {
  HsdpLayout layout;
  std::unique_ptr<NcclCommunicator> shard;
  std::unique_ptr<NcclCommunicator> replicate;  // null when layout.replicate == 1
  std::unique_ptr<NcclCommunicator> tp;         // null without tensor parallelism (T == 1)

  Mesh mesh() const { return Mesh(*shard, replicate.get(), tp.get()); }
  void shutdown();
};

NcclMesh make_hsdp_groups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                          int shard_size, c10::Device device, const NcclOptions& options,
                          const std::string& prefix = "flatshard");

// The 3-D mesh of `shape` (replicate x shard x tp); world_size == shape.global_size().
NcclMesh make_mesh_groups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                          const MeshShape& shape, c10::Device device, const NcclOptions& options,
                          const std::string& prefix = "flatshard");

// From the launcher's environment (as NcclCommunicator::from_env): device cuda:LOCAL_RANK,
// shard-group size hsdp_shard_size(env, shard_size), i.e. the node unless given.
NcclMesh make_hsdp_groups_from_env(int shard_size = 0, const std::string& prefix = "flatshard");

}  // namespace flatshard
