// flatshard/collectives/agree.h — turn one rank's local failure into the same error on every
// rank, at a point every rank reaches.
//
// Why: a rank that throws between collectives leaves the others waiting in the next one (NCCL:
// until the watchdog; threads: until the world is aborted), and their errors name no cause.
// Code that may fail locally before a collective (a checkpoint's file I/O, a deferred init's
// user callback) catches the error, reaches an agree point, and every rank throws there.
//
// Contract
// - Collective over `comm`: every rank calls it in the same order. Uses the Communicator only
//   (fp32 tensors on comm.device()), so it works on the threads backend and over NCCL alike.
//   Costs one all_reduce of world floats; when some rank failed, one more all_gather of the
//   messages (collectives/gather_bytes.h).
// - failures(): "" when no rank of `comm` failed (`local_error` empty everywhere), else one
//   line naming the failed ranks of `comm` and the lowest one's message. Never throws for a
//   local failure, so a second group can be asked next (HSDP: the shard group, then the
//   replicate group, with the first answer as the local error of the second).
// - agree(): returns only if no rank failed. Otherwise every rank throws c10::Error: a failed
//   rank its own error (prefixed with `what` and its rank), the others naming the ranks that
//   failed and the first one's error.
// - error_message(): the text of a caught exception (c10::Error without its backtrace).
#pragma once

#include <exception>
#include <string>

#include "collectives/communicator.h"
#include "collectives/mesh.h"

namespace flatshard {

std::string failures(Communicator& comm, const std::string& local_error);

void agree(Communicator& comm, std::exception_ptr local_error, const std::string& what);
// Over every group of `mesh`, innermost first (HSDP: the shard group, then the replicate group;
// a mesh of one group: as above): failures() over the first, then over the next with that answer
// as the local error, so every rank of the mesh learns of any failure; every rank then throws
// one message naming them.
void agree(const Mesh& mesh, std::exception_ptr local_error, const std::string& what);

// The one way to turn a local failure into the same error on every rank: runs `fn`, catches
// what it throws, and agrees over `group` (a Communicator or a Mesh). Returns only if no rank
// failed.
template <class Group, class Fn>
void run_agreed(Group& group, const std::string& what, Fn&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  agree(group, error, what);
}

std::string error_message(std::exception_ptr e);

}  // namespace flatshard
