#include "checkpoint/load_into_shards.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "support/input_file.h"
#include "support/json.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors_loader reads little-endian tensor data as is: a little-endian host is needed"
#endif

namespace flatshard {
namespace {

constexpr int64_t kChunkBytes = int64_t{64} << 20;  // the largest staging buffer of one read
constexpr int64_t kMaxIndexBytes = int64_t{64} << 20;
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kModelName = "model.safetensors";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < shape.size(); ++i) o << (i ? ", " : "") << shape[i];
  o << ']';
  return o.str();
}

// One safetensors file, opened once and its header validated.
struct Source {
  std::unique_ptr<InputFile> file;
  SafetensorsHeader header;
};

// Where a planned parameter's values are.
struct Resolved {
  const Source* source = nullptr;
  TensorEntry entry;
};

class SafetensorsLoader {
 public:
  SafetensorsLoader(std::string path, NameMap map, std::shared_ptr<LoadStats> stats,
                    UnreadFilter unread_ok)
      : path_(std::move(path)),
        map_(std::move(map)),
        stats_(std::move(stats)),
        unread_ok_(std::move(unread_ok)) {}

  // The entry of tensor `tensor` (a name in the files), or nullptr when the files lack it.
  const TensorEntry* entry(const std::string& tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    discover();
    if (!index_path_.empty()) {
      auto it = weight_map_.find(tensor);
      if (it == weight_map_.end()) return nullptr;
      return source(it->second, "tensor '" + printable_escape(tensor) + "'")->header.find(tensor);
    }
    return source(single_path_, "tensor '" + printable_escape(tensor) + "'")->header.find(tensor);
  }

  void check(const std::vector<PlannedParam>& planned) {
    std::lock_guard<std::mutex> lock(mu_);
    discover();
    std::map<std::string, std::vector<std::string>> users;  // mapped tensor -> parameters
    for (const auto& p : planned) {
      const std::string mapped = map_ ? map_(p.name) : p.name;
      users[mapped].push_back(p.name);
      const std::string what = "safetensors_loader: parameter '" + p.name + "'" +
                               (mapped != p.name ? " (looked up as '" + mapped + "')" : "");
      const Source* src = nullptr;
      if (!index_path_.empty()) {
        auto it = weight_map_.find(mapped);
        TORCH_CHECK(it != weight_map_.end(), what, " is not in the weight_map of '", index_path_,
                    "' (", weight_map_.size(), " tensors)");
        src = source(it->second, what + ", which '" + index_path_ + "' puts in '" + it->second +
                                     "'");
      } else {
        src = source(single_path_, what);
      }
      const TensorEntry* e = src->header.find(mapped);
      TORCH_CHECK(e != nullptr, what, " is not in '", src->file->path(), "' (",
                  src->header.tensors().size(), " tensors)");
      TORCH_CHECK(e->shape == p.shape, what, " has shape ", shape_str(e->shape), " in '",
                  src->file->path(), "' but ", shape_str(p.shape), " in the model");
      TORCH_CHECK(e->dtype == at::kFloat || e->dtype == at::kBFloat16 || e->dtype == at::kHalf,
                  what, " is ", safetensors_dtype_name(e->dtype), " in '", src->file->path(),
                  "'; only F32, BF16 and F16 tensors are loaded (converted to the fp32 master)");
      resolved_[p.name] = Resolved{src, *e};
    }
    // Several parameters from one tensor (the contract in load_into_shards.h): the shapes
    // agree (checked above, each against the tensor), but the model does not tie them — a tied
    // parameter is planned once — so each gets its own copy. Said once per loader, not per rank.
    for (const auto& [tensor, names] : users) {
      if (names.size() < 2 || warned_) continue;
      std::string list;
      for (const auto& n : names) list += (list.empty() ? "'" : ", '") + n + "'";
      TORCH_WARN("safetensors_loader: the name map sends ", names.size(), " parameters (", list,
                 ") to one tensor '", tensor, "': each is loaded with a copy of its values, but "
                 "the model does not tie them, so training makes them differ. If they are one "
                 "weight, tie them in the model (e.g. GPTConfig::tie_embeddings) so it is loaded "
                 "once; if a copy is meant (initialising an untied model), ignore this");
      warned_ = true;
    }
    report_unread(users);
  }

  void read(const std::string& name, int64_t begin, int64_t end, const at::Tensor& dst) {
    Resolved r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = resolved_.find(name);
      TORCH_CHECK(it != resolved_.end(), "safetensors_loader: parameter '", name,
                  "' was not among the parameters check() validated");
      r = it->second;
    }
    const int64_t numel = r.entry.numel();
    TORCH_CHECK(0 <= begin && begin <= end && end <= numel && dst.dim() == 1 &&
                    dst.numel() == end - begin && dst.scalar_type() == at::kFloat,
                "safetensors_loader: parameter '", name, "': bad request for elements [", begin,
                ", ", end, ") of ", numel, " into a ", dst.scalar_type(), " tensor of ",
                dst.numel(), " elements");
    if (end == begin) return;
    const int64_t elem = static_cast<int64_t>(c10::elementSize(r.entry.dtype));
    const int64_t chunk = std::min(end - begin, std::max<int64_t>(1, kChunkBytes / elem));
    const at::Tensor staging = at::empty(
        {chunk}, at::TensorOptions().dtype(r.entry.dtype).pinned_memory(dst.is_cuda()));
    const int64_t base = r.source->header.data_start() + r.entry.begin;
    for (int64_t pos = begin; pos < end; pos += chunk) {
      const int64_t n = std::min(chunk, end - pos);
      const at::Tensor buf = staging.narrow(0, 0, n);
      r.source->file->read(base + pos * elem, buf.data_ptr(), static_cast<size_t>(n * elem));
      dst.narrow(0, pos - begin, n).copy_(buf);
      if (stats_) {
        stats_->bytes += n * elem;
        stats_->reads += 1;
      }
    }
  }

 private:
  // Which layout `path_` is; reads the index. Once.
  void discover() {
    if (discovered_) return;
    std::string index;
    if (is_directory(path_)) {
      const WeightsDirPick pick = pick_weights_in_dir(path_);
      if (pick.index) {
        index = pick.path;
      } else if (!pick.path.empty()) {
        single_path_ = pick.path;
      } else {
        TORCH_CHECK(!path_exists(join_path(path_, kManifestName)), "safetensors_loader: '", path_,
                    "' is a sharded flatshard checkpoint (a manifest, no ", kModelName,
                    "); load it with load_checkpoint after fully_shard, or save a full one");
        TORCH_CHECK(false, "safetensors_loader: '", path_, "' holds neither ", kIndexName,
                    " nor ", kModelName);
      }
      // A full flatshard checkpoint's model.safetensors also holds the model's buffers (its
      // manifest lists them): expected there, so not reported as unread. A manifest that
      // cannot be read only costs that (this loader reads the tensors, not the manifest).
      if (!pick.index && path_exists(join_path(path_, kManifestName))) {
        try {
          for (const auto& b : read_manifest(path_).buffers) manifest_buffers_.insert(b.name);
        } catch (const c10::Error&) {
        }
      }
      // Note [Weights file of a directory]: transformers reads model.safetensors, so do we.
      if (!pick.shadowed.empty())
        TORCH_WARN("safetensors_loader: '", printable_escape(path_), "' holds both ", kModelName,
                   " and ", kIndexName, "; reading '", printable_escape(pick.path),
                   "' as transformers does, not the files the index '",
                   printable_escape(pick.shadowed),
                   "' names (remove whichever is stale so the two cannot disagree)");
    } else if (ends_with(path_, ".json")) {
      index = path_;
    } else {
      single_path_ = path_;
    }
    if (!index.empty()) read_index(index);
    discovered_ = true;
  }

  void read_index(const std::string& index) {
    const std::string text = read_text_file(resolve_weights_file(index), kMaxIndexBytes);
    const json::Json doc = json::parse(text, index);
    const json::Node root(doc, index);
    const json::Node map = root.at("weight_map");
    std::unordered_map<std::string, std::string> weight_map;
    for (const auto& [tensor, file] : map.members()) {
      const std::string& f = file.as_string();
      // Note [Checkpoint confinement]: the index is input; it names files beside it only.
      if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos)
        file.fail("'" + f + "' is not a plain file name beside the index");
      weight_map[tensor] = f;
    }
    weight_map_ = std::move(weight_map);
    index_dir_ = parent_dir(index);
    index_path_ = index;
  }

  // Tensors of the files that no planned parameter reads: said once per loader, as
  // transformers reports them (its load report's UNEXPECTED keys), leaving out the ones
  // unread_ok_ accepts. The index's weight_map lists an index's tensors; a file's header
  // lists its own.
  void report_unread(const std::map<std::string, std::vector<std::string>>& users) {
    if (reported_unread_) return;
    reported_unread_ = true;
    std::vector<std::string> unread;
    auto consider = [&](const std::string& tensor) {
      if (users.count(tensor) == 0 && manifest_buffers_.count(tensor) == 0 &&
          !(unread_ok_ && unread_ok_(tensor)))
        unread.push_back(tensor);
    };
    std::string where;
    if (!index_path_.empty()) {
      for (const auto& kv : weight_map_) consider(kv.first);
      where = index_path_;
    } else {
      const Source* src = source(single_path_, "safetensors_loader");
      for (const auto& t : src->header.tensors()) consider(t.name);
      where = src->file->path();
    }
    if (unread.empty()) return;
    std::sort(unread.begin(), unread.end());
    constexpr size_t kShown = 8;
    std::string list;
    for (size_t i = 0; i < unread.size() && i < kShown; ++i)
      list += (i ? ", '" : "'") + printable_escape(unread[i]) + "'";
    if (unread.size() > kShown)
      list += ", ... (" + std::to_string(unread.size() - kShown) + " more)";
    TORCH_WARN("safetensors_loader: ", unread.size(), " tensor", unread.size() == 1 ? "" : "s",
               " of '", printable_escape(where), "' ", unread.size() == 1 ? "is" : "are",
               " read by no parameter of the model and dropped: ", list,
               " (a model other than the one these weights were saved from?)");
  }

  // The file (a name from the index, or the single file's path), opened and its header read
  // on first use; errors are prefixed with `what` (the tensor that needs it).
  const Source* source(const std::string& file, const std::string& what) {
    auto it = sources_.find(file);
    if (it != sources_.end()) return it->second.get();
    auto s = std::make_unique<Source>();
    try {
      // Note [Hub snapshots]: a link is followed only from a snapshot into its blobs.
      s->file = std::make_unique<InputFile>(resolve_weights_file(
          index_path_.empty() ? file : join_path(index_dir_, file)));
      s->header = SafetensorsHeader::read(*s->file);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, what, ": ", e.msg());
    }
    return sources_.emplace(file, std::move(s)).first->second.get();
  }

  const std::string path_;
  const NameMap map_;
  const std::shared_ptr<LoadStats> stats_;
  std::mutex mu_;  // check() may run on several rank threads sharing this loader
  bool discovered_ = false;
  const UnreadFilter unread_ok_;  // tensors that may stay unread without a word
  bool warned_ = false;  // the several-parameters-one-tensor warning was given
  std::set<std::string> manifest_buffers_;  // a flatshard checkpoint's buffers (not reported)
  bool reported_unread_ = false;            // report_unread ran (once per loader, not per rank)
  std::string single_path_;                                  // one file, or
  std::string index_path_, index_dir_;                       // an index and its directory
  std::unordered_map<std::string, std::string> weight_map_;  // tensor name -> file name
  std::unordered_map<std::string, std::unique_ptr<Source>> sources_;  // by file name
  std::unordered_map<std::string, Resolved> resolved_;  // by model parameter name
};

}  // namespace

ParamLoader safetensors_loader(const std::string& path, NameMap name_map,
                               std::shared_ptr<LoadStats> stats, UnreadFilter unread_ok) {
  // A sharded flatshard checkpoint: its pieces are found through the manifest.
  if (is_directory(path) && path_exists(join_path(path, "manifest.json")) &&
      !path_exists(join_path(path, kModelName)) && !path_exists(join_path(path, kIndexName)))
    return checkpoint_loader(path, std::move(name_map), std::move(stats));
  return ParamLoader::over(std::make_shared<SafetensorsLoader>(
      path, std::move(name_map), std::move(stats), std::move(unread_ok)));
}

std::optional<bool> safetensors_tensors_equal(const std::string& path, const std::string& a,
                                              const std::string& b) {
  auto loader = std::make_shared<SafetensorsLoader>(path, NameMap{}, nullptr,
                                                    [](const std::string&) { return true; });
  const TensorEntry* ea = loader->entry(a);
  const TensorEntry* eb = loader->entry(b);
  if (ea == nullptr || eb == nullptr) return std::nullopt;
  if (ea->shape != eb->shape) return false;
  const std::vector<int64_t> shape = ea->shape;
  const int64_t numel = ea->numel();
  loader->check({PlannedParam{a, shape}, PlannedParam{b, shape}});  // dtypes, bounds
  // In fp32, as the loaded parameters compare (torch.equal in transformers' tie check), a
  // bounded piece at a time: an embedding may be gigabytes.
  constexpr int64_t kPiece = int64_t{1} << 22;
  at::Tensor x = at::empty({std::min(numel, kPiece)}, at::kFloat);
  at::Tensor y = at::empty_like(x);
  for (int64_t pos = 0; pos < numel; pos += kPiece) {
    const int64_t n = std::min(kPiece, numel - pos);
    loader->read(a, pos, pos + n, x.narrow(0, 0, n));
    loader->read(b, pos, pos + n, y.narrow(0, 0, n));
    if (!at::equal(x.narrow(0, 0, n), y.narrow(0, 0, n))) return false;
  }
  return true;
}

}  // namespace flatshard
