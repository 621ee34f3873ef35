// flatshard/fsdp/order_check.h — FLATSHARD_DEBUG=1: do all ranks enter the same unit next?
//
// Why: the units' collectives carry no names. If one rank calls blocks.1 where another calls
// blocks.2 (a data-dependent branch, a skipped layer), the ranks exchange unrelated parameter
// shards: NCCL mixes them silently when sizes match and hangs when they do not. Off by default
// because each check is one small collective plus a host sync.
//
// Contract
// - check_unit_order() is collective: every rank calls it before the first collective of each
//   unit in a forward (and backward) pass, with the unit's plan index and its position in the
//   pass. If any rank differs, every rank throws the same c10::Error naming the pass, the
//   position and each differing rank's unit, e.g.
//     "FLATSHARD_DEBUG: ranks enter different units in forward at position 2: rank 0 enters unit
//      2 'blocks.1', rank 1 enters unit 3 'blocks.2'"
// - Unit indices and positions travel as float32 (exact below 2^24).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flatshard {

class Communicator;

void check_unit_order(Communicator& comm, const std::vector<std::string>& unit_names,
                      int unit_index, const char* pass, int64_t position);

}  // namespace flatshard
