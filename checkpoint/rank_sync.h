// flatshard/checkpoint/rank_sync.h — how the ranks of a save or load agree (internal).
//
// Collective: every rank calls these in the same order. They use the Communicator only
// (fp32 tensors on comm.device()), so they work on the threads backend and over NCCL alike.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "collectives/agree.h"
#include "collectives/communicator.h"

namespace flatshard {

// agree(comm, local_error, what) (collectives/agree.h): local errors are deferred to these
// points so that no rank is left waiting in a collective for a rank that stopped early.

// Every rank's `text`, in rank order (collectives/gather_bytes.h: one fp32 element per byte).
// Each text must be shorter than 2^24 bytes (its length travels as an fp32).
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text);

}  // namespace flatshard
