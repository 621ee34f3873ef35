#include "checkpoint/rank_sync.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

#include "collectives/gather_bytes.h"

namespace flatshard {

namespace {
std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.msg();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown exception";
  }
}
}  // namespace

void agree(Communicator& comm, std::exception_ptr local_error, const std::string& what) {
  const int world = comm.world_size(), rank = comm.rank();
  at::Tensor failed =
      at::zeros({world}, at::TensorOptions().dtype(at::kFloat).device(comm.device()));
  if (local_error) failed[rank].fill_(1);
  if (world > 1) comm.all_reduce(failed, ReduceOp::kSum, comm.current_stream());
  failed = failed.cpu();
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r)
    if (failed[r].item<float>() > 0) ranks.push_back(r);
  if (ranks.empty()) return;
  // Every rank reports the first failed rank's message, so whichever rank's error a launcher
  // shows first says what went wrong.
  const std::vector<std::string> messages =
      all_gather_text(comm, local_error ? message_of(local_error).substr(0, 1u << 16) : "");
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  if (local_error) TORCH_CHECK(false, what, " failed on rank ", rank, ": ", messages[rank]);
  TORCH_CHECK(false, what, " failed on rank(s) ", os.str(), "; rank ", ranks.front(), ": ",
              messages[ranks.front()]);
}

std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text) {
  TORCH_CHECK(text.size() < (1u << 24), "checkpoint: ", text.size(), " bytes of metadata on rank ",
              comm.rank(), " is more than one exchange carries");
  return all_gather_bytes(comm, text);
}

}  // namespace flatshard
