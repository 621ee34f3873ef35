// flatshard/models/synthetic_language.h — the learnable synthetic language every reference model
// family (models/gpt.h, models/llama.h) trains on: one home, so the families see the same data.
//
// Contract
//   * synthetic_tokens(vocab, seq_len, batch, seed, rank, step) -> {idx, targets}, int64 CPU
//     tensors [batch, seq_len]: each row is an arithmetic progression mod vocab,
//     s_j = (start + stride·j) mod V, with start uniform in [0, V) and stride uniform in [1, 16]
//     drawn per row; idx = s[0..T), targets = s[1..T] (next-token prediction). The next token is
//     predictable from the two before it, so the loss can fall towards ~0 on fresh batches.
//   * Deterministic per (seed, rank, step): the rows come from a private generator seeded with
//     a hash of the three, independent of the global RNG, of the device and of other calls;
//     ranks (and steps) get different data.
//   * Throws c10::Error for vocab, seq_len or batch <= 0.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace flatshard {
namespace models {

std::pair<at::Tensor, at::Tensor> synthetic_tokens(int64_t vocab, int64_t seq_len, int64_t batch,
                                                   int64_t seed, int rank, int64_t step);

}  // namespace models
}  // namespace flatshard
