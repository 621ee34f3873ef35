#include "fsdp/fingerprint.h"

#include <torch/nn/module.h>

#include <sstream>
#include <unordered_map>

#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "collectives/gather_bytes.h"
#include "fsdp/tensor_parallel.h"

namespace flatshard {

namespace {

constexpr char kFieldSep = '\x1f';
constexpr char kEntrySep = '\x1e';

std::string str(const std::optional<ShardingStrategy>& s) {
  return s ? to_string(*s) : "default";
}
std::string str(const std::optional<bool>& b) { return b ? (*b ? "true" : "false") : "default"; }
std::string str(const std::optional<int>& i) { return i ? std::to_string(*i) : "default"; }
template <class T>
std::string str(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string serialize(const std::vector<FingerprintEntry>& entries) {
  std::string s;
  for (const auto& e : entries) {
    s += e.where;
    s += kFieldSep;
    s += e.what;
    s += kFieldSep;
    s += e.value;
    s += kEntrySep;
  }
  return s;
}

std::vector<FingerprintEntry> deserialize(const std::string& s) {
  std::vector<FingerprintEntry> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(kEntrySep, pos);
    if (end == std::string::npos) end = s.size();
    const std::string rec = s.substr(pos, end - pos);
    FingerprintEntry e;
    const size_t a = rec.find(kFieldSep);
    const size_t b = a == std::string::npos ? a : rec.find(kFieldSep, a + 1);
    e.where = rec.substr(0, a);
    if (a != std::string::npos) e.what = rec.substr(a + 1, b == std::string::npos ? b : b - a - 1);
    if (b != std::string::npos) e.value = rec.substr(b + 1);
    out.push_back(std::move(e));
    pos = end + 1;
  }
  return out;
}

// FNV-1a, 64 bits: a collision between two different setups is not a practical concern.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Buffers are not in any unit, so they are described at setup level: names, shapes, dtypes
// and device types always (broadcast_buffers, fsdp/buffers.h, needs them equal); with
// sync_module_states off also a hash of the values, since nothing will make them equal then.
void add_buffers(std::vector<FingerprintEntry>& fp, const torch::nn::Module& model,
                 bool sync_module_states) {
  const std::string setup = "setup";
  const auto buffers = model.named_buffers(/*recurse=*/true);
  fp.push_back({setup, "buffers", str(buffers.size())});
  for (const auto& item : buffers) {
    const std::string what = "buffer '" + item.key() + "'";
    const at::Tensor& b = item.value();
    if (!b.defined()) {
      fp.push_back({setup, what, "undefined"});
      continue;
    }
    fp.push_back({setup, what + " shape", str(b.sizes())});
    fp.push_back({setup, what + " dtype", str(b.scalar_type())});
    fp.push_back({setup, what + " device type", str(b.device().type())});
    if (sync_module_states || b.is_meta()) continue;
    const at::Tensor bytes = b.detach().cpu().contiguous().view({-1}).view(at::kByte);
    const std::string raw(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                          static_cast<size_t>(bytes.numel()));
    std::ostringstream h;
    h << "fnv1a:" << std::hex << fnv1a(raw);
    fp.push_back({setup, what + " values (sync_module_states is off: ranks must hold equal values)",
                  h.str()});
  }
}

}  // namespace

std::vector<FingerprintEntry> setup_fingerprint(const torch::nn::Module& model, const Plan& plan,
                                                const ShardingOptions& options,
                                                const Mesh& mesh) {
  const Communicator& comm = mesh.shard();
  std::vector<FingerprintEntry> fp;
  const std::string setup = "setup";
  fp.push_back({setup, "world size", str(comm.world_size())});
  fp.push_back({setup, "mesh", mesh.shape().to_string()});
  // Ranks that split different modules (or by a different plan) would exchange slices of
  // different tensors (issue 51: ranks that disagree on the TP plan).
  if (const TensorParallel* tp = find_tensor_parallel(&model)) {
    fp.push_back({setup, "tp plan", tp->plan().to_spec()});
    fp.push_back({setup, "tp size", str(tp->tp_size())});
  }
  fp.push_back({setup, "backend", comm.backend_name()});
  fp.push_back({setup, "device type", str(comm.device().type())});
  fp.push_back({setup, "option strategy", to_string(options.strategy)});
  fp.push_back({setup, "option reshard_after_forward", options.reshard_after_forward ? "true" : "false"});
  fp.push_back({setup, "option mixed_precision.param_dtype", str(options.mixed_precision.param_dtype)});
  fp.push_back({setup, "option mixed_precision.reduce_dtype",
                options.mixed_precision.reduce_dtype ? str(*options.mixed_precision.reduce_dtype)
                                                     : "default"});
  // A rank quantizing its gathers while another does not would all-gather different sizes.
  fp.push_back({setup, "option mixed_precision.gather_dtype",
                gather_dtype_name(options.mixed_precision.gather_dtype)});
  fp.push_back({setup, "option mixed_precision.buffer_dtype",
                options.mixed_precision.buffer_dtype ? str(*options.mixed_precision.buffer_dtype)
                                                     : "default"});
  fp.push_back({setup, "option align", str(options.align)});
  fp.push_back({setup, "option sync_module_states", options.sync_module_states ? "true" : "false"});
  // Offload decides where the master shard and the optimizer step live and, at level 2, adds
  // an upload before each all-gather: ranks that disagree step different states.
  fp.push_back({setup, "option offload", str(options.offload)});
  // A rank loading while another initialises would broadcast alone (Note [Loading into shards]).
  fp.push_back({setup, "option load", options.load ? "set" : "unset"});
  fp.push_back({setup, "plan units", str(plan.units.size())});
  for (const auto& [first, others] : plan.tied) {
    std::string v;
    for (const auto& o : others) v += (v.empty() ? "" : ", ") + o;
    fp.push_back({setup, "tied parameter '" + first + "'", "[" + v + "]"});
  }

  add_buffers(fp, model, options.sync_module_states);

  std::unordered_map<std::string, at::Tensor> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    params.emplace(item.key(), item.value());
  for (size_t i = 0; i < plan.units.size(); ++i) {
    const UnitSpec& u = plan.units[i];
    const std::string where = "unit " + std::to_string(i) + " '" + u.name + "'";
    fp.push_back({where, "name", u.name});
    fp.push_back({where, "is root", u.is_root ? "true" : "false"});
    fp.push_back({where, "strategy", str(u.options.strategy)});
    fp.push_back({where, "reshard_after_forward", str(u.options.reshard_after_forward)});
    fp.push_back({where, "recompute", str(u.options.recompute)});
    fp.push_back({where, "offload", str(u.options.offload)});
    fp.push_back({where, "gather_dtype", u.options.gather_dtype
                                             ? gather_dtype_name(*u.options.gather_dtype)
                                             : "default"});
    fp.push_back({where, "modules", str(u.module_paths.size())});
    for (size_t k = 0; k < u.module_paths.size(); ++k)
      fp.push_back({where, "module " + std::to_string(k), u.module_paths[k]});
    fp.push_back({where, "params", str(u.param_names.size())});
    for (const auto& name : u.param_names) {
      const std::string what = "param '" + name + "'";
      auto it = params.find(name);
      if (it == params.end()) {
        fp.push_back({where, what, "missing from the model"});
        continue;
      }
      const at::Tensor& p = it->second;
      fp.push_back({where, what + " shape", str(p.sizes())});
      fp.push_back({where, what + " dtype", str(p.scalar_type())});
      fp.push_back({where, what + " device type", str(p.device().type())});
      // Frozen or not decides whether the unit reduces: ranks must agree.
      fp.push_back({where, what + " requires_grad", p.requires_grad() ? "true" : "false"});
    }
  }
  return fp;
}

std::string describe_difference(const std::vector<FingerprintEntry>& base, int base_rank,
                                const std::vector<FingerprintEntry>& other, int other_rank) {
  std::ostringstream os;
  os << "rank " << other_rank << " differs from rank " << base_rank << " at ";
  const size_t n = std::min(base.size(), other.size());
  for (size_t i = 0; i < n; ++i) {
    const FingerprintEntry& b = base[i];
    const FingerprintEntry& o = other[i];
    if (b.where == o.where && b.what == o.what && b.value == o.value) continue;
    if (b.where == o.where && b.what == o.what) {
      os << o.where << ": " << o.what << " " << o.value << " vs " << b.value;
    } else {
      os << o.where << ": it has " << o.what << " " << o.value << " where rank " << base_rank
         << " has " << b.where << ": " << b.what << " " << b.value;
    }
    return os.str();
  }
  if (base.size() == other.size()) return "";
  const bool other_longer = other.size() > base.size();
  const FingerprintEntry& extra = other_longer ? other[n] : base[n];
  os << extra.where << ": rank " << (other_longer ? other_rank : base_rank) << " has "
     << extra.what << " " << extra.value << ", which rank "
     << (other_longer ? base_rank : other_rank) << " lacks";
  return os.str();
}

namespace {

// Over the group of `dim`; rank r of it is global rank mesh.global_rank_at(dim, r).
void check_group_agrees(const std::vector<FingerprintEntry>& mine, const Mesh& mesh, MeshDim dim) {
  Communicator* group = mesh.group(dim);
  if (group == nullptr) return;
  Communicator& comm = *group;
  const int world = comm.world_size();
  auto name = [&](int r) { return mesh.global_rank_at(dim, r); };
  at::NoGradGuard no_grad;
  const std::string text = serialize(mine);
  const uint64_t h = fnv1a(text);
  const int64_t len = static_cast<int64_t>(text.size());
  TORCH_CHECK(len < (int64_t{1} << 32), "fully_shard: setup fingerprint too long (", len,
              " bytes)");
  // Six 16-bit pieces: exact in float32 (see the header's note on encoding).
  const auto cpu_f = at::TensorOptions().dtype(at::kFloat);
  at::Tensor summary = at::empty({6}, cpu_f);
  auto* s = summary.data_ptr<float>();
  for (int k = 0; k < 4; ++k) s[k] = static_cast<float>((h >> (16 * k)) & 0xffff);
  s[4] = static_cast<float>(len & 0xffff);
  s[5] = static_cast<float>((len >> 16) & 0xffff);
  const c10::Device dev = comm.device();
  const c10::Stream stream = comm.current_stream();
  at::Tensor all = at::empty({6 * world}, cpu_f.device(dev));
  comm.all_gather(summary.to(dev), all, stream);
  all = all.cpu();  // waits for the collective on GPUs
  const float* a = all.data_ptr<float>();
  bool same = true;
  std::vector<int64_t> lens(world);
  for (int r = 0; r < world; ++r) {
    for (int k = 0; k < 6; ++k) same = same && a[6 * r + k] == a[k];
    lens[r] = static_cast<int64_t>(a[6 * r + 4]) + (static_cast<int64_t>(a[6 * r + 5]) << 16);
  }
  if (same) return;

  // Some rank differs (every rank sees the same summaries, so every rank gets here): exchange
  // the full texts (the lengths are known from the summaries).
  const std::vector<std::string> texts = all_gather_bytes(comm, text, lens);
  std::vector<std::vector<FingerprintEntry>> per_rank(world);
  for (int r = 0; r < world; ++r) per_rank[r] = deserialize(texts[r]);
  for (int r = 1; r < world; ++r) {
    const std::string diff = describe_difference(per_rank[0], name(0), per_rank[r], name(r));
    if (!diff.empty())
      TORCH_CHECK(false, "fully_shard: ", diff, " (reported by rank ", name(comm.rank()),
                  "); every rank must call fully_shard with the same plan, options and model "
                  "shapes");
  }
  TORCH_CHECK(false, "fully_shard: the ranks' setup fingerprints differ (hash or length) but no "
              "entry does (rank ", name(comm.rank()), ")");
}

}  // namespace

void check_ranks_agree(const std::vector<FingerprintEntry>& mine, const Mesh& mesh) {
  check_group_agrees(mine, mesh, MeshDim::kShard);
  check_group_agrees(mine, mesh, MeshDim::kReplicate);
  check_group_agrees(mine, mesh, MeshDim::kTp);
}

}  // namespace flatshard
