// flat_param/quantized_gather.h: the fp8 and int8 wire formats bit for bit against a Python
// reference written from the formulas (torch's own float8 and int8 casts, run with the build's
// venv python: it fails, never skips, when python or torch is missing), including zeros,
// all-equal blocks, rounding ties, denormals and a short last block; then the plans on CPU
// thread ranks (worlds 1-4): full() equals the quantize-dequantize of each parameter (fp8: one
// scale from the whole parameter's amax, though each rank holds a part) or of each rank's
// blocks (int8), bytes() and the communicator's counters equal the closed form, and a
// non-finite master is the same clear error on every rank (never a NaN in full()).
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "flat_param/collective_plan.h"
#include "flat_param/flat_param.h"
#include "flat_param/quantized_gather.h"
#include "fsdp/resolve.h"
#include "parity_util.h"
#include "rank_require.h"
#include "temp_dir.h"
#include "tiny_net.h"
#include "wrap_policies/spec.h"

#ifndef FLATSHARD_PYTHON_EXE
#error "FLATSHARD_PYTHON_EXE (the venv's python) must be defined by CMake"
#endif

using namespace flatshard;
using flatshard_test::init_params;
using flatshard_test::read_bytes;
using flatshard_test::TempDir;
using flatshard_test::TinyNet;
using flatshard_test::TinyNetImpl;
using flatshard_test::write_bytes;

namespace {

// The reference: the formulas of flat_param/quantized_gather.h written out per segment / per
// block with torch's casts. Reads x (fp32 raw) and the fp8 segment bounds, writes raw outputs.
const char* kScript = R"PY(
import math, sys, torch
src, out = sys.argv[1], sys.argv[2]
bounds = [int(b) for b in sys.argv[3].split(",")]
x = torch.frombuffer(bytearray(open(src, "rb").read()), dtype=torch.float32)
TINY = torch.finfo(torch.float32).tiny

def scale(amax, qmax):
    s = amax / qmax
    s = torch.where(s < TINY, torch.full_like(s, TINY), s)
    return torch.where(amax == 0, torch.ones_like(s), s)

def save(name, t):
    open(out + "/" + name, "wb").write(t.contiguous().view(torch.uint8).numpy().tobytes())

q8, s8, d8, d8b = [], [], [], []
for b, e in zip(bounds[:-1], bounds[1:]):
    seg = x[b:e]
    s = scale(seg.abs().max().reshape(1), 448.0)
    q = torch.clamp(seg / s, -448.0, 448.0).to(torch.float8_e4m3fn)
    q8.append(q); s8.append(s)
    d8.append(q.to(torch.float32) * s); d8b.append((q.to(torch.float32) * s).to(torch.bfloat16))
save("fp8_q", torch.cat(q8)); save("fp8_s", torch.cat(s8))
save("fp8_d32", torch.cat(d8)); save("fp8_d16", torch.cat(d8b))

qi, si, di, dib = [], [], [], []
for blk in range(math.ceil(x.numel() / 256)):
    v = x[blk * 256:(blk + 1) * 256]
    s = scale(v.abs().max().reshape(1), 127.0)
    q = torch.clamp(torch.round(v / s), -127, 127).to(torch.int8)
    qi.append(q); si.append(s)
    di.append(q.to(torch.float32) * s); dib.append((q.to(torch.float32) * s).to(torch.bfloat16))
save("int8_q", torch.cat(qi)); save("int8_s", torch.cat(si))
save("int8_d32", torch.cat(di)); save("int8_d16", torch.cat(dib))
)PY";

void run_python(const TempDir& tmp, const std::string& args) {
  const std::string python = FLATSHARD_PYTHON_EXE;
  INFO("python: " << python);
  write_bytes(tmp / "ref.py", kScript);
  const std::string cmd =
      python + " -W ignore " + (tmp / "ref.py") + " " + args + " 2> " + (tmp / "err.txt");
  const int rc = std::system(cmd.c_str());
  INFO("stderr:\n" << read_bytes(tmp / "err.txt"));
  REQUIRE(rc == 0);
}

std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// 6 full blocks and a short one (1573 elements), each block a case of its own.
at::Tensor wire_input() {
  auto gen = at::detail::createCPUGenerator(53);
  at::Tensor x = at::empty({6 * 256 + 37});
  x.narrow(0, 0, 256).copy_(at::randn({256}, gen) * 3);  // ordinary values
  x.narrow(0, 256, 256).zero_();                         // amax 0: scale 1
  x.narrow(0, 512, 256).fill_(0.7);                      // all equal
  at::Tensor ties = at::arange(256, at::kFloat).remainder_(9).sub_(4).add_(0.5);
  ties[0] = 127;  // int8 scale 1: every other value is a rounding tie
  x.narrow(0, 768, 256).copy_(ties);
  at::Tensor den = at::arange(1, 257, at::kFloat).mul_(3e-42);  // subnormal fp32
  den.narrow(0, 0, 128).neg_();
  x.narrow(0, 1024, 256).copy_(den);
  at::Tensor mags = at::pow(10.0, at::rand({256}, gen).mul_(40).sub_(20));
  x.narrow(0, 1280, 256).copy_(at::randn({256}, gen) * mags);  // 40 decades
  x.narrow(0, 1536, 37).copy_(at::randn({37}, gen) * 1000);    // the short block
  return x;
}

}  // namespace

TEST_CASE("fp8 and int8 wire formats equal the Python reference bit for bit",
          "[flat_param][quantized_gather][python]") {
  TempDir tmp;
  const at::Tensor x = wire_input();
  REQUIRE(x.narrow(0, 1024, 256).abs().max().item<float>() < FLT_MIN);  // really subnormal
  write_bytes(tmp / "x.bin", bytes_of(x));
  const std::vector<int64_t> bounds = {0, 100, 256, 512, 768, 1024, 1280, 1573};
  std::string arg;
  for (int64_t b : bounds) arg += (arg.empty() ? "" : ",") + std::to_string(b);
  run_python(tmp, (tmp / "x.bin") + " " + tmp.path() + " " + arg);

  std::vector<at::Tensor> q8, s8, d8, d8b;
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    const at::Tensor seg = x.narrow(0, bounds[k], bounds[k + 1] - bounds[k]);
    const at::Tensor s = scales_from_amax(seg.abs().amax().view({1}), kFp8Max);
    const at::Tensor q = fp8_quantize(seg, s);
    REQUIRE(q.scalar_type() == at::kFloat8_e4m3fn);
    q8.push_back(q);
    s8.push_back(s);
    d8.push_back(fp8_dequantize(q, s, at::kFloat));
    d8b.push_back(fp8_dequantize(q, s, at::kBFloat16));
  }
  CHECK(bytes_of(at::cat(s8)) == read_bytes(tmp / "fp8_s"));
  CHECK(bytes_of(at::cat(q8)) == read_bytes(tmp / "fp8_q"));
  CHECK(bytes_of(at::cat(d8)) == read_bytes(tmp / "fp8_d32"));
  CHECK(bytes_of(at::cat(d8b)) == read_bytes(tmp / "fp8_d16"));

  const at::Tensor si = int8_block_scales(x);
  REQUIRE(si.numel() == 7);
  const at::Tensor qi = int8_quantize(x, si);
  REQUIRE(qi.scalar_type() == at::kChar);
  REQUIRE(qi.numel() == x.numel());
  CHECK(bytes_of(si) == read_bytes(tmp / "int8_s"));
  CHECK(bytes_of(qi) == read_bytes(tmp / "int8_q"));
  CHECK(bytes_of(int8_dequantize(qi, si, at::kFloat)) == read_bytes(tmp / "int8_d32"));
  CHECK(bytes_of(int8_dequantize(qi, si, at::kBFloat16)) == read_bytes(tmp / "int8_d16"));

  // The documented edge values, stated directly.
  CHECK(si[1].item<float>() == 1.0f);                     // zeros: scale 1
  CHECK(si[4].item<float>() == FLT_MIN);                  // subnormal amax: scale FLT_MIN
  CHECK(si[3].item<float>() == 1.0f);                     // amax 127
  CHECK(static_cast<int>(qi[769].item<int8_t>()) == -2);  // -2.5 rounds half to even
  CHECK(static_cast<int>(qi[770].item<int8_t>()) == -2);  // and so does -1.5
  CHECK(at::isfinite(at::cat(d8)).all().item<bool>());
}

namespace {

// Parameters large enough for several int8 blocks per shard, small ones, and an odd one.
const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {700}, {1}, {2, 3, 3}, {333}};

std::vector<at::Tensor> make_params() {
  auto gen = at::detail::createCPUGenerator(7);
  std::vector<at::Tensor> ps;
  for (size_t i = 0; i < kShapes.size(); ++i)
    ps.push_back((at::randn(kShapes[i], gen) * std::pow(10.0, static_cast<double>(i) - 2))
                     .requires_grad_(true));
  return ps;
}

std::vector<ParamRef> refs(const std::vector<at::Tensor>& ps) {
  std::vector<ParamRef> r;
  for (size_t i = 0; i < ps.size(); ++i) r.push_back({"p" + std::to_string(i), ps[i]});
  return r;
}

FlatParamConfig quantized_config(GatherDtype g, at::ScalarType param) {
  FlatParamConfig cfg;
  cfg.gather_dtype = g;
  cfg.param_dtype = param;
  cfg.align = 4;
  return cfg;
}

// What full() must hold, from the parameters (each rank's master is their padded flat slice).
at::Tensor expected_full(const std::vector<at::Tensor>& ps, const FlatLayout& l, GatherDtype g,
                         at::ScalarType dtype) {
  at::Tensor flat = at::zeros({l.padded_numel});
  for (size_t i = 0; i < ps.size(); ++i)
    flat.narrow(0, l.offsets[i], l.numels[i]).copy_(ps[i].detach().reshape({-1}));
  at::Tensor out = at::zeros({l.padded_numel}, dtype);
  if (g == GatherDtype::kFp8) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const at::Tensor p = flat.narrow(0, l.offsets[i], l.numels[i]);
      const at::Tensor s = scales_from_amax(p.abs().amax().view({1}), kFp8Max);
      out.narrow(0, l.offsets[i], l.numels[i]).copy_(fp8_dequantize(fp8_quantize(p, s), s, dtype));
    }
  } else {
    for (int r = 0; r < l.world_size; ++r) {
      const at::Tensor shard = flat.narrow(0, l.shard_begin(r), l.shard_numel);
      const at::Tensor s = int8_block_scales(shard);
      out.narrow(0, l.shard_begin(r), l.shard_numel)
          .copy_(int8_dequantize(int8_quantize(shard, s), s, dtype));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("quantized gathers fill full() with each parameter's quantize-dequantize",
          "[flat_param][quantized_gather]") {
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8})
    for (auto dtype : {at::kFloat, at::kBFloat16})
      for (int world = 1; world <= 4; ++world) {
        CAPTURE(gather_dtype_name(g), dtype, world);
        const FlatParamConfig cfg = quantized_config(g, dtype);
        const FlatLayout l = FlatLayout::make(kShapes, world, cfg.align);
        const at::Tensor expect = expected_full(make_params(), l, g, dtype);
        const int64_t nb = (l.shard_numel + kInt8BlockSize - 1) / kInt8BlockSize;
        const int64_t closed = g == GatherDtype::kFp8
                                   ? l.shard_numel + 4 * static_cast<int64_t>(kShapes.size())
                                   : 4 * nb + (l.shard_numel + 3) / 4 * 4;
        CHECK(all_gather_bytes(cfg, l) == closed);
        run_ranks(world, [&](Communicator& c) {
          auto ps = make_params();
          FlatParam fp("unit", refs(ps), c, cfg);
          RANK_REQUIRE(fp.gather_plan().name() ==
                       (g == GatherDtype::kFp8 ? "Fp8AllGather" : "Int8AllGather"));
          RANK_REQUIRE(fp.gather_plan().bytes() == closed);
          c.reset_counters();
          for (int twice = 0; twice < 2; ++twice) {
            fp.unshard(c.current_stream());
            RANK_REQUIRE(at::equal(fp.full(), expect));
            fp.reshard();
          }
          // The counters see the wire: two gathers, one all-gather each (and fp8's amax
          // all-reduce), bytes() each.
          RANK_REQUIRE(c.counters().all_gathers == 2);
          RANK_REQUIRE(c.counters().all_reduces == (g == GatherDtype::kFp8 ? 2 : 0));
          RANK_REQUIRE(c.counters().bytes == 2 * closed);
        });
      }
}

TEST_CASE("quantized gathers under HSDP stay inside the shard group",
          "[flat_param][quantized_gather][hsdp]") {
  // 2 replicas of 2-rank shard groups: the same full() as a 2-rank world, on every rank.
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8}) {
    CAPTURE(gather_dtype_name(g));
    const FlatParamConfig cfg = quantized_config(g, at::kBFloat16);
    const at::Tensor expect =
        expected_full(make_params(), FlatLayout::make(kShapes, 2, cfg.align), g, at::kBFloat16);
    run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
      auto ps = make_params();
      FlatParam fp("unit", refs(ps), Mesh(shard, &rep), cfg);
      fp.unshard(shard.current_stream());
      RANK_REQUIRE(at::equal(fp.full(), expect));
      RANK_REQUIRE(rep.counters().all_gathers + rep.counters().all_reduces == 0);
    });
  }
}

TEST_CASE("quantized gathers: the wire is smaller than bf16's by the expected ratio",
          "[flat_param][quantized_gather]") {
  // A unit of 64 parameters of 64 Ki elements over 4 ranks: bf16 sends 2 B per element; fp8
  // 1 B plus 4 B per parameter (the amax all-reduce); int8 1 B plus 4 B per 256 elements.
  const std::vector<std::vector<int64_t>> shapes(64, std::vector<int64_t>{65536});
  FlatParamConfig bf16;
  bf16.param_dtype = at::kBFloat16;
  const FlatLayout l = FlatLayout::make(shapes, 4, bf16.align);
  FlatParamConfig fp8 = bf16, int8 = bf16;
  fp8.gather_dtype = GatherDtype::kFp8;
  int8.gather_dtype = GatherDtype::kInt8;
  REQUIRE(l.shard_numel == 64 * 65536 / 4);
  CHECK(all_gather_bytes(bf16, l) == 2 * l.shard_numel);
  CHECK(all_gather_bytes(fp8, l) == l.shard_numel + 4 * 64);
  CHECK(all_gather_bytes(int8, l) == l.shard_numel + 4 * (l.shard_numel / 256));
}

TEST_CASE("a non-finite master is the same clear error on every rank, never a NaN in full()",
          "[flat_param][quantized_gather]") {
  const float inf = std::numeric_limits<float>::infinity();
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8})
    for (float bad : {inf, -inf, std::nanf("")}) {
      CAPTURE(gather_dtype_name(g), bad);
      const FlatParamConfig cfg = quantized_config(g, at::kBFloat16);
      const FlatLayout l = FlatLayout::make(kShapes, 3, cfg.align);
      // Element 500 of p1 (700 elements at offset 16): flat element 516, on rank 1 of 3.
      const int64_t at_flat = l.offsets[1] + 500;
      const int owner = static_cast<int>(at_flat / l.shard_numel);
      REQUIRE(owner == 1);
      std::vector<std::string> errors(3);
      std::mutex mu;
      run_ranks(3, [&](Communicator& c) {
        auto ps = make_params();
        FlatParam fp("blocks.1", refs(ps), c, cfg);
        if (c.rank() == owner) {
          at::NoGradGuard no_grad;
          fp.master()[at_flat - l.shard_begin(owner)] = bad;
        }
        try {
          fp.unshard(c.current_stream());
        } catch (const c10::Error& e) {
          std::lock_guard<std::mutex> lock(mu);
          errors[c.rank()] = e.what_without_backtrace();
        }
      });
      for (int r = 0; r < 3; ++r) {
        CAPTURE(r, errors[r]);
        CHECK_THAT(errors[r], Catch::Contains("unit 'blocks.1'") && Catch::Contains("inf or nan") &&
                                  Catch::Contains("'p1'"));
        if (g == GatherDtype::kInt8)
          CHECK_THAT(errors[r],
                     Catch::Contains("rank 1 holds inf or nan in int8 block " +
                                     std::to_string((at_flat - l.shard_begin(owner)) / 256)));
      }
    }
}

TEST_CASE("quantized gather dtypes: config rules and names", "[flat_param][quantized_gather]") {
  FlatParamConfig cfg;
  cfg.gather_dtype = GatherDtype::kFp8;
  cfg.sharded = false;
  CHECK_THROWS_WITH(cfg.validate("u"), Catch::Contains("unit 'u': gather dtype fp8 needs a "
                                                       "sharded unit"));
  cfg.sharded = true;
  cfg.offload = 1;
  CHECK_THROWS_WITH(cfg.validate("u"), Catch::Contains("cannot be combined with offload"));
  for (GatherDtype g : {GatherDtype::kParam, GatherDtype::kFp8, GatherDtype::kInt8})
    CHECK(gather_dtype_from_name(gather_dtype_name(g)) == g);
  CHECK_FALSE(gather_dtype_from_name("FP8").has_value());
  CHECK_FALSE(gather_dtype_from_name("").has_value());
}

// --- sharded training parity -------------------------------------------------------------------

namespace {

constexpr int64_t kIn = 16, kD = 40, kLayers = 3, kBatch = 4;

std::vector<std::vector<std::string>> layer_units() {
  std::vector<std::vector<std::string>> u;
  for (int i = 0; i < kLayers; ++i) u.push_back({"blocks." + std::to_string(i)});
  return u;
}

// The reference's quantize-dequantize of every parameter, with the scales the sharded run
// uses: fp8 per parameter from its amax; int8 per 256-element block of each rank's shard of
// its unit's flat buffer (the layout FlatLayout::make gives the unit's parameters). A unit's
// own gather option wins over `global` (all units here are sharded).
void quantize_for_use(torch::nn::Module& model, const Plan& plan, GatherDtype global, int world,
                      int64_t align) {
  std::map<std::string, at::Tensor> byname;
  for (auto& p : model.named_parameters()) byname[p.key()] = p.value();
  for (const UnitSpec& u : plan.units) {
    const GatherDtype g = u.options.gather_dtype.value_or(global);
    if (g == GatherDtype::kParam) continue;
    std::vector<at::Tensor> ps;
    std::vector<std::vector<int64_t>> shapes;
    for (const std::string& n : u.param_names) {
      ps.push_back(byname.at(n).detach());
      shapes.push_back(ps.back().sizes().vec());
    }
    if (g == GatherDtype::kFp8) {
      for (auto& p : ps) {
        const at::Tensor flat = p.reshape({-1});
        const at::Tensor s = scales_from_amax(flat.abs().amax().view({1}), kFp8Max);
        p.copy_(fp8_dequantize(fp8_quantize(flat, s), s, at::kFloat).view(p.sizes()));
      }
      continue;
    }
    const FlatLayout l = FlatLayout::make(shapes, world, align);
    at::Tensor flat = at::zeros({l.padded_numel});
    for (size_t i = 0; i < ps.size(); ++i)
      flat.narrow(0, l.offsets[i], l.numels[i]).copy_(ps[i].reshape({-1}));
    for (int r = 0; r < world; ++r) {
      at::Tensor shard = flat.narrow(0, l.shard_begin(r), l.shard_numel);
      const at::Tensor s = int8_block_scales(shard);
      shard.copy_(int8_dequantize(int8_quantize(shard, s), s, at::kFloat));
    }
    for (size_t i = 0; i < ps.size(); ++i)
      ps[i].copy_(flat.narrow(0, l.offsets[i], l.numels[i]).view(ps[i].sizes()));
  }
}

flatshard_test::ParitySpec quantized_spec(int world, GatherDtype g) {
  flatshard_test::ParitySpec s;
  s.world = world;
  s.options.mixed_precision.gather_dtype = g;
  s.make_model = [] {
    auto m = TinyNet(kIn, kD, kLayers);
    init_params(*m, 4321);
    return std::static_pointer_cast<torch::nn::Module>(m.ptr());
  };
  s.plan = [](torch::nn::Module& m) { return flatshard_test::manual_plan(m, layer_units()); };
  s.loss = [](const std::shared_ptr<torch::nn::Module>& m, int rank, int step, int micro) {
    auto gen = at::detail::createCPUGenerator(1000 * step + 100 * micro + rank);
    auto x = at::randn({kBatch, kIn}, gen);
    auto y = at::randn({kBatch, 3}, gen);
    auto net = std::static_pointer_cast<TinyNetImpl>(m);
    return at::mse_loss(flatshard::call(net, x), y);
  };
  const int64_t align = s.options.align;
  auto plan_of = s.plan;
  s.before_use = [=](torch::nn::Module& m) { quantize_for_use(m, plan_of(m), g, world, align); };
  return s;
}

}  // namespace

TEST_CASE("sharded training with fp8 and int8 gathers equals the quantize-dequantize reference",
          "[quantized_gather][parity]") {
  // Step 0: the same quantized weights on both sides, only the gradient summation order
  // differs: loss and gradients within 1e-5. After 5 AdamW steps: tests/fsdp_test.cpp's fp32
  // tolerances (rtol 1e-4, atol 5e-5).
  flatshard_test::ParityTolerance tol;
  tol.grad_rtol = 1e-5;
  tol.grad_atol = 1e-5;
  tol.param_atol = 5e-5;
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8})
    for (int world = 1; world <= 4; ++world) {
      CAPTURE(gather_dtype_name(g), world);
      const flatshard_test::ParitySpec s = quantized_spec(world, g);
      const flatshard_test::ParityRun ref = flatshard_test::run_reference(s);
      const flatshard_test::ParityRun got = flatshard_test::run_sharded(s);
      flatshard_test::require_parity(ref, got, tol);
      // The quantization is real: without it the reference's step-0 loss differs.
      flatshard_test::ParitySpec plain = s;
      plain.before_use = nullptr;
      plain.steps = 1;
      CHECK(std::abs(flatshard_test::run_reference(plain).losses[0] - ref.losses[0]) > 1e-5);
    }
}

TEST_CASE("ranks that disagree on the gather dtype fail at setup, naming the option",
          "[quantized_gather][fingerprint]") {
  // Without the fingerprint entry the ranks would all-gather different byte counts.
  std::vector<std::string> errors(2);
  std::mutex mu;
  run_ranks(2, [&](Communicator& comm) {
    auto net = TinyNet(5, 7, 2);
    ShardingOptions o;
    if (comm.rank() == 1) o.mixed_precision.gather_dtype = GatherDtype::kInt8;
    std::string e;
    try {
      fully_shard(net.ptr(), flatshard_test::manual_plan(*net, {{"blocks.0"}, {"blocks.1"}}), comm,
                  o);
    } catch (const c10::Error& err) {
      e = err.msg();
    }
    std::lock_guard<std::mutex> lock(mu);
    errors[comm.rank()] = e;
  });
  for (const std::string& e : errors) {
    CAPTURE(e);
    CHECK(e.find("option mixed_precision.gather_dtype") != std::string::npos);
    CHECK(e.find("int8") != std::string::npos);
  }
}

TEST_CASE("per-unit gather dtypes: a plan's option wins, NO_SHARD refuses one, parity holds",
          "[quantized_gather][parity][resolve]") {
  ShardingOptions o;
  o.mixed_precision.gather_dtype = GatherDtype::kFp8;
  UnitSpec u;
  u.name = "blocks.0";
  CHECK(resolve_unit(u, o, 2).flat.gather_dtype == GatherDtype::kFp8);
  u.options.gather_dtype = GatherDtype::kInt8;
  CHECK(resolve_unit(u, o, 2).flat.gather_dtype == GatherDtype::kInt8);
  u.options.gather_dtype = GatherDtype::kParam;
  CHECK(resolve_unit(u, o, 2).flat.gather_dtype == GatherDtype::kParam);
  u.options.gather_dtype.reset();
  u.options.strategy = ShardingStrategy::kNoShard;  // MixedPrecision's: NO_SHARD gathers nothing
  CHECK(resolve_unit(u, o, 2).flat.gather_dtype == GatherDtype::kParam);
  u.options.gather_dtype = GatherDtype::kFp8;  // asked of this unit: an error naming it
  CHECK_THROWS_WITH(resolve_unit(u, o, 2),
                    Catch::Contains("unit 'blocks.0': gather dtype fp8 needs a sharded unit"));

  // blocks.0 fp8, blocks.1 int8 (from a spec's words), blocks.2 and the root the param dtype.
  for (int world : {2, 3}) {
    CAPTURE(world);
    flatshard_test::ParitySpec s = quantized_spec(world, GatherDtype::kParam);
    s.plan = [](torch::nn::Module& m) {
      UnitOptions fp8, int8;
      fp8.gather_dtype = GatherDtype::kFp8;
      int8.gather_dtype = parse_policy("gather_int8:path=x").rules[0].options.gather_dtype;
      return flatshard_test::manual_plan(m, layer_units(), {fp8, int8});
    };
    auto plan_of = s.plan;
    const int64_t align = s.options.align;
    s.before_use = [=](torch::nn::Module& m) {
      quantize_for_use(m, plan_of(m), GatherDtype::kParam, world, align);
    };
    flatshard_test::ParityTolerance tol;
    tol.grad_rtol = 1e-5;
    tol.grad_atol = 1e-5;
    tol.param_atol = 5e-5;
    flatshard_test::require_parity(flatshard_test::run_reference(s), flatshard_test::run_sharded(s),
                                   tol);
  }
}

TEST_CASE("fp8_delayed: each gather uses the previous gather's amax; one all-reduce, the first",
          "[flat_param][quantized_gather][delayed]") {
  // The masters move between gathers by factors (x_k = x_0 * f[k]); gather k quantizes x_k
  // with the scales of x_{k-1}'s amax (gather 0: its own, from the all-reduce), so a growing
  // master saturates at +-448 * s (f 1 -> 1.5) and a shrinking one keeps the larger scale.
  const std::vector<float> f = {1.0f, 1.5f, 0.5f, 0.5f};
  const int64_t P = static_cast<int64_t>(kShapes.size());
  for (auto dtype : {at::kFloat, at::kBFloat16})
    for (int world = 1; world <= 3; ++world) {
      CAPTURE(dtype, world);
      const FlatParamConfig cfg = quantized_config(GatherDtype::kFp8Delayed, dtype);
      const FlatLayout l = FlatLayout::make(kShapes, world, cfg.align);
      // The closed form: per rank [P amaxes, 4 B each | fp8 shard | pad to 4 B]; no all-reduce.
      const int64_t wire = 4 * P + (l.shard_numel + 3) / 4 * 4;
      CHECK(all_gather_bytes(cfg, l) == wire);
      CHECK(gather_all_reduces(cfg) == 0);
      // The reference, per gather and parameter, from the whole parameters.
      const std::vector<at::Tensor> p0 = make_params();
      std::vector<at::Tensor> expect;
      for (size_t k = 0; k < f.size(); ++k) {
        at::Tensor out = at::zeros({l.padded_numel}, dtype);
        for (size_t i = 0; i < p0.size(); ++i) {
          const at::Tensor x = p0[i].detach().reshape({-1}) * f[k];
          const at::Tensor prev = p0[i].detach().reshape({-1}) * f[k == 0 ? 0 : k - 1];
          const at::Tensor s = scales_from_amax(prev.abs().amax().view({1}), kFp8Max);
          out.narrow(0, l.offsets[i], l.numels[i])
              .copy_(fp8_dequantize(fp8_quantize(x, s), s, dtype));
        }
        expect.push_back(out);
      }
      // Saturation happened (gather 1), and the shrunk master kept gather 1's scale (gather 2).
      CHECK_FALSE(at::equal(expect[1], expected_full(
                                           [&] {
                                             auto ps = make_params();
                                             at::NoGradGuard g;
                                             for (auto& p : ps) p.mul_(f[1]);
                                             return ps;
                                           }(),
                                           l, GatherDtype::kFp8, dtype)));
      run_ranks(world, [&](Communicator& c) {
        auto ps = make_params();
        FlatParam fp("unit", refs(ps), c, cfg);
        RANK_REQUIRE(fp.gather_plan().name() == "Fp8AllGather");
        RANK_REQUIRE(fp.gather_plan().bytes() == wire);
        const at::Tensor m0 = fp.master().detach().clone();
        c.reset_counters();
        for (size_t k = 0; k < f.size(); ++k) {
          {
            at::NoGradGuard no_grad;
            fp.master().copy_(m0 * f[k]);
          }
          fp.unshard(c.current_stream());
          RANK_REQUIRE(at::equal(fp.full(), expect[k]));
          fp.reshard();
        }
        // The counters: one all-gather per gather, the amax all-reduce at the first only.
        RANK_REQUIRE(c.counters().all_gathers == static_cast<int64_t>(f.size()));
        RANK_REQUIRE(c.counters().all_reduces == 1);
        RANK_REQUIRE(c.counters().bytes == 4 * P + static_cast<int64_t>(f.size()) * wire);
      });
    }
}

TEST_CASE("fp8_delayed: names, spec word, and a non-finite master still fails every rank",
          "[flat_param][quantized_gather][delayed]") {
  CHECK(std::string(gather_dtype_name(GatherDtype::kFp8Delayed)) == "fp8_delayed");
  CHECK(gather_dtype_from_name("fp8_delayed") == GatherDtype::kFp8Delayed);
  const Policy pol = parse_policy("gather_fp8_delayed:type=Linear");
  REQUIRE(pol.rules.size() == 1);
  CHECK(pol.rules[0].options.gather_dtype == GatherDtype::kFp8Delayed);
  // A master going non-finite after the first gather: the second gather (scales from the
  // first's amax) sees it in the gathered amaxes; every rank throws the same error.
  const FlatParamConfig cfg = quantized_config(GatherDtype::kFp8Delayed, at::kBFloat16);
  const FlatLayout l = FlatLayout::make(kShapes, 3, cfg.align);
  const int64_t at_flat = l.offsets[1] + 500;  // p1, on rank 1 of 3
  std::vector<std::string> errors(3);
  std::mutex mu;
  run_ranks(3, [&](Communicator& c) {
    auto ps = make_params();
    FlatParam fp("blocks.1", refs(ps), c, cfg);
    fp.unshard(c.current_stream());
    fp.reshard();
    if (c.rank() == 1) {
      at::NoGradGuard no_grad;
      fp.master()[at_flat - l.shard_begin(1)] = std::numeric_limits<float>::infinity();
    }
    try {
      fp.unshard(c.current_stream());
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[c.rank()] = e.what_without_backtrace();
    }
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r, errors[r]);
    CHECK_THAT(errors[r], Catch::Contains("unit 'blocks.1'") && Catch::Contains("inf or nan") &&
                              Catch::Contains("parameter 'p1'"));
  }
}
