// flatshard/collectives/gather_bytes.h — all_gather of byte strings through the Communicator.
//
// Why floats: the Communicator moves only float32/bfloat16. A byte (0..255) is an integer below
// 2^24, exact in float32, so a string travels one byte per fp32 element, padded to the longest
// rank's, without widening the Communicator's dtypes. Used where ranks exchange descriptions
// rather than tensors: the setup fingerprint (fsdp/fingerprint.cpp) and the checkpoint's
// file records and error messages (checkpoint/rank_sync.cpp).
//
// Contract
// - Collective over `comm`: every rank calls it, with its own bytes. Returns every rank's bytes
//   in rank order (the caller's own included). On one rank, returns {mine} with no collective.
// - Uses comm.device() and comm.current_stream(); returns after the result is on the host.
// - Costs one all_gather of world * longest floats (plus one of world floats when the lengths
//   are not given): meant for metadata, not for bulk data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flatshard {

class Communicator;

// `lengths[r]`: the length of rank r's bytes, already known to every rank (e.g. exchanged with
// a hash first); lengths[comm.rank()] must be mine.size().
std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine,
                                          const std::vector<int64_t>& lengths);

// Exchanges the lengths first (one float per rank, so each rank's bytes must be shorter than
// 2^24; throws naming the rank and the length otherwise).
std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine);

}  // namespace flatshard
