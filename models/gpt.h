// flatshard/models/gpt.h — the reference GPT decoder used by the tests and the benchmark.
//
// Contract
//   * Architecture (pre-LayerNorm GPT-2 style, no dropout):
//       x = wte(idx) + wpe(arange(T))
//       for each Block:  x = x + attn(ln1(x));  x = x + mlp(ln2(x))
//       logits = lm_head(ln_f(x))                       // [B, T, vocab], no bias
//     attn: qkv Linear d->3d, causal scaled_dot_product_attention over n_heads, proj Linear d->d.
//     mlp:  fc Linear d->4d, GELU (tanh approximation), proj Linear 4d->d.
//   * Every parent->child call goes through flatshard::call (fsdp/call.h), so any module — a leaf
//     Linear, a Block, the whole GPT — can be a sharding unit.
//   * Module paths: wte, wpe, blocks.<i>, blocks.<i>.{ln1,attn,attn.qkv,attn.proj,ln2,mlp,
//     mlp.fc,mlp.proj}, ln_f, lm_head. Module::name() is the short type name: "GPT", "Block",
//     "CausalSelfAttention", "MLP" (the torch leaves keep LibTorch's names, e.g.
//     "torch::nn::LinearImpl"), so wrap policies can match blocks by the type name "Block".
//   * Deterministic init, per tensor: GPT(cfg, seed) draws each parameter from its own CPU
//     generator seeded with (seed, its name) (models/model_init.h: tensor_seed, normal_init),
//     so two constructions with the same (cfg, seed) are bit-identical whatever was built
//     before, whatever the global RNG state, and whatever order tensors are initialised in.
//     The model is built on CPU in fp32; move it with ->to(device, dtype) afterwards (that keeps
//     the values). Construction leaves the global CPU RNG as it found it. Init values: weights
//     of Linear/Embedding ~ N(0, init_std), the residual projections (attn.proj, mlp.proj) ~
//     N(0, init_std / sqrt(2 * n_layers)) when scaled_residual_init (GPT-2), biases 0,
//     LayerNorm weight 1 / bias 0.
//   * Deferred init: built under flatshard::MetaInit (fsdp/meta_init.h) the GPT holds shapes
//     only; it implements flatshard::InitializesItself, so fully_shard initialises it unit by
//     unit on the device through init_tensor() — the same values as eager construction
//     (Note [Deferred initialization], fsdp/deferred_init.h).
//   * tie_embeddings: lm_head.weight and wte.weight are the same tensor (one TensorImpl).
//     LibTorch's parameters() does not deduplicate, so it lists that tensor twice; hand
//     optimizers unique_parameters(model) instead.
//   * Dtypes: parameters may be fp32 or bf16 (any floating dtype); loss() computes the
//     cross-entropy in fp32 whatever the logits' dtype. cfg.fp8: the blocks' four Linears run
//     fp8 matmuls (models/fp8_linear.h); wte, wpe and lm_head stay in the param dtype.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/deferred_init.h"
#include "fsdp/tensor_parallel.h"
#include "models/transformer.h"
#include "planner/model_shape.h"

namespace flatshard {
namespace models {
class Family;
}
namespace gpt {

// The GPT's config: the shared sizes and init settings (models/transformer.h; defaults: the
// "1b" preset's sizes) and nothing of its own.
struct GPTConfig : models::TransformerConfig {
  // Named presets (each passes validate()):
  //   "tiny"  vocab 512,   d 64,   heads 4,  layers 2,  seq 32     (~0.17 M params; CPU tests)
  //   "small" vocab 4096,  d 256,  heads 8,  layers 4,  seq 256    (~5.3 M params; CPU bench)
  //   "1b"    vocab 32768, d 2048, heads 16, layers 16, seq 2048   (~0.94 B params; GPU bench)
  // Throws c10::Error naming the known presets for any other name.
  static GPTConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // The family descriptor (models/family.h) this config belongs to.
  static const models::Family& family();

  // Throws c10::Error with the offending values (TransformerConfig::validate_sizes).
  void validate() const;
  std::unique_ptr<models::TransformerConfig> clone() const override {
    return std::make_unique<GPTConfig>(*this);
  }
  // One line, e.g. "vocab=512 d_model=64 n_heads=4 n_layers=2 seq_len=32 tied=0".
  std::string to_string() const;
};

// Number of distinct parameter elements of GPT(cfg), in closed form:
//   V·d·(tied ? 1 : 2) + T·d + L·(12·d² + 13·d) + 2·d
// (per block: ln1 2d, qkv 3d²+3d, attn.proj d²+d, ln2 2d, fc 4d²+4d, mlp.proj 4d²+d; ln_f 2d).
int64_t num_parameters(const GPTConfig& cfg);
// The same closed form in long double, for any sizes (no int64 overflow): what tools check
// hostile sizes against before building anything.
long double num_parameters_bound(const GPTConfig& cfg);

// Training FLOPs per token (forward + backward), PaLM appendix-B / Chinchilla convention:
//   flops_per_token = 6·N + 12·L·d·T,   N = L·12·d² + V·d,   T = cfg.seq_len
// N counts the weights of every matmul: the blocks' Linear weights and the output projection
// (which runs whether or not it is tied). Left out as negligible or FLOP-free: the embedding
// lookups (gathers), biases, LayerNorms, GELU, softmax. 12·L·d·T is the attention score and
// value matmuls (QKᵀ and AV) at full T; causal kernels skip about half of that work, the
// convention counts it anyway. MFU = tokens/s · flops_per_token / peak FLOP/s.
double flops_per_token(const GPTConfig& cfg);

// The planner's description of the GPT (planner/model_shape.h): paths blocks / wte, wpe /
// lm_head, spec types "Block" and "Linear|LayerNorm|Embedding", and the closed forms (element
// size e of the compute dtype, d model width, H heads):
//   layer_matmul_params       12 d^2
//   attention FLOPs           12 d per token and position
//   layer_activations         17 d e + 2 (2 x 4) + 4 H   (ln1, qkv, SDPA q k v out lse, proj
//                             input copy, ln2, fc, GELU)
//   recompute_keeps           d e (the layer's input)
//   layer_backward_work       e (2 d + 2 x 4 d)
//   head_activations          2 d e + 4 V  (ln_f input, lm_head input, fp32 log-softmax)
TransformerShape transformer_shape(const GPTConfig& cfg);

// A deterministic batch of the synthetic language (models/synthetic_language.h, shared with the
// other model families) at cfg.vocab and cfg.seq_len: int64 CPU tensors [batch, seq_len], idx and
// next-token targets, deterministic per (seed, rank, step).
std::pair<at::Tensor, at::Tensor> synthetic_batch(const GPTConfig& cfg, int64_t batch, int64_t seed,
                                                  int rank, int64_t step = 0);

// models::unique_parameters (models/model_init.h): parameters() with tied tensors listed once.
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module);

// --- modules ------------------------------------------------------------------------------------

// Under tensor parallelism (fsdp/tensor_parallel.h, the family's tp plan: qkv colwise/3, proj
// rowwise) each rank runs n_heads / tp heads: forward reads the local head count from qkv's
// weight, never from the config.
class CausalSelfAttentionImpl : public torch::nn::Module, public flatshard::TensorParallelModule {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& cfg);
  at::Tensor forward(const at::Tensor& x);  // [B, T, d] -> [B, T, d]
  void check_tensor_parallel(const std::string& path, int tp) const override;

  torch::nn::Linear qkv{nullptr};   // d -> 3d (q, k, v stacked along the output dim)
  torch::nn::Linear proj{nullptr};  // d -> d
 private:
  int64_t n_heads_;
  bool fp8_;  // cfg.fp8: qkv and proj run fp8 matmuls (models/fp8_linear.h)
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const GPTConfig& cfg);
  at::Tensor forward(const at::Tensor& x);  // [B, T, d] -> [B, T, d]

  torch::nn::Linear fc{nullptr};    // d -> 4d
  torch::nn::Linear proj{nullptr};  // 4d -> d
 private:
  bool fp8_;  // cfg.fp8: fc and proj run fp8 matmuls (models/fp8_linear.h)
};
TORCH_MODULE(MLP);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& cfg);
  at::Tensor forward(const at::Tensor& x);  // [B, T, d] -> [B, T, d]

  torch::nn::LayerNorm ln1{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module, public flatshard::InitializesItself {
 public:
  // Validates cfg, builds on CPU in fp32 and initializes from `seed` (see the contract above).
  explicit GPTImpl(const GPTConfig& cfg, uint64_t seed = 0);

  // idx: int64 [B, T] with 1 <= T <= seq_len and tokens in [0, vocab) -> logits [B, T, vocab]
  // in the parameters' dtype.
  at::Tensor forward(const at::Tensor& idx);
  // Mean next-token cross-entropy of forward(idx) against targets (int64 [B, T]), as an fp32
  // scalar whatever the parameters' dtype.
  at::Tensor loss(const at::Tensor& idx, const at::Tensor& targets);

  const GPTConfig& config() const { return cfg_; }
  // Typed holders of the blocks registered under "blocks" (flatshard::call needs the type).
  const std::vector<Block>& blocks() const { return blocks_; }

  torch::nn::Embedding wte{nullptr};           // token embedding [vocab, d]
  torch::nn::Embedding wpe{nullptr};           // learned position embedding [seq_len, d]
  torch::nn::ModuleList blocks_list{nullptr};  // registered as "blocks"
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};  // d -> vocab, no bias; weight is wte's when tied

  // Fills parameter `name` (as named_parameters() spells it; a tied weight under either name)
  // with its initial values, in place, on any device and dtype: what construction gives it.
  // Throws c10::Error for an unknown name or a shape that is not the parameter's.
  void init_tensor(const std::string& name, const at::Tensor& values) const override;

 private:
  void init_parameters();

  GPTConfig cfg_;
  uint64_t seed_;
  std::vector<Block> blocks_;  // same modules as blocks_list, kept typed for flatshard::call
};
TORCH_MODULE(GPT);

}  // namespace gpt
}  // namespace flatshard
