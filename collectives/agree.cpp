// flatshard/collectives/agree.cpp — see agree.h for the contract.
#include "collectives/agree.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <vector>

#include "collectives/gather_bytes.h"

namespace flatshard {

namespace {

constexpr size_t kMaxMessage = 1u << 16;  // of each rank's message, in bytes

// The ranks of `comm` whose `failed` flag is set (one all_reduce of world floats).
std::vector<int> failed_ranks(Communicator& comm, bool failed) {
  const int world = comm.world_size();
  at::Tensor flags =
      at::zeros({world}, at::TensorOptions().dtype(at::kFloat).device(comm.device()));
  if (failed) flags[comm.rank()].fill_(1);
  if (world > 1) comm.all_reduce(flags, ReduceOp::kSum, comm.current_stream());
  flags = flags.cpu();
  const float* f = flags.data_ptr<float>();
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r)
    if (f[r] > 0) ranks.push_back(r);
  return ranks;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

}  // namespace

std::string error_message(std::exception_ptr e) {
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

std::string failures(Communicator& comm, const std::string& local_error) {
  const std::vector<int> ranks = failed_ranks(comm, !local_error.empty());
  if (ranks.empty()) return "";
  const std::vector<std::string> messages =
      all_gather_bytes(comm, local_error.substr(0, kMaxMessage));
  return "rank(s) " + rank_list(ranks) + " failed; rank " + std::to_string(ranks.front()) +
         ": " + messages[static_cast<size_t>(ranks.front())];
}

void agree(Communicator& comm, std::exception_ptr local_error, const std::string& what) {
  const int rank = comm.rank();
  const std::vector<int> ranks = failed_ranks(comm, local_error != nullptr);
  if (ranks.empty()) return;
  // Every rank reports the first failed rank's message, so whichever rank's error a launcher
  // shows first says what went wrong.
  const std::vector<std::string> messages = all_gather_bytes(
      comm, local_error ? error_message(local_error).substr(0, kMaxMessage) : "");
  if (local_error) TORCH_CHECK(false, what, " failed on rank ", rank, ": ", messages[rank]);
  TORCH_CHECK(false, what, " failed on rank(s) ", rank_list(ranks), "; rank ", ranks.front(),
              ": ", messages[ranks.front()]);
}

void agree(const Mesh& mesh, std::exception_ptr local_error, const std::string& what) {
  Communicator* replicate = mesh.replicate();
  if (replicate == nullptr) return agree(mesh.shard(), local_error, what);
  Communicator& shard = mesh.shard();
  const std::string mine = failures(shard, local_error ? error_message(local_error) : "");
  const std::string all = failures(*replicate, mine.empty() ? "" : "in its shard group, " + mine);
  TORCH_CHECK(all.empty(), what, " failed (", mesh.describe_rank(), "): replicate ", all);
}

}  // namespace flatshard
