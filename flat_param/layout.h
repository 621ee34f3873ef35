// flatshard/flat_param/layout.h — where each original parameter lives inside a flat parameter.
//
// Pure arithmetic, no tensors. The flat buffer of one unit is
//   [p0 | pad | p1 | pad | ... | p_{n-1} | tail pad]
// - every parameter starts at a multiple of `align` elements (so bf16 views start 16-byte
//   aligned and vectorised kernels stay on their fast path);
// - the total (`padded_numel`) is a multiple of world_size * align, so every rank's shard has
//   `shard_numel` elements and starts aligned too.
// Padding never holds data that reaches a user: it is zero in the master shard and in gradients.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flatshard {

struct FlatLayout {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> numels;
  std::vector<int64_t> offsets;  // element offset of each parameter in the flat buffer
  int64_t used_numel = 0;        // sum of numels (real data)
  int64_t padded_numel = 0;      // flat buffer size, multiple of world_size * align
  int64_t shard_numel = 0;       // padded_numel / world_size
  int world_size = 1;
  int64_t align = 1;

  static FlatLayout make(const std::vector<std::vector<int64_t>>& shapes, int world_size,
                         int64_t align);

  int64_t padding() const { return padded_numel - used_numel; }
  // The [begin, end) range of the flat buffer owned by `rank`.
  int64_t shard_begin(int rank) const { return rank * shard_numel; }
  int64_t shard_end(int rank) const { return (rank + 1) * shard_numel; }
  std::string to_string() const;
};

}  // namespace flatshard
