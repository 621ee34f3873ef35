// flatshard/checkpoint/unit_ranges.h — which part of a unit's flat buffer a rank holds and
// writes, and its gather (internal). Element ranges [begin, end) of the padded flat buffer
// (flat_param/layout.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "collectives/communicator.h"
#include "flat_param/flat_param.h"

namespace flatshard {

struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return std::max<int64_t>(0, end - begin); }
};

inline FlatRange intersect(FlatRange a, FlatRange b) {
  return {std::max(a.begin, b.begin), std::min(a.end, b.end)};
}

// What this rank's master tensor holds: its shard, or the whole buffer of a replicated unit.
inline FlatRange master_range(const FlatParam& f, int rank) {
  const FlatLayout& l = f.layout();
  if (!f.config().sharded) return {0, l.padded_numel};
  return {l.shard_begin(rank), l.shard_end(rank)};
}

// What `rank` writes in a sharded checkpoint: its shard; a replicated unit (identical on every
// rank) is split into `world` near-equal parts so that its writing is shared too.
inline FlatRange write_range(const FlatParam& f, int rank, int world) {
  if (f.config().sharded) return master_range(f, rank);
  const int64_t n = f.layout().padded_numel;
  const int64_t part = (n + world - 1) / world;
  return {std::min(n, rank * part), std::min(n, (rank + 1) * part)};
}

}  // namespace flatshard
