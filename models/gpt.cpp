// flatshard/models/gpt.cpp — see gpt.h for the contract.
#include "models/gpt.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

#include "fsdp/call.h"
#include "models/model_init.h"
#include "models/synthetic_language.h"

namespace flatshard {
namespace gpt {

// --- config
// ---------------------------------------------------------------------------------------

GPTConfig GPTConfig::preset(const std::string& name) {
  auto make = [](int64_t vocab, int64_t d_model, int64_t n_heads, int64_t n_layers,
                 int64_t seq_len) {
    GPTConfig c;
    c.vocab = vocab;
    c.d_model = d_model;
    c.n_heads = n_heads;
    c.n_layers = n_layers;
    c.seq_len = seq_len;
    return c;
  };
  if (name == "tiny") return make(512, 64, 4, 2, 32);
  if (name == "small") return make(4096, 256, 8, 4, 256);
  if (name == "1b") return make(32768, 2048, 16, 16, 2048);
  TORCH_CHECK(false, "GPTConfig::preset: unknown preset '", name,
              "'; known presets: tiny, small, 1b");
}

void GPTConfig::validate() const {
  TORCH_CHECK(vocab > 0, "GPTConfig: vocab must be > 0, got ", vocab);
  TORCH_CHECK(d_model > 0, "GPTConfig: d_model must be > 0, got ", d_model);
  TORCH_CHECK(n_heads > 0, "GPTConfig: n_heads must be > 0, got ", n_heads);
  TORCH_CHECK(n_layers > 0, "GPTConfig: n_layers must be > 0, got ", n_layers);
  TORCH_CHECK(seq_len > 0, "GPTConfig: seq_len must be > 0, got ", seq_len);
  TORCH_CHECK(d_model % n_heads == 0, "GPTConfig: n_heads (", n_heads, ") must divide d_model (",
              d_model, ")");
  TORCH_CHECK(std::isfinite(init_std) && init_std >= 0.0,
              "GPTConfig: init_std must be finite and >= 0, got ", init_std);
}

std::string GPTConfig::to_string() const {
  std::ostringstream os;
  os << "vocab=" << vocab << " d_model=" << d_model << " n_heads=" << n_heads
     << " n_layers=" << n_layers << " seq_len=" << seq_len << " tied=" << tie_embeddings;
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

double flops_per_token(const GPTConfig& cfg) {
  const double d = static_cast<double>(cfg.d_model);
  const double L = static_cast<double>(cfg.n_layers);
  const double matmul_params = L * 12.0 * d * d + static_cast<double>(cfg.vocab) * d;
  return 6.0 * matmul_params + 12.0 * L * d * static_cast<double>(cfg.seq_len);
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
at::Tensor linear(torch::nn::Linear& m, const at::Tensor& x) {
  auto out_sizes = x.sizes().vec();
  const at::Tensor y = flatshard::call(m, x.reshape({-1, x.size(-1)}));
  out_sizes.back() = y.size(-1);
  return y.view(out_sizes);
}

}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& cfg)
    : torch::nn::Module("CausalSelfAttention"), n_heads_(cfg.n_heads) {
  qkv = register_module("qkv", torch::nn::Linear(cfg.d_model, 3 * cfg.d_model));
  proj = register_module("proj", torch::nn::Linear(cfg.d_model, cfg.d_model));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2);
  // [B, T, 3d] -> three [B, H, T, hd] views: q, k, v with heads as a batch dimension, as SDPA
  // wants. split, not indexing a permuted [3, B, H, T, hd]: select's backward materialises a
  // zero tensor of the whole qkv output per slice and adds them (on the 1B GPT on an H200: ~130
  // strided elementwise kernels, ~12 ms of a 100 ms step); split's backward is one cat.
  const int64_t hd = d / n_heads_;
  const auto parts = linear(qkv, x).split(d, /*dim=*/2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, n_heads_, hd}).transpose(1, 2); };
  const at::Tensor y = at::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]),
                                                        heads(parts[2]), /*attn_mask=*/{},
                                                        /*dropout_p=*/0.0, /*is_causal=*/true);
  return linear(proj, y.transpose(1, 2).reshape({B, T, d}));
}

MLPImpl::MLPImpl(const GPTConfig& cfg) : torch::nn::Module("MLP") {
  fc = register_module("fc", torch::nn::Linear(cfg.d_model, 4 * cfg.d_model));
  proj = register_module("proj", torch::nn::Linear(4 * cfg.d_model, cfg.d_model));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  return linear(proj, at::gelu(linear(fc, x), /*approximate=*/"tanh"));
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

  // Built before wte so that, when tied, wte can adopt lm_head's weight tensor itself (the
  // Embedding registers a given _weight as is): one TensorImpl under both paths, so gradients
  // of both uses accumulate into it and ->to() keeps them tied.
  auto head = torch::nn::Linear(torch::nn::LinearOptions(d, cfg_.vocab).bias(false));
  auto tok_opts = torch::nn::EmbeddingOptions(cfg_.vocab, d);
  if (cfg_.tie_embeddings) tok_opts._weight(head->weight);

  wte = register_module("wte", torch::nn::Embedding(tok_opts));
  wpe = register_module("wpe", torch::nn::Embedding(cfg_.seq_len, d));
  blocks_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.n_layers; ++i) {
    blocks_.emplace_back(cfg_);
    blocks_list->push_back(blocks_.back());
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  lm_head = register_module("lm_head", head);
  TORCH_INTERNAL_ASSERT(!cfg_.tie_embeddings ||
                        wte->weight.unsafeGetTensorImpl() == lm_head->weight.unsafeGetTensorImpl());

  init_parameters();
}

void GPTImpl::init_parameters() {
  models::init_each_parameter(*this, [this](const std::string& n, const at::Tensor& v) {
    init_tensor(n, v);
  });
}

void GPTImpl::init_tensor(const std::string& name, const at::Tensor& values) const {
  at::NoGradGuard no_grad;
  // A tied weight is one tensor with one init, whichever of its names the caller uses.
  const std::string key = cfg_.tie_embeddings && name == "lm_head.weight" ? "wte.weight" : name;
  const models::TensorSite site =
      models::find_tensor_for_init(*this, key, values, "GPT::init_tensor");
  const torch::nn::Module* m = site.module;
  const std::string& path = site.path;
  if (site.leaf == "bias") {
    values.zero_();  // Linear and LayerNorm biases
  } else if (dynamic_cast<const torch::nn::LayerNormImpl*>(m)) {
    values.fill_(1.0);
  } else if (dynamic_cast<const torch::nn::LinearImpl*>(m)) {
    const bool residual =
        models::path_ends_with(path, "attn.proj") || models::path_ends_with(path, "mlp.proj");
    const double residual_std = cfg_.scaled_residual_init
                                    ? cfg_.init_std / std::sqrt(2.0 * cfg_.n_layers)
                                    : cfg_.init_std;
    models::normal_init(values, residual ? residual_std : cfg_.init_std, seed_, key);
  } else {
    TORCH_INTERNAL_ASSERT(dynamic_cast<const torch::nn::EmbeddingImpl*>(m), "GPT init: '", name,
                          "' belongs to no known module type");
    models::normal_init(values, cfg_.init_std, seed_, key);
  }
}

at::Tensor GPTImpl::forward(const at::Tensor& idx) {
  TORCH_CHECK(idx.dim() == 2, "GPT::forward: idx must be [B, T], got ", idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kLong, "GPT::forward: idx must be int64, got ",
              idx.scalar_type());
  const int64_t T = idx.size(1);
  TORCH_CHECK(T >= 1 && T <= cfg_.seq_len, "GPT::forward: sequence length ", T,
              " outside [1, seq_len=", cfg_.seq_len, "]");
  const at::Tensor pos = at::arange(T, idx.options());
  at::Tensor x = flatshard::call(wte, idx) + flatshard::call(wpe, pos);
  for (auto& block : blocks_) x = flatshard::call(block, x);
  return flatshard::call(lm_head, flatshard::call(ln_f, x));
}

at::Tensor GPTImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  TORCH_CHECK(targets.sizes() == idx.sizes(), "GPT::loss: targets ", targets.sizes(),
              " must have the shape of idx ", idx.sizes());
  const at::Tensor logits = forward(idx);
  return at::cross_entropy_loss(logits.reshape({-1, cfg_.vocab}).to(at::kFloat),
                                targets.reshape({-1}));
}

}  // namespace gpt
}  // namespace flatshard
