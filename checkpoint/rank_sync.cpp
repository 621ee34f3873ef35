#include "checkpoint/rank_sync.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "collectives/gather_bytes.h"

namespace flatshard {

std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text) {
  TORCH_CHECK(text.size() < (1u << 24), "checkpoint: ", text.size(), " bytes of metadata on rank ",
              comm.rank(), " is more than one exchange carries");
  return all_gather_bytes(comm, text);
}

}  // namespace flatshard
