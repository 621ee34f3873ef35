// flatshard/models/llama.cpp — see llama.h for the contract.
#include "models/llama.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

#include "fsdp/call.h"
#include "models/model_init.h"
#include "models/synthetic_language.h"

namespace flatshard {
namespace llama {

// --- config -------------------------------------------------------------------------------------

LlamaConfig LlamaConfig::preset(const std::string& name) {
  auto make = [](int64_t vocab, int64_t d_model, int64_t n_heads, int64_t n_kv_heads,
                 int64_t n_layers, int64_t seq_len) {
    LlamaConfig c;
    c.vocab = vocab;
    c.d_model = d_model;
    c.n_heads = n_heads;
    c.n_kv_heads = n_kv_heads;
    c.n_layers = n_layers;
    c.seq_len = seq_len;
    return c;
  };
  if (name == "tiny") {
    LlamaConfig c = make(512, 64, 4, 2, 2, 32);
    c.multiple_of = 32;
    return c;
  }
  if (name == "small") return make(4096, 256, 8, 4, 4, 256);
  if (name == "1b") return make(32000, 2048, 16, 16, 16, 2048);
  if (name == "7b") return make(32000, 4096, 32, 32, 32, 4096);
  TORCH_CHECK(false, "LlamaConfig::preset: unknown preset '", name,
              "'; known presets: tiny, small, 1b, 7b");
}

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab > 0, "LlamaConfig: vocab must be > 0, got ", vocab);
  TORCH_CHECK(d_model > 0, "LlamaConfig: d_model must be > 0, got ", d_model);
  TORCH_CHECK(n_heads > 0, "LlamaConfig: n_heads must be > 0, got ", n_heads);
  TORCH_CHECK(n_kv_heads >= 0, "LlamaConfig: n_kv_heads must be >= 0 (0: n_heads), got ",
              n_kv_heads);
  TORCH_CHECK(n_layers > 0, "LlamaConfig: n_layers must be > 0, got ", n_layers);
  TORCH_CHECK(seq_len > 0, "LlamaConfig: seq_len must be > 0, got ", seq_len);
  TORCH_CHECK(hidden >= 0, "LlamaConfig: hidden must be >= 0 (0: the LLaMA rule), got ", hidden);
  TORCH_CHECK(multiple_of > 0, "LlamaConfig: multiple_of must be > 0, got ", multiple_of);
  TORCH_CHECK(d_model % n_heads == 0, "LlamaConfig: n_heads (", n_heads,
              ") must divide d_model (", d_model, ")");
  TORCH_CHECK(n_heads % kv_heads() == 0, "LlamaConfig: n_kv_heads (", kv_heads(),
              ") must divide n_heads (", n_heads, ")");
  TORCH_CHECK(head_dim() % 2 == 0, "LlamaConfig: the head dim d_model / n_heads = ", d_model,
              " / ", n_heads, " = ", head_dim(), " must be even (RoPE rotates pairs)");
  TORCH_CHECK(std::isfinite(rope_theta) && rope_theta > 1.0,
              "LlamaConfig: rope_theta must be finite and > 1, got ", rope_theta);
  TORCH_CHECK(std::isfinite(norm_eps) && norm_eps > 0.0,
              "LlamaConfig: norm_eps must be finite and > 0, got ", norm_eps);
  TORCH_CHECK(std::isfinite(init_std) && init_std >= 0.0,
              "LlamaConfig: init_std must be finite and >= 0, got ", init_std);
}

int64_t LlamaConfig::hidden_size() const {
  if (hidden > 0) return hidden;
  const int64_t rule = (8 * d_model) / 3;  // 2/3 of the classic 4d, floored as LLaMA does
  return multiple_of * ((rule + multiple_of - 1) / multiple_of);
}

std::string LlamaConfig::to_string() const {
  std::ostringstream os;
  os << "vocab=" << vocab << " d_model=" << d_model << " n_heads=" << n_heads
     << " n_kv_heads=" << kv_heads() << " n_layers=" << n_layers << " seq_len=" << seq_len
     << " hidden=" << hidden_size() << " tied=" << tie_embeddings;
  return os.str();
}

// --- closed forms -------------------------------------------------------------------------------

int64_t num_parameters(const LlamaConfig& cfg) {
  const int64_t d = cfg.d_model, kv = cfg.kv_heads() * cfg.head_dim(), h = cfg.hidden_size();
  const int64_t per_layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * h;
  return cfg.vocab * d * (cfg.tie_embeddings ? 1 : 2) + cfg.n_layers * per_layer + d;
}

double flops_per_token(const LlamaConfig& cfg) {
  const double d = static_cast<double>(cfg.d_model);
  const double L = static_cast<double>(cfg.n_layers);
  const double kv = static_cast<double>(cfg.kv_heads() * cfg.head_dim());
  const double h = static_cast<double>(cfg.hidden_size());
  const double matmul_params =
      L * (2.0 * d * d + 2.0 * d * kv + 3.0 * d * h) + static_cast<double>(cfg.vocab) * d;
  return 6.0 * matmul_params + 12.0 * L * d * static_cast<double>(cfg.seq_len);
}

std::pair<at::Tensor, at::Tensor> synthetic_batch(const LlamaConfig& cfg, int64_t batch,
                                                  int64_t seed, int rank, int64_t step) {
  cfg.validate();
  return models::synthetic_tokens(cfg.vocab, cfg.seq_len, batch, seed, rank, step);
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t hd = x.size(-1);
  TORCH_CHECK(hd % 2 == 0 && cos.dim() == 2 && cos.size(1) * 2 == hd &&
                  cos.size(0) == x.size(-2) && sin.sizes() == cos.sizes(),
              "apply_rotary: x ", x.sizes(), " needs cos and sin [T, hd/2] = [", x.size(-2), ", ",
              hd / 2, "], got ", cos.sizes(), " and ", sin.sizes());
  const at::Tensor c = cos.to(x.scalar_type()), s = sin.to(x.scalar_type());
  const at::Tensor x1 = x.narrow(-1, 0, hd / 2), x2 = x.narrow(-1, hd / 2, hd / 2);
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

// --- modules ------------------------------------------------------------------------------------

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : torch::nn::Module("RMSNorm"), eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // fp32 statistics whatever x's dtype; cast back before the weight, as LLaMA does.
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return normed.to(x.scalar_type()) * weight;
}

at::Tensor rope_inv_freq(int64_t head_dim, double theta) {
  // 1 / theta^(2i/hd) with the ops (and so the rounding) of the LLaMA and HF code:
  //   1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd)). Also builds on meta.
  const at::Tensor i2 = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kFloat));
  return at::reciprocal(at::pow(at::Scalar(theta), i2 / static_cast<double>(head_dim)));
}

RotaryEmbeddingImpl::RotaryEmbeddingImpl(int64_t head_dim, double theta)
    : torch::nn::Module("RotaryEmbedding") {
  inv_freq = register_buffer("inv_freq", rope_inv_freq(head_dim, theta));
}

void RotaryEmbeddingImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
}

void RotaryEmbeddingImpl::to(torch::Dtype /*dtype*/, bool /*non_blocking*/) {}

std::tuple<at::Tensor, at::Tensor> RotaryEmbeddingImpl::forward(int64_t T) {
  const at::Tensor pos = at::arange(T, inv_freq.options().dtype(at::kFloat));
  const at::Tensor angles = at::outer(pos, inv_freq.to(at::kFloat));  // [T, hd/2]
  return {angles.cos(), angles.sin()};
}

AttentionImpl::AttentionImpl(const LlamaConfig& cfg)
    : torch::nn::Module("Attention"), n_heads_(cfg.n_heads), n_kv_heads_(cfg.kv_heads()) {
  const int64_t d = cfg.d_model, hd = cfg.head_dim();
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  q = register_module("q", linear(d, n_heads_ * hd));
  k = register_module("k", linear(d, n_kv_heads_ * hd));
  v = register_module("v", linear(d, n_kv_heads_ * hd));
  o = register_module("o", linear(n_heads_ * hd, d));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t hd = q->options.out_features() / n_heads_;
  // [B, T, H·hd] -> [B, H, T, hd]: heads as a batch dimension, as SDPA wants.
  auto heads = [&](const at::Tensor& t, int64_t h) {
    return t.view({B, T, h, hd}).transpose(1, 2);
  };
  const at::Tensor qh = apply_rotary(heads(flatshard::call(q, x), n_heads_), cos, sin);
  at::Tensor kh = apply_rotary(heads(flatshard::call(k, x), n_kv_heads_), cos, sin);
  at::Tensor vh = heads(flatshard::call(v, x), n_kv_heads_);
  if (n_kv_heads_ != n_heads_) {  // grouped-query: kv head j serves q heads [j·g, (j+1)·g)
    const int64_t g = n_heads_ / n_kv_heads_;
    kh = kh.repeat_interleave(g, /*dim=*/1);
    vh = vh.repeat_interleave(g, /*dim=*/1);
  }
  const at::Tensor y = at::scaled_dot_product_attention(qh, kh, vh, /*attn_mask=*/{},
                                                        /*dropout_p=*/0.0, /*is_causal=*/true);
  return flatshard::call(o, y.transpose(1, 2).reshape({B, T, n_heads_ * hd}));
}

MLPImpl::MLPImpl(const LlamaConfig& cfg) : torch::nn::Module("MLP") {
  const int64_t d = cfg.d_model, h = cfg.hidden_size();
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  gate = register_module("gate", linear(d, h));
  up = register_module("up", linear(d, h));
  down = register_module("down", linear(h, d));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  return flatshard::call(down, at::silu(flatshard::call(gate, x)) * flatshard::call(up, x));
}

DecoderLayerImpl::DecoderLayerImpl(const LlamaConfig& cfg) : torch::nn::Module("DecoderLayer") {
  input_norm = register_module("input_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
  attn = register_module("attn", Attention(cfg));
  post_attn_norm = register_module("post_attn_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
  mlp = register_module("mlp", MLP(cfg));
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                     const at::Tensor& sin) {
  const at::Tensor h = x + flatshard::call(attn, flatshard::call(input_norm, x), cos, sin);
  return h + flatshard::call(mlp, flatshard::call(post_attn_norm, h));
}

LlamaImpl::LlamaImpl(const LlamaConfig& cfg, uint64_t seed)
    : torch::nn::Module("Llama"), cfg_(cfg), seed_(seed) {
  cfg_.validate();
  models::GlobalRngRestorer restore_global_rng;
  const int64_t d = cfg_.d_model;

  // Built before embed_tokens so that, when tied, the Embedding can adopt lm_head's weight
  // tensor itself: one TensorImpl under both paths (see gpt.cpp for why this order).
  auto head = torch::nn::Linear(torch::nn::LinearOptions(d, cfg_.vocab).bias(false));
  auto tok_opts = torch::nn::EmbeddingOptions(cfg_.vocab, d);
  if (cfg_.tie_embeddings) tok_opts._weight(head->weight);

  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(tok_opts));
  rope = register_module("rope", RotaryEmbedding(cfg_.head_dim(), cfg_.rope_theta));
  layers_list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.n_layers; ++i) {
    layers_.emplace_back(cfg_);
    layers_list->push_back(layers_.back());
  }
  norm = register_module("norm", RMSNorm(d, cfg_.norm_eps));
  lm_head = register_module("lm_head", head);
  TORCH_INTERNAL_ASSERT(!cfg_.tie_embeddings || embed_tokens->weight.unsafeGetTensorImpl() ==
                                                    lm_head->weight.unsafeGetTensorImpl());
  init_parameters();
}

void LlamaImpl::init_parameters() {
  // rope.inv_freq was computed by its module's constructor, with the function init_tensor() uses.
  models::init_each_parameter(*this, [this](const std::string& n, const at::Tensor& v) {
    init_tensor(n, v);
  });
}

void LlamaImpl::init_tensor(const std::string& name, const at::Tensor& values) const {
  at::NoGradGuard no_grad;
  // A tied weight is one tensor with one init, whichever of its names the caller uses.
  const std::string key =
      cfg_.tie_embeddings && name == "lm_head.weight" ? "embed_tokens.weight" : name;
  const models::TensorSite site =
      models::find_tensor_for_init(*this, key, values, "Llama::init_tensor");
  const torch::nn::Module* m = site.module;
  const std::string& path = site.path;
  if (dynamic_cast<const RotaryEmbeddingImpl*>(m)) {
    values.copy_(rope_inv_freq(cfg_.head_dim(), cfg_.rope_theta));
  } else if (dynamic_cast<const RMSNormImpl*>(m)) {
    values.fill_(1.0);
  } else if (dynamic_cast<const torch::nn::LinearImpl*>(m)) {
    const bool residual =
        models::path_ends_with(path, "attn.o") || models::path_ends_with(path, "mlp.down");
    const double residual_std = cfg_.scaled_residual_init
                                    ? cfg_.init_std / std::sqrt(2.0 * cfg_.n_layers)
                                    : cfg_.init_std;
    models::normal_init(values, residual ? residual_std : cfg_.init_std, seed_, key);
  } else {
    TORCH_INTERNAL_ASSERT(dynamic_cast<const torch::nn::EmbeddingImpl*>(m), "Llama init: '",
                          name, "' belongs to no known module type");
    models::normal_init(values, cfg_.init_std, seed_, key);
  }
}

at::Tensor LlamaImpl::forward(const at::Tensor& idx) {
  TORCH_CHECK(idx.dim() == 2, "Llama::forward: idx must be [B, T], got ", idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kLong, "Llama::forward: idx must be int64, got ",
              idx.scalar_type());
  const int64_t T = idx.size(1);
  TORCH_CHECK(T >= 1 && T <= cfg_.seq_len, "Llama::forward: sequence length ", T,
              " outside [1, seq_len=", cfg_.seq_len, "]");
  const auto [cos, sin] = flatshard::call(rope, T);
  at::Tensor x = flatshard::call(embed_tokens, idx);
  for (auto& layer : layers_) x = flatshard::call(layer, x, cos, sin);
  return flatshard::call(lm_head, flatshard::call(norm, x));
}

at::Tensor LlamaImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  TORCH_CHECK(targets.sizes() == idx.sizes(), "Llama::loss: targets ", targets.sizes(),
              " must have the shape of idx ", idx.sizes());
  const at::Tensor logits = forward(idx);
  return at::cross_entropy_loss(logits.reshape({-1, cfg_.vocab}).to(at::kFloat),
                                targets.reshape({-1}));
}

}  // namespace llama
}  // namespace flatshard
