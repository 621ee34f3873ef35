#include "checkpoint/safetensors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "checkpoint/file_io.h"
#include "support/json.h"

namespace flatshard {

namespace {

// The reference implementation refuses larger headers; so do we (a flipped bit in the length
// would otherwise ask for terabytes).
constexpr uint64_t kMaxHeader = 100u << 20;

const std::pair<at::ScalarType, const char*> kDtypes[] = {
    {at::kFloat, "F32"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"},  {at::kDouble, "F64"},
    {at::kLong, "I64"},  {at::kInt, "I32"},       {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},   {at::kBool, "BOOL"},
};

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  return os.str() + "]";
}

}  // namespace

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool checked_numel(const std::vector<int64_t>& shape, int64_t* numel) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return false;
  *numel = n;
  return true;
}

const char* safetensors_dtype_name(at::ScalarType t) {
  for (const auto& [st, name] : kDtypes)
    if (st == t) return name;
  TORCH_CHECK(false, "safetensors: dtype ", t, " has no safetensors name");
}

std::optional<at::ScalarType> find_safetensors_dtype(std::string_view name) {
  for (const auto& [st, n] : kDtypes)
    if (name == n) return st;
  return std::nullopt;
}

at::ScalarType safetensors_dtype(const std::string& name, const std::string& what) {
  if (const auto st = find_safetensors_dtype(name)) return *st;
  TORCH_CHECK(false, what, ": unknown safetensors dtype '", name,
              "' (known: F32 BF16 F16 F64 I64 I32 I16 I8 U8 BOOL)");
}

SafetensorsHeader SafetensorsHeader::make(std::vector<TensorEntry> entries, Metadata metadata) {
  SafetensorsHeader h;
  h.metadata_ = std::move(metadata);
  std::string json = "{";
  if (!h.metadata_.empty()) {
    json += "\"__metadata__\":{";
    for (size_t i = 0; i < h.metadata_.size(); ++i)
      json += (i ? "," : "") + json::quote(h.metadata_[i].first) + ":" +
              json::quote(h.metadata_[i].second);
    json += "}";
  }
  int64_t off = 0;
  for (auto& e : entries) {
    e.begin = off;
    e.end = off + e.numel() * static_cast<int64_t>(c10::elementSize(e.dtype));
    off = e.end;
    if (json.size() > 1) json += ",";
    json +=
        json::quote(e.name) + ":{\"dtype\":\"" + safetensors_dtype_name(e.dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) json += (i ? "," : "") + std::to_string(e.shape[i]);
    json += "],\"data_offsets\":[" + std::to_string(e.begin) + "," + std::to_string(e.end) + "]}";
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const uint64_t n = json.size();
  h.bytes_.resize(8);
  for (int i = 0; i < 8; ++i) h.bytes_[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  h.bytes_ += json;
  h.tensors_ = std::move(entries);
  h.data_bytes_ = off;
  h.index();
  return h;
}

std::string SafetensorsHeader::read_raw(const InputFile& file) {
  TORCH_CHECK(file.size() >= 8, file.path(), ": not a safetensors file: only ", file.size(),
              " bytes (truncated?)");
  unsigned char len[8];
  file.read(0, len, 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  TORCH_CHECK(n <= kMaxHeader, file.path(), ": corrupt safetensors header length ", n,
              " (more than ", kMaxHeader, " bytes)");
  TORCH_CHECK(static_cast<int64_t>(8 + n) <= file.size(), file.path(),
              ": truncated inside the safetensors header: it needs ", 8 + n,
              " bytes, the file has ", file.size());
  std::string raw(8 + n, '\0');
  file.read(0, raw.data(), raw.size());
  return raw;
}

SafetensorsHeader SafetensorsHeader::parse(std::string raw, const std::string& path,
                                           int64_t file_size) {
  SafetensorsHeader h;
  h.bytes_ = std::move(raw);
  const std::string_view text = std::string_view(h.bytes_).substr(8);
  TORCH_CHECK(!text.empty() && text[0] == '{', path,
              ": safetensors header does not start with '{'");
  const std::string what = path + " (safetensors header)";
  const json::Json parsed = json::parse(text, what);
  // Errors name the file and the key (a JSON Pointer: "/wte.weight/shape/0").
  const auto members = json::Node(parsed, what).member_views();
  h.tensors_.reserve(members.size());
  for (const auto& [key, value] : members) {
    if (key == "__metadata__") {
      for (const auto& [k, v] : value.members()) h.metadata_.emplace_back(k, v.as_string());
      continue;
    }
    TensorEntry e;
    e.name = key;
    const std::string& dtype = value.at("dtype").as_string();
    const auto known = find_safetensors_dtype(dtype);
    e.dtype = known ? *known : safetensors_dtype(dtype, path + ", tensor '" + e.name + "'");
    for (const auto& d : value.at("shape").items()) {
      e.shape.push_back(d.as_int());
      if (e.shape.back() < 0) d.fail("negative dimension");
    }
    const json::Node offsets = value.at("data_offsets");
    const auto off = offsets.items();
    if (off.size() != 2) offsets.fail("data_offsets must have two entries");
    e.begin = off[0].as_int();
    e.end = off[1].as_int();
    h.tensors_.push_back(std::move(e));
  }
  // By (begin, end): an empty tensor shares its offset with the next one ([x, x] then [x, y]),
  // and by begin alone the sort may put it after that one (files save_file writes have them).
  // Writers lay tensors out in header order: a linear check first, the sort only when needed.
  const auto by_offsets = [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  };
  if (!std::is_sorted(h.tensors_.begin(), h.tensors_.end(), by_offsets))
    std::sort(h.tensors_.begin(), h.tensors_.end(), by_offsets);
  int64_t expect = 0;
  for (const auto& e : h.tensors_) {
    int64_t numel = 0, want = 0;
    TORCH_CHECK(
        checked_numel(e.shape, &numel) &&
            !__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(e.dtype)), &want),
        path, ": tensor '", e.name, "' has shape ", shape_string(e.shape),
        ", whose size overflows int64");
    TORCH_CHECK(e.begin == expect && e.end - e.begin == want, path, ": tensor '", e.name, "' (",
                safetensors_dtype_name(e.dtype), " ", shape_string(e.shape), ", data_offsets [",
                e.begin, ", ", e.end, "]) does not follow the previous tensor", " at ", expect,
                " with ", want, " bytes");
    expect = e.end;
  }
  h.data_bytes_ = expect;
  const int64_t data_end = h.data_start() + h.data_bytes_;
  if (data_end > file_size) {
    for (const auto& e : h.tensors_) {
      TORCH_CHECK(h.data_start() + e.end <= file_size, path, ": truncated: the file has ",
                  file_size, " bytes but tensor '", e.name, "' needs bytes [",
                  h.data_start() + e.begin, ", ", h.data_start() + e.end, ")");
    }
  }
  TORCH_CHECK(data_end == file_size, path, ": ", file_size - data_end,
              " unexpected bytes after the last tensor (the header accounts for ", data_end, ")");
  h.index();
  return h;
}

SafetensorsHeader SafetensorsHeader::read(const InputFile& file) {
  return parse(read_raw(file), file.path(), file.size());
}

SafetensorsHeader::SafetensorsHeader(const SafetensorsHeader& other)
    : bytes_(other.bytes_),
      tensors_(other.tensors_),
      metadata_(other.metadata_),
      data_bytes_(other.data_bytes_) {
  index();
}

SafetensorsHeader& SafetensorsHeader::operator=(const SafetensorsHeader& other) {
  if (this != &other) {
    bytes_ = other.bytes_;
    tensors_ = other.tensors_;
    metadata_ = other.metadata_;
    data_bytes_ = other.data_bytes_;
    index();
  }
  return *this;
}

void SafetensorsHeader::index() {
  by_name_.clear();
  by_name_.reserve(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

const TensorEntry* SafetensorsHeader::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace flatshard
