// flatshard/models/llama.cpp — see llama.h for the contract.
#include "models/llama.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "fsdp/call.h"
#include "fsdp/tensor_parallel.h"
#include "models/family.h"
#include "models/fp8_linear.h"
#include "models/model_init.h"
#include "models/synthetic_language.h"

namespace flatshard {
namespace llama {

// --- config -------------------------------------------------------------------------------------

namespace {

struct Preset {
  const char* name;
  int64_t vocab, d_model, n_heads, n_kv_heads, n_layers, seq_len, multiple_of;
};
constexpr Preset kPresets[] = {
    {"tiny", 512, 64, 4, 2, 2, 32, 32},
    {"small", 4096, 256, 8, 4, 4, 256, 256},
    {"1b", 32000, 2048, 16, 16, 16, 2048, 256},
    {"7b", 32000, 4096, 32, 32, 32, 4096, 256},
};

}  // namespace

std::vector<std::string> LlamaConfig::preset_names() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.emplace_back(p.name);
  return out;
}

LlamaConfig LlamaConfig::preset(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name != p.name) continue;
    LlamaConfig c;
    c.set_sizes(p.vocab, p.d_model, p.n_heads, p.n_layers, p.seq_len);
    c.n_kv_heads = p.n_kv_heads;
    c.multiple_of = p.multiple_of;
    return c;
  }
  std::string known;
  for (const auto& p : kPresets) known += (known.empty() ? "" : ", ") + std::string(p.name);
  TORCH_CHECK(false, "LlamaConfig::preset: unknown preset '", name, "'; known presets: ", known);
}

void LlamaConfig::validate() const {
  TORCH_CHECK(head_size >= 0, "LlamaConfig: head_size must be >= 0 (0: d_model / n_heads), got ",
              head_size);
  TORCH_CHECK(sliding_window >= 0, "LlamaConfig: sliding_window must be >= 0 (0: none), got ",
              sliding_window);
  validate_sizes("LlamaConfig", /*heads_divide=*/head_size == 0);
  TORCH_CHECK(n_kv_heads >= 0, "LlamaConfig: n_kv_heads must be >= 0 (0: n_heads), got ",
              n_kv_heads);
  TORCH_CHECK(hidden >= 0, "LlamaConfig: hidden must be >= 0 (0: the LLaMA rule), got ", hidden);
  TORCH_CHECK(multiple_of > 0, "LlamaConfig: multiple_of must be > 0, got ", multiple_of);
  TORCH_CHECK(n_heads % kv_heads() == 0, "LlamaConfig: n_kv_heads (", kv_heads(),
              ") must divide n_heads (", n_heads, ")");
  TORCH_CHECK(head_dim() % 2 == 0, "LlamaConfig: the head dim ",
              head_size > 0 ? "head_size = " + std::to_string(head_size)
                            : "d_model / n_heads = " + std::to_string(d_model) + " / " +
                                  std::to_string(n_heads) + " = " + std::to_string(head_dim()),
              " must be even (RoPE rotates pairs)");
  TORCH_CHECK(std::isfinite(rope_theta) && rope_theta > 1.0,
              "LlamaConfig: rope_theta must be finite and > 1, got ", rope_theta);
  TORCH_CHECK(std::isfinite(norm_eps) && norm_eps > 0.0,
              "LlamaConfig: norm_eps must be finite and > 0, got ", norm_eps);
  const RopeScaling& r = rope_scaling;
  if (r.type != RopeScaling::Type::kNone)
    TORCH_CHECK(std::isfinite(r.factor) && r.factor > 0,
                "LlamaConfig: rope_scaling factor must be finite and > 0, got ", r.factor);
  if (r.type == RopeScaling::Type::kLlama3) {
    TORCH_CHECK(std::isfinite(r.low_freq_factor) && std::isfinite(r.high_freq_factor) &&
                    r.low_freq_factor > 0 && r.low_freq_factor < r.high_freq_factor,
                "LlamaConfig: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, "
                "got ", r.low_freq_factor, " and ", r.high_freq_factor);
    TORCH_CHECK(r.original_max_position_embeddings > 0,
                "LlamaConfig: llama3 rope_scaling original_max_position_embeddings must be > 0, "
                "got ", r.original_max_position_embeddings);
  }
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
  if (head_size > 0) os << " head_dim=" << head_size;
  if (attention_bias) os << " qkv_bias=1";
  if (fp8) os << " fp8=1";
  if (sliding_window > 0) os << " window=" << sliding_window;
  if (rope_scaling.type == RopeScaling::Type::kLinear) os << " rope=linear:" << rope_scaling.factor;
  if (rope_scaling.type == RopeScaling::Type::kLlama3) os << " rope=llama3:" << rope_scaling.factor;
  return os.str();
}

// --- closed forms -------------------------------------------------------------------------------

int64_t num_parameters(const LlamaConfig& cfg) {
  const int64_t d = cfg.d_model, q = cfg.n_heads * cfg.head_dim();
  const int64_t kv = cfg.kv_heads() * cfg.head_dim(), h = cfg.hidden_size();
  const int64_t bias = cfg.attention_bias ? q + 2 * kv : 0;
  const int64_t per_layer = 2 * d + 2 * d * q + 2 * d * kv + 3 * d * h + bias;
  return cfg.vocab * d * (cfg.tie_embeddings ? 1 : 2) + cfg.n_layers * per_layer + d;
}

long double num_parameters_bound(const LlamaConfig& cfg) {
  // kv heads as many as heads (the most), the MLP width the config's own or above the rule's
  // (8d/3 + multiple_of): at least num_parameters(), in long double, for any sizes.
  const long double d = cfg.d_model, V = cfg.vocab, L = cfg.n_layers;
  const long double h = cfg.hidden > 0 ? static_cast<long double>(cfg.hidden)
                                       : 8 * d / 3 + static_cast<long double>(cfg.multiple_of);
  // q = H hd (d unless head_size is set); k and v at most as wide; biases at most 3 q.
  const long double q = cfg.head_size > 0 ? static_cast<long double>(cfg.n_heads) * cfg.head_size
                                          : d;
  return V * d * (cfg.tie_embeddings ? 1 : 2) + L * (2 * d + 4 * d * q + 3 * d * h + 3 * q) + d;
}

double flops_per_token(const LlamaConfig& cfg) {
  const double d = static_cast<double>(cfg.d_model);
  const double L = static_cast<double>(cfg.n_layers);
  const double kv = static_cast<double>(cfg.kv_heads() * cfg.head_dim());
  const double q = static_cast<double>(cfg.n_heads * cfg.head_dim());
  const double h = static_cast<double>(cfg.hidden_size());
  const double matmul_params =
      L * (2.0 * d * q + 2.0 * d * kv + 3.0 * d * h) + static_cast<double>(cfg.vocab) * d;
  return 6.0 * matmul_params + 12.0 * L * q * static_cast<double>(cfg.seq_len);
}

TransformerShape transformer_shape(const LlamaConfig& cfg) {
  cfg.validate();
  const int64_t kvh = cfg.kv_heads();
  const double d = static_cast<double>(cfg.d_model), H = static_cast<double>(cfg.n_heads);
  const double kv = static_cast<double>(kvh * cfg.head_dim());
  const double q = static_cast<double>(cfg.n_heads * cfg.head_dim());
  const double h = static_cast<double>(cfg.hidden_size());
  TransformerShape s;
  s.vocab = cfg.vocab;
  s.d_model = cfg.d_model;
  s.n_layers = cfg.n_layers;
  s.layer_prefix = "layers";
  s.input_modules = {"embed_tokens", "rope"};
  s.head_modules = {"lm_head"};
  const auto& m = LlamaConfig::family().modules();
  s.layer_type = m.layer_type;
  s.leaf_types = m.leaf_types;
  const int64_t di = cfg.d_model, kvi = kvh * cfg.head_dim(), qi = cfg.n_heads * cfg.head_dim();
  s.layer_matmul_params = 2 * di * qi + 2 * di * kvi + 3 * di * cfg.hidden_size();
  s.attention_flops_per_token_per_position = 12 * q;
  // Per element: the norms' cast outputs (2 d), attention (GQA: 4 q + kv + 2 q), SwiGLU (4 h);
  // fixed: the norms' fp32 copies and statistics, SDPA's fp32 log-sum-exp.
  const double attn = kvh != cfg.n_heads ? 4 * q + kv + 2 * q : 4 * q + 3 * kv;
  s.layer_activations = {2 * d + attn + 4 * h, 2 * (4 * d + 4) + 4 * H};
  s.recompute_keeps = {d, 0};
  s.layer_backward_work = {2 * d + 2 * (2 * h), 0};
  s.recomputed_leaf_savings = {{"input_norm", 4 * d + 4}, {"post_attn_norm", 4 * d + 4}};
  s.head_activations = {2 * d, 4 * static_cast<double>(cfg.vocab)};
  return s;
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

at::Tensor rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling) {
  // 1 / theta^(2i/hd) with the ops (and so the rounding) of the LLaMA and HF code:
  //   1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd)). Also builds on meta.
  const at::Tensor i2 = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor inv_freq =
      at::reciprocal(at::pow(at::Scalar(theta), i2 / static_cast<double>(head_dim)));
  switch (scaling.type) {
    case RopeScaling::Type::kNone:
      return inv_freq;
    case RopeScaling::Type::kLinear:  // transformers' _compute_linear_scaling_rope_parameters
      return inv_freq / scaling.factor;
    case RopeScaling::Type::kLlama3:
      break;
  }
  // transformers' _compute_llama3_parameters, op for op (fp32). Under MetaInit only the shape
  // counts (at::where has no meta kernel); init_tensor() computes the values later.
  if (inv_freq.is_meta()) return inv_freq;
  const double old_len = static_cast<double>(scaling.original_max_position_embeddings);
  const double low_wavelen = old_len / scaling.low_freq_factor;
  const double high_wavelen = old_len / scaling.high_freq_factor;
  const at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq);
  const at::Tensor smooth = (old_len / wavelen - scaling.low_freq_factor) /
                            (scaling.high_freq_factor - scaling.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled;
  const at::Tensor medium = at::logical_not(wavelen < high_wavelen)
                                .logical_and(at::logical_not(wavelen > low_wavelen));
  return at::where(medium, smoothed, scaled);
}

RotaryEmbeddingImpl::RotaryEmbeddingImpl(int64_t head_dim, double theta,
                                         const RopeScaling& scaling)
    : torch::nn::Module("RotaryEmbedding") {
  inv_freq = register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling));
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
    : torch::nn::Module("Attention"),
      n_heads_(cfg.n_heads),
      n_kv_heads_(cfg.kv_heads()),
      window_(cfg.sliding_window),
      head_dim_(cfg.head_dim()),
      fp8_(cfg.fp8) {
  const int64_t d = cfg.d_model, hd = cfg.head_dim();
  auto linear = [](int64_t in, int64_t out, bool bias) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  q = register_module("q", linear(d, n_heads_ * hd, cfg.attention_bias));
  k = register_module("k", linear(d, n_kv_heads_ * hd, cfg.attention_bias));
  v = register_module("v", linear(d, n_kv_heads_ * hd, cfg.attention_bias));
  o = register_module("o", linear(n_heads_ * hd, d, false));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  const int64_t B = x.size(0);
  // Local head counts from the projections' outputs (tensor parallelism splits the heads:
  // fsdp/tensor_parallel.h; with kv heads fewer than tp, k and v are whole and their exit keeps
  // this rank's one kv head: Note [Replicated kv heads]). The sequence length from q's output
  // too: under sequence parallelism x holds T/tp positions and q's entry gathers them.
  const at::Tensor qx = models::call_linear(q, x, fp8_), kx = models::call_linear(k, x, fp8_),
                   vx = models::call_linear(v, x, fp8_);
  const int64_t T = qx.size(1);
  const int64_t hd = head_dim_, hq = qx.size(-1) / hd, hkv = kx.size(-1) / hd;
  // [B, T, H·hd] -> [B, H, T, hd]: heads as a batch dimension, as SDPA wants.
  auto heads = [&](const at::Tensor& t, int64_t h) {
    return t.view({B, T, h, hd}).transpose(1, 2);
  };
  const at::Tensor qh = apply_rotary(heads(qx, hq), cos, sin);
  at::Tensor kh = apply_rotary(heads(kx, hkv), cos, sin);
  at::Tensor vh = heads(vx, hkv);
  if (hkv != hq) {  // grouped-query: kv head j serves q heads [j·g, (j+1)·g)
    const int64_t g = hq / hkv;
    kh = kh.repeat_interleave(g, /*dim=*/1);
    vh = vh.repeat_interleave(g, /*dim=*/1);
  }
  at::Tensor y;
  if (window_ > 0 && T > window_) {  // keys j with i - W < j <= i
    const at::Tensor i = at::arange(T, x.options().dtype(at::kLong)).unsqueeze(1);
    const at::Tensor j = at::arange(T, x.options().dtype(at::kLong)).unsqueeze(0);
    const at::Tensor keep = (j <= i).logical_and(j > i - window_);
    y = at::scaled_dot_product_attention(qh, kh, vh, keep, /*dropout_p=*/0.0,
                                         /*is_causal=*/false);
  } else {
    y = at::scaled_dot_product_attention(qh, kh, vh, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                         /*is_causal=*/true);
  }
  return models::call_linear(o, y.transpose(1, 2).reshape({B, T, hq * hd}), fp8_);
}

void AttentionImpl::check_tensor_parallel(const std::string& path, int tp) const {
  // Kv heads fewer than tp are replicated (tp_replicated_children), when tp is a multiple.
  const bool kv_ok = n_kv_heads_ % tp == 0 || tp % n_kv_heads_ == 0;
  TORCH_CHECK(n_heads_ % tp == 0 && kv_ok, "tensor parallelism: module '", path,
              "' (Attention) has n_heads = ", n_heads_, " and n_kv_heads = ", n_kv_heads_,
              ", which tp ", tp, " cannot split into whole heads per rank (n_heads must be a "
              "multiple of tp, and n_kv_heads a multiple or a divisor of it: kv heads fewer than "
              "tp are replicated); use a tp size that divides n_heads and divides or is a "
              "multiple of n_kv_heads");
}

std::vector<std::pair<std::string, int64_t>> AttentionImpl::tp_replicated_children(int tp) const {
  if (n_kv_heads_ >= tp) return {};
  return {{"k", n_kv_heads_}, {"v", n_kv_heads_}};
}

MLPImpl::MLPImpl(const LlamaConfig& cfg) : torch::nn::Module("MLP"), fp8_(cfg.fp8) {
  const int64_t d = cfg.d_model, h = cfg.hidden_size();
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  gate = register_module("gate", linear(d, h));
  up = register_module("up", linear(d, h));
  down = register_module("down", linear(h, d));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  return models::call_linear(
      down, at::silu(models::call_linear(gate, x, fp8_)) * models::call_linear(up, x, fp8_), fp8_);
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

  auto [tok, head] = models::embedding_and_head(cfg_.vocab, d, cfg_.tie_embeddings);
  embed_tokens = register_module("embed_tokens", tok);
  rope = register_module("rope",
                         RotaryEmbedding(cfg_.head_dim(), cfg_.rope_theta, cfg_.rope_scaling));
  layers_list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.n_layers; ++i) {
    layers_.emplace_back(cfg_);
    layers_list->push_back(layers_.back());
  }
  norm = register_module("norm", RMSNorm(d, cfg_.norm_eps));
  lm_head = register_module("lm_head", head);
  init_parameters();
}

void LlamaImpl::init_parameters() {
  // rope.inv_freq was computed by its module's constructor, with the function init_tensor() uses.
  models::init_each_parameter(*this, [this](const std::string& n, const at::Tensor& v) {
    init_tensor(n, v);
  });
}

void LlamaImpl::init_tensor(const std::string& name, const at::Tensor& values) const {
  const auto scheme = models::InitScheme::of(cfg_, seed_, {"attn.o", "mlp.down"}, "lm_head.weight",
                                             "embed_tokens.weight", "Llama::init_tensor");
  models::init_transformer_tensor(
      *this, scheme, name, values, [this](const models::TensorSite& site, const at::Tensor& v) {
        if (dynamic_cast<const RotaryEmbeddingImpl*>(site.module)) {
          v.copy_(rope_inv_freq(cfg_.head_dim(), cfg_.rope_theta, cfg_.rope_scaling));
        } else if (dynamic_cast<const RMSNormImpl*>(site.module)) {
          v.fill_(1.0);
        } else {
          return false;
        }
        return true;
      });
}

at::Tensor LlamaImpl::forward(const at::Tensor& idx) {
  // No length limit: RoPE is computed for the batch's positions (llama.h).
  models::check_tokens(idx, std::numeric_limits<int64_t>::max(), "Llama::forward");
  const auto [cos, sin] = flatshard::call(rope, idx.size(1));
  // Sequence parallelism (fsdp/tensor_parallel.h): the layers run on this tp rank's part of the
  // sequence; identities otherwise.
  at::Tensor x = sequence_shard(*this, flatshard::call(embed_tokens, idx));
  for (auto& layer : layers_) x = flatshard::call(layer, x, cos, sin);
  return flatshard::call(lm_head, sequence_gather(*this, flatshard::call(norm, x), *lm_head));
}

at::Tensor LlamaImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  models::check_targets(idx, targets, "Llama::loss");
  return models::next_token_loss(forward(idx), targets, cfg_.vocab, this);
}

// --- the family descriptor (models/family.h) ----------------------------------------------------

const models::Family& LlamaConfig::family() {
  static const models::FamilyOf<LlamaConfig, LlamaImpl> f(
      "llama", "LLaMA",
      {"DecoderLayer", "Linear|RMSNorm|Embedding",
       "Llama, DecoderLayer, Attention, MLP, RMSNorm, RotaryEmbedding, Linear, Embedding",
       "colwise:path=*.attn.q|*.attn.k|*.attn.v|*.mlp.gate|*.mlp.up;"
       "rowwise:path=*.attn.o|*.mlp.down;sequence:type=RMSNorm"});
  return f;
}

}  // namespace llama
}  // namespace flatshard
