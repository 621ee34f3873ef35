// flatshard/models/gpt.cpp — see gpt.h for the contract.
#include "models/gpt.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

#include "fsdp/call.h"
#include "fsdp/tensor_parallel.h"
#include "models/family.h"
#include "models/fp8_linear.h"
#include "models/model_init.h"
#include "models/synthetic_language.h"

namespace flatshard {
namespace gpt {

// --- config
// ---------------------------------------------------------------------------------------

namespace {

struct Preset {
  const char* name;
  int64_t vocab, d_model, n_heads, n_layers, seq_len;
};
constexpr Preset kPresets[] = {
    {"tiny", 512, 64, 4, 2, 32},
    {"small", 4096, 256, 8, 4, 256},
    {"1b", 32768, 2048, 16, 16, 2048},
};

}  // namespace

std::vector<std::string> GPTConfig::preset_names() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.emplace_back(p.name);
  return out;
}

GPTConfig GPTConfig::preset(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name != p.name) continue;
    GPTConfig c;
    c.set_sizes(p.vocab, p.d_model, p.n_heads, p.n_layers, p.seq_len);
    return c;
  }
  std::string known;
  for (const auto& p : kPresets) known += (known.empty() ? "" : ", ") + std::string(p.name);
  TORCH_CHECK(false, "GPTConfig::preset: unknown preset '", name, "'; known presets: ", known);
}

void GPTConfig::validate() const { validate_sizes("GPTConfig"); }

std::string GPTConfig::to_string() const {
  std::ostringstream os;
  os << "vocab=" << vocab << " d_model=" << d_model << " n_heads=" << n_heads
     << " n_layers=" << n_layers << " seq_len=" << seq_len << " tied=" << tie_embeddings;
  if (fp8) os << " fp8=1";
  return os.str();
}

// --- closed forms
// -----------------------------------------------------------------------------------

int64_t num_parameters(const GPTConfig& cfg) {
  const int64_t d = cfg.d_model;
  const int64_t embeddings = cfg.vocab * d * (cfg.tie_embeddings ? 1 : 2) + cfg.seq_len * d;
  const int64_t per_block = 12 * d * d + 13 * d;
  return embeddings + cfg.n_layers * per_block + 2 * d;
}

long double num_parameters_bound(const GPTConfig& cfg) {
  // num_parameters()'s closed form in long double: exact, whatever the sizes.
  const long double d = cfg.d_model, V = cfg.vocab, L = cfg.n_layers, T = cfg.seq_len;
  return V * d * (cfg.tie_embeddings ? 1 : 2) + T * d + L * (12 * d * d + 13 * d) + 2 * d;
}

double flops_per_token(const GPTConfig& cfg) {
  const double d = static_cast<double>(cfg.d_model);
  const double L = static_cast<double>(cfg.n_layers);
  const double matmul_params = L * 12.0 * d * d + static_cast<double>(cfg.vocab) * d;
  return 6.0 * matmul_params + 12.0 * L * d * static_cast<double>(cfg.seq_len);
}

TransformerShape transformer_shape(const GPTConfig& cfg) {
  cfg.validate();
  const double d = static_cast<double>(cfg.d_model), H = static_cast<double>(cfg.n_heads);
  TransformerShape s;
  s.vocab = cfg.vocab;
  s.d_model = cfg.d_model;
  s.n_layers = cfg.n_layers;
  s.layer_prefix = "blocks";
  s.input_modules = {"wte", "wpe"};
  s.head_modules = {"lm_head"};
  const auto& m = GPTConfig::family().modules();
  s.layer_type = m.layer_type;
  s.leaf_types = m.leaf_types;
  s.layer_matmul_params = 12 * cfg.d_model * cfg.d_model;
  s.attention_flops_per_token_per_position = 12 * d;
  s.layer_activations = {17 * d, 2 * (2 * 4) + 4 * H};
  s.recompute_keeps = {d, 0};
  s.layer_backward_work = {2 * d + 2 * (4 * d), 0};
  s.head_activations = {2 * d, 4 * static_cast<double>(cfg.vocab)};
  return s;
}

// --- data
// ---------------------------------------------------------------------------------------------

std::pair<at::Tensor, at::Tensor> synthetic_batch(const GPTConfig& cfg, int64_t batch, int64_t seed,
                                                  int rank, int64_t step) {
  cfg.validate();
  return models::synthetic_tokens(cfg.vocab, cfg.seq_len, batch, seed, rank, step);
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module) {
  return models::unique_parameters(module);
}

// --- modules
// --------------------------------------------------------------------------------------

namespace {

// A Linear on [..., in] through flatshard::call, as one 2-D matmul. LibTorch's
// torch::nn::functional::linear (what LinearImpl::forward calls) fuses the bias into the GEMM
// (addmm) only for 2-D inputs; a 3-D input takes matmul + an in-place bias add, one more kernel
// per Linear in forward (and a slower GEMM without the epilogue) than PyTorch's F.linear.
// fp8: models/fp8_linear.h's matmul instead (the same unit-aware call).
// Under sequence parallelism a split Linear gathers or scatters along the sequence (dim 1), so it
// gets the [B, T, in] input as is (fsdp/tensor_parallel.h, takes_sequence_shards).
at::Tensor linear(torch::nn::Linear& m, const at::Tensor& x, bool fp8) {
  if (takes_sequence_shards(*m)) return models::call_linear(m, x, fp8);
  auto out_sizes = x.sizes().vec();
  const at::Tensor y = models::call_linear(m, x.reshape({-1, x.size(-1)}), fp8);
  out_sizes.back() = y.size(-1);
  return y.view(out_sizes);
}

}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& cfg)
    : torch::nn::Module("CausalSelfAttention"), n_heads_(cfg.n_heads), fp8_(cfg.fp8) {
  qkv = register_module("qkv", torch::nn::Linear(cfg.d_model, 3 * cfg.d_model));
  proj = register_module("proj", torch::nn::Linear(cfg.d_model, cfg.d_model));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), d = x.size(2);
  // [B, T, 3d] -> three [B, H, T, hd] views: q, k, v with heads as a batch dimension, as SDPA
  // wants. split, not indexing a permuted [3, B, H, T, hd]: select's backward materialises a
  // zero tensor of the whole qkv output per slice and adds them (on the 1B GPT on an H200: ~130
  // strided elementwise kernels, ~12 ms of a 100 ms step); split's backward is one cat.
  // Local sizes from the weight (tensor parallelism splits the heads: fsdp/tensor_parallel.h).
  // The sequence length from qkv's output: under sequence parallelism x holds T/tp positions and
  // qkv's entry gathers them.
  const int64_t hd = d / n_heads_, local = qkv->weight.size(0) / 3, h = local / hd;
  const at::Tensor fused = linear(qkv, x, fp8_);
  const int64_t T = fused.size(1);
  const auto parts = fused.split(local, /*dim=*/2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, h, hd}).transpose(1, 2); };
  const at::Tensor y = at::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]),
                                                        heads(parts[2]), /*attn_mask=*/{},
                                                        /*dropout_p=*/0.0, /*is_causal=*/true);
  return linear(proj, y.transpose(1, 2).reshape({B, T, local}), fp8_);
}

void CausalSelfAttentionImpl::check_tensor_parallel(const std::string& path, int tp) const {
  TORCH_CHECK(n_heads_ % tp == 0, "tensor parallelism: module '", path, "' (CausalSelfAttention) ",
              "has n_heads = ", n_heads_, ", which tp ", tp, " cannot split into whole heads per ",
              "rank; use a tp size that divides ", n_heads_);
}

MLPImpl::MLPImpl(const GPTConfig& cfg) : torch::nn::Module("MLP"), fp8_(cfg.fp8) {
  fc = register_module("fc", torch::nn::Linear(cfg.d_model, 4 * cfg.d_model));
  proj = register_module("proj", torch::nn::Linear(4 * cfg.d_model, cfg.d_model));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  return linear(proj, at::gelu(linear(fc, x, fp8_), /*approximate=*/"tanh"), fp8_);
}

BlockImpl::BlockImpl(const GPTConfig& cfg) : torch::nn::Module("Block") {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
  attn = register_module("attn", CausalSelfAttention(cfg));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
  mlp = register_module("mlp", MLP(cfg));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + flatshard::call(attn, flatshard::call(ln1, x));
  return h + flatshard::call(mlp, flatshard::call(ln2, h));
}

GPTImpl::GPTImpl(const GPTConfig& cfg, uint64_t seed)
    : torch::nn::Module("GPT"), cfg_(cfg), seed_(seed) {
  cfg_.validate();
  models::GlobalRngRestorer restore_global_rng;
  const int64_t d = cfg_.d_model;

  auto [tok, head] = models::embedding_and_head(cfg_.vocab, d, cfg_.tie_embeddings);
  wte = register_module("wte", tok);
  wpe = register_module("wpe", torch::nn::Embedding(cfg_.seq_len, d));
  blocks_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.n_layers; ++i) {
    blocks_.emplace_back(cfg_);
    blocks_list->push_back(blocks_.back());
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  lm_head = register_module("lm_head", head);

  init_parameters();
}

void GPTImpl::init_parameters() {
  models::init_each_parameter(*this, [this](const std::string& n, const at::Tensor& v) {
    init_tensor(n, v);
  });
}

void GPTImpl::init_tensor(const std::string& name, const at::Tensor& values) const {
  const auto scheme = models::InitScheme::of(cfg_, seed_, {"attn.proj", "mlp.proj"}, "lm_head.weight",
                                             "wte.weight", "GPT::init_tensor");
  models::init_transformer_tensor(
      *this, scheme, name, values, [](const models::TensorSite& site, const at::Tensor& v) {
        if (!dynamic_cast<const torch::nn::LayerNormImpl*>(site.module)) return false;
        v.fill_(1.0);  // LayerNorm weights (biases are zeroed by the shared walk)
        return true;
      });
}

at::Tensor GPTImpl::forward(const at::Tensor& idx) {
  models::check_tokens(idx, cfg_.seq_len, "GPT::forward");
  const at::Tensor pos = at::arange(idx.size(1), idx.options());
  // Sequence parallelism (fsdp/tensor_parallel.h): the blocks run on this tp rank's part of the
  // sequence; identities otherwise.
  at::Tensor x = sequence_shard(*this, flatshard::call(wte, idx) + flatshard::call(wpe, pos));
  for (auto& block : blocks_) x = flatshard::call(block, x);
  return flatshard::call(lm_head, sequence_gather(*this, flatshard::call(ln_f, x), *lm_head));
}

at::Tensor GPTImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  models::check_targets(idx, targets, "GPT::loss");
  return models::next_token_loss(forward(idx), targets, cfg_.vocab, this);
}

// --- the family descriptor (models/family.h) ----------------------------------------------------

const models::Family& GPTConfig::family() {
  static const models::FamilyOf<GPTConfig, GPTImpl> f(
      "gpt", "GPT",
      {"Block", "Linear|LayerNorm|Embedding",
       "GPT, Block, CausalSelfAttention, MLP, Linear, LayerNorm, Embedding",
       "colwise/3:path=*.attn.qkv;colwise:path=*.mlp.fc;rowwise:path=*.attn.proj|*.mlp.proj;"
       "sequence:type=LayerNorm"});
  return f;
}

}  // namespace gpt
}  // namespace flatshard
