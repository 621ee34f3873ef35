// flatshard/models/transformer.cpp — see transformer.h for the contract.
#include "models/transformer.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "fsdp/tensor_parallel.h"

namespace flatshard {
namespace models {

void TransformerConfig::set_sizes(int64_t v, int64_t d, int64_t h, int64_t l, int64_t t) {
  vocab = v;
  d_model = d;
  n_heads = h;
  n_layers = l;
  seq_len = t;
}

void TransformerConfig::validate_sizes(const char* who, bool heads_divide) const {
  TORCH_CHECK(vocab > 0, who, ": vocab must be > 0, got ", vocab);
  TORCH_CHECK(d_model > 0, who, ": d_model must be > 0, got ", d_model);
  TORCH_CHECK(n_heads > 0, who, ": n_heads must be > 0, got ", n_heads);
  TORCH_CHECK(n_layers > 0, who, ": n_layers must be > 0, got ", n_layers);
  TORCH_CHECK(seq_len > 0, who, ": seq_len must be > 0, got ", seq_len);
  TORCH_CHECK(!heads_divide || d_model % n_heads == 0, who, ": n_heads (", n_heads, ") must divide d_model (",
              d_model, ")");
  TORCH_CHECK(std::isfinite(init_std) && init_std >= 0.0, who,
              ": init_std must be finite and >= 0, got ", init_std);
}

double TransformerConfig::residual_std() const {
  return scaled_residual_init ? init_std / std::sqrt(2.0 * n_layers) : init_std;
}

std::pair<torch::nn::Embedding, torch::nn::Linear> embedding_and_head(int64_t vocab, int64_t d,
                                                                      bool tied) {
  // The head first, so that the embedding can adopt its weight tensor when tied.
  auto head = torch::nn::Linear(torch::nn::LinearOptions(d, vocab).bias(false));
  auto tok_opts = torch::nn::EmbeddingOptions(vocab, d);
  if (tied) tok_opts._weight(head->weight);
  auto embedding = torch::nn::Embedding(tok_opts);
  TORCH_INTERNAL_ASSERT(!tied || embedding->weight.unsafeGetTensorImpl() ==
                                     head->weight.unsafeGetTensorImpl());
  return {embedding, head};
}

void check_tokens(const at::Tensor& idx, int64_t seq_len, const char* who) {
  TORCH_CHECK(idx.dim() == 2, who, ": idx must be [B, T], got ", idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kLong, who, ": idx must be int64, got ", idx.scalar_type());
  const int64_t T = idx.size(1);
  TORCH_CHECK(T >= 1 && T <= seq_len, who, ": sequence length ", T,
              " outside [1, seq_len=", seq_len, "]");
}

void check_targets(const at::Tensor& idx, const at::Tensor& targets, const char* who) {
  TORCH_CHECK(targets.sizes() == idx.sizes(), who, ": targets ", targets.sizes(),
              " must have the shape of idx ", idx.sizes());
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                           const torch::nn::Module* root) {
  const TensorParallel* tp = root != nullptr ? find_tensor_parallel(root) : nullptr;
  if (tp != nullptr && tp->plan().loss_parallel)
    return tp->vocab_parallel_cross_entropy(logits, targets, vocab);
  TORCH_CHECK(logits.size(-1) == vocab, "next_token_loss: the logits have ", logits.size(-1),
              " classes but the vocabulary is ", vocab,
              tp != nullptr ? "; a head the tp plan splits colwise needs the plan's loss_parallel "
                              "option (fsdp/tensor_parallel.h)"
                            : "");
  return at::cross_entropy_loss(logits.reshape({-1, vocab}).to(at::kFloat), targets.reshape({-1}));
}

}  // namespace models
}  // namespace flatshard
