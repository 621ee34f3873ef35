// The reference LLaMA-style decoder (models/llama.h): parameter count vs the closed form (and
// LLaMA-2 7B's published count), seeded determinism, module paths and type names, the rotary
// embedding against hand-computed rotations and its relative-position property, grouped-query
// attention against plain multi-head attention with repeated k/v weights, causality, the fp32
// inv_freq buffer, meta-device construction, config errors, and the logits against the same
// architecture written in plain PyTorch (tools/torch_reference.py, run in the venv's python).
// Tiny configs only: the binary runs in seconds on 2 CPU cores.
#include "models/llama.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

#include "fsdp/meta_init.h"
#include "models/family.h"
#include "models/gpt.h"
#include "models/model_init.h"
#include "temp_dir.h"

#ifndef FLATSHARD_PYTHON_EXE
#error "FLATSHARD_PYTHON_EXE (the venv's python) must be defined by CMake"
#endif
#ifndef FLATSHARD_SOURCE_DIR
#error "FLATSHARD_SOURCE_DIR must be defined by CMake"
#endif

using flatshard::llama::Llama;
using flatshard::llama::LlamaConfig;
namespace ll = flatshard::llama;

namespace {

int64_t count_unique(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : flatshard::models::unique_parameters(m)) n += p.numel();
  return n;
}

LlamaConfig tiny() { return LlamaConfig::preset("tiny"); }

at::Tensor random_tokens(int64_t vocab, int64_t batch, int64_t T, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, vocab, {batch, T}, gen, at::kLong);
}

}  // namespace

TEST_CASE("LLaMA parameter count equals the closed form", "[llama]") {
  for (const std::string name : {"tiny", "small"}) {
    for (bool tied : {false, true}) {
      for (int64_t kv : {int64_t{0}, int64_t{1}}) {
        CAPTURE(name, tied, kv);
        LlamaConfig cfg = LlamaConfig::preset(name);
        cfg.tie_embeddings = tied;
        if (kv) cfg.n_kv_heads = kv;
        Llama model(cfg, 0);
        CHECK(count_unique(*model) == ll::num_parameters(cfg));
      }
    }
  }
  // Pinned, hand-computed from the formula in llama.h, so a preset change is noticed.
  // tiny: 2·512·64 + 2·(128 + 2·64² + 2·64·32 + 3·64·192) + 64
  CHECK(ll::num_parameters(LlamaConfig::preset("tiny")) == 164160);
  CHECK(ll::num_parameters(LlamaConfig::preset("small")) == 5245184);
  CHECK(ll::num_parameters(LlamaConfig::preset("1b")) == 953223168);
  // An independent number: LLaMA-2 7B's published parameter count (its config.json shapes).
  CHECK(ll::num_parameters(LlamaConfig::preset("7b")) == 6738415616);
  CHECK(LlamaConfig::preset("7b").hidden_size() == 11008);  // LLaMA-2 7B's intermediate_size
  CHECK(LlamaConfig::preset("1b").hidden_size() == 5632);
  // 6·(16·(2·2048² + 2·2048² + 3·2048·5632) + 32000·2048) + 12·16·2048·2048
  CHECK(ll::flops_per_token(LlamaConfig::preset("1b")) ==
        Approx(6.0 * (16.0 * (4.0 * 2048 * 2048 + 3.0 * 2048 * 5632) + 32000.0 * 2048) +
               12.0 * 16 * 2048 * 2048));
}

TEST_CASE("LLaMA module paths and type names", "[llama]") {
  LlamaConfig cfg = tiny();
  Llama model(cfg, 0);
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  const std::vector<std::string> layer = {"input_norm.weight", "attn.q.weight",
                                          "attn.k.weight",     "attn.v.weight",
                                          "attn.o.weight",     "post_attn_norm.weight",
                                          "mlp.gate.weight",   "mlp.up.weight",
                                          "mlp.down.weight"};
  std::vector<std::string> want = {"embed_tokens.weight"};
  for (int i = 0; i < cfg.n_layers; ++i)
    for (const auto& n : layer) want.push_back("layers." + std::to_string(i) + "." + n);
  want.push_back("norm.weight");
  want.push_back("lm_head.weight");
  CHECK(names == want);
  // No biases anywhere.
  for (const auto& n : names) CHECK(n.find("bias") == std::string::npos);

  auto buffers = model->named_buffers();
  REQUIRE(buffers.size() == 1);
  CHECK(buffers[0].key() == "rope.inv_freq");
  CHECK(buffers[0].value().scalar_type() == at::kFloat);

  std::map<std::string, std::string> types;
  for (const auto& m : model->named_modules()) types[m.key()] = m.value()->name();
  CHECK(types[""] == "Llama");
  CHECK(types["layers.0"] == "DecoderLayer");
  CHECK(types["layers.1.attn"] == "Attention");
  CHECK(types["layers.1.mlp"] == "MLP");
  CHECK(types["layers.0.input_norm"] == "RMSNorm");
  CHECK(types["norm"] == "RMSNorm");
  CHECK(types["rope"] == "RotaryEmbedding");
  CHECK(model->layers_list->size() == static_cast<size_t>(cfg.n_layers));
  CHECK(model->layers()[0]->attn->k->weight.sizes() == at::IntArrayRef({2 * 16, 64}));
  CHECK(model->layers()[0]->mlp->gate->weight.sizes() == at::IntArrayRef({192, 64}));
}

TEST_CASE("LLaMA init is deterministic per seed and leaves the global RNG alone", "[llama]") {
  const LlamaConfig cfg = tiny();
  const at::Tensor before = at::detail::getDefaultCPUGenerator().get_state();
  Llama a(cfg, 7), b(cfg, 7), c(cfg, 8);
  CHECK(at::equal(before, at::detail::getDefaultCPUGenerator().get_state()));
  auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  bool any_diff = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].key());
    CHECK(at::equal(pa[i].value(), pb[i].value()));
    if (pa[i].key().find("norm") == std::string::npos)
      any_diff = any_diff || !at::equal(pa[i].value(), pc[i].value());
  }
  CHECK(any_diff);
  // Init values: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), norms 1.
  LlamaConfig big = tiny();
  big.d_model = 256;
  big.n_heads = 4;
  Llama m(big, 1);
  CHECK(m->layers()[0]->attn->q->weight.std().item<double>() == Approx(0.02).epsilon(0.03));
  CHECK(m->layers()[0]->attn->o->weight.std().item<double>() ==
        Approx(0.02 / std::sqrt(2.0 * big.n_layers)).epsilon(0.03));
  CHECK(m->layers()[1]->mlp->down->weight.std().item<double>() ==
        Approx(0.02 / std::sqrt(2.0 * big.n_layers)).epsilon(0.03));
  CHECK(at::equal(m->norm->weight, at::ones({256})));
}

TEST_CASE("rotary embedding: hand-computed rotation for head dim 4", "[llama][rope]") {
  // hd 4, theta 100: inv_freq = [100^0, 100^(-2/4)] = [1, 0.1]; pairs (x0, x2) and (x1, x3).
  ll::RotaryEmbedding rope(4, 100.0);
  REQUIRE(rope->inv_freq.scalar_type() == at::kFloat);
  CHECK(rope->inv_freq[0].item<double>() == Approx(1.0));
  CHECK(rope->inv_freq[1].item<double>() == Approx(0.1));
  auto [cos, sin] = rope->forward(3);
  const at::Tensor x = at::tensor({1.0f, 2.0f, 3.0f, 4.0f}).view({1, 4}).expand({3, 4});
  const at::Tensor got = ll::apply_rotary(x.contiguous(), cos, sin);
  for (int p = 0; p < 3; ++p) {
    CAPTURE(p);
    const double a0 = p * 1.0, a1 = p * 0.1;
    // (x0, x2) = (1, 3) rotated by a0; (x1, x3) = (2, 4) rotated by a1.
    CHECK(got[p][0].item<double>() == Approx(1 * std::cos(a0) - 3 * std::sin(a0)).margin(1e-6));
    CHECK(got[p][2].item<double>() == Approx(3 * std::cos(a0) + 1 * std::sin(a0)).margin(1e-6));
    CHECK(got[p][1].item<double>() == Approx(2 * std::cos(a1) - 4 * std::sin(a1)).margin(1e-6));
    CHECK(got[p][3].item<double>() == Approx(4 * std::cos(a1) + 2 * std::sin(a1)).margin(1e-6));
  }
  // The default theta 10000 at hd 64: inv_freq[i] = 10000^(-2i/64).
  ll::RotaryEmbedding r64(64, 10000.0);
  for (int i = 0; i < 32; ++i)
    CHECK(r64->inv_freq[i].item<double>() == Approx(std::pow(10000.0, -2.0 * i / 64)).epsilon(1e-6));
}

TEST_CASE("rotary embedding: q·k depends only on the position difference", "[llama][rope]") {
  const int64_t hd = 16, T = 12;
  ll::RotaryEmbedding rope(hd, 10000.0);
  auto [cos, sin] = rope->forward(T);
  at::Generator gen = at::detail::createCPUGenerator(3);
  const at::Tensor q = at::randn({hd}, gen, at::kDouble).to(at::kFloat);
  const at::Tensor k = at::randn({hd}, gen, at::kDouble).to(at::kFloat);
  // The same q at every position, the same k at every position.
  const at::Tensor qr = ll::apply_rotary(q.expand({T, hd}).contiguous(), cos, sin);
  const at::Tensor kr = ll::apply_rotary(k.expand({T, hd}).contiguous(), cos, sin);
  const at::Tensor dots = at::matmul(qr, kr.t());  // [m, n] = q_m · k_n
  bool varies = false;
  for (int64_t off = -4; off <= 4; ++off) {
    for (int64_t m = std::max<int64_t>(0, -off); m + off < T && m < T; ++m) {
      CAPTURE(off, m);
      CHECK(dots[m][m + off].item<double>() ==
            Approx(dots[std::max<int64_t>(0, -off)][std::max<int64_t>(0, -off) + off].item<double>())
                .margin(1e-5));
    }
    varies = varies || std::abs(dots[4][4 + off].item<double>() - dots[4][4].item<double>()) > 1e-3;
  }
  CHECK(varies);  // it does depend on the difference (the check above is not vacuous)
  // Norms are preserved (a rotation).
  CHECK(at::allclose(qr.norm(2, -1), q.norm().expand({T}), 1e-5, 1e-6));
}

TEST_CASE("grouped-query attention equals multi-head attention with repeated k/v", "[llama]") {
  LlamaConfig gqa = tiny();  // 4 heads, 2 kv heads
  LlamaConfig mha = gqa;
  mha.n_kv_heads = 0;
  Llama a(gqa, 4), b(mha, 5);
  {
    at::NoGradGuard ng;
    for (auto& p : b->named_parameters()) {
      const at::Tensor src = a->named_parameters()[p.key()];
      if (p.value().sizes() == src.sizes()) {
        p.value().copy_(src);
      } else {  // k or v: kv head j serves q heads 2j, 2j+1 -> repeat each head's rows twice
        const int64_t hd = gqa.head_dim();
        p.value().copy_(src.view({2, 1, hd, gqa.d_model}).expand({2, 2, hd, gqa.d_model})
                            .reshape(p.value().sizes()));
      }
    }
  }
  const at::Tensor idx = random_tokens(gqa.vocab, 2, 9, 1);
  CHECK(at::allclose(a->forward(idx), b->forward(idx), 1e-5, 1e-5));
}

TEST_CASE("LLaMA forward is causal, loss is fp32, training learns", "[llama]") {
  const LlamaConfig cfg = tiny();
  Llama model(cfg, 0);
  at::Tensor idx = random_tokens(cfg.vocab, 2, 10, 2);
  const at::Tensor l1 = model->forward(idx);
  CHECK(l1.sizes() == at::IntArrayRef({2, 10, cfg.vocab}));
  idx.index_put_({at::indexing::Slice(), 7}, (idx.index({at::indexing::Slice(), 7}) + 1) % cfg.vocab);
  const at::Tensor l2 = model->forward(idx);
  using at::indexing::Slice;
  CHECK(at::equal(l1.index({Slice(), Slice(0, 7)}), l2.index({Slice(), Slice(0, 7)})));
  CHECK_FALSE(at::allclose(l1.index({Slice(), 7}), l2.index({Slice(), 7})));

  torch::optim::AdamW opt(flatshard::models::unique_parameters(*model),
                          torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  for (int s = 0; s < 30; ++s) {
    auto [x, y] = ll::synthetic_batch(cfg, 8, 0, 0, s);
    opt.zero_grad();
    at::Tensor loss = model->loss(x, y);
    CHECK(loss.scalar_type() == at::kFloat);
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  CHECK(first == Approx(std::log(static_cast<double>(cfg.vocab))).epsilon(0.05));
  CHECK(last < first - 0.5);
}

TEST_CASE("LLaMA in bf16 keeps the fp32 inv_freq; tied embeddings share one tensor", "[llama]") {
  LlamaConfig cfg = tiny();
  cfg.tie_embeddings = true;
  Llama model(cfg, 2);
  CHECK(model->embed_tokens->weight.unsafeGetTensorImpl() ==
        model->lm_head->weight.unsafeGetTensorImpl());
  CHECK(count_unique(*model) == ll::num_parameters(cfg));
  const at::Tensor inv = model->rope->inv_freq.clone();
  model->to(at::kBFloat16);
  CHECK(model->lm_head->weight.scalar_type() == at::kBFloat16);
  CHECK(model->rope->inv_freq.scalar_type() == at::kFloat);
  CHECK(at::equal(model->rope->inv_freq, inv));
  auto [x, y] = ll::synthetic_batch(cfg, 2, 0, 0);
  const at::Tensor loss = model->loss(x, y);
  CHECK(loss.scalar_type() == at::kFloat);
  CHECK(std::isfinite(loss.item<double>()));
}

TEST_CASE("LLaMA builds on the meta device: 1b preset, nothing allocated", "[llama][meta]") {
  Llama model{nullptr};
  {
    flatshard::MetaInit meta;
    model = Llama(LlamaConfig::preset("1b"), 0);
  }
  // Leaving the scope restores the thread's dispatch keys: plain CPU ops work again on this
  // thread (the include guard alone left the Meta backend bit set, and this failed with
  // "found at least two devices, meta and cpu").
  const at::Tensor x = at::ones({3}) * 2 + at::arange(3);
  CHECK(x.device().is_cpu());
  CHECK(x.sum().item<double>() == 9.0);
  flatshard::check_on_meta(*model);
  CHECK(model->rope->inv_freq.is_meta());
  CHECK(model->rope->inv_freq.sizes() == at::IntArrayRef({2048 / 16 / 2}));
  CHECK(count_unique(*model) == ll::num_parameters(LlamaConfig::preset("1b")));
}

TEST_CASE("LLaMA config errors name the values", "[llama]") {
  auto bad = [](auto change, const std::string& needle) {
    LlamaConfig c = LlamaConfig::preset("tiny");
    change(c);
    CAPTURE(needle);
    CHECK_THROWS_WITH(c.validate(), Catch::Contains(needle));
  };
  bad([](LlamaConfig& c) { c.n_kv_heads = 3; }, "n_kv_heads (3) must divide n_heads (4)");
  bad([](LlamaConfig& c) { c.n_heads = 3; }, "n_heads (3) must divide d_model (64)");
  bad([](LlamaConfig& c) { c.d_model = 12; c.n_heads = 4; c.n_kv_heads = 0; }, "must be even");
  bad([](LlamaConfig& c) { c.rope_theta = 0.5; }, "rope_theta must be finite and > 1, got 0.5");
  bad([](LlamaConfig& c) { c.norm_eps = 0; }, "norm_eps");
  CHECK_THROWS_WITH(LlamaConfig::preset("13b"), Catch::Contains("tiny, small, 1b, 7b"));
  CHECK_THROWS_WITH(flatshard::models::family("bert"), Catch::Contains("gpt, llama"));
}

TEST_CASE("both families share one synthetic language", "[llama]") {
  const auto g = flatshard::gpt::GPTConfig::preset("tiny");
  const auto l = LlamaConfig::preset("tiny");
  REQUIRE(g.vocab == l.vocab);
  REQUIRE(g.seq_len == l.seq_len);
  auto [gx, gy] = flatshard::gpt::synthetic_batch(g, 3, 9, 1, 2);
  auto [lx, ly] = ll::synthetic_batch(l, 3, 9, 1, 2);
  CHECK(at::equal(gx, lx));
  CHECK(at::equal(gy, ly));
}

// The independent reference: tools/torch_reference.py's Llama (plain torch ops, written from the
// architecture in llama.h, not from this C++) loads this model's weights and buffer and must
// produce the same logits. Files: raw little-endian fp32/int64, one per tensor, and a manifest.
TEST_CASE("LLaMA logits match the PyTorch reference (tools/torch_reference.py)",
          "[llama][python]") {
  flatshard_test::TempDir tmp;
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    LlamaConfig cfg = tiny();
    cfg.tie_embeddings = tied;
    cfg.norm_eps = 1e-6;   // not the default, so a hard-coded eps on either side shows up
    cfg.rope_theta = 500;  // idem for theta; and a short period exercises the rotation
    Llama model(cfg, 13);
    const at::Tensor idx = random_tokens(cfg.vocab, 2, cfg.seq_len, 4);
    const at::Tensor logits = model->forward(idx).contiguous();

    auto write_raw = [&](const std::string& name, const at::Tensor& t) {
      std::ofstream f(tmp / (name + ".bin"), std::ios::binary);
      const at::Tensor c = t.contiguous();
      f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
      REQUIRE(f.good());
    };
    std::ofstream manifest(tmp / "manifest.txt");
    for (const auto& p : model->named_parameters()) {
      write_raw(p.key(), p.value().detach());
      manifest << p.key();
      for (auto s : p.value().sizes()) manifest << " " << s;
      manifest << "\n";
    }
    for (const auto& b : model->named_buffers()) {
      write_raw(b.key(), b.value());
      manifest << b.key();
      for (auto s : b.value().sizes()) manifest << " " << s;
      manifest << "\n";
    }
    manifest.close();
    write_raw("idx", idx);

    std::ofstream script(tmp / "ref.py");
    script << R"PY(
import sys, torch
sys.path.insert(0, sys.argv[1] + "/tools")
import torch_reference as tr
d = sys.argv[2]
tied = sys.argv[3] == "1"
cfg = dict(tr.LLAMA_PRESETS["tiny"])
cfg.update(norm_eps=1e-6, rope_theta=500.0, tied=tied)
model = tr.Llama(**cfg)
state = {}
for line in open(d + "/manifest.txt"):
    name, *shape = line.split()
    raw = open(d + "/" + name + ".bin", "rb").read()
    state[name] = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(*map(int, shape))
# inv_freq is compared, not loaded: the reference computes its own from theta.
inv = state.pop("rope.inv_freq")
assert torch.allclose(inv, model.rope_inv_freq, rtol=1e-6, atol=0), (inv, model.rope_inv_freq)
missing, unexpected = model.load_state_dict(state, strict=False)
assert not unexpected, unexpected
assert all(m == "lm_head.weight" and tied for m in missing), missing
if tied:
    assert model.lm_head.weight is model.embed_tokens.weight
raw = open(d + "/idx.bin", "rb").read()
idx = torch.frombuffer(bytearray(raw), dtype=torch.int64).view(2, cfg["seq"])
with torch.no_grad():
    out = model.logits(idx).float().contiguous()
open(d + "/py_logits.bin", "wb").write(out.numpy().tobytes())
)PY";
    script.close();
    const std::string python = FLATSHARD_PYTHON_EXE;
    const std::string cmd = python + " -W ignore " + (tmp / "ref.py") + " " +
                            FLATSHARD_SOURCE_DIR + " " + tmp.path() + " " + (tied ? "1" : "0") +
                            " 2> " + (tmp / "err.txt");
    const int rc = std::system(cmd.c_str());
    INFO("python stderr: " << flatshard_test::read_bytes(tmp / "err.txt"));
    REQUIRE(rc == 0);
    const std::string bytes = flatshard_test::read_bytes(tmp / "py_logits.bin");
    REQUIRE(static_cast<int64_t>(bytes.size()) == logits.numel() * 4);
    const at::Tensor py =
        at::from_blob(const_cast<char*>(bytes.data()), logits.sizes(), at::kFloat).clone();
    // fp32 on both sides with the same op order, only the kernels may differ: rtol 1e-4 /
    // atol 1e-5 on logits of magnitude ~0.1. A wrong rotation fails it (checked: flipping the
    // rotation's direction in apply_rotary makes this check fail).
    CAPTURE((py - logits).abs().max().item<double>());
    CHECK(at::allclose(py, logits, 1e-4, 1e-5));
  }
}
