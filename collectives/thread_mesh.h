// flatshard/collectives/thread_mesh.h — HSDP on the CPU backend: a 2-D grid of ranks as threads.
//
// run_ranks_2d(R, S, fn) runs fn(shard, replicate) on R * S threads. Thread r = i * S + j gets
// rank j of shard group i (one ThreadWorld of S ranks per group) and rank i of replicate group
// j (one ThreadWorld of R ranks per group): the layout of collectives/sharding_mesh.h.
// Failure semantics are those of run_ranks(): a rank that throws aborts every group, the
// others fail fast, and the root cause is rethrown as "rank R: ...".
#pragma once

#include "collectives/communicator.h"

#include <chrono>
#include <functional>

namespace flatshard {

void run_ranks_2d(int replicate, int shard,
                  const std::function<void(Communicator& shard, Communicator& replicate)>& fn,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

}  // namespace flatshard
