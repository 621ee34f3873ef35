#include "collectives/rendezvous.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace flatshard {

c10::intrusive_ptr<c10d::Store> create_store(const LaunchEnv& env,
                                             std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "create_store (rank ", env.rank, "): timeout must be positive, got ",
              timeout.count(), " ms");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.timeout = timeout;
  // Rank 0 hosts the store unless torchrun's agent already does. Nobody waits for the others to
  // connect here: the first get() of a key another rank sets is the real meeting point.
  opts.isServer = !env.use_agent_store && env.rank == 0;
  opts.waitWorkers = false;
  opts.multiTenant = opts.isServer;
  if (opts.isServer) opts.numWorkers = static_cast<std::size_t>(env.world_size);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "flatshard rendezvous (rank ", env.rank, "): cannot ",
                opts.isServer ? "host" : "connect to", " the store at MASTER_ADDR=",
                env.master_addr, " MASTER_PORT=", env.master_port,
                env.use_agent_store ? " (torchrun agent store)" : "", " within ", timeout.count(),
                " ms: ", e.what_without_backtrace());
  }
  if (env.use_agent_store) store = c10::make_intrusive<c10d::PrefixStore>(env.store_prefix(), store);
  return store;
}

void store_barrier(c10d::Store& store, const std::string& key, int world_size, int64_t generation) {
  const int64_t target = static_cast<int64_t>(world_size) * (generation + 1);
  const std::string done = key + "/done/" + std::to_string(generation);
  const int64_t reached = store.add(key, 1);
  if (reached == target) store.set(done, std::vector<uint8_t>{1});
  try {
    store.wait({done});
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "flatshard store_barrier '", key, "' (generation ", generation,
                "): not all ", world_size, " ranks arrived within ", store.getTimeout().count(),
                " ms (this rank saw count ", reached, " of ", target, "): ",
                e.what_without_backtrace());
  }
}

}  // namespace flatshard
