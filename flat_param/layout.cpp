#include "flat_param/layout.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace flatshard {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

FlatLayout FlatLayout::make(const std::vector<std::vector<int64_t>>& shapes, int world_size,
                            int64_t align) {
  TORCH_CHECK(world_size >= 1, "FlatLayout: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(align >= 1, "FlatLayout: align must be >= 1, got ", align);
  FlatLayout l;
  l.shapes = shapes;
  l.world_size = world_size;
  l.align = align;
  int64_t off = 0;
  for (const auto& s : shapes) {
    int64_t n = 1;
    for (int64_t d : s) {
      TORCH_CHECK(d >= 0, "FlatLayout: negative dimension in shape");
      n *= d;
    }
    off = round_up(off, align);
    l.offsets.push_back(off);
    l.numels.push_back(n);
    l.used_numel += n;
    off += n;
  }
  l.padded_numel = round_up(off, static_cast<int64_t>(world_size) * align);
  l.shard_numel = l.padded_numel / world_size;
  return l;
}

std::string FlatLayout::to_string() const {
  std::ostringstream os;
  os << "FlatLayout(params=" << numels.size() << ", used=" << used_numel
     << ", padded=" << padded_numel << ", shard=" << shard_numel << ", world=" << world_size
     << ", align=" << align << ")";
  return os.str();
}

}  // namespace flatshard
