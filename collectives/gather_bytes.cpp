// flatshard/collectives/gather_bytes.cpp — see gather_bytes.h.
#include "collectives/gather_bytes.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "collectives/communicator.h"

namespace flatshard {

std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine,
                                          const std::vector<int64_t>& lengths) {
  const int world = comm.world_size(), rank = comm.rank();
  TORCH_CHECK(lengths.size() == static_cast<size_t>(world), "all_gather_bytes on rank ", rank,
              ": expected ", world, " lengths (one per rank), got ", lengths.size());
  TORCH_CHECK(lengths[rank] == static_cast<int64_t>(mine.size()), "all_gather_bytes on rank ", rank,
              ": lengths[", rank, "] = ", lengths[rank], " but this rank has ", mine.size(),
              " bytes");
  if (world == 1) return {mine};
  const int64_t longest = std::max<int64_t>(*std::max_element(lengths.begin(), lengths.end()), 1);
  const auto cpu_f = at::TensorOptions().dtype(at::kFloat);
  at::Tensor padded = at::zeros({longest}, cpu_f);
  float* p = padded.data_ptr<float>();
  for (size_t i = 0; i < mine.size(); ++i) p[i] = static_cast<unsigned char>(mine[i]);
  at::Tensor all = at::empty({world * longest}, cpu_f.device(comm.device()));
  comm.all_gather(padded.to(comm.device()), all, comm.current_stream());
  all = all.cpu();  // waits for the collective on GPUs
  const float* a = all.data_ptr<float>();
  std::vector<std::string> out(world);
  for (int r = 0; r < world; ++r) {
    out[r].resize(static_cast<size_t>(lengths[r]));
    for (int64_t i = 0; i < lengths[r]; ++i)
      out[r][i] = static_cast<char>(static_cast<unsigned char>(a[r * longest + i]));
  }
  return out;
}

std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine) {
  const int world = comm.world_size();
  TORCH_CHECK(mine.size() < (1u << 24), "all_gather_bytes: ", mine.size(), " bytes on rank ",
              comm.rank(),
              " is more than one exchange carries (lengths travel as fp32, exact "
              "below 2^24)");
  if (world == 1) return {mine};
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(comm.device());
  const at::Tensor len = at::full({1}, static_cast<float>(mine.size()), opts);
  at::Tensor lens = at::empty({world}, opts);
  comm.all_gather(len, lens, comm.current_stream());
  lens = lens.cpu();
  const float* l = lens.data_ptr<float>();
  return all_gather_bytes(comm, mine, std::vector<int64_t>(l, l + world));
}

}  // namespace flatshard
