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

// Tensor parallelism: a save or export is a collective of the shard x tp grid. agree() over the
// shard group `comm`, then the outcome over the tp group (when the mesh has one), so every rank
// of the grid throws if any failed; run_agreed_tp runs `fn` first, as run_agreed does.
inline void agree_tp(const Mesh& mesh, Communicator& comm, std::exception_ptr err,
                     const std::string& what) {
  Communicator* tp = mesh.size(MeshDim::kTp) > 1 ? mesh.tp() : nullptr;
  if (tp == nullptr) return agree(comm, err, what);
  try {
    agree(comm, err, what);
    err = nullptr;
  } catch (...) {
    err = std::current_exception();
  }
  agree(*tp, err, what);
}
template <class Fn>
void run_agreed_tp(const Mesh& mesh, Communicator& comm, const std::string& what, Fn&& fn) {
  std::exception_ptr err;
  try {
    fn();
  } catch (...) {
    err = std::current_exception();
  }
  agree_tp(mesh, comm, err, what);
}

// Note [HSDP checkpoints] (checkpoint/save.cpp): replicas hold identical shards, so only the
// shard group(s) of replica 0 (one per tp rank) run `write` (a collective over its shard group); the other groups
// wait for its outcome in the agreement across the replicate group, so every rank returns after
// `write` succeeded or throws the writing group's error. Without HSDP: `write` on every rank.
template <class Write>
void write_from_first_replica(const Mesh& mesh, const std::string& what, Write&& write) {
  Communicator* replicate = mesh.replicate();
  if (replicate == nullptr) return write();
  std::exception_ptr err;
  if (mesh.coord(MeshDim::kReplicate) == 0) {  // every tp rank of replica 0 writes its slices
    try {
      write();
    } catch (...) {
      err = std::current_exception();
    }
  }
  agree(*replicate, err, what + " (HSDP, replicate rank 0 writes)");
}

}  // namespace flatshard
