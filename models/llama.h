// flatshard/models/llama.h — the reference LLaMA-style decoder: the second model family of the
// tests, tools and benchmark (the first is models/gpt.h), so nothing in flatshard can quietly
// depend on one family's module names.
//
// Contract
//   * Architecture (pre-RMSNorm, rotary positions, SwiGLU, no bias anywhere, no dropout):
//       x = embed_tokens(idx);  (cos, sin) = rope(T)
//       for each DecoderLayer:  x = x + attn(input_norm(x), cos, sin)
//                               x = x + mlp(post_attn_norm(x))
//       logits = lm_head(norm(x))                        // [B, T, vocab]
//     RMSNorm(x) = x / sqrt(mean(x², last dim) + eps) · weight, computed in fp32 and cast back
//     to x's dtype before the weight multiplies (as LLaMA does).
//     attn: q Linear d -> H·hd, k and v Linear d -> Hkv·hd, rotary embedding on q and k, each
//     k/v head shared by H/Hkv consecutive q heads (grouped-query attention; Hkv = H is plain
//     multi-head), causal scaled_dot_product_attention (with sliding_window W and T > W: a
//     boolean mask keeping keys j with i - W < j <= i, as transformers' Mistral), o Linear
//     H·hd -> d. hd = d / H, or
//     LlamaConfig::head_size when set (then H·hd need not be d). attention_bias: q, k and v
//     have biases (Qwen2), o has none.
//     mlp: down(silu(gate(x)) · up(x)); gate, up Linear d -> hidden, down hidden -> d.
//   * Rotary embedding (RoPE, the "rotate half" layout of HF transformers): the registered fp32
//     buffer rope.inv_freq[i] = theta^(-2i/hd), i in [0, hd/2), then scaled as
//     LlamaConfig::rope_scaling says (RopeScaling below: none, linear, llama3 — transformers'
//     rules). For position p, angle
//     a_{p,i} = p · inv_freq[i]; a head vector x (hd values) becomes
//       out[i]        = x[i] · cos a − x[i + hd/2] · sin a
//       out[i + hd/2] = x[i + hd/2] · cos a + x[i] · sin a          (i < hd/2)
//     i.e. each pair (x[i], x[i + hd/2]) is rotated by a_{p,i}, so q·k after RoPE depends only on
//     the positions' difference. cos/sin are computed in fp32 from inv_freq and cast to the
//     dtype of q/k when applied. inv_freq is a buffer, not a parameter: it is not trained, not
//     sharded, and stays fp32 when the model is cast with ->to(dtype) (RotaryEmbedding overrides
//     to()) or sharded with bf16 compute (MixedPrecision::buffer_dtype, fsdp/options.h, keeps
//     buffers' own dtype by default).
//   * Every parent->child call goes through flatshard::call (fsdp/call.h), so any module — a leaf
//     Linear or RMSNorm, a DecoderLayer, the whole model — can be a sharding unit.
//   * Module paths: embed_tokens, rope, layers.<i>, layers.<i>.{input_norm, attn, attn.q,
//     attn.k, attn.v, attn.o, post_attn_norm, mlp, mlp.gate, mlp.up, mlp.down}, norm, lm_head.
//     Parameters: <linear>.weight, <norm>.weight, embed_tokens.weight; buffer: rope.inv_freq.
//     Module::name() is the short type name: "Llama", "DecoderLayer", "Attention", "MLP",
//     "RMSNorm", "RotaryEmbedding" (torch leaves keep LibTorch's names: "torch::nn::LinearImpl",
//     "torch::nn::EmbeddingImpl"), so wrap policies can match layers by the type name
//     "DecoderLayer" and leaves by "Linear|RMSNorm|Embedding".
//   * Deterministic init, per tensor: Llama(cfg, seed) draws each parameter from its own CPU
//     generator seeded with (seed, its name) (models/model_init.h: tensor_seed, normal_init),
//     independent of the order of initialisation; the global CPU RNG is left as found.
//     Built on CPU in fp32 (works under flatshard::MetaInit, fsdp/meta_init.h: shapes only).
//     Deferred init: a Llama built on meta implements flatshard::InitializesItself, so
//     fully_shard initialises it unit by unit on the device through init_tensor() — the same
//     values as eager construction, rope.inv_freq included (Note [Deferred initialization],
//     fsdp/deferred_init.h).
//     Init values: Linear/Embedding weights ~ N(0, init_std); the residual projections
//     (attn.o, mlp.down) ~ N(0, init_std / sqrt(2 · n_layers)) when scaled_residual_init;
//     RMSNorm weights 1.
//   * tie_embeddings (default off, as LLaMA): lm_head.weight and embed_tokens.weight are one
//     tensor; hand optimizers models::unique_parameters(model) (models/model_init.h).
//   * Dtypes: parameters may be fp32 or bf16; loss() computes the cross-entropy in fp32.
//     cfg.fp8: the layers' seven Linears run fp8 matmuls (models/fp8_linear.h); embed_tokens and
//     lm_head stay in the param dtype.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/deferred_init.h"
#include "fsdp/tensor_parallel.h"
#include "models/transformer.h"
#include "planner/model_shape.h"
#include "wrap_policies/match.h"

namespace flatshard {
namespace models {
class Family;
}
namespace llama {

// The LLaMA's config: the shared sizes and init settings (models/transformer.h; defaults: the
// "1b" preset's sizes) and its own fields.
// RoPE frequency scaling, as transformers' rope_scaling / rope_parameters: kLinear divides every
// inverse frequency by `factor`; kLlama3 (Llama 3.1+) divides the low frequencies (wavelength
// above original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
// (wavelength below original_max_position_embeddings / high_freq_factor) and interpolates
// between: s = (original / wavelength - low) / (high - low), f' = (1 - s) f / factor + s f.
struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3 };
  Type type = Type::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // kLlama3
  int64_t original_max_position_embeddings = 8192;       // kLlama3
};

struct LlamaConfig : models::TransformerConfig {
  // The Hugging Face architecture this config is (models/hf.h: hf_config records it, save_hf
  // writes it back): LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM. The model is
  // the same for all three; what each can express differs (models/hf_config.h,
  // hf_config_json: Qwen2 always has q/k/v biases, only Mistral has a sliding window).
  enum class Architecture { kLlama, kMistral, kQwen2 };
  Architecture architecture = Architecture::kLlama;
  int64_t n_kv_heads = 0;  // key/value heads; 0: n_heads (no grouping). Must divide n_heads.
  // The size of one head; 0: d_model / n_heads (then n_heads must divide d_model).
  int64_t head_size = 0;
  bool attention_bias = false;  // q, k, v Linear biases (Qwen2)
  RopeScaling rope_scaling;
  // Sliding-window attention (Mistral): a query at position i sees keys j with i - W < j <= i;
  // 0: every earlier key (plain causal). Only sequences longer than W differ.
  int64_t sliding_window = 0;
  // SwiGLU hidden size; 0: the LLaMA rule, multiple_of · ceil(floor(8·d/3) / multiple_of).
  int64_t hidden = 0;
  int64_t multiple_of = 256;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;

  LlamaConfig() { vocab = 32000; }

  // Named presets (each passes validate()); kv = n_kv_heads, h = hidden (from the rule):
  //   "tiny"  vocab 512,   d 64,   heads 4,  kv 2,  layers 2,  seq 32,   h 192   (~0.16 M)
  //   "small" vocab 4096,  d 256,  heads 8,  kv 4,  layers 4,  seq 256,  h 768   (~5.2 M)
  //   "1b"    vocab 32000, d 2048, heads 16, kv 16, layers 16, seq 2048, h 5632  (~0.95 B)
  //   "7b"    vocab 32000, d 4096, heads 32, kv 32, layers 32, seq 4096, h 11008 (~6.74 B,
  //           LLaMA-2 7B's shapes)
  // tiny uses multiple_of 32 (the rule's 256 would make its MLP 4d wide). Throws c10::Error
  // naming the known presets for any other name.
  static LlamaConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // The family descriptor (models/family.h) this config belongs to.
  static const models::Family& family();

  // Throws c10::Error with the offending values: the shared sizes
  // (TransformerConfig::validate_sizes; n_heads divides d_model unless head_size is set),
  // n_kv_heads, hidden, head_size >= 0, multiple_of > 0, n_kv_heads divides n_heads, the head
  // dim is even (RoPE rotates pairs), rope_theta > 1, norm_eps > 0, the scaling's factors finite
  // and > 0 (llama3: low_freq_factor < high_freq_factor, original_max_position_embeddings > 0).
  void validate() const;
  std::unique_ptr<models::TransformerConfig> clone() const override {
    return std::make_unique<LlamaConfig>(*this);
  }

  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_dim() const override { return head_size > 0 ? head_size : d_model / n_heads; }
  int64_t hidden_size() const;  // hidden, or the LLaMA rule when hidden == 0
  // One line, e.g. "vocab=512 d_model=64 n_heads=4 n_kv_heads=2 n_layers=2 seq_len=32
  // hidden=192 tied=0".
  std::string to_string() const;
};

// Number of distinct parameter elements of Llama(cfg), in closed form (q = H·hd, kv =
// kv_heads()·hd, h = hidden_size(), b = attention_bias):
//   V·d·(tied ? 1 : 2) + L·(2·d + 2·d·q + 2·d·kv + 3·d·h + b·(q + 2·kv)) + d
// (per layer: two RMSNorm weights, q and o d·q, k and v d·kv, gate/up/down d·h, the biases;
// final norm d).
int64_t num_parameters(const LlamaConfig& cfg);
// At least num_parameters(), in long double, for any sizes (no int64 overflow): kv heads as
// many as heads, the MLP width above the rule's unless set.
long double num_parameters_bound(const LlamaConfig& cfg);

// Training FLOPs per token, the convention of gpt::flops_per_token (PaLM appendix B):
//   6·N + 12·L·q·T,   N = L·(2·d·q + 2·d·kv + 3·d·h) + V·d,   T = cfg.seq_len, q = H·hd
// N counts every matmul weight (the output projection whether tied or not); left out: the
// embedding gather, norms, RoPE, SiLU and the gating product, softmax.
double flops_per_token(const LlamaConfig& cfg);

// The planner's description of the LLaMA (planner/model_shape.h): paths layers / embed_tokens,
// rope / lm_head, spec types "DecoderLayer" and "Linear|RMSNorm|Embedding", and the closed forms
// (element size e of the compute dtype, d model width, H heads, kv = kv_heads() · hd, h the MLP
// width):
//   layer_matmul_params       2 d q + 2 d kv + 3 d h   (q = H hd, which is d unless head_size)
//   attention FLOPs           12 q per token and position
//   layer_activations         2 (4 d + d e + 4) + e (4 q + 3 kv) + 4 H + 4 h e; under GQA
//                             e (4 q + kv + 2 q) instead of e (4 q + 3 kv)   (two RMSNorms with
//                             fp32 statistics; q, rotated q, k, rotated k or the repeated k and
//                             v, v, SDPA out, o input copy; SwiGLU's 4 h e)
//   recompute_keeps           d e (the layer's input)
//   layer_backward_work       e (2 d + 2 x 2 h)
//   recomputed leaves         input_norm, post_attn_norm keep their input: 4 d + 4 saved
//   head_activations          2 d e + 4 V
TransformerShape transformer_shape(const LlamaConfig& cfg);

// A batch of the shared synthetic language (models/synthetic_language.h) at cfg.vocab and
// cfg.seq_len: int64 CPU [batch, seq_len] tokens and next-token targets, per (seed, rank, step).
std::pair<at::Tensor, at::Tensor> synthetic_batch(const LlamaConfig& cfg, int64_t batch,
                                                  int64_t seed, int rank, int64_t step = 0);

// rope.inv_freq's values (the contract above): fp32 [hd/2] on CPU (meta under MetaInit).
at::Tensor rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling = {});

// x: [..., T, hd] (any leading dims), cos/sin: [T, hd/2] -> x rotated per the contract, in x's
// dtype (cos and sin are cast to it).
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// --- modules ------------------------------------------------------------------------------------

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);  // [..., dim] -> [..., dim]

  at::Tensor weight;  // [dim], init 1
 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

class RotaryEmbeddingImpl : public torch::nn::Module {
 public:
  RotaryEmbeddingImpl(int64_t head_dim, double theta, const RopeScaling& scaling = {});
  // (cos, sin) of the angles p · inv_freq for positions p in [0, T): fp32 [T, hd/2] each, on
  // inv_freq's device.
  std::tuple<at::Tensor, at::Tensor> forward(int64_t T);

  // inv_freq stays fp32 whatever dtype the model is cast to (devices still move): in bf16 the
  // angles p · inv_freq at p ~ 2048 would be off by several radians. A buffer dtype asked for
  // explicitly (MixedPrecision::buffer_dtype) bypasses this.
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;

  at::Tensor inv_freq;  // buffer [hd/2], fp32
};
TORCH_MODULE(RotaryEmbedding);

// Under tensor parallelism (fsdp/tensor_parallel.h; the family's tp plan: q, k, v colwise, o
// rowwise) each rank runs n_heads / tp query heads and n_kv_heads / tp kv heads (one, replicated,
// when n_kv_heads < tp): forward reads the local head counts from the projections' outputs,
// never from the config.
class AttentionImpl : public torch::nn::Module, public flatshard::TensorParallelModule {
 public:
  explicit AttentionImpl(const LlamaConfig& cfg);
  // x [B, T, d], cos/sin [T, hd/2] -> [B, T, d]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  void check_tensor_parallel(const std::string& path, int tp) const override;
  // n_kv_heads < tp: k and v are kept whole, each rank using its query heads' kv head
  // (Note [Replicated kv heads], fsdp/tensor_parallel.cpp).
  std::vector<std::pair<std::string, int64_t>> tp_replicated_children(int tp) const override;

  torch::nn::Linear q{nullptr};  // d -> H·hd
  torch::nn::Linear k{nullptr};  // d -> Hkv·hd
  torch::nn::Linear v{nullptr};  // d -> Hkv·hd
  torch::nn::Linear o{nullptr};  // H·hd -> d
 private:
  int64_t n_heads_, n_kv_heads_, window_, head_dim_;
  bool fp8_;  // cfg.fp8: q, k, v and o run fp8 matmuls (models/fp8_linear.h)
};
TORCH_MODULE(Attention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const LlamaConfig& cfg);
  at::Tensor forward(const at::Tensor& x);  // [B, T, d] -> [B, T, d]

  torch::nn::Linear gate{nullptr};  // d -> hidden
  torch::nn::Linear up{nullptr};    // d -> hidden
  torch::nn::Linear down{nullptr};  // hidden -> d
 private:
  bool fp8_;  // cfg.fp8: gate, up and down run fp8 matmuls (models/fp8_linear.h)
};
TORCH_MODULE(MLP);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  explicit DecoderLayerImpl(const LlamaConfig& cfg);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  RMSNorm input_norm{nullptr};
  Attention attn{nullptr};
  RMSNorm post_attn_norm{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

// Its modules also answer to their Hugging Face names in wrap policies (Note [Module aliases],
// wrap_policies/match.h; models/hf_config.h: hf_module_alias): a policy flatshard-explain
// --weights prints for a checkpoint (type=LlamaDecoderLayer, path=model.layers.[0-9]) works on
// the model hf_config(dir).build() makes.
class LlamaImpl : public torch::nn::Module,
                  public flatshard::InitializesItself,
                  public flatshard::ModuleAliases {
 public:
  // Validates cfg, builds on CPU in fp32 and initializes from `seed` (see the contract above).
  explicit LlamaImpl(const LlamaConfig& cfg, uint64_t seed = 0);

  // idx: int64 [B, T], T >= 1 -> logits [B, T, vocab] in the parameters' dtype. Any T: RoPE is
  // computed for the positions the batch has (seq_len is what flops_per_token and the synthetic
  // batches use, as transformers' max_position_embeddings is no limit either).
  at::Tensor forward(const at::Tensor& idx);
  // Mean next-token cross-entropy of forward(idx) against targets (int64 [B, T]), fp32 scalar.
  at::Tensor loss(const at::Tensor& idx, const at::Tensor& targets);

  const LlamaConfig& config() const { return cfg_; }
  // Typed holders of the layers registered under "layers" (flatshard::call needs the type).
  const std::vector<DecoderLayer>& layers() const { return layers_; }

  torch::nn::Embedding embed_tokens{nullptr};  // [vocab, d]
  RotaryEmbedding rope{nullptr};               // holds the inv_freq buffer; no parameters
  torch::nn::ModuleList layers_list{nullptr};  // registered as "layers"
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};  // d -> vocab; weight is embed_tokens' when tied

  // Fills parameter or buffer `name` (as named_parameters() / named_buffers() spell it; a
  // tied weight under either name) with its initial values, in place, on any device and
  // dtype: what construction gives it. Throws c10::Error for an unknown name or a shape that
  // is not the tensor's.
  void init_tensor(const std::string& name, const at::Tensor& values) const override;

  // The Hugging Face path and type of the module at `path` (models/hf_config.h:
  // hf_module_alias with this config's architecture).
  Alias module_alias(const std::string& path, const torch::nn::Module& module) const override;

 private:
  void init_parameters();

  LlamaConfig cfg_;
  uint64_t seed_;
  std::vector<DecoderLayer> layers_;  // same modules as layers_list, kept typed
};
TORCH_MODULE(Llama);

}  // namespace llama
}  // namespace flatshard
