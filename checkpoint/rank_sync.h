// flatshard/checkpoint/rank_sync.h — how the ranks of a save or load agree (internal).
//
// Collective: every rank calls these in the same order. They use the Communicator only
// (fp32 tensors on comm.device()), so they work on the threads backend and over NCCL alike.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <vector>

#include "collectives/agree.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"

namespace flatshard {

// agree(comm, local_error, what) (collectives/agree.h): local errors are deferred to these
// points so that no rank is left waiting in a collective for a rank that stopped early.

// Every rank's `text`, in rank order (collectives/gather_bytes.h: one fp32 element per byte).
// Each text must be shorter than 2^24 bytes (its length travels as an fp32).
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text);

// Checkpoints do not record tensor-parallel placement yet (issue 51): every tp rank would write
// its slices under the full names. Refused, the same on every rank (local: no collective).
inline void refuse_tensor_parallel(const Mesh& mesh, const std::string& what) {
  TORCH_CHECK(mesh.size(MeshDim::kTp) == 1, what, " (", mesh.describe_rank(), "): the model is ",
              "tensor-parallel (mesh ", mesh.shape().to_string(), ") and checkpoints do not ",
              "record tp placement yet; gather what you need with ",
              "ShardedModel::gather_full_params() on each tp rank (fsdp/tensor_parallel.h)");
}

// Note [HSDP checkpoints] (checkpoint/save.cpp): replicas hold identical shards, so only the
// shard group of replica 0 runs `write` (a collective over its shard group); the other groups
// wait for its outcome in the agreement across the replicate group, so every rank returns after
// `write` succeeded or throws the writing group's error. Without HSDP: `write` on every rank.
template <class Write>
void write_from_first_replica(const Mesh& mesh, const std::string& what, Write&& write) {
  refuse_tensor_parallel(mesh, what);
  Communicator* replicate = mesh.replicate();
  if (replicate == nullptr) return write();
  std::exception_ptr err;
  if (mesh.first_along_others(MeshDim::kShard)) {
    try {
      write();
    } catch (...) {
      err = std::current_exception();
    }
  }
  agree(*replicate, err, what + " (HSDP, replicate rank 0 writes)");
}

}  // namespace flatshard
