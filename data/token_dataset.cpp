// flatshard/data/token_dataset.cpp — see token_dataset.h for the contract.
#include "data/token_dataset.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "support/input_file.h"

namespace flatshard {
namespace data {

namespace {

std::string where(const std::string& path) { return "token file '" + printable_escape(path) + "'"; }

// splitmix64's finaliser (Steele, Lea, Flood 2014): a well-mixed 64-bit hash.
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

int32_t read_i32(const unsigned char* p) {
  uint32_t v = 0;
  std::memcpy(&v, p, 4);  // little-endian hosts only (x86-64, aarch64), as llm.c
  return static_cast<int32_t>(v);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

const char* token_dtype_name(TokenDtype d) {
  return d == TokenDtype::kUint16 ? "uint16" : "uint32";
}

TokenDtype parse_token_dtype(const std::string& name) {
  if (name == "uint16") return TokenDtype::kUint16;
  if (name == "uint32") return TokenDtype::kUint32;
  TORCH_CHECK(false, "token dtype '", printable_escape(name), "': expected uint16 or uint32");
}

int64_t BatchLayout::accumulation() const {
  check();
  return global_batch / (micro_batch * world);
}

void BatchLayout::check() const {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "batch layout: rank ", rank, " of world ",
              world);
  TORCH_CHECK(micro_batch >= 1, "micro-batch: expected at least 1 sample, got ", micro_batch);
  TORCH_CHECK(global_batch >= 1 && global_batch % (micro_batch * world) == 0, "global batch ",
              global_batch, ": expected a positive multiple of micro-batch ", micro_batch,
              " x world ", world, " = ", micro_batch * world,
              " (each rank runs global / (micro x world) micro-batches per step)");
}

TokenDataset::TokenDataset(const std::string& path, TokenDatasetOptions options)
    : options_(options) {
  TORCH_CHECK(options_.vocab > 0, where(path), ": vocabulary size must be positive, got ",
              options_.vocab);
  TORCH_CHECK(options_.seq_len > 0, where(path), ": sequence length must be positive, got ",
              options_.seq_len);
  struct stat st {};
  // stat (not open) only to tell a directory from a file; every file is then opened through
  // MappedInputFile, which refuses FIFOs and devices without blocking.
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    DIR* d = ::opendir(path.c_str());
    TORCH_CHECK(d != nullptr, where(path), ": cannot open directory: ", std::strerror(errno));
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (ends_with(name, ".bin")) names.push_back(name);
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    TORCH_CHECK(!names.empty(), where(path), ": a directory without any *.bin token file");
    for (const auto& n : names) add_file(path + "/" + n);
  } else {
    add_file(path);
  }
}

TokenDataset::~TokenDataset() = default;

void TokenDataset::add_file(const std::string& path) {
  Shard s;
  s.path = path;
  s.map = std::make_unique<MappedInputFile>(path, "token file");
  const int64_t bytes = s.map->size();
  TORCH_CHECK(bytes > 0, where(path), ": empty (0 bytes)");
  s.dtype = options_.dtype;
  if (bytes >= 4 && read_i32(s.map->data()) == kLlmcMagic) {
    TORCH_CHECK(bytes >= kLlmcHeaderBytes, where(path), ": starts with llm.c's magic ", kLlmcMagic,
                " but has ", bytes, " bytes, less than its ", kLlmcHeaderBytes, "-byte header");
    const int32_t version = read_i32(s.map->data() + 4);
    const int64_t count = read_i32(s.map->data() + 8);
    TORCH_CHECK(version == 1 || version == 2, where(path), ": llm.c header version ", version,
                ", expected 1 (uint16 tokens) or 2 (uint32)");
    s.dtype = version == 1 ? TokenDtype::kUint16 : TokenDtype::kUint32;
    const int64_t width = version == 1 ? 2 : 4;
    const int64_t expect = kLlmcHeaderBytes + count * width;
    TORCH_CHECK(count >= 0 && bytes == expect, where(path), ": llm.c header says ", count,
                " tokens (", expect, " bytes), the file has ", bytes,
                " bytes (truncated or not llm.c's format)");
    s.header_bytes = kLlmcHeaderBytes;
    s.tokens = count;
  } else {
    const int64_t width = s.dtype == TokenDtype::kUint16 ? 2 : 4;
    TORCH_CHECK(bytes % width == 0, where(path), ": ", bytes, " bytes, not a multiple of ", width,
                " (", token_dtype_name(s.dtype), " tokens; truncated, or another token dtype)");
    s.tokens = bytes / width;
  }
  const int64_t need = options_.seq_len + 1;
  TORCH_CHECK(s.tokens >= need, where(path), ": ", s.tokens, " tokens, fewer than sequence length ",
              options_.seq_len, " + 1 = ", need);
  s.first_window = windows_;
  windows_ += s.tokens - need + 1;
  paths_.push_back(path);
  shards_.push_back(std::move(s));
}

int64_t TokenDataset::num_tokens() const {
  int64_t n = 0;
  for (const auto& s : shards_) n += s.tokens;
  return n;
}

at::Tensor TokenDataset::window(int64_t w) const {
  TORCH_CHECK(w >= 0 && w < windows_, "token data: window ", w, " of ", windows_);
  auto it = std::upper_bound(shards_.begin(), shards_.end(), w,
                             [](int64_t v, const Shard& s) { return v < s.first_window; });
  const Shard& s = *(it - 1);
  const int64_t begin = w - s.first_window;
  const int64_t n = options_.seq_len + 1;
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* dst = out.data_ptr<int64_t>();
  const unsigned char* base = s.map->data() + s.header_bytes;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t;
    if (s.dtype == TokenDtype::kUint16) {
      uint16_t v;
      std::memcpy(&v, base + 2 * (begin + i), 2);
      t = v;
    } else {
      uint32_t v;
      std::memcpy(&v, base + 4 * (begin + i), 4);
      t = v;
    }
    TORCH_CHECK(t < options_.vocab, where(s.path), ": token ", begin + i, " is ", t,
                ", not below the model's vocabulary size ", options_.vocab,
                " (tokenized for another model?)");
    dst[i] = t;
  }
  return out;
}

int64_t TokenDataset::sample_window(uint64_t seed, int64_t step, int64_t g) const {
  const uint64_t h = mix(mix(mix(seed) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(g));
  return static_cast<int64_t>(h % static_cast<uint64_t>(windows_));
}

std::pair<at::Tensor, at::Tensor> TokenDataset::micro_batch(uint64_t seed, int64_t step,
                                                            const BatchLayout& layout,
                                                            int64_t m) const {
  const int64_t accum = layout.accumulation();
  TORCH_CHECK(m >= 0 && m < accum, "micro-batch ", m, " of ", accum);
  TORCH_CHECK(step >= 0, "token data: step ", step, " is negative");
  std::vector<at::Tensor> rows;
  for (int64_t j = 0; j < layout.micro_batch; ++j) {
    const int64_t g = (m * layout.world + layout.rank) * layout.micro_batch + j;
    rows.push_back(window(sample_window(seed, step, g)));
  }
  at::Tensor b = at::stack(rows);
  const int64_t t = options_.seq_len;
  return {b.narrow(1, 0, t).contiguous(), b.narrow(1, 1, t).contiguous()};
}

std::pair<at::Tensor, at::Tensor> TokenDataset::eval_batch(int64_t first, int64_t count) const {
  TORCH_CHECK(first >= 0 && count >= 1, "eval batch: samples ", first, " + ", count);
  std::vector<at::Tensor> rows;
  const int64_t n = options_.seq_len + 1;
  for (int64_t k = first; k < first + count; ++k) rows.push_back(window((k * n) % windows_));
  at::Tensor b = at::stack(rows);
  return {b.narrow(1, 0, options_.seq_len).contiguous(),
          b.narrow(1, 1, options_.seq_len).contiguous()};
}

}  // namespace data
}  // namespace flatshard
