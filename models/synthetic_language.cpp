// flatshard/models/synthetic_language.cpp — see synthetic_language.h for the contract.
#include "models/synthetic_language.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace flatshard {
namespace models {

namespace {

// splitmix64 finalizer: spreads (seed, rank, step) over the whole 64-bit seed space so that
// neighbouring ranks/steps get unrelated streams.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> synthetic_tokens(int64_t vocab, int64_t seq_len, int64_t batch,
                                                   int64_t seed, int rank, int64_t step) {
  TORCH_CHECK(vocab > 0, "synthetic_tokens: vocab must be > 0, got ", vocab);
  TORCH_CHECK(seq_len > 0, "synthetic_tokens: seq_len must be > 0, got ", seq_len);
  TORCH_CHECK(batch > 0, "synthetic_tokens: batch must be > 0, got ", batch);
  const uint64_t s = mix64(mix64(mix64(static_cast<uint64_t>(seed)) ^ static_cast<uint64_t>(rank)) ^
                           static_cast<uint64_t>(step));
  at::Generator gen = at::detail::createCPUGenerator(s);
  // No lock here: the ATen sampling kernels take the generator's mutex themselves.
  const at::Tensor start = at::randint(0, vocab, {batch, 1}, gen, at::kLong);
  const at::Tensor stride = at::randint(1, 17, {batch, 1}, gen, at::kLong);
  const at::Tensor j = at::arange(seq_len + 1, at::kLong).unsqueeze(0);  // [1, T + 1]
  const at::Tensor seq = (start + stride * j).remainder(vocab);          // [B, T + 1]
  using at::indexing::Slice;
  return {seq.index({Slice(), Slice(0, seq_len)}).contiguous(),
          seq.index({Slice(), Slice(1, seq_len + 1)}).contiguous()};
}

}  // namespace models
}  // namespace flatshard
