// flatshard/data/token_dataset.h — pre-tokenized training data: binary token files (the layout
// nanoGPT and llm.c write), memory-mapped, cut into next-token batches that every rank reads its
// own slice of, deterministically from (seed, step).
//
//   using namespace flatshard::data;
//   TokenDataset ds("train.bin", {TokenDtype::kUint16, /*vocab=*/50304, /*seq_len=*/256});
//   BatchLayout layout{/*global_batch=*/16, /*micro_batch=*/2, world, rank};
//   for (int64_t m = 0; m < layout.accumulation(); ++m) {
//     auto [idx, targets] = ds.micro_batch(seed, step, layout, m);   // int64 [micro, seq]
//   }
//
// Contract
// - Files: raw little-endian uint16 or uint32 tokens (nanoGPT's train.bin: no header; the dtype
//   comes from the options), or llm.c's format: a 256 x int32 header (magic 20240520, version 1
//   = uint16 tokens, 2 = uint32, then the token count) and the tokens; a file whose first int32
//   is the magic is read as llm.c's and its header must agree with its size. `path` names one
//   file or a directory of shards: its regular files ending ".bin", in byte order of their
//   names (the order prepare_tokens.py numbers them in); other entries are ignored.
// - Every file is opened through support/input_file.h (MappedInputFile: regular files only, a
//   FIFO or device is refused without blocking) and checked before any batch is read: a size
//   that is not a multiple of the token size, an empty file, a file with fewer than seq_len + 1
//   tokens, an llm.c header that disagrees with the size or has an unknown version, and an
//   empty directory are errors. Tokens are checked against `vocab` as they are read (each batch
//   checks every token it returns): a token >= vocab is an error naming the file, the token's
//   index in it and both values. Errors are c10::Error, one line, "token file '<path>': ...".
// - Samples: a sample is seq_len + 1 consecutive tokens of one file (input and the target shifted
//   by one); the windows are every start position of every file, numbered across files in
//   order. Sample g (0 <= g < global_batch) of step s starts at window
//   splitmix64(seed, s, g) mod windows: sampling with replacement, as nanoGPT does, a pure
//   function of (seed, step, g) — so a run resumes from the step alone (the data position to
//   record is the step), and the samples of a step do not depend on the world size.
// - BatchLayout: a step's global batch of `global_batch` samples is split into world * A
//   micro-batches of `micro_batch` samples (A = accumulation(), which must be a whole number);
//   rank r's micro-batch m holds samples (m * world + r) * micro_batch + j. Every rank reads only
//   its own samples.
// - Thread safety: const methods may be called from several threads (ranks as threads) at once.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flatshard {

class MappedInputFile;  // support/input_file.h

namespace data {

enum class TokenDtype { kUint16, kUint32 };

// "uint16" / "uint32" and back (c10::Error naming both choices for another name).
const char* token_dtype_name(TokenDtype d);
TokenDtype parse_token_dtype(const std::string& name);

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

struct TokenDatasetOptions {
  TokenDtype dtype = TokenDtype::kUint16;  // of raw files (llm.c's header says its own)
  int64_t vocab = 0;                       // every token must be below it (> 0)
  int64_t seq_len = 0;                     // tokens fed per sample (> 0)
};

struct BatchLayout {
  int64_t global_batch = 1;  // samples per optimizer step, over all ranks
  int64_t micro_batch = 1;   // samples per forward/backward of one rank
  int world = 1;
  int rank = 0;
  // Micro-batches per rank per step: global_batch / (micro_batch * world). check() says why
  // when that is not a positive whole number.
  int64_t accumulation() const;
  void check() const;
};

class TokenDataset {
 public:
  TokenDataset(const std::string& path, TokenDatasetOptions options);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  const std::vector<std::string>& files() const { return paths_; }
  int64_t num_tokens() const;
  int64_t num_windows() const { return windows_; }
  const TokenDatasetOptions& options() const { return options_; }

  // The seq_len + 1 tokens of window w (0 <= w < num_windows()), checked against the vocab.
  at::Tensor window(int64_t w) const;
  // The window sample g of step `step` starts at (the contract's splitmix64 rule).
  int64_t sample_window(uint64_t seed, int64_t step, int64_t g) const;
  // This rank's micro-batch m (0 <= m < layout.accumulation()) of step `step`: (inputs,
  // targets), int64 [micro_batch, seq_len] on CPU.
  std::pair<at::Tensor, at::Tensor> micro_batch(uint64_t seed, int64_t step,
                                                const BatchLayout& layout, int64_t m) const;
  // Evaluation samples first .. first + count - 1: sample k is window (k * (seq_len + 1)) mod
  // num_windows() (consecutive non-overlapping chunks from the start; the same on every call):
  // (inputs, targets) of [count, seq_len].
  std::pair<at::Tensor, at::Tensor> eval_batch(int64_t first, int64_t count) const;

 private:
  struct Shard {
    std::unique_ptr<MappedInputFile> map;
    std::string path;
    int64_t header_bytes = 0;
    int64_t tokens = 0;
    TokenDtype dtype = TokenDtype::kUint16;
    int64_t first_window = 0;  // windows of the files before it
  };
  void add_file(const std::string& path);

  TokenDatasetOptions options_;
  std::vector<std::string> paths_;
  std::vector<Shard> shards_;
  int64_t windows_ = 0;
};

}  // namespace data
}  // namespace flatshard
