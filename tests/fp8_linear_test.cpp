// models/fp8_linear.h and flat_param/gathered_scale.h on CPU (at::_scaled_mm runs there in torch
// 2.11):
// - fp8_linear's forward and both gradients against a reference written with plain ATen: torch's
//   own float8 casts, dequantized, multiplied in fp32, rounded to the output dtype.
// - an fp8-gathered weight requantized with its gather's scale gives the wire's bytes back, bit
//   for bit, in fp32 and bf16 (FlatParam on thread ranks, worlds 1-3).
// - the tiny GPT and LLaMA with fp8 matmuls and fp8 gathers, sharded on 1 and 2 ranks, against the
//   unsharded fp32 model running the same recipe with the same scales.
// - 200 steps of the tiny GPT and LLaMA: fp8 matmuls + fp8 gathers against bf16 gathers and bf16
//   matmuls.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <array>
#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "flat_param/flat_param.h"
#include "flat_param/gathered_scale.h"
#include "flat_param/quantized_gather.h"
#include "gpt_parity_spec.h"
#include "llama_parity_spec.h"
#include "models/fp8_linear.h"
#include "rank_require.h"

using namespace flatshard;

namespace {

// --- the reference: torch's float8 casts, fp32 matmuls -------------------------------------------

// v -> float8 with scale amax|v| / qmax, dequantized to fp32 (v is not all zeros here).
at::Tensor ref_qdq(const at::Tensor& v, double qmax, at::ScalarType f8) {
  const at::Tensor vf = v.to(at::kFloat);
  const at::Tensor s = vf.abs().max() / qmax;
  return (vf / s).clamp(-qmax, qmax).to(f8).to(at::kFloat) * s;
}
at::Tensor e4m3_qdq(const at::Tensor& v) { return ref_qdq(v, 448.0, at::kFloat8_e4m3fn); }
at::Tensor e5m2_qdq(const at::Tensor& v) { return ref_qdq(v, 57344.0, at::kFloat8_e5m2); }

// |got - ref| <= bound elementwise; returns the largest difference.
double check_close(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& bound) {
  const at::Tensor d = (got.to(at::kFloat) - ref.to(at::kFloat)).abs();
  CHECK((d <= bound).all().item<bool>());
  return d.max().item<double>();
}

}  // namespace

TEST_CASE("fp8_linear: forward and gradients equal the float8 reference", "[fp8_linear]") {
  // Tolerance: at::_scaled_mm on CPU and the reference both multiply the same dequantized
  // values in fp32; only the summation order may differ, at most K * 2^-24 of sum |a b| (K <=
  // 72 here: < 5e-6 of it; bound 1e-5). A bf16 output may then round the other way: one bf16
  // ulp, 2^-8 of the value. A missing or wrong quantization moves results by ~2^-4 relative.
  for (auto dtype : {at::kFloat, at::kBFloat16})
    for (auto [m, k, n] : std::vector<std::array<int64_t, 3>>{{4, 8, 6}, {33, 72, 17}, {1, 1, 1}}) {
      CAPTURE(dtype, m, k, n);
      auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(m * 1000 + k * 10 + n));
      const at::Tensor x0 = at::randn({m, k}, gen).mul(3).to(dtype);
      const at::Tensor w0 = at::randn({n, k}, gen).mul(0.05).to(dtype);
      const at::Tensor b0 = at::randn({n}, gen).to(dtype);
      const at::Tensor dy = at::randn({m, n}, gen).mul(1e-3).to(dtype);
      at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      at::Tensor b = b0.clone().requires_grad_(true);
      // A 3-D input as the models give it: [2, m, k].
      const at::Tensor x3 = at::stack({x, x * 0.5});
      const at::Tensor y = models::fp8_linear(x3, w, b);
      REQUIRE(y.scalar_type() == dtype);
      REQUIRE(y.sizes() == at::IntArrayRef({2, m, n}));
      y.backward(at::stack({dy, dy * 2}));

      // One [2m, k] activation tensor (one scale), one [2m, n] output gradient (one scale).
      const double ulp = dtype == at::kBFloat16 ? std::ldexp(1.0, -8) : 0.0;  // one bf16 rounding
      const at::Tensor xsq = e4m3_qdq(at::stack({x0, x0 * 0.5}).reshape({2 * m, k}));
      const at::Tensor wq = e4m3_qdq(w0);
      const at::Tensor gq = e5m2_qdq(at::stack({dy, dy * 2}).reshape({2 * m, n}));
      auto sum_bound = [](const at::Tensor& a, const at::Tensor& b) {
        return at::matmul(a.abs(), b.abs()) * 1e-5 + 1e-30;
      };
      // y: the matmul rounded to dtype, then the bias added in dtype (a second rounding).
      const at::Tensor y_ref = (at::matmul(xsq, wq.t()).to(dtype) + b0).to(at::kFloat);
      double worst =
          check_close(y.reshape({2 * m, n}), y_ref, sum_bound(xsq, wq.t()) + y_ref.abs() * 2 * ulp);
      // dx: autograd adds the two slices' gradients in dtype: dx = d0 + 0.5 d1.
      const at::Tensor dx3 = at::matmul(gq, wq).to(dtype).view({2, m, k});
      const at::Tensor dx_ref = (dx3[0] + dx3[1] * 0.5).to(at::kFloat);
      const at::Tensor dxb = sum_bound(gq, wq).view({2, m, k});
      worst = std::max(worst, check_close(x.grad(), dx_ref,
                                          dxb[0] + dxb[1] + dx_ref.abs() * 3 * ulp +
                                              dx3.abs().to(at::kFloat).sum(0) * ulp));
      const at::Tensor dw_ref = at::matmul(gq.t(), xsq).to(dtype).to(at::kFloat);
      worst = std::max(worst,
                       check_close(w.grad(), dw_ref, sum_bound(gq.t(), xsq) + dw_ref.abs() * ulp));
      const at::Tensor db_ref =
          at::stack({dy, dy * 2}).to(at::kFloat).sum(std::vector<int64_t>{0, 1});
      CHECK(at::allclose(b.grad().to(at::kFloat), db_ref, dtype == at::kFloat ? 1e-6 : 1e-2, 1e-6));
      WARN("max |fp8_linear - reference| (" << dtype << ", " << m << "x" << k << "x" << n
                                            << "): " << worst);
      // The quantization is real: a plain matmul differs by far more than the tolerance.
      if (k > 1) {
        const at::Tensor plain = at::matmul(x0.to(at::kFloat), w0.to(at::kFloat).t());
        CHECK((y[0].to(at::kFloat) - b0.to(at::kFloat) - plain).abs().max().item<double>() >
              1e-3 * plain.abs().max().item<double>());
      }
    }
}

TEST_CASE("fp8_linear: zeros stay zeros, wrong inputs are clear errors", "[fp8_linear]") {
  at::Tensor w = at::zeros({3, 4}).requires_grad_(true);
  at::Tensor x = at::zeros({2, 4}).requires_grad_(true);
  const at::Tensor y = models::fp8_linear(x, w);
  y.sum().backward();
  CHECK(at::equal(y, at::zeros({2, 3})));
  CHECK(at::equal(w.grad(), at::zeros({3, 4})));
  CHECK(at::equal(x.grad(), at::zeros({2, 4})));
  CHECK_THROWS_WITH(models::fp8_linear(at::zeros({2, 5}), w),
                    Catch::Contains("does not end in the weight's in = 4"));
  CHECK_THROWS_WITH(models::fp8_linear(at::zeros({2, 4}, at::kBFloat16), w),
                    Catch::Contains("input dtype BFloat16 differs from the weight's Float"));
}

TEST_CASE("an fp8-gathered weight requantized with its gather's scale is the wire, bit for bit",
          "[fp8_linear][quantized_gather]") {
  // Independent reference of the wire: each whole parameter's amax / 448 and torch's e4m3 cast.
  const std::vector<std::vector<int64_t>> shapes = {{7, 5}, {33}, {4, 4}, {64, 64}};
  auto make = [&] {
    auto gen = at::detail::createCPUGenerator(99);
    std::vector<at::Tensor> ps;
    for (size_t i = 0; i < shapes.size(); ++i)
      ps.push_back((at::randn(shapes[i], gen) * std::pow(10.0, static_cast<double>(i) - 1))
                       .requires_grad_(true));
    ps[2].detach().zero_();  // all zeros: scale 1
    return ps;
  };
  std::vector<at::Tensor> wire, scale;
  for (const at::Tensor& p : make()) {
    const at::Tensor amax = p.detach().abs().max().reshape({1});
    const at::Tensor s = at::where(amax == 0, at::ones_like(amax), amax / 448.0);
    scale.push_back(s);
    wire.push_back((p.detach() / s).clamp(-448, 448).to(at::kFloat8_e4m3fn).view(at::kByte));
  }
  int64_t moved_codes[2] = {0, 0};  // fp32, bf16
  double scale_off[2] = {0, 0};
  for (auto dtype : {at::kFloat, at::kBFloat16})
    for (int world = 1; world <= 3; ++world) {
      CAPTURE(dtype, world);
      run_ranks(world, [&](Communicator& c) {
        auto ps = make();
        std::vector<ParamRef> refs;
        for (size_t i = 0; i < ps.size(); ++i) refs.push_back({"p" + std::to_string(i), ps[i]});
        FlatParamConfig cfg;
        cfg.param_dtype = dtype;
        cfg.gather_dtype = GatherDtype::kFp8;
        FlatParam fp("unit", refs, c, cfg);
        RANK_REQUIRE(!gathered_fp8_scale(ps[0]).defined());  // sharded: guarded
        fp.unshard(c.current_stream());
        for (size_t i = 0; i < ps.size(); ++i) {
          const at::Tensor s = gathered_fp8_scale(ps[i]);
          RANK_REQUIRE(s.defined());
          RANK_REQUIRE(at::equal(s, scale[i]));
          const at::Tensor q = fp8_quantize(ps[i].detach().reshape({-1}).to(at::kFloat), s);
          RANK_REQUIRE(at::equal(q.view(at::kByte), wire[i].reshape({-1})));
        }
        // Why the lookup: the dequantized weight's own dynamic scale is not the gather's. In
        // bf16 its amax is the bf16 rounding of the master's, so the scale is off by up to 2^-8
        // (the codes come out the same: the values sit on the fp8 grid, so the rounding does
        // not move them), and every output of the matmul with it.
        const at::Tensor w = ps[3].detach().reshape({-1}).to(at::kFloat);
        const at::Tensor own_s = scales_from_amax(w.abs().amax().view({1}), kFp8Max);
        const at::Tensor own = fp8_quantize(w, own_s);
        const int64_t moved = own.view(at::kByte).ne(wire[3].reshape({-1})).sum().item<int64_t>();
        const double off = (own_s / scale[3] - 1).abs().item<double>();
        if (dtype == at::kBFloat16) RANK_CHECK(off > 0);
        if (c.rank() == 0 && world == 1) scale_off[dtype == at::kBFloat16] = off;
        if (c.rank() == 0 && world == 1) moved_codes[dtype == at::kBFloat16] = moved;
        fp.reshard();
        RANK_REQUIRE(!gathered_fp8_scale(ps[0]).defined());
        RANK_REQUIRE(!gathered_fp8_scale(at::ones({2})).defined());  // not a unit's parameter
      });
    }
  WARN("the dequantized weight's own scale against the gather's: relative difference fp32 "
       << scale_off[0] << ", bf16 " << scale_off[1] << "; codes moved (of 4096) fp32 "
       << moved_codes[0] << ", bf16 " << moved_codes[1]);
  // A unit that gathers the param dtype registers nothing.
  run_ranks(2, [&](Communicator& c) {
    auto ps = make();
    FlatParam fp("unit", {{"p0", ps[0]}}, c, FlatParamConfig{});
    fp.unshard(c.current_stream());
    RANK_REQUIRE(!gathered_fp8_scale(ps[0]).defined());
  });
}

// --- the model families
// ---------------------------------------------------------------------------

namespace {

// The blocks' Linear weights, which fp8_linear quantizes itself (with the dynamic scale that
// equals the gather's on the fp32 reference); every other parameter the reference
// quantize-dequantizes as the fp8 gather does (tests/quantized_gather_test.cpp's reference).
bool fp8_matmul_weight(const std::string& name) {
  const bool in_layer =
      name.find(".attn.") != std::string::npos || name.find(".mlp.") != std::string::npos;
  return in_layer && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
}

void quantize_others(torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  for (auto& p : model.named_parameters()) {
    if (fp8_matmul_weight(p.key())) continue;
    const at::Tensor flat = p.value().detach().reshape({-1});
    const at::Tensor s = scales_from_amax(flat.abs().amax().view({1}), kFp8Max);
    p.value().detach().copy_(
        fp8_dequantize(fp8_quantize(flat, s), s, at::kFloat).view(p.value().sizes()));
  }
}

// `base` with fp8 matmuls and fp8 gathers; `reference` quantizes as the gathers do.
flatshard_test::ParitySpec fp8_spec(flatshard_test::ParitySpec s) {
  s.options.mixed_precision.gather_dtype = GatherDtype::kFp8;
  s.before_use = quantize_others;
  s.steps = 3;
  return s;
}

void check_fp8_parity(const std::string& family, const flatshard_test::ParitySpec& s) {
  const flatshard_test::ParityRun ref = flatshard_test::run_reference(s);
  const flatshard_test::ParityRun got = flatshard_test::run_sharded(s);
  const double d0 = std::abs(ref.losses[0] - got.losses[0]);
  double gmax = 0;
  for (auto& [name, g] : ref.grads) {
    CAPTURE(name);
    REQUIRE(got.grads.count(name));
    const double d = (got.grads.at(name) - g).abs().max().item<double>();
    gmax = std::max(gmax, d);
    // fp32 throughout; ranks reduce their gradients in another order than the reference's one
    // backward over both batches (tests/gpt_parity_test.cpp: ~1e-9 observed).
    CHECK(at::allclose(got.grads.at(name), g, 1e-4, 1e-6));
  }
  WARN(family << " world " << s.world << ": step-0 loss " << got.losses[0] << " vs unsharded "
              << ref.losses[0] << " (|diff| " << d0 << "), step-0 gradients max |diff| " << gmax);
  CHECK(d0 <= 1e-5);
  for (size_t i = 1; i < ref.losses.size(); ++i) {  // later steps: the same training
    CAPTURE(i);
    CHECK(std::abs(ref.losses[i] - got.losses[i]) <= 1e-4 * (1 + std::abs(ref.losses[i])));
  }
}

}  // namespace

TEST_CASE("GPT and LLaMA with fp8 matmuls and fp8 gathers equal the unsharded fp8 model",
          "[fp8_linear][parity]") {
  // Per rank, the sharded forward is the reference's forward on that rank's batch: the same
  // activation scales (each rank's batch is its own tensor on both sides), the same fp8 weight
  // bytes (the gather's scale is the fp32 weight's own, the previous test), so step-0 losses
  // agree to fp32 rounding. World 2: the reference's gradient of the averaged loss is each
  // rank's halved, which shifts e5m2 scales by exactly 2^-1 (the same codes). At world 3 it
  // would not be a power of two.
  // GPT at world 2 also with recompute units (the fp8 node re-run in backward) and per-leaf
  // units (each Linear its own unit: models::call_linear as the unit's entry).
  for (int world : {1, 2}) {
    for (const char* policy :
         {"type=Block", "recompute:type=Block", "type=Linear|LayerNorm|Embedding"}) {
      if (world == 1 && std::string(policy) != "type=Block") continue;
      flatshard_test::ParitySpec s = flatshard_test::gpt_parity_spec(world, policy);
      s.make_model = [] {
        auto c = flatshard_test::parity_gpt_config();
        c.fp8 = true;
        return std::static_pointer_cast<torch::nn::Module>(gpt::GPT(c, 11).ptr());
      };
      check_fp8_parity(std::string("GPT (") + policy + ")", fp8_spec(s));
    }
    {
      flatshard_test::ParitySpec s = flatshard_test::llama_spec(world, "type=DecoderLayer");
      s.make_model = [] {
        auto c = flatshard_test::parity_llama_config();
        c.fp8 = true;
        return std::static_pointer_cast<torch::nn::Module>(llama::Llama(c, 11).ptr());
      };
      check_fp8_parity("LLaMA", fp8_spec(s));
    }
  }
  // The recipe is on: without fp8 matmuls the unsharded model's step-0 loss differs.
  flatshard_test::ParitySpec plain = flatshard_test::gpt_parity_spec(1, "");
  plain.steps = 1;
  flatshard_test::ParitySpec fp8 = plain;
  fp8.make_model = [] {
    auto c = flatshard_test::parity_gpt_config();
    c.fp8 = true;
    return std::static_pointer_cast<torch::nn::Module>(gpt::GPT(c, 11).ptr());
  };
  CHECK(std::abs(flatshard_test::run_reference(plain).losses[0] -
                 flatshard_test::run_reference(fp8).losses[0]) > 1e-5);
}

// The bar: fp8 matmuls + fp8 gathers against bf16 gathers and bf16 matmuls, both with
// bf16 params, 2 ranks, per-layer units, AdamW lr 3e-3, 200 steps of the family's tiny preset.
// Compared per window of 20 steps (the mean loss of each window), so one noisy batch does not
// decide; the largest per-step difference is reported too.
static void fp8_within_2_percent_of_bf16(bool llama) {
  auto spec = [llama](bool fp8) {
    flatshard_test::ParitySpec s = llama ? flatshard_test::llama_spec(2, "type=DecoderLayer")
                                         : flatshard_test::gpt_parity_spec(2, "type=Block");
    s.steps = 200;
    s.lr = 3e-3;
    s.options.mixed_precision.param_dtype = at::kBFloat16;
    if (fp8) s.options.mixed_precision.gather_dtype = GatherDtype::kFp8;
    s.make_model = [fp8, llama] {
      if (llama) {
        auto c = llama::LlamaConfig::preset("tiny");
        c.fp8 = fp8;
        return std::static_pointer_cast<torch::nn::Module>(llama::Llama(c, 11).ptr());
      }
      auto c = gpt::GPTConfig::preset("tiny");
      c.fp8 = fp8;
      return std::static_pointer_cast<torch::nn::Module>(gpt::GPT(c, 11).ptr());
    };
    return s;
  };
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<double> bf16 = flatshard_test::run_sharded(spec(false)).losses;
  const std::vector<double> fp8 = flatshard_test::run_sharded(spec(true)).losses;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double worst_window = 0, worst_step = 0;
  std::string windows;  // "bf16/fp8" mean loss per window, for the report
  for (size_t w = 0; w < 200; w += 20) {
    double a = 0, b = 0;
    for (size_t i = w; i < w + 20; ++i) {
      a += bf16[i] / 20;
      b += fp8[i] / 20;
      worst_step = std::max(worst_step, std::abs(fp8[i] - bf16[i]) / bf16[i]);
    }
    CAPTURE(w, a, b);
    windows += " " + std::to_string(a).substr(0, 5) + "/" + std::to_string(b).substr(0, 5);
    worst_window = std::max(worst_window, std::abs(b - a) / a);
    CHECK(std::abs(b - a) <= 0.02 * a);
  }
  WARN((llama ? "tiny LLaMA" : "tiny GPT")
       << ", 200 steps, 2 ranks: bf16 loss " << bf16[0] << " -> " << bf16[199] << ", fp8 "
       << fp8[0] << " -> " << fp8[199] << "; worst window " << 100 * worst_window
       << "%, worst step " << 100 * worst_step << "%; both runs " << seconds
       << " s; windows (bf16/fp8):" << windows);
  CHECK(bf16[199] < 0.8 * bf16[0]);  // it trained
}

TEST_CASE("200 steps of the tiny GPT: fp8 matmuls and fp8 gathers stay within 2% of bf16",
          "[fp8_linear][training]") {
  fp8_within_2_percent_of_bf16(/*llama=*/false);
}

TEST_CASE("200 steps of the tiny LLaMA: fp8 matmuls and fp8 gathers stay within 2% of bf16",
          "[fp8_linear][training]") {
  fp8_within_2_percent_of_bf16(/*llama=*/true);
}
