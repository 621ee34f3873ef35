#include "collectives/nccl_mesh.h"

#include "collectives/env.h"
#include "collectives/launch_env.h"
#include "collectives/rendezvous.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace flatshard {

void NcclMesh::shutdown() {
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
