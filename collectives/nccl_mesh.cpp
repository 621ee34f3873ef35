#include "collectives/nccl_mesh.h"

#include "collectives/env.h"
#include "collectives/launch_env.h"
#include "collectives/rendezvous.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace flatshard {

void NcclMesh::shutdown() {
  if (tp) tp->shutdown();
  if (replicate) replicate->shutdown();
  if (shard) shard->shutdown();
}

NcclMesh make_hsdp_groups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                          int shard_size, c10::Device device, const NcclOptions& options,
                          const std::string& prefix) {
  TORCH_CHECK(rank >= 0 && rank < world_size, "make_hsdp_groups: rank ", rank,
              " out of range for world size ", world_size);
  NcclMesh m;
  m.layout = HsdpLayout::make(world_size, shard_size);
  const int group = m.layout.shard_group(rank), pos = m.layout.shard_rank(rank);
  // Shard groups first on every rank, then replicate groups: a group's members all reach its
  // creation (NCCL init blocks until they do) without waiting on another group's.
  m.shard = NcclCommunicator::create(store, pos, m.layout.shard, device, options,
                                     prefix + "/shard" + std::to_string(group));
  if (m.layout.replicate > 1)
    m.replicate = NcclCommunicator::create(store, group, m.layout.replicate, device, options,
                                           prefix + "/replicate" + std::to_string(pos));
  return m;
}

NcclMesh make_mesh_groups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                          const MeshShape& shape, c10::Device device, const NcclOptions& options,
                          const std::string& prefix) {
  TORCH_CHECK(world_size == shape.global_size(), "make_mesh_groups (rank ", rank, "): the mesh ",
              shape.to_string(), " has ", shape.global_size(), " ranks but the world has ",
              world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "make_mesh_groups: rank ", rank,
              " out of range for world size ", world_size);
  const int t = shape.tp(), s = shape.shard(), k = rank % t, dp = rank / t;
  NcclMesh m;
  m.layout = HsdpLayout::make(shape.data_parallel_size(), s);
  const int i = m.layout.shard_group(dp), j = m.layout.shard_rank(dp);
  // Groups named by their lowest global rank; created in the same order on every rank (shard,
  // replicate, tp) so each group's members reach its creation without waiting on another's.
  m.shard = NcclCommunicator::create(store, j, s, device, options,
                                     prefix + "/shard" + std::to_string(i * s * t + k));
  if (m.layout.replicate > 1)
    m.replicate = NcclCommunicator::create(store, i, m.layout.replicate, device, options,
                                           prefix + "/replicate" + std::to_string(j * t + k));
  if (t > 1)
    m.tp = NcclCommunicator::create(store, k, t, device, options,
                                    prefix + "/tp" + std::to_string(dp * t));
  return m;
}

NcclMesh make_hsdp_groups_from_env(int shard_size, const std::string& prefix) {
  const LaunchEnv e = LaunchEnv::from_env();
  const int s = hsdp_shard_size(e, shard_size);
  const int ndev = c10::cuda::device_count();
  TORCH_CHECK(e.local_rank < ndev, "make_hsdp_groups_from_env (rank ", e.rank, "): local rank ",
              e.local_rank, " selects CUDA device ", e.local_rank, " but only ", ndev,
              " CUDA devices are visible (CUDA_VISIBLE_DEVICES='", env::get("CUDA_VISIBLE_DEVICES"),
              "')");
  const auto dev = static_cast<c10::DeviceIndex>(e.local_rank);
  c10::cuda::set_device(dev);
  auto store = create_store(e, env::store_timeout());
  return make_hsdp_groups(store, e.rank, e.world_size, s, c10::Device(c10::kCUDA, dev),
                          NcclOptions::from_env(), prefix);
}

}  // namespace flatshard
