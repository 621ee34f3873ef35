// flatshard/collectives/thread_mesh.h — meshes on the CPU backend: grids of ranks as threads.
//
// run_ranks_2d(R, S, fn) runs fn(shard, replicate) on R * S threads. Thread r = i * S + j gets
// rank j of shard group i (one ThreadWorld of S ranks per group) and rank i of replicate group
// j (one ThreadWorld of R ranks per group): the layout of collectives/sharding_mesh.h.
// Failure semantics are those of run_ranks(): a rank that throws aborts every group, the
// others fail fast, and the root cause is rethrown as "rank R: ...".
//
// run_mesh(shape, fn) runs fn(mesh) on shape.global_size() threads, one Mesh per rank over every
// dimension of `shape` (replicate x shard x tp, row-major in MeshDim order, collectives/mesh.h):
// thread r is the rank whose coordinates are r's digits; each group of a dimension is one
// ThreadWorld of that dimension's size (a dimension of size 1 gets none: mesh.group() is null).
// Same failure semantics as run_ranks_2d.
#pragma once

#include "collectives/communicator.h"
#include "collectives/mesh.h"

#include <chrono>
#include <functional>

namespace flatshard {

void run_ranks_2d(int replicate, int shard,
                  const std::function<void(Communicator& shard, Communicator& replicate)>& fn,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

void run_mesh(const MeshShape& shape, const std::function<void(const Mesh& mesh)>& fn,
              std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

}  // namespace flatshard
