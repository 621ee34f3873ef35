#include "planner/weights_tree.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "support/json.h"

namespace flatshard {

namespace {

constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;  // the reference implementation's limit

// Names come from files: control characters would break the one-line errors.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string dirname_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A read-only regular file; a symbolic link is followed only into a hub snapshot's blobs (Note
// [Hub snapshots], checkpoint/file_io.h), any other is refused naming it.
class LinkedFile {
 public:
  explicit LinkedFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(resolve_weights_file(path_).c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd_ < 0) {
      const int err = errno;
      struct stat st;
      const bool dangling =
          err == ENOENT && ::lstat(path_.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
      TORCH_CHECK(!dangling, printable(path_),
                  ": is a symbolic link whose target does not exist (an incomplete download?)");
      TORCH_CHECK(err != ENOENT, printable(path_), ": no such file");
      TORCH_CHECK(false, printable(path_), ": cannot open: ", std::strerror(err));
    }
    struct stat st;
    TORCH_CHECK(::fstat(fd_, &st) == 0, printable(path_), ": cannot stat: ", std::strerror(errno));
    TORCH_CHECK(S_ISREG(st.st_mode), printable(path_), ": is ",
                S_ISDIR(st.st_mode)    ? "a directory"
                : S_ISFIFO(st.st_mode) ? "a FIFO"
                : S_ISSOCK(st.st_mode) ? "a socket"
                : S_ISCHR(st.st_mode)  ? "a character device"
                : S_ISBLK(st.st_mode)  ? "a block device"
                                       : "not a regular file",
                ", not a regular file; refusing to read it");
    size_ = st.st_size;
  }
  ~LinkedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  LinkedFile(const LinkedFile&) = delete;
  LinkedFile& operator=(const LinkedFile&) = delete;

  int64_t size() const { return size_; }
  void read(int64_t offset, char* dst, int64_t n) const {
    while (n > 0) {
      const ssize_t got = ::pread(fd_, dst, static_cast<size_t>(n), offset);
      if (got < 0 && errno == EINTR) continue;
      TORCH_CHECK(got >= 0, printable(path_), ": read failed at byte ", offset, ": ",
                  std::strerror(errno));
      TORCH_CHECK(got > 0, printable(path_), ": ends at byte ", offset,
                  " while reading it (truncated while being read?)");
      dst += got;
      n -= got;
      offset += got;
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// The header of one safetensors file, validated by the checkpoint's parser.
SafetensorsHeader read_header(const std::string& path) {
  LinkedFile f(path);
  TORCH_CHECK(f.size() >= 8, printable(path), ": not a safetensors file: ", f.size(),
              " bytes, fewer than the 8 of the header length (truncated?)");
  unsigned char len[8];
  f.read(0, reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  TORCH_CHECK(n <= static_cast<uint64_t>(kMaxHeaderBytes), printable(path),
              ": not a safetensors file: header length ", n, " is more than ", kMaxHeaderBytes,
              " bytes");
  TORCH_CHECK(8 + static_cast<int64_t>(n) <= f.size(), printable(path),
              ": truncated inside the safetensors header: it needs ", 8 + n,
              " bytes, the file has ", f.size());
  std::string raw(8 + n, '\0');
  f.read(0, raw.data(), static_cast<int64_t>(raw.size()));
  return SafetensorsHeader::parse(std::move(raw), printable(path), f.size());
}

WeightTensor from_entry(const TensorEntry& e, const std::string& file) {
  WeightTensor t;
  t.name = e.name;
  t.dtype = e.dtype;
  t.shape = e.shape;
  t.numel = e.numel();  // parse() checked that it does not overflow
  t.file = file;
  t.buffer = !at::isFloatingType(e.dtype);  // naming.is_buffer: read_weights
  return t;
}

void read_single(WeightsInfo& w) {
  const SafetensorsHeader h = read_header(w.path);
  w.files.push_back(w.path);
  for (const auto& e : h.tensors()) w.tensors.push_back(from_entry(e, w.path));
  TORCH_CHECK(!w.tensors.empty(), printable(w.path), ": holds no tensors");
}

void check_shard_name(const std::string& index, const std::string& tensor, const std::string& f) {
  TORCH_CHECK(!f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
                  f.find('\0') == std::string::npos,
              printable(index), ": weight_map names file '", printable(f), "' for tensor '",
              printable(tensor),
              "', which is not a plain file name in the index's directory (no '/', not '.' or "
              "'..'); refusing it");
}

void read_index(WeightsInfo& w) {
  const std::string text = read_weights_text_file(w.path, kMaxIndexBytes);
  const std::string what = printable(w.path);
  const json::Json doc = json::parse(text, what);
  const json::Node root(doc, what);
  TORCH_CHECK(root.is_object(), what, ": a safetensors index must be a JSON object");
  const auto map = root.at("weight_map").members();
  TORCH_CHECK(!map.empty(), what, ": weight_map is empty");
  TORCH_CHECK(static_cast<int64_t>(map.size()) <= kMaxTensors, what, ": weight_map lists ",
              map.size(), " tensors, more than the ", kMaxTensors, " explain builds");
  // Each distinct file once, in order of first mention.
  std::vector<std::string> order;
  std::unordered_map<std::string, std::vector<std::string>> by_file;
  for (const auto& [tensor, file] : map) {
    const std::string& f = file.as_string();
    check_shard_name(w.path, tensor, f);
    auto [it, fresh] = by_file.try_emplace(f);
    if (fresh) order.push_back(f);
    it->second.push_back(tensor);
  }
  for (const std::string& f : order) {
    const std::string path = join_path(w.dir, f);
    const SafetensorsHeader h = read_header(path);
    w.files.push_back(path);
    const auto& wanted = by_file.at(f);
    for (const std::string& tensor : wanted) {
      const TensorEntry* e = h.find(tensor);
      TORCH_CHECK(e != nullptr, printable(path), ": has no tensor '", printable(tensor),
                  "', which ", what, " places in it");
      w.tensors.push_back(from_entry(*e, path));
    }
    w.unlisted += static_cast<int64_t>(h.tensors().size()) - static_cast<int64_t>(wanted.size());
  }
}

void read_flatshard(WeightsInfo& w) {
  const std::string text = read_weights_text_file(w.path, kMaxIndexBytes);
  const Manifest m = Manifest::parse(text, printable(w.path));
  for (const FileRecord& f : m.files) {
    // Note [Checkpoint confinement]: plain names (parse() checked), no symlinks, regular files.
    const std::string path = join_path(w.dir, f.name);
    const InputFile in(path);
    TORCH_CHECK(in.size() == f.bytes, printable(path), ": is ", in.size(), " bytes but ",
                printable(w.path), " records ", f.bytes, " (an incomplete copy?)");
    w.files.push_back(path);
  }
  auto add = [&](const ValueRecord& v, bool buffer) {
    WeightTensor t;
    t.name = v.name;
    t.dtype = v.dtype;
    t.shape = v.shape;
    t.numel = v.numel();  // parse() checked that it does not overflow
    t.file = v.pieces.empty() ? std::string() : join_path(w.dir, v.pieces.front().file);
    t.buffer = buffer;
    w.tensors.push_back(std::move(t));
    for (const auto& a : v.aliases) w.aliases.emplace_back(a, v.name);
  };
  for (const auto& p : m.params) add(p, false);
  for (const auto& b : m.buffers) add(b, true);
  TORCH_CHECK(!w.tensors.empty(), printable(w.path), ": records no parameters");
}

// Which file of a directory to read (the order of the header's contract).
std::string pick_in_dir(const std::string& dir, WeightsFormat* format) {
  auto exists = [&](const std::string& name) {
    struct stat st;
    return ::lstat(join_path(dir, name).c_str(), &st) == 0;
  };
  if (exists(kManifestName)) {
    *format = WeightsFormat::kFlatshardCheckpoint;
    return join_path(dir, kManifestName);
  }
  // Note [Weights file of a directory]: the file safetensors_loader reads (transformers').
  const WeightsDirPick pick = pick_weights_in_dir(dir);
  if (!pick.path.empty()) {
    *format = pick.index ? WeightsFormat::kSafetensorsIndex : WeightsFormat::kSafetensors;
    return pick.path;
  }
  std::vector<std::string> indexes, files;
  for (const auto& name : list_dir(dir)) {
    if (ends_with(name, ".safetensors.index.json")) indexes.push_back(name);
    if (ends_with(name, ".safetensors")) files.push_back(name);
  }
  std::sort(indexes.begin(), indexes.end());
  std::sort(files.begin(), files.end());
  if (indexes.size() == 1) {
    *format = WeightsFormat::kSafetensorsIndex;
    return join_path(dir, indexes[0]);
  }
  if (indexes.empty() && files.size() == 1) {
    *format = WeightsFormat::kSafetensors;
    return join_path(dir, files[0]);
  }
  TORCH_CHECK(false, printable(dir),
              ": holds no manifest.json, model.safetensors.index.json or "
              "model.safetensors",
              indexes.size() > 1 ? " and several *.safetensors.index.json; pass one of them"
              : files.size() > 1 ? " and several *.safetensors without an index; pass one of them"
                                 : " (nor any *.safetensors file)");
}

// Module order (header contract): by component, numbers numerically; what naming.runs_last
// accepts after the rest (read_weights sorts on that first).
bool is_number(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
std::vector<std::string> split(const std::string& name) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = name.find('.', start);
    parts.push_back(name.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}
bool component_less(const std::string& a, const std::string& b) {
  const bool na = is_number(a), nb = is_number(b);
  if (na && nb) {
    const size_t za = a.find_first_not_of('0'), zb = b.find_first_not_of('0');
    const std::string ta = za == std::string::npos ? "" : a.substr(za);
    const std::string tb = zb == std::string::npos ? "" : b.substr(zb);
    if (ta.size() != tb.size()) return ta.size() < tb.size();
    if (ta != tb) return ta < tb;
    return a < b;
  }
  if (na != nb) return na;  // numbers before names (not seen in practice)
  return a < b;
}
bool module_order_less(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] == b[i]) continue;
    return component_less(a[i], b[i]);
  }
  return a.size() < b.size();
}

// Empty components and names that are both a tensor and a module.
void check_names(const WeightsInfo& w) {
  std::unordered_map<std::string, const std::string*> tensors;  // name -> file
  for (const auto& t : w.tensors) tensors.emplace(t.name, &t.file);
  for (const auto& [alias, target] : w.aliases) tensors.emplace(alias, &w.path);
  for (const auto& [name, file] : tensors) {
    const std::string where = printable(file->empty() ? w.path : *file);
    for (const auto& part : split(name))
      TORCH_CHECK(!part.empty(), where, ": tensor name '", printable(name),
                  "' has an empty component (a leading, trailing or doubled '.')");
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
      auto it = tensors.find(name.substr(0, dot));
      TORCH_CHECK(it == tensors.end(), where, ": '", printable(it->first),
                  "' is a tensor and also a module (of tensor '", printable(name),
                  "'); a name cannot be both");
    }
  }
}

}  // namespace

const char* weights_format_name(WeightsFormat f) {
  switch (f) {
    case WeightsFormat::kSafetensors:
      return "safetensors";
    case WeightsFormat::kSafetensorsIndex:
      return "safetensors index";
    case WeightsFormat::kFlatshardCheckpoint:
      return "flatshard checkpoint";
  }
  return "?";
}

std::string read_weights_text_file(const std::string& path, int64_t max_bytes) {
  LinkedFile f(path);
  TORCH_CHECK(f.size() <= max_bytes, printable(path), ": is ", f.size(), " bytes, more than the ",
              max_bytes, " it may have; refusing to read it");
  std::string text(static_cast<size_t>(f.size()), '\0');
  f.read(0, text.data(), f.size());
  return text;
}

const WeightTensor* WeightsInfo::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

int64_t WeightsInfo::num_parameters() const {
  int64_t n = 0;
  for (const auto& t : tensors)
    if (!t.buffer) n += t.numel;  // read_weights checked the sum
  return n;
}

std::string WeightsInfo::dtype_summary() const {
  std::map<at::ScalarType, int64_t> count;
  for (const auto& t : tensors)
    if (!t.buffer) ++count[t.dtype];
  std::vector<std::pair<int64_t, at::ScalarType>> by_count;
  for (const auto& [d, n] : count) by_count.emplace_back(n, d);
  std::sort(by_count.begin(), by_count.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  if (by_count.empty()) return "none";
  if (by_count.size() == 1) return safetensors_dtype_name(by_count[0].second);
  std::string s;
  for (size_t i = 0; i < by_count.size(); ++i)
    s += std::string(i ? " + " : "") + safetensors_dtype_name(by_count[i].second) + " (" +
         std::to_string(by_count[i].first) + (i ? ")" : " tensors)");
  return s;
}

std::string WeightsInfo::config_path() const {
  const std::string p = join_path(dir, "config.json");
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) ? p : std::string();
}

WeightsInfo read_weights(const std::string& path, const WeightsNaming& naming) {
  TORCH_CHECK(!path.empty(), "--weights: the path is empty");
  WeightsInfo w;
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    w.path = pick_in_dir(path, &w.format);
  } else {
    w.path = path;
    const size_t slash = path.find_last_of('/');
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    w.format = base == kManifestName      ? WeightsFormat::kFlatshardCheckpoint
               : ends_with(base, ".json") ? WeightsFormat::kSafetensorsIndex
                                          : WeightsFormat::kSafetensors;
  }
  w.dir = dirname_of(w.path);
  switch (w.format) {
    case WeightsFormat::kSafetensors:
      read_single(w);
      break;
    case WeightsFormat::kSafetensorsIndex:
      read_index(w);
      break;
    case WeightsFormat::kFlatshardCheckpoint:
      read_flatshard(w);
      break;
  }
  TORCH_CHECK(static_cast<int64_t>(w.tensors.size()) <= kMaxTensors, printable(w.path), ": ",
              w.tensors.size(), " tensors, more than the ", kMaxTensors, " explain builds");
  int64_t total = 0;
  for (const auto& t : w.tensors)
    TORCH_CHECK(!__builtin_add_overflow(total, t.numel, &total), printable(w.path),
                ": the tensors' element count overflows int64 (at '", printable(t.name), "')");
  check_names(w);
  if (naming.is_buffer && w.format != WeightsFormat::kFlatshardCheckpoint)
    for (auto& t : w.tensors) t.buffer = t.buffer || naming.is_buffer(t.name);
  // Sort on split names once (module_order_less compares components), each name asked of
  // naming.runs_last once.
  struct Key {
    bool last;
    std::vector<std::string> parts;
    size_t index;
  };
  std::vector<Key> keys;
  keys.reserve(w.tensors.size());
  for (size_t i = 0; i < w.tensors.size(); ++i) {
    Key k{false, split(w.tensors[i].name), i};
    k.last = naming.runs_last && naming.runs_last(k.parts.front());
    keys.push_back(std::move(k));
  }
  std::stable_sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
    if (a.last != b.last) return b.last;
    return module_order_less(a.parts, b.parts);
  });
  std::vector<WeightTensor> sorted;
  sorted.reserve(w.tensors.size());
  for (const auto& k : keys) sorted.push_back(std::move(w.tensors[k.index]));
  w.tensors = std::move(sorted);
  return w;
}

void add_alias(WeightsInfo& w, const std::string& alias, const std::string& target) {
  TORCH_CHECK(w.find(target) != nullptr, "add_alias: no tensor '", printable(target), "'");
  TORCH_CHECK(w.find(alias) == nullptr, "add_alias: '", printable(alias), "' is already a tensor");
  for (const auto& a : w.aliases)
    TORCH_CHECK(a.first != alias, "add_alias: '", printable(alias), "' is already an alias");
  w.aliases.emplace_back(alias, target);
  check_names(w);
}

std::string generic_module_type(const ModuleView& m) {
  const WeightTensor* weight = nullptr;
  bool only_1d = !m.tensors.empty();
  for (const auto& [name, t] : m.tensors) {
    if (t->buffer) continue;
    if (name == "weight") weight = t;
    only_1d = only_1d && t->shape.size() == 1;
  }
  if (weight != nullptr && weight->shape.size() == 2) return "Linear";
  if (weight != nullptr && only_1d) return "Norm";
  return "Module";
}

std::shared_ptr<torch::nn::Module> module_tree_from_weights(const WeightsInfo& w,
                                                            const WeightsNaming& naming) {
  return module_tree_from_weights(
      w, naming.module_type ? naming.module_type : ModuleTypeFn(generic_module_type));
}

std::shared_ptr<torch::nn::Module> module_tree_from_weights(const WeightsInfo& w,
                                                            const ModuleTypeFn& type_of) {
  TORCH_CHECK(type_of, "module_tree_from_weights: the type namer is empty");
  check_names(w);
  // Pass 1: every module path in order of first appearance, with its own tensors.
  struct Entry {
    ModuleView view;
    std::vector<std::string> children;
  };
  std::vector<Entry> modules(1);  // [0]: the root
  std::unordered_map<std::string, size_t> index{{"", 0}};
  auto module_of = [&](const std::string& tensor_name) -> Entry& {
    size_t parent = 0;
    std::string path;
    const auto parts = split(tensor_name);
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      path += (i ? "." : "") + parts[i];
      auto [it, fresh] = index.try_emplace(path, modules.size());
      if (fresh) {
        Entry e;
        e.view.path = path;
        e.view.name = parts[i];
        modules[parent].view.has_children = true;
        modules[parent].children.push_back(parts[i]);
        modules.push_back(std::move(e));
      }
      parent = it->second;
    }
    return modules[parent];
  };
  auto last = [](const std::string& name) {
    const size_t dot = name.find_last_of('.');
    return dot == std::string::npos ? name : name.substr(dot + 1);
  };
  for (const auto& t : w.tensors) module_of(t.name).view.tensors.emplace_back(last(t.name), &t);
  for (const auto& [alias, target] : w.aliases) {
    const WeightTensor* t = w.find(target);
    TORCH_CHECK(t != nullptr, "module_tree_from_weights: alias '", printable(alias),
                "' names no tensor '", printable(target), "'");
    TORCH_CHECK(!t->buffer, "module_tree_from_weights: alias '", printable(alias),
                "' names buffer '", printable(target), "'; only parameters can be tied");
    module_of(alias).view.tensors.emplace_back(last(alias), t);
  }

  // Pass 2: modules with their type names, tensors (one meta tensor per WeightTensor), children.
  std::vector<std::shared_ptr<torch::nn::Module>> built(modules.size());
  for (size_t i = 0; i < modules.size(); ++i)
    built[i] = std::make_shared<torch::nn::Module>(type_of(modules[i].view));
  std::unordered_map<const WeightTensor*, at::Tensor> made;
  for (size_t i = 0; i < modules.size(); ++i) {
    for (const auto& [name, t] : modules[i].view.tensors) {
      auto it = made.find(t);
      if (it == made.end()) {
        const auto dtype = t->buffer ? t->dtype : at::kFloat;
        it =
            made.emplace(t, at::empty(t->shape, at::TensorOptions().dtype(dtype).device(at::kMeta)))
                .first;
      }
      if (t->buffer)
        built[i]->register_buffer(name, it->second);
      else
        built[i]->register_parameter(name, it->second, /*requires_grad=*/true);
    }
    const std::string prefix = modules[i].view.path.empty() ? "" : modules[i].view.path + ".";
    for (const auto& child : modules[i].children)
      built[i]->register_module(child, built[index.at(prefix + child)]);
  }
  return built[0];
}

std::optional<LayerList> find_layer_list(const WeightsInfo& w) {
  // Children and parameter elements of every module path.
  std::map<std::string, std::unordered_set<std::string>> children;
  std::unordered_map<std::string, int64_t> numel;
  for (const auto& t : w.tensors) {
    std::string path;
    const auto parts = split(t.name);
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      children[path].insert(parts[i]);
      if (!t.buffer) numel[path] += t.numel;
      path += (i ? "." : "") + parts[i];
    }
    if (!t.buffer) numel[path] += t.numel;
  }
  std::optional<LayerList> best;
  int64_t best_numel = -1;
  size_t best_depth = 0;
  for (const auto& [path, kids] : children) {
    const int64_t count = static_cast<int64_t>(kids.size());
    bool list = true;
    for (const auto& k : kids) {
      list = list && is_number(k) && (k == "0" || k[0] != '0') && k.size() <= 9 &&
             std::stoll(k) < count;
    }
    if (!list) continue;  // names are distinct, so all below `count`: exactly 0 .. count-1
    const size_t depth = path.empty() ? 0 : split(path).size();
    const int64_t n = numel[path];
    if (n > best_numel || (n == best_numel && depth < best_depth)) {
      best = LayerList{path, count};
      best_numel = n;
      best_depth = depth;
    }
  }
  return best;
}

std::optional<std::string> layer_list_policy(const LayerList& l) {
  if (l.count < 1) return std::nullopt;
  for (char c : l.prefix)
    if (std::strchr("*?[]!^ \t\r\n,;|:=", c) != nullptr) return std::nullopt;
  const size_t digits = std::to_string(l.count - 1).size();
  std::string spec = "path=";
  std::string glob;
  for (size_t d = 1; d <= digits; ++d) {
    glob += "[0-9]";
    spec += (d > 1 ? "|" : "") + (l.prefix.empty() ? "" : l.prefix + ".") + glob;
  }
  return spec;
}

}  // namespace flatshard
