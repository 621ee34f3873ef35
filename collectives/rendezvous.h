// flatshard/collectives/rendezvous.h — the key-value store every rank meets at.
//
// Contract
// - create_store(env, timeout) returns a c10d::TCPStore (from the torch wheel) reachable by all
//   ranks of the job described by `env` (see collectives/launch_env.h):
//     * torchrun agent store (env.use_agent_store): the store already exists at
//       MASTER_ADDR:MASTER_PORT; every rank connects as a client, wrapped in a c10d::PrefixStore
//       under env.store_prefix() ("/worker/attempt_<restart>"), so restarts never see stale keys.
//       (torch 2.11's own env:// rendezvous creates a new store per attempt and uses no prefix;
//       the prefix costs nothing and keeps us correct with agents that reuse one store.)
//     * otherwise rank 0 hosts the store (multi-tenant, so another library may share the port)
//       and the other ranks connect as clients, retrying until `timeout`.
// - `timeout` bounds connecting and every blocking get()/wait() on the store.
// - Errors (unreachable store, port in use) throw c10::Error naming the address, rank and the
//   launcher variables they came from.
// - The store must outlive everything that still reads it; with rank 0 hosting it, rank 0's
//   store object must stay alive until the other ranks are done with it (NcclCommunicator keeps
//   a reference for that reason).
#pragma once

#include "collectives/launch_env.h"

#include <c10/util/intrusive_ptr.h>

#include <chrono>

namespace c10d {
class Store;
}

namespace flatshard {

c10::intrusive_ptr<c10d::Store> create_store(const LaunchEnv& env,
                                             std::chrono::milliseconds timeout);

// Host-only barrier over the store (no GPU): every rank adds 1 to `key` and waits until the
// count reaches world_size * (generation + 1). Use a key unique to the call site; `generation`
// lets one key serve repeated barriers (pass 0, 1, 2, ... in order). Throws after the store's
// timeout, naming the key and the count reached.
void store_barrier(c10d::Store& store, const std::string& key, int world_size,
                   int64_t generation = 0);

}  // namespace flatshard
