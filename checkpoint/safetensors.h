// flatshard/checkpoint/safetensors.h — the safetensors file format, written and read by hand.
//
// Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..],
// "data_offsets": [begin, end]}, ...} padded with spaces so the data starts 8-byte aligned,
// then the raw little-endian tensor bytes, back to back, offsets relative to the data start.
// Python opens these files with safetensors.torch.load_file, or with a few lines of json +
// torch.frombuffer (README.md, "Checkpoints").
//
// Contract: make() lays entries out in the order given; read() rejects anything the reference
// implementation rejects (bad JSON, unknown dtype, a size that does not match the shape, data
// regions that overlap, leave gaps or run past the end of the file), each error naming the file
// and, where one is involved, the tensor.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace flatshard {

class InputFile;

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets in the data section
  int64_t end = 0;
  int64_t numel() const;
  int64_t nbytes() const { return end - begin; }
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

class SafetensorsHeader {
 public:
  SafetensorsHeader() = default;
  // Copies index their own names (by_name_ holds views of tensors_' names); moves keep them.
  SafetensorsHeader(const SafetensorsHeader& other);
  SafetensorsHeader& operator=(const SafetensorsHeader& other);
  SafetensorsHeader(SafetensorsHeader&&) = default;
  SafetensorsHeader& operator=(SafetensorsHeader&&) = default;

  // Lays `entries` out back to back in the given order (assigns begin/end).
  static SafetensorsHeader make(std::vector<TensorEntry> entries, Metadata metadata);
  // The first 8 + N bytes of `file` (checks that N is sane and that the file holds them).
  static std::string read_raw(const InputFile& file);
  // Parses bytes from read_raw(); `file_size` bounds the data regions.
  static SafetensorsHeader parse(std::string raw, const std::string& path, int64_t file_size);
  static SafetensorsHeader read(const InputFile& file);

  // Everything before the data: length prefix + padded JSON.
  const std::string& bytes() const { return bytes_; }
  int64_t data_start() const { return static_cast<int64_t>(bytes_.size()); }
  int64_t data_bytes() const { return data_bytes_; }
  int64_t file_bytes() const { return data_start() + data_bytes_; }
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  const Metadata& metadata() const { return metadata_; }
  const TensorEntry* find(std::string_view name) const;

 private:
  void index();

  std::string bytes_;
  std::vector<TensorEntry> tensors_;  // in data order
  Metadata metadata_;
  int64_t data_bytes_ = 0;
  std::unordered_map<std::string_view, size_t> by_name_;  // views of tensors_[i].name
};

// The product of `shape` into *numel; false if a dimension is negative or the product
// overflows int64 (a hostile header's shape must not wrap around to a small size).
bool checked_numel(const std::vector<int64_t>& shape, int64_t* numel);

// "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL".
const char* safetensors_dtype_name(at::ScalarType t);
// The inverse; throws naming `what` and the known names.
at::ScalarType safetensors_dtype(const std::string& name, const std::string& what);
// The inverse, nullopt for an unknown name (callers that build `what` only for the error).
std::optional<at::ScalarType> find_safetensors_dtype(std::string_view name);

}  // namespace flatshard
