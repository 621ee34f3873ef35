// The reference GPT (models/gpt.h): parameter count vs the closed form, shapes, causality,
// seeded determinism, module paths and names, that a few AdamW steps learn, bf16, config errors
// and the synthetic data. Tiny configs only: the whole binary runs in seconds on 2 CPU cores.
#include "models/gpt.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <iostream>
#include <string>

using at::indexing::None;
using at::indexing::Slice;
using flatshard::gpt::GPT;
using flatshard::gpt::GPTConfig;

namespace {

int64_t count_unique(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : flatshard::gpt::unique_parameters(m)) n += p.numel();
  return n;
}

GPTConfig tiny() { return GPTConfig::preset("tiny"); }

at::Tensor random_tokens(const GPTConfig& cfg, int64_t batch, int64_t T, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, cfg.vocab, {batch, T}, gen, at::kLong);
}

}  // namespace

TEST_CASE("parameter count equals the closed form", "[gpt]") {
  for (const std::string name : {"tiny", "small"}) {
    for (bool tied : {false, true}) {
      CAPTURE(name, tied);
      GPTConfig cfg = GPTConfig::preset(name);
      cfg.tie_embeddings = tied;
      GPT model(cfg, 0);
      CHECK(count_unique(*model) == flatshard::gpt::num_parameters(cfg));
    }
  }
  // Pinned values (hand-computed from the formula in gpt.h) so a preset change is noticed.
  CHECK(flatshard::gpt::num_parameters(GPTConfig::preset("tiny")) == 167680);
  CHECK(flatshard::gpt::num_parameters(GPTConfig::preset("small")) == 5322240);
  CHECK(flatshard::gpt::num_parameters(GPTConfig::preset("1b")) == 944148480);
  // 6 (16·12·2048² + 32768·2048) + 12·16·2048·2048
  CHECK(flatshard::gpt::flops_per_token(GPTConfig::preset("1b")) == Approx(6039797760.0));
}

TEST_CASE("tied embeddings share one tensor, also after ->to() and in backward", "[gpt]") {
  GPTConfig cfg = tiny();
  cfg.tie_embeddings = true;
  GPT model(cfg, 1);
  CHECK(model->wte->weight.unsafeGetTensorImpl() == model->lm_head->weight.unsafeGetTensorImpl());
  // LibTorch's parameters() lists the tied tensor under both paths; unique_parameters once.
  CHECK(model->parameters().size() == flatshard::gpt::unique_parameters(*model).size() + 1);
  auto [idx, tgt] = flatshard::gpt::synthetic_batch(cfg, 2, 0, 0);
  model->loss(idx, tgt).backward();
  CHECK(model->wte->weight.grad().defined());
  model->to(at::kBFloat16);
  CHECK(model->wte->weight.unsafeGetTensorImpl() == model->lm_head->weight.unsafeGetTensorImpl());
  CHECK(model->wte->weight.scalar_type() == at::kBFloat16);
}

TEST_CASE("forward and loss shapes", "[gpt]") {
  const GPTConfig cfg = tiny();
  GPT model(cfg, 0);
  for (int64_t T : {int64_t{1}, int64_t{5}, cfg.seq_len}) {
    CAPTURE(T);
    const at::Tensor idx = random_tokens(cfg, 3, T, 11);
    const at::Tensor logits = model->forward(idx);
    CHECK(logits.sizes() == at::IntArrayRef({3, T, cfg.vocab}));
    const at::Tensor loss = model->loss(idx, idx);
    CHECK(loss.dim() == 0);
    CHECK(loss.scalar_type() == at::kFloat);
    // Fresh init is close to uniform over the vocabulary.
    CHECK(loss.item<double>() == Approx(std::log(static_cast<double>(cfg.vocab))).epsilon(0.05));
  }
  CHECK_THROWS_WITH(model->forward(random_tokens(cfg, 1, cfg.seq_len + 1, 0)),
                    Catch::Contains("outside [1, seq_len=32]"));
  CHECK_THROWS_WITH(model->forward(at::zeros({4}, at::kLong)), Catch::Contains("[B, T]"));
  CHECK_THROWS_WITH(model->forward(at::zeros({1, 4}, at::kInt)), Catch::Contains("int64"));
}

TEST_CASE("causal: logits at <= t ignore tokens after t and depend on token t", "[gpt]") {
  const GPTConfig cfg = tiny();
  GPT model(cfg, 3);
  at::NoGradGuard no_grad;
  const at::Tensor idx = random_tokens(cfg, 2, cfg.seq_len, 5);
  const at::Tensor ref = model->forward(idx);
  for (int64_t t : {int64_t{0}, int64_t{7}, cfg.seq_len - 2}) {
    CAPTURE(t);
    at::Tensor later = idx.clone();
    later.index_put_({Slice(), Slice(t + 1, None)},
                     (idx.index({Slice(), Slice(t + 1, None)}) + 1) % cfg.vocab);
    const at::Tensor out = model->forward(later);
    CHECK(at::allclose(out.index({Slice(), Slice(0, t + 1)}), ref.index({Slice(), Slice(0, t + 1)}),
                       /*rtol=*/0.0, /*atol=*/1e-5));
    CHECK_FALSE(at::allclose(out.index({Slice(), t + 1}), ref.index({Slice(), t + 1}), 0.0, 1e-3));

    at::Tensor at_t = idx.clone();
    at_t.index_put_({Slice(), t}, (idx.index({Slice(), t}) + 1) % cfg.vocab);
    const at::Tensor out_t = model->forward(at_t);
    if (t > 0) {
      CHECK(at::allclose(out_t.index({Slice(), Slice(0, t)}), ref.index({Slice(), Slice(0, t)}),
                         0.0, 1e-5));
    }
    CHECK_FALSE(at::allclose(out_t.index({Slice(), t}), ref.index({Slice(), t}), 0.0, 1e-3));
  }
}

TEST_CASE("same seed gives bit-identical parameters, another seed differs", "[gpt]") {
  const GPTConfig cfg = tiny();
  at::manual_seed(123);
  GPT a(cfg, 42);
  at::manual_seed(999);  // neither the global seed nor what was built before matters
  GPT other(cfg, 7);
  GPT b(cfg, 42);
  auto pa = a->named_parameters(), pb = b->named_parameters(), po = other->named_parameters();
  REQUIRE(pa.size() == pb.size());
  bool any_differs = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].key());
    CHECK(pa[i].key() == pb[i].key());
    CHECK(at::equal(pa[i].value(), pb[i].value()));
    if (!at::equal(pa[i].value(), po[i].value())) any_differs = true;
  }
  CHECK(any_differs);
  CHECK_FALSE(at::equal(a->wte->weight, other->wte->weight));
}

TEST_CASE("init values, and construction leaves the global RNG alone", "[gpt]") {
  const GPTConfig cfg = GPTConfig::preset("small");
  at::manual_seed(5);
  const at::Tensor expect = at::randn({4});
  at::manual_seed(5);
  GPT model(cfg, 0);
  CHECK(at::equal(at::randn({4}), expect));

  auto params = model->named_parameters();
  CHECK(at::equal(params["blocks.0.ln1.weight"], at::ones({cfg.d_model})));
  CHECK(at::equal(params["blocks.0.ln1.bias"], at::zeros({cfg.d_model})));
  CHECK(at::equal(params["blocks.3.attn.qkv.bias"], at::zeros({3 * cfg.d_model})));
  CHECK(params["wte.weight"].std().item<double>() == Approx(cfg.init_std).epsilon(0.02));
  CHECK(params["blocks.1.mlp.fc.weight"].std().item<double>() ==
        Approx(cfg.init_std).epsilon(0.02));
  const double residual = cfg.init_std / std::sqrt(2.0 * cfg.n_layers);
  CHECK(params["blocks.1.mlp.proj.weight"].std().item<double>() == Approx(residual).epsilon(0.02));
  CHECK(params["blocks.2.attn.proj.weight"].std().item<double>() == Approx(residual).epsilon(0.05));
}

TEST_CASE("module paths and type names", "[gpt]") {
  const GPTConfig cfg = tiny();
  GPT model(cfg, 0);
  const auto modules = model->named_modules();
  for (const char* path :
       {"wte", "wpe", "blocks", "blocks.0", "blocks.1", "blocks.0.ln1", "blocks.0.attn",
        "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.ln2", "blocks.0.mlp",
        "blocks.0.mlp.fc", "blocks.1.mlp.proj", "ln_f", "lm_head"}) {
    CAPTURE(path);
    CHECK(modules.contains(path));
  }
  CHECK_FALSE(modules.contains("blocks.2"));
  CHECK(model->name() == "GPT");
  CHECK(modules["blocks.0"]->name() == "Block");
  CHECK(modules["blocks.0.attn"]->name() == "CausalSelfAttention");
  CHECK(modules["blocks.0.mlp"]->name() == "MLP");
  CHECK(modules["blocks.0.attn.qkv"]->name() == "torch::nn::LinearImpl");  // LibTorch's default
  // The typed holders are the registered modules themselves.
  CHECK(model->blocks().size() == 2);
  CHECK(model->blocks()[1].ptr().get() == modules["blocks.1"].get());
  CHECK(model->named_parameters().contains("blocks.0.attn.qkv.weight"));
  CHECK_FALSE(model->named_parameters().contains("lm_head.bias"));
}

// Hidden (run with `gpt_test "[slow]"`): builds the 1b preset on CPU (~4 GB fp32).
TEST_CASE("1b preset: parameter count equals the closed form", "[.][slow]") {
  const GPTConfig cfg = GPTConfig::preset("1b");
  GPT model(cfg, 0);
  CHECK(count_unique(*model) == flatshard::gpt::num_parameters(cfg));
}

TEST_CASE("a few AdamW steps on a repeated batch reduce the loss", "[gpt]") {
  const GPTConfig cfg = tiny();
  GPT model(cfg, 0);
  torch::optim::AdamW opt(flatshard::gpt::unique_parameters(*model),
                          torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  auto [idx, tgt] = flatshard::gpt::synthetic_batch(cfg, 8, 0, 0);
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 25; ++step) {
    opt.zero_grad();
    at::Tensor loss = model->loss(idx, tgt);
    loss.backward();
    opt.step();
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  CAPTURE(first, last);
  CHECK(std::isfinite(last));
  CHECK(last < 0.5 * first);
}

TEST_CASE("bf16 parameters: forward runs and the loss is a finite fp32 scalar", "[gpt]") {
  const GPTConfig cfg = tiny();
  GPT model(cfg, 0);
  model->to(at::kBFloat16);
  auto [idx, tgt] = flatshard::gpt::synthetic_batch(cfg, 2, 1, 0);
  CHECK(model->forward(idx).scalar_type() == at::kBFloat16);
  const at::Tensor loss = model->loss(idx, tgt);
  CHECK(loss.scalar_type() == at::kFloat);
  CHECK(std::isfinite(loss.item<double>()));
  loss.backward();
  CHECK(model->blocks()[0]->attn->qkv->weight.grad().scalar_type() == at::kBFloat16);
}

TEST_CASE("config validation and presets", "[gpt]") {
  GPTConfig cfg = tiny();
  cfg.n_heads = 3;
  CHECK_THROWS_WITH(cfg.validate(), Catch::Contains("n_heads (3) must divide d_model (64)"));
  CHECK_THROWS_WITH(GPT(cfg, 0), Catch::Contains("must divide"));
  cfg = tiny();
  cfg.n_layers = 0;
  CHECK_THROWS_WITH(cfg.validate(), Catch::Contains("n_layers must be > 0, got 0"));
  cfg = tiny();
  cfg.vocab = -1;
  CHECK_THROWS_WITH(cfg.validate(), Catch::Contains("vocab must be > 0, got -1"));
  CHECK_THROWS_WITH(GPTConfig::preset("huge"), Catch::Contains("known presets: tiny, small, 1b"));
  for (const char* name : {"tiny", "small", "1b"})
    CHECK_NOTHROW(GPTConfig::preset(name).validate());
  CHECK(GPTConfig().to_string() == GPTConfig::preset("1b").to_string());
}

TEST_CASE("synthetic_batch is deterministic per (seed, rank, step) and learnable", "[gpt]") {
  const GPTConfig cfg = tiny();
  auto [idx, tgt] = flatshard::gpt::synthetic_batch(cfg, 4, 9, 1, 2);
  CHECK(idx.sizes() == at::IntArrayRef({4, cfg.seq_len}));
  CHECK(tgt.sizes() == idx.sizes());
  CHECK(idx.scalar_type() == at::kLong);
  CHECK(idx.device().is_cpu());
  CHECK(idx.min().item<int64_t>() >= 0);
  CHECK(idx.max().item<int64_t>() < cfg.vocab);
  // targets are the next tokens
  CHECK(at::equal(tgt.index({Slice(), Slice(0, -1)}), idx.index({Slice(), Slice(1, None)})));
  // each row is an arithmetic progression mod vocab
  const at::Tensor diff = (tgt - idx).remainder(cfg.vocab);
  CHECK(at::equal(diff, diff.index({Slice(), Slice(0, 1)}).expand_as(diff)));

  at::manual_seed(77);  // the global RNG plays no part
  CHECK(at::equal(flatshard::gpt::synthetic_batch(cfg, 4, 9, 1, 2).first, idx));
  CHECK_FALSE(at::equal(flatshard::gpt::synthetic_batch(cfg, 4, 9, 0, 2).first, idx));
  CHECK_FALSE(at::equal(flatshard::gpt::synthetic_batch(cfg, 4, 9, 1, 3).first, idx));
  CHECK_FALSE(at::equal(flatshard::gpt::synthetic_batch(cfg, 4, 10, 1, 2).first, idx));
}
