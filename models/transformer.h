// flatshard/models/transformer.h — what every decoder-only family of models/ shares: the sizes
// and init settings of its config, the token-embedding / output-projection pair, the input
// checks and the next-token loss (models/gpt.h and models/llama.h are built from these; a new
// family starts here, docs/design.md "How to add a model family").
//
// Contract
//   * TransformerConfig: the fields every family has. A family's config derives from it and
//     adds its own (LlamaConfig: kv heads, MLP width, RoPE, norm eps) and implements clone().
//     validate_sizes(who) throws c10::Error prefixed by `who` ("GPTConfig") with the offending
//     values: every size > 0, n_heads divides d_model (unless heads_divide is false), init_std
//     finite and >= 0.
//     set_sizes(...) sets the five sizes at once (what a preset table writes). residual_std():
//     init_std / sqrt(2 n_layers) with scaled_residual_init (GPT-2), else init_std.
//   * embedding_and_head(vocab, d, tied): the token embedding [vocab, d] and the output
//     projection d -> vocab without bias. Tied, the embedding adopts the head's weight tensor
//     itself (the Embedding registers a given _weight as is): one TensorImpl under both paths,
//     so gradients of both uses accumulate into it and ->to() keeps them tied. LibTorch's
//     parameters() then lists it twice: optimizers take models::unique_parameters.
//   * check_tokens(idx, seq_len, who): idx is int64 [B, T] with 1 <= T <= seq_len, else
//     c10::Error prefixed by `who` ("GPT::forward").
//   * check_targets(idx, targets, who): targets have idx's shape, else c10::Error (checked before
//     the forward runs). next_token_loss(logits, targets, vocab): the mean cross-entropy of
//     logits [B, T, vocab] (any dtype; computed in fp32) against targets int64 [B, T]. With
//     `root` parallelized with loss parallelism (fsdp/tensor_parallel.h, TpPlan::loss_parallel)
//     the logits are this tp rank's vocabulary slice [B, T, vocab/tp] and the loss is
//     vocabulary-parallel; logits of another width than vocab are an error naming the fix.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <utility>

namespace flatshard {
namespace models {

struct TransformerConfig {
  int64_t vocab = 32768;
  int64_t d_model = 2048;
  int64_t n_heads = 16;
  int64_t n_layers = 16;
  int64_t seq_len = 2048;  // maximum sequence length; also T in flops_per_token
  bool tie_embeddings = false;
  double init_std = 0.02;
  bool scaled_residual_init = true;  // residual projections get init_std / sqrt(2 L)
  // The layers' Linears run fp8 matmuls (models/fp8_linear.h: torchao's tensorwise recipe, on
  // the unit's fp8 gather when it has one); embeddings and the output head stay in the param
  // dtype. Opt-in: flatshard-bench / flatshard-train --fp8.
  bool fp8 = false;

  TransformerConfig() = default;
  TransformerConfig(const TransformerConfig&) = default;
  TransformerConfig& operator=(const TransformerConfig&) = default;
  virtual ~TransformerConfig() = default;
  virtual std::unique_ptr<TransformerConfig> clone() const = 0;

  void set_sizes(int64_t vocab, int64_t d_model, int64_t n_heads, int64_t n_layers,
                 int64_t seq_len);
  // heads_divide: n_heads must divide d_model (false for a family with an explicit head size).
  void validate_sizes(const char* who, bool heads_divide = true) const;
  // The size of one attention head: d_model / n_heads unless the family sets its own.
  virtual int64_t head_dim() const { return d_model / n_heads; }
  double residual_std() const;
};

std::pair<torch::nn::Embedding, torch::nn::Linear> embedding_and_head(int64_t vocab, int64_t d,
                                                                      bool tied);
void check_tokens(const at::Tensor& idx, int64_t seq_len, const char* who);
void check_targets(const at::Tensor& idx, const at::Tensor& targets, const char* who);
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                           const torch::nn::Module* root = nullptr);

}  // namespace models
}  // namespace flatshard
