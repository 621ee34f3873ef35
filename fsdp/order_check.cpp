#include "fsdp/order_check.h"

#include <ATen/ATen.h>

#include <sstream>

#include "collectives/communicator.h"

namespace flatshard {

void check_unit_order(Communicator& comm, const std::vector<std::string>& unit_names,
                      int unit_index, const char* pass, int64_t position) {
  const int world = comm.world_size();
  if (world == 1) return;
  at::NoGradGuard no_grad;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor mine = at::empty({2}, f32);
  mine.data_ptr<float>()[0] = static_cast<float>(unit_index);
  mine.data_ptr<float>()[1] = static_cast<float>(position);
  at::Tensor all = at::empty({2 * world}, f32.device(comm.device()));
  comm.all_gather(mine.to(comm.device()), all, comm.current_stream());
  all = all.cpu();  // host sync: the debug mode's price
  const float* a = all.data_ptr<float>();
  bool same = true;
  for (int r = 1; r < world; ++r) same = same && a[2 * r] == a[0] && a[2 * r + 1] == a[1];
  if (same) return;
  auto name = [&](float idx) {
    const auto i = static_cast<size_t>(idx);
    return i < unit_names.size() ? unit_names[i] : std::string("?");
  };
  std::ostringstream os;
  os << "FLATSHARD_DEBUG: ranks enter different units in " << pass << " at position " << position
     << ":";
  for (int r = 0; r < world; ++r)
    os << (r ? "," : "") << " rank " << r << " enters unit " << a[2 * r] << " '"
       << name(a[2 * r]) << "'" << (a[2 * r + 1] != a[1] ? " at position " : "")
       << (a[2 * r + 1] != a[1] ? std::to_string(static_cast<int64_t>(a[2 * r + 1])) : "");
  os << " (reported by rank " << comm.rank()
     << "); every rank must call the same units in the same order";
  TORCH_CHECK(false, os.str());
}

}  // namespace flatshard
