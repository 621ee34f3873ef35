// flatshard/collectives/mesh.h — the rank layout of one model: named dimensions, one object.
//
// Contract
// - A Mesh names one Communicator per dimension it has, outermost first: `replicate` (HSDP:
//   gradients averaged across replicas), `shard` (all-gathers and reduce-scatters) and `tp`
//   (tensor parallelism, innermost as torchtitan's [dp_replicate, dp_shard, tp]: the all-reduces
//   of the modules a TP plan names, tp/tensor_parallel.h). The data-parallel ranks are those of
//   replicate x shard; the ranks of one tp group see the same batch.
//   The global rank is row-major over the dimensions in MeshDim's order: with R replicas of a
//   shard group of S ranks, global rank r = i * S + j is rank j of shard group i and rank i of
//   replicate group j (collectives/sharding_mesh.h: HsdpLayout, run_ranks_2d, make_hsdp_groups);
//   with a tp group of T ranks, r = (i * S + j) * T + k (run_ranks_3d, make_mesh_groups), so a
//   tp group is T consecutive ranks (one node's NVLink domain).
// - Code asks the mesh for a group (`group(MeshDim::kReplicate)`), a size or a coordinate, and
//   for global ranks (`global_rank()`, `global_rank_at()`); nothing outside this file rebuilds a
//   global rank from group ranks. A dimension the mesh lacks has size 1 and coordinate 0;
//   group() returns nullptr for it and for a dimension of one rank (nothing to communicate).
// - The Communicators are not owned; they outlive every object built over the mesh (the
//   ShardedModel copies the Mesh, not the groups).
// - Pure but for all_reduce(): no communication, no CUDA. check() throws (naming the rank) when `shard` is unset or
//   the groups live on different devices.
//
// How to add a dimension (docs/design.md "How to add a mesh dimension"): a MeshDim value in
// mesh order and its name in to_string(); the launcher/thread grid that builds its group
// (collectives/thread_mesh.h, collectives/nccl_mesh.h); the code that issues its collectives.
#pragma once

#include <c10/core/Device.h>

#include <array>
#include <cstdint>
#include <string>

#include "collectives/communicator.h"

namespace flatshard {

// Mesh dimensions, outermost first (the order of the global rank's digits).
enum class MeshDim : uint8_t { kReplicate = 0, kShard = 1, kTp = 2 };
inline constexpr int kNumMeshDims = 3;
const char* to_string(MeshDim dim);

// Sizes only, for code that plans without communicating (planner/: explain, the cost model).
struct MeshShape {
  std::array<int, kNumMeshDims> sizes{1, 1, 1};

  MeshShape() = default;
  // `shard` ranks per shard group, `replicate` groups (HSDP), `tp` ranks per tensor-parallel
  // group; all >= 1 (checked by users).
  MeshShape(int shard, int replicate, int tp = 1) {
    sizes[static_cast<int>(MeshDim::kShard)] = shard;
    sizes[static_cast<int>(MeshDim::kReplicate)] = replicate;
    sizes[static_cast<int>(MeshDim::kTp)] = tp;
  }
  int size(MeshDim dim) const { return sizes[static_cast<int>(dim)]; }
  int shard() const { return size(MeshDim::kShard); }
  int replicate() const { return size(MeshDim::kReplicate); }
  int tp() const { return size(MeshDim::kTp); }
  bool hybrid() const { return replicate() > 1; }
  int global_size() const;
  // replicate x shard: the ranks that see different batches.
  int data_parallel_size() const { return replicate() * shard(); }
  // "shard 4", "replicate 2 x shard 4" or "shard 2 x tp 2".
  std::string to_string() const;
};

class Mesh {
 public:
  Mesh() = default;
  // Data parallel: one shard group, and with HSDP its replicate group (nullptr: none).
  // Not explicit: a communicator is the one-dimensional mesh of its ranks.
  Mesh(Communicator& shard, Communicator* replicate = nullptr);  // NOLINT(runtime/explicit)
  // With tensor parallelism: `tp` is this rank's tp group (nullptr: none).
  Mesh(Communicator& shard, Communicator* replicate, Communicator* tp);

  // The shard group (all-gathers, reduce-scatters, NO_SHARD all-reduces); always present.
  Communicator& shard() const;
  // The group of `dim`, or nullptr when the mesh lacks it or it has one rank.
  Communicator* group(MeshDim dim) const;
  Communicator* replicate() const { return group(MeshDim::kReplicate); }
  Communicator* tp() const { return group(MeshDim::kTp); }
  int size(MeshDim dim) const;   // 1 when absent
  int coord(MeshDim dim) const;  // this rank's coordinate on `dim`; 0 when absent
  // HSDP: gradients are also averaged across replicas.
  bool hybrid() const { return replicate() != nullptr; }
  MeshShape shape() const;

  // Rank and size over every dimension.
  int global_rank() const;
  int global_size() const { return shape().global_size(); }
  // The global rank of the rank whose coordinate on `dim` is `i`, its others equal to this rank's.
  int global_rank_at(MeshDim dim, int i) const;
  // Rank 0 on every dimension but `dim` (the one group of `dim` that speaks for all: e.g. the
  // shard group of replica 0 writes a checkpoint).
  bool first_along_others(MeshDim dim) const;

  c10::Device device() const { return shard().device(); }
  // Throws (naming the rank) unless `shard` is set and every group shares its device.
  void check() const;
  void reset_counters() const;
  // "rank 5 (replicate 1 of 2, shard 1 of 4)"; with tp "rank 3 (shard 1 of 2, tp 1 of 2)".
  std::string describe_rank() const;

 private:
  std::array<Communicator*, kNumMeshDims> groups_{};  // by MeshDim; nullptr: absent
};

// In place over every rank of the mesh: `op` over each group in turn, innermost first (a sum
// of sums is the sum; an average of equal-sized groups' averages is the average).
void all_reduce(const Mesh& mesh, const at::Tensor& tensor, ReduceOp op, c10::Stream stream);

}  // namespace flatshard
