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
#include <string_view>
#include <unordered_map>

#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "support/input_file.h"
#include "support/json.h"

namespace flatshard {

namespace {

constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;  // the reference implementation's limit

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
      TORCH_CHECK(!dangling, printable_escape(path_),
                  ": is a symbolic link whose target does not exist (an incomplete download?)");
      TORCH_CHECK(err != ENOENT, printable_escape(path_), ": no such file");
      TORCH_CHECK(false, printable_escape(path_), ": cannot open: ", std::strerror(err));
    }
    struct stat st;
    TORCH_CHECK(::fstat(fd_, &st) == 0, printable_escape(path_), ": cannot stat: ", std::strerror(errno));
    TORCH_CHECK(S_ISREG(st.st_mode), printable_escape(path_), ": is ",
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
      TORCH_CHECK(got >= 0, printable_escape(path_), ": read failed at byte ", offset, ": ",
                  std::strerror(errno));
      TORCH_CHECK(got > 0, printable_escape(path_), ": ends at byte ", offset,
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

// Members of the top-level object of JSON `text`, counted without parsing it: the commas at
// depth 1 outside strings, plus one unless it has none. Exact for valid JSON; for invalid JSON
// some number (the parser refuses the text afterwards). Linear and allocation-free, so a header
// of more tensors than explain builds is refused before it is parsed (Note [Weights bounds]).
int64_t count_top_level_members(std::string_view text) {
  int64_t commas = 0;
  int64_t depth = 0;
  bool in_string = false, any = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, '"' included
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      any = any || depth == 1;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == ',' && depth == 1) {
      ++commas;
    }
  }
  return any ? commas + 1 : 0;
}

// The header of one safetensors file, validated by the checkpoint's parser. `budget`: how many
// more tensors explain builds (kMaxTensors less those of the headers read before); a header
// holding more is refused before its JSON is parsed (Note [Weights bounds]).
SafetensorsHeader read_header(const std::string& path, int64_t budget) {
  LinkedFile f(path);
  TORCH_CHECK(f.size() >= 8, printable_escape(path), ": not a safetensors file: ", f.size(),
              " bytes, fewer than the 8 of the header length (truncated?)");
  unsigned char len[8];
  f.read(0, reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  TORCH_CHECK(n <= static_cast<uint64_t>(kMaxHeaderBytes), printable_escape(path),
              ": not a safetensors file: header length ", n, " is more than ", kMaxHeaderBytes,
              " bytes");
  TORCH_CHECK(8 + static_cast<int64_t>(n) <= f.size(), printable_escape(path),
              ": truncated inside the safetensors header: it needs ", 8 + n,
              " bytes, the file has ", f.size());
  std::string raw(8 + n, '\0');
  f.read(0, raw.data(), static_cast<int64_t>(raw.size()));
  // What is left to build, for the errors.
  const std::string limit =
      budget == kMaxTensors
          ? "the " + std::to_string(kMaxTensors) + " explain builds"
          : "the " + std::to_string(budget) + " left of the " + std::to_string(kMaxTensors) +
                " explain builds (the shards read before hold the rest)";
  // One member may be __metadata__.
  const int64_t members = count_top_level_members(std::string_view(raw).substr(8));
  TORCH_CHECK(members - 1 <= budget, printable_escape(path), ": its header holds at least ",
              members - 1, " tensors, more than ", limit, "; refused before parsing it");
  SafetensorsHeader h = SafetensorsHeader::parse(std::move(raw), printable_escape(path), f.size());
  TORCH_CHECK(static_cast<int64_t>(h.tensors().size()) <= budget, printable_escape(path),
              ": its header holds ", h.tensors().size(), " tensors, more than ", limit);
  return h;
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
  const SafetensorsHeader h = read_header(w.path, kMaxTensors);
  w.files.push_back(w.path);
  w.tensors.reserve(h.tensors().size());
  for (const auto& e : h.tensors()) w.tensors.push_back(from_entry(e, w.path));
  TORCH_CHECK(!w.tensors.empty(), printable_escape(w.path), ": holds no tensors");
}

void check_shard_name(const std::string& index, std::string_view tensor, const std::string& f) {
  TORCH_CHECK(!f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
                  f.find('\0') == std::string::npos,
              printable_escape(index), ": weight_map names file '", printable_escape(f), "' for tensor '",
              printable_escape(tensor),
              "', which is not a plain file name in the index's directory (no '/', not '.' or "
              "'..'); refusing it");
}

void read_index(WeightsInfo& w) {
  const std::string text = read_weights_text_file(w.path, kMaxIndexBytes);
  const std::string what = printable_escape(w.path);
  const json::Json doc = json::parse(text, what);
  const json::Node root(doc, what);
  TORCH_CHECK(root.is_object(), what, ": a safetensors index must be a JSON object");
  const auto map = root.at("weight_map").member_views();  // views of `doc`, alive below
  TORCH_CHECK(!map.empty(), what, ": weight_map is empty");
  TORCH_CHECK(static_cast<int64_t>(map.size()) <= kMaxTensors, what, ": weight_map lists ",
              map.size(), " tensors, more than the ", kMaxTensors, " explain builds");
  // Each distinct file once, in order of first mention.
  std::vector<std::string> order;
  std::unordered_map<std::string, std::vector<std::string_view>> by_file;
  for (const auto& [tensor, file] : map) {
    const std::string& f = file.as_string();
    check_shard_name(w.path, tensor, f);
    auto [it, fresh] = by_file.try_emplace(f);
    if (fresh) order.push_back(f);
    it->second.push_back(tensor);
  }
  w.tensors.reserve(map.size());
  int64_t in_headers = 0;  // tensors of the headers read so far, listed or not
  for (const std::string& f : order) {
    const std::string path = join_path(w.dir, f);
    const SafetensorsHeader h = read_header(path, kMaxTensors - in_headers);
    in_headers += static_cast<int64_t>(h.tensors().size());
    w.files.push_back(path);
    const auto& wanted = by_file.at(f);
    for (const std::string_view tensor : wanted) {
      const TensorEntry* e = h.find(tensor);
      TORCH_CHECK(e != nullptr, printable_escape(path), ": has no tensor '", printable_escape(tensor),
                  "', which ", what, " places in it");
      w.tensors.push_back(from_entry(*e, path));
    }
    w.unlisted += static_cast<int64_t>(h.tensors().size()) - static_cast<int64_t>(wanted.size());
  }
}

void read_flatshard(WeightsInfo& w) {
  const std::string text = read_weights_text_file(w.path, kMaxIndexBytes);
  const Manifest m = Manifest::parse(text, printable_escape(w.path));
  for (const FileRecord& f : m.files) {
    // Note [Checkpoint confinement]: plain names (parse() checked), no symlinks, regular files.
    const std::string path = join_path(w.dir, f.name);
    const InputFile in(path);
    TORCH_CHECK(in.size() == f.bytes, printable_escape(path), ": is ", in.size(), " bytes but ",
                printable_escape(w.path), " records ", f.bytes, " (an incomplete copy?)");
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
  TORCH_CHECK(!w.tensors.empty(), printable_escape(w.path), ": records no parameters");
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
  TORCH_CHECK(false, printable_escape(dir),
              ": holds no manifest.json, model.safetensors.index.json or "
              "model.safetensors",
              indexes.size() > 1 ? " and several *.safetensors.index.json; pass one of them"
              : files.size() > 1 ? " and several *.safetensors without an index; pass one of them"
                                 : " (nor any *.safetensors file)");
}

// Module order (header contract): by component, numbers numerically; what naming.runs_last
// accepts after the rest (read_weights sorts on that first).
bool is_number(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
bool component_less(std::string_view a, std::string_view b) {
  const bool na = is_number(a), nb = is_number(b);
  if (na && nb) {
    // Without leading zeros: the shorter is the smaller, then bytewise; "01" after "1".
    const std::string_view ta = a.substr(std::min(a.find_first_not_of('0'), a.size()));
    const std::string_view tb = b.substr(std::min(b.find_first_not_of('0'), b.size()));
    if (ta.size() != tb.size()) return ta.size() < tb.size();
    if (ta != tb) return ta < tb;
    return a < b;
  }
  if (na != nb) return na;  // numbers before names (not seen in practice)
  return a < b;
}
// Dotted names compared component by component, in place (no split copies: sorting 524,288
// names on split vectors was most of read_weights' sort, issue 49); a name that runs out of
// components first is the smaller.
bool module_order_less(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (true) {
    const size_t ea = std::min(a.find('.', i), a.size());
    const size_t eb = std::min(b.find('.', j), b.size());
    const std::string_view ca = a.substr(i, ea - i), cb = b.substr(j, eb - j);
    if (ca != cb) return component_less(ca, cb);
    const bool a_ends = ea == a.size(), b_ends = eb == b.size();
    if (a_ends || b_ends) return a_ends && !b_ends;
    i = ea + 1;
    j = eb + 1;
  }
}

// At most this many bytes of a name in an error (a hostile one may be megabytes long).
std::string name_for_error(std::string_view name) {
  constexpr size_t kShown = 160;
  if (name.size() <= kShown) return printable_escape(name);
  return printable_escape(name.substr(0, kShown)) + "... (" +
         std::to_string(name.size()) + " bytes)";
}

// A module's child by (parent index, component): one hash map for a whole tree. The key carries
// its hash: the map does not cache hash codes for a custom hasher and would hash the component
// again for every node a lookup passes.
struct ChildKey {
  ChildKey(size_t p, std::string_view c)
      : parent(p), part(c), hash(std::hash<std::string_view>()(c) ^ (p * 0x9E3779B97F4A7C15ull)) {}
  size_t parent;
  std::string_view part;
  size_t hash;
  bool operator==(const ChildKey& o) const { return parent == o.parent && part == o.part; }
};
struct ChildKeyHash {
  size_t operator()(const ChildKey& k) const { return k.hash; }
};
using ChildIndex = std::unordered_map<ChildKey, size_t, ChildKeyHash>;

// Note [Weights bounds]
// A checkpoint's names and counts come from files anyone can write, and everything built from
// them is host memory and host time: each module is a torch::nn::Module, and the plan walker
// (wrap_policies/make_plan.cpp), torch's named_parameters() and explain recurse once per level
// of the tree, joining paths as they go. So read_weights bounds, before building anything:
// - the tensors: at most kMaxTensors, counted in each safetensors header before its JSON is
//   parsed (count_top_level_members: a header of 10^6 tensors took 6.8 s to refuse), across all
//   the headers an index makes it read (listed or not), and in weight_map;
// - the depth of a name: at most kMaxNameDepth dot-separated components, checked here first
//   (one linear count per name), so every later walk (the prefix checks below, the tree's
//   modules, the plan walker's recursion and its path strings) is bounded by that constant. A
//   name of 30,000 components crashed the plan walker's recursion (SIGSEGV), and 200,000 made
//   its O(depth^2) path copies throw std::bad_alloc.
// With both bounds, reading, sorting and the tree are linear in the headers' size.

// Depth and empty components: one pass over each name, nothing built.
void check_components(const WeightsInfo& w) {
  auto check = [&](std::string_view name, const std::string& file) {
    const int64_t components = std::count(name.begin(), name.end(), '.') + 1;
    const std::string_view where = file.empty() ? w.path : file;
    TORCH_CHECK(components <= kMaxNameDepth, printable_escape(where), ": tensor name '",
                name_for_error(name), "' has ", components,
                " dot-separated components, more than the ", kMaxNameDepth,
                " a module path may have (Note [Weights bounds])");
    TORCH_CHECK(!name.empty() && name.front() != '.' && name.back() != '.' &&
                    name.find("..") == std::string_view::npos,
                printable_escape(where), ": tensor name '", name_for_error(name),
                "' has an empty component (a leading, trailing or doubled '.')");
  };
  for (const auto& t : w.tensors) check(t.name, t.file);
  for (const auto& a : w.aliases) check(a.first, w.path);
}

// check_components, then names that are both a tensor and a module (module_tree_from_weights
// finds those in its tree instead).
void check_names(const WeightsInfo& w) {
  check_components(w);
  std::unordered_map<std::string_view, const std::string*> tensors;  // name -> file
  tensors.reserve(w.tensors.size() + w.aliases.size());
  for (const auto& t : w.tensors) tensors.emplace(t.name, &t.file);
  for (const auto& a : w.aliases) tensors.emplace(a.first, &w.path);
  // Each module prefix of each name is looked up, in file order; a prefix the name before
  // shares up to one of its dots was looked up already (8 tensors of a layer share 4 of their 5
  // prefixes: ~1.3 lookups per name instead of 5, issue 49).
  std::string_view before;
  auto check = [&](std::string_view view, const std::string& file) {
    size_t shared = 0;  // the length of the longest prefix known checked, ending before a dot
    for (size_t i = 0; i < view.size() && i < before.size() && view[i] == before[i]; ++i)
      if (view[i] == '.') shared = i;
    before = view;
    for (size_t dot = view.find('.', shared == 0 ? 0 : shared + 1); dot != std::string_view::npos;
         dot = view.find('.', dot + 1)) {
      auto it = tensors.find(view.substr(0, dot));
      TORCH_CHECK(it == tensors.end(), printable_escape(file.empty() ? w.path : file), ": '",
                  name_for_error(it->first), "' is a tensor and also a module (of tensor '",
                  name_for_error(view), "'); a name cannot be both");
    }
  };
  for (const auto& t : w.tensors) check(t.name, t.file);
  for (const auto& a : w.aliases) check(a.first, w.path);
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
  TORCH_CHECK(f.size() <= max_bytes, printable_escape(path), ": is ", f.size(), " bytes, more than the ",
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
  // Anything there is the config: a FIFO, a dangling link or a link out of the snapshot is an
  // error of read_hf_config (read_weights_text_file), never a run without it. Only nothing
  // there (or a path that cannot have it, ENOTDIR) means there is no config.
  const std::string p = join_path(dir, "config.json");
  struct stat st;
  if (::lstat(p.c_str(), &st) == 0) return p;
  return errno == ENOENT || errno == ENOTDIR ? std::string() : p;
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
  TORCH_CHECK(static_cast<int64_t>(w.tensors.size()) <= kMaxTensors, printable_escape(w.path), ": ",
              w.tensors.size(), " tensors, more than the ", kMaxTensors, " explain builds");
  int64_t total = 0;
  for (const auto& t : w.tensors)
    TORCH_CHECK(!__builtin_add_overflow(total, t.numel, &total), printable_escape(w.path),
                ": the tensors' element count overflows int64 (at '", printable_escape(t.name), "')");
  check_names(w);
  if (naming.is_buffer && w.format != WeightsFormat::kFlatshardCheckpoint)
    for (auto& t : w.tensors) t.buffer = t.buffer || naming.is_buffer(t.name);
  // Module order: each name's top-level component asked of naming.runs_last once (the answer
  // kept while it repeats), names compared in place. Headers are usually in module order
  // already: a linear check first, the stable sort only when it fails (issue 49).
  struct Key {
    bool last;
    size_t index;
  };
  std::vector<Key> keys;
  keys.reserve(w.tensors.size());
  std::string top;
  bool top_last = false;
  for (size_t i = 0; i < w.tensors.size(); ++i) {
    const std::string& name = w.tensors[i].name;
    const std::string_view first = std::string_view(name).substr(0, name.find('.'));
    if (i == 0 || first != top) {
      top.assign(first);
      top_last = naming.runs_last && naming.runs_last(top);
    }
    keys.push_back(Key{top_last, i});
  }
  const auto less = [&](const Key& a, const Key& b) {
    if (a.last != b.last) return b.last;
    return module_order_less(w.tensors[a.index].name, w.tensors[b.index].name);
  };
  if (std::is_sorted(keys.begin(), keys.end(), less)) return w;
  std::stable_sort(keys.begin(), keys.end(), less);
  std::vector<WeightTensor> sorted;
  sorted.reserve(w.tensors.size());
  for (const auto& k : keys) sorted.push_back(std::move(w.tensors[k.index]));
  w.tensors = std::move(sorted);
  return w;
}

void add_alias(WeightsInfo& w, const std::string& alias, const std::string& target) {
  TORCH_CHECK(w.find(target) != nullptr, "add_alias: no tensor '", printable_escape(target), "'");
  TORCH_CHECK(w.find(alias) == nullptr, "add_alias: '", printable_escape(alias), "' is already a tensor");
  for (const auto& a : w.aliases)
    TORCH_CHECK(a.first != alias, "add_alias: '", printable_escape(alias), "' is already an alias");
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
  check_components(w);  // a tensor that is also a module: found in the tree below
  // Pass 1: every module path in order of first appearance, with its own tensors. A module is
  // found from its parent by its component alone, and its path is joined once, when it is
  // first seen: linear in the names (Note [Weights bounds]).
  struct Entry {
    ModuleView view;
    std::vector<size_t> children;  // indices into `modules`, in order
  };
  std::vector<Entry> modules(1);  // [0]: the root
  // (parent, component) -> index into `modules`: one map for the tree, components viewed in the
  // names (a map per module was ~4% of building 655,000 modules, issue 49).
  ChildIndex child;
  child.reserve(w.tensors.size() + w.aliases.size());
  auto module_of = [&](const std::string& tensor_name) -> Entry& {
    size_t parent = 0;
    size_t start = 0;
    for (size_t dot = tensor_name.find('.'); dot != std::string::npos;
         start = dot + 1, dot = tensor_name.find('.', start)) {
      const std::string_view part = std::string_view(tensor_name).substr(start, dot - start);
      const auto [it, fresh] = child.try_emplace(ChildKey{parent, part}, modules.size());
      const size_t found = it->second;  // before push_back moves the entries
      if (fresh) {
        Entry e;
        e.view.path = tensor_name.substr(0, dot);
        e.view.name = std::string(part);
        modules[parent].view.has_children = true;
        modules[parent].children.push_back(found);
        modules.push_back(std::move(e));
      }
      parent = found;
    }
    return modules[parent];
  };
  auto last = [](const std::string& name) {
    const size_t dot = name.find_last_of('.');
    return dot == std::string::npos ? name : name.substr(dot + 1);
  };
  for (const auto& t : w.tensors) module_of(t.name).view.tensors.emplace_back(last(t.name), &t);
  std::unordered_map<std::string_view, const WeightTensor*> by_name;
  if (!w.aliases.empty())
    for (const auto& t : w.tensors) by_name.emplace(t.name, &t);
  for (const auto& [alias, target] : w.aliases) {
    const auto found = by_name.find(target);
    const WeightTensor* t = found == by_name.end() ? nullptr : found->second;
    TORCH_CHECK(t != nullptr, "module_tree_from_weights: alias '", printable_escape(alias),
                "' names no tensor '", printable_escape(target), "'");
    TORCH_CHECK(!t->buffer, "module_tree_from_weights: alias '", printable_escape(alias),
                "' names buffer '", printable_escape(target), "'; only parameters can be tied");
    module_of(alias).view.tensors.emplace_back(last(alias), t);
  }

  // A tensor that is also a module: its module has a child of the tensor's own name.
  for (size_t i = 0; i < modules.size(); ++i) {
    const Entry& m = modules[i];
    for (const auto& [name, t] : m.view.tensors) {
      const auto found = child.find(ChildKey{i, name});
      if (found == child.end()) continue;
      size_t below = found->second;  // the first tensor under that module, for the message
      while (modules[below].view.tensors.empty()) below = modules[below].children.front();
      const std::string both = m.view.path.empty() ? name : m.view.path + "." + name;
      TORCH_CHECK(false, printable_escape(t->file.empty() ? w.path : t->file), ": '",
                  name_for_error(both), "' is a tensor and also a module (of tensor '",
                  name_for_error(modules[below].view.path + "." +
                                 modules[below].view.tensors.front().first),
                  "'); a name cannot be both");
    }
  }

  // Pass 2: modules with their type names, tensors (one meta tensor per WeightTensor), children.
  std::vector<std::shared_ptr<torch::nn::Module>> built(modules.size());
  for (size_t i = 0; i < modules.size(); ++i)
    built[i] = std::make_shared<torch::nn::Module>(type_of(modules[i].view));
  std::unordered_map<const WeightTensor*, at::Tensor> made;
  made.reserve(w.tensors.size());
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
    for (const size_t child : modules[i].children)
      built[i]->register_module(modules[child].view.name, built[child]);
  }
  return built[0];
}

std::optional<LayerList> find_layer_list(const WeightsInfo& w) {
  // Every module, found from its parent by its component (linear in the names, Note [Weights
  // bounds]): its children and the parameter elements below it.
  struct Node {
    std::string_view name;  // the component ("" for the root)
    size_t parent = 0;
    size_t depth = 0;
    int64_t numel = 0;
    std::vector<size_t> children;
  };
  std::vector<Node> nodes(1);
  ChildIndex child;  // one map for the tree (as module_tree_from_weights)
  child.reserve(w.tensors.size());
  for (const auto& t : w.tensors) {
    const std::string_view name(t.name);
    TORCH_CHECK(std::count(name.begin(), name.end(), '.') < kMaxNameDepth,
                "find_layer_list: tensor name '", name_for_error(name), "' has more than ",
                kMaxNameDepth, " components");
    size_t at = 0;
    if (!t.buffer) nodes[0].numel += t.numel;
    size_t start = 0;
    for (size_t dot = name.find('.'); dot != std::string_view::npos;
         start = dot + 1, dot = name.find('.', start)) {
      const std::string_view part = name.substr(start, dot - start);
      const auto [it, fresh] = child.try_emplace(ChildKey{at, part}, nodes.size());
      const size_t next = it->second;  // before emplace_back moves the nodes
      if (fresh) {
        Node n;
        n.name = part;
        n.parent = at;
        n.depth = nodes[at].depth + 1;
        nodes[at].children.push_back(next);
        nodes.push_back(std::move(n));
      }
      at = next;
      if (!t.buffer) nodes[at].numel += t.numel;
    }
  }
  auto path_of = [&](size_t i) {
    std::vector<std::string_view> parts;
    for (; i != 0; i = nodes[i].parent) parts.push_back(nodes[i].name);
    std::string path;
    for (auto it = parts.rbegin(); it != parts.rend(); ++it)
      path += (path.empty() ? "" : ".") + std::string(*it);
    return path;
  };
  // The most parameter elements, then the outermost, then the first path bytewise.
  std::optional<LayerList> best;
  int64_t best_numel = -1;
  size_t best_depth = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const auto& kids = nodes[i].children;
    if (kids.empty()) continue;
    const int64_t count = static_cast<int64_t>(kids.size());
    bool list = true;
    for (const size_t c : kids) {
      const std::string_view k = nodes[c].name;
      list = list && is_number(k) && (k == "0" || k[0] != '0') && k.size() <= 9 &&
             std::stoll(std::string(k)) < count;
    }
    if (!list) continue;  // names are distinct, so all below `count`: exactly 0 .. count-1
    const int64_t n = nodes[i].numel;
    const size_t depth = nodes[i].depth;
    if (n > best_numel || (n == best_numel && depth < best_depth)) {
      best = LayerList{path_of(i), count};
      best_numel = n;
      best_depth = depth;
    } else if (n == best_numel && depth == best_depth) {
      std::string path = path_of(i);
      if (path < best->prefix) best->prefix = std::move(path), best->count = count;
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
