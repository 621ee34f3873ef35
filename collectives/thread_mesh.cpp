#include "collectives/thread_mesh.h"

#include "collectives/sharding_mesh.h"
#include "collectives/thread_communicator.h"

#include <array>
#include <memory>
#include <string>
#include <vector>

namespace flatshard {

void run_ranks_2d(int replicate, int shard,
                  const std::function<void(Communicator& shard, Communicator& replicate)>& fn,
                  std::chrono::milliseconds timeout) {
  TORCH_CHECK(replicate >= 1 && shard >= 1, "run_ranks_2d: replicate (", replicate,
              ") and shard (", shard, ") must be >= 1");
  const HsdpLayout layout = HsdpLayout::make(replicate * shard, shard);
  std::vector<std::shared_ptr<ThreadWorld>> shard_worlds, replicate_worlds;
  for (int i = 0; i < replicate; ++i) shard_worlds.push_back(ThreadWorld::create(shard, timeout));
  for (int j = 0; j < shard; ++j) replicate_worlds.push_back(ThreadWorld::create(replicate, timeout));
  // run_ranks owns the threads and the root-cause report; its own world only numbers the
  // ranks. A failing rank must also abort the sub-groups, where its peers actually wait.
  run_ranks(
      layout.world_size(),
      [&](Communicator& world) {
        const int r = world.rank();
        auto s = shard_worlds[layout.shard_group(r)]->communicator(layout.shard_rank(r));
        auto p = replicate_worlds[layout.shard_rank(r)]->communicator(layout.shard_group(r));
        try {
          fn(*s, *p);
        } catch (const std::exception& e) {
          const std::string reason = "rank " + std::to_string(r) + " failed: " + e.what();
          for (auto& w : shard_worlds) w->abort(reason);
          for (auto& w : replicate_worlds) w->abort(reason);
          throw;
        }
      },
      timeout);
}

void run_mesh(const MeshShape& shape, const std::function<void(const Mesh& mesh)>& fn,
              std::chrono::milliseconds timeout) {
  for (int d = 0; d < kNumMeshDims; ++d)
    TORCH_CHECK(shape.sizes[d] >= 1, "run_mesh: the ", to_string(static_cast<MeshDim>(d)),
                " size must be >= 1, got ", shape.sizes[d], " (mesh ", shape.to_string(), ")");
  const int world = shape.global_size();
  // stride[d]: how far apart two ranks differing by one on `d` are (row-major, innermost last).
  std::array<int, kNumMeshDims> stride{};
  for (int d = kNumMeshDims - 1, s = 1; d >= 0; --d) {
    stride[d] = s;
    s *= shape.sizes[d];
  }
  auto coord = [&](int r, int d) { return (r / stride[d]) % shape.sizes[d]; };
  // The group of `d` holding rank r: r with its digit on `d` set to 0 names it.
  auto group_of = [&](int r, int d) { return r - coord(r, d) * stride[d]; };
  // worlds[d][key]: one ThreadWorld per group of dimension d, keyed by its first rank.
  std::array<std::vector<std::shared_ptr<ThreadWorld>>, kNumMeshDims> worlds;
  for (int d = 0; d < kNumMeshDims; ++d) {
    if (shape.sizes[d] == 1 && static_cast<MeshDim>(d) != MeshDim::kShard) continue;
    worlds[d].resize(world);
    for (int r = 0; r < world; ++r)
      if (coord(r, d) == 0) worlds[d][r] = ThreadWorld::create(shape.sizes[d], timeout);
  }
  run_ranks(
      world,
      [&](Communicator& w) {
        const int r = w.rank();
        std::array<std::unique_ptr<Communicator>, kNumMeshDims> comms;
        for (int d = 0; d < kNumMeshDims; ++d)
          if (!worlds[d].empty()) comms[d] = worlds[d][group_of(r, d)]->communicator(coord(r, d));
        auto at = [&](MeshDim d) { return comms[static_cast<int>(d)].get(); };
        const Mesh mesh(*at(MeshDim::kShard), at(MeshDim::kReplicate), at(MeshDim::kTp));
        try {
          fn(mesh);
        } catch (const std::exception& e) {
          const std::string reason = "rank " + std::to_string(r) + " failed: " + e.what();
          for (auto& per_dim : worlds)
            for (auto& g : per_dim)
              if (g) g->abort(reason);
          throw;
        }
      },
      timeout);
}

}  // namespace flatshard
