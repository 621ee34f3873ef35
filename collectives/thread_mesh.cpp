#include "collectives/thread_mesh.h"

#include "collectives/sharding_mesh.h"
#include "collectives/thread_communicator.h"

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

}  // namespace flatshard
