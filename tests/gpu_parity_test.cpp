// GPU parity: the parity tests of fsdp_test.cpp on real GPUs with NCCL, one process per GPU
// (launched by torchrun; see tests/CMakeLists.txt), on the reference GPT; plus a stress variant
// that queues device sleeps before every all-gather, every reduction and the optimizer step, so
// a missing stream wait turns into wrong numbers.
//
// Tolerances: fp32 runs compare like the CPU tests (only summation order differs; cuBLAS fp32
// without TF32). bf16 runs (bf16 parameters and compute, fp32 master and fp32 reduction)
// compare against the fp32 reference: losses within 2% and each parameter's step-0 gradient
// within 5% relative L2 error (bf16 keeps 8 bits of mantissa: ~0.4% per rounding, a few dozen
// roundings deep in a 2-layer model).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/cuda/CUDAFunctions.h>

#include "collectives/nccl_communicator.h"
#include "flat_param/offload.h"
#include "flat_param/upcast.h"
#include "optim/fused_adamw.h"
#include "fsdp/sharded_model.h"
#include "gpu_gpt_parity.h"
#include "nccl_test_main.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;

namespace {

NcclCommunicator* g_comm = nullptr;

using Run = flatshard_test::GpuRun;
using flatshard_test::require_fp32_parity;

Run reference(int world) { return flatshard_test::gpu_parity_reference(world, g_comm->device()); }

Run sharded(const std::string& spec, const ShardingOptions& opts, int64_t sleep_before_step,
            bool fused = false) {
  const c10::Device dev = g_comm->device();
  auto model = flatshard_test::gpu_parity_model(dev);
  auto plan = make_plan(*model, spec.empty() ? Policy{} : parse_policy(spec));
  auto fsdp = fully_shard(model.ptr(), plan, *g_comm, opts);
  return flatshard_test::train_sharded(
      model, *fsdp, g_comm->rank(), dev,
      [](at::Tensor& t) { g_comm->all_reduce(t, ReduceOp::kAvg, g_comm->current_stream()); },
      sleep_before_step, fused);
}

const std::vector<std::pair<const char*, const char*>> kPlans = {
    {"per-leaf", "type=Linear|LayerNorm|Embedding"},
    {"per-layer", "type=Block"},
    {"every-2", "every=2,type=Block"},
    {"whole-model", ""},
};

// The offload cases: per block and per leaf, with race-exposing sleeps or without.
constexpr int64_t kSleepCycles = 20'000'000;
const char* const kOffloadPlans[] = {"type=Block", "type=Linear|LayerNorm|Embedding"};

ShardingOptions offload_options(int level, bool sleeps) {
  ShardingOptions opts;
  opts.offload = level;
  if (sleeps) {
    opts.debug_sleep_before_all_gather_cycles = kSleepCycles;
    opts.debug_sleep_before_reduce_cycles = kSleepCycles;
  }
  return opts;
}

}  // namespace

TEST_CASE("GPU fp32 parity: plans x strategies", "[gpu][parity]") {
  const Run ref = reference(g_comm->world_size());
  for (auto& [name, spec] : kPlans)
    for (const char* mode : {"full", "grad_op", "mixed"}) {
      CAPTURE(name, mode);
      std::string s = spec;
      ShardingOptions opts;
      if (std::string(mode) == "grad_op") opts.strategy = ShardingStrategy::kShardGradOp;
      if (std::string(mode) == "mixed")
        s = "noshard:path=blocks.1|lm_head|wte" + (s.empty() ? "" : ";" + s);
      auto got = sharded(s, opts, 0);
      require_fp32_parity(ref, got);
    }
}

TEST_CASE("GPU per-layer FULL_SHARD collective counts", "[gpu][counters]") {
  auto got = sharded("type=Block", ShardingOptions{}, 0);
  const int L = flatshard_test::gpu_parity_config().n_layers;
  CHECK(got.counters.total.forward_all_gathers == L + 1);
  CHECK(got.counters.total.backward_all_gathers == L);
  CHECK(got.counters.total.reduce_scatters == L + 1);
  CHECK(got.counters.total.all_reduces == 0);
}

TEST_CASE("GPU parity under injected device sleeps", "[gpu][stress]") {
  const Run ref = reference(g_comm->world_size());
  ShardingOptions opts;
  opts.debug_sleep_before_all_gather_cycles = 20'000'000;  // ~10 ms at ~2 GHz
  opts.debug_sleep_before_reduce_cycles = 20'000'000;
  opts.forward_prefetch = 2;
  opts.backward_prefetch = 2;
  for (auto& [name, spec] : kPlans) {
    CAPTURE(name);
    require_fp32_parity(ref, sharded(spec, opts, 20'000'000));
  }
}

TEST_CASE("GPU bf16 mixed precision against the fp32 reference", "[gpu][parity][bf16]") {
  const Run ref = reference(g_comm->world_size());
  for (const char* spec : {"type=Block", "type=Linear|LayerNorm|Embedding"}) {
    CAPTURE(spec);
    ShardingOptions opts;
    opts.mixed_precision.param_dtype = at::kBFloat16;
    opts.mixed_precision.reduce_dtype = at::kFloat;
    auto got = sharded(spec, opts, 0);
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      CAPTURE(i, ref.losses[i], got.losses[i]);
      REQUIRE(std::abs(ref.losses[i] - got.losses[i]) <= 2e-2 * std::abs(ref.losses[i]));
    }
    for (auto& kv : ref.grads0) {
      const double denom = kv.second.norm().item<double>();
      if (denom == 0) continue;
      const double rel = (got.grads0.at(kv.first) - kv.second).norm().item<double>() / denom;
      CAPTURE(kv.first, rel);
      REQUIRE(rel < 5e-2);
    }
  }
}

// Note [One-pass AdamW kernel] (optim/adamw_kernel.h): FusedAdamW (the kernel: with compute
// copies, with bf16 / fp16 gradients, and for fp32 tensors of 1 Mi elements or more) against
// ATen's _fused_adamw_ on the upcast gradients followed by the cast, on the device: parameters,
// both moments and the copy bit for bit, over steps, with and without decay, fp32 / bf16 / fp16
// gradients, bf16 / fp16 copies or none (Note [Low-precision master gradient]), fp32 or bf16
// moments (Note [Low-precision moments]), sizes that leave vector tails and a view at an odd
// offset (the scalar path).
TEST_CASE("GPU one-pass AdamW kernel: ATen's fused AdamW and the cast, bit for bit",
          "[gpu][optim]") {
  const c10::Device dev = g_comm->device();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  for (at::ScalarType grad_dtype : {at::kFloat, at::kBFloat16, at::kHalf})
    for (std::optional<at::ScalarType> copy_dtype :
         {std::optional<at::ScalarType>(at::kBFloat16), std::optional<at::ScalarType>(at::kHalf),
          std::optional<at::ScalarType>()})
      for (double wd : {0.0, 0.1})
      for (bool bf16_moments : {false, true}) {
        CAPTURE(grad_dtype, copy_dtype.has_value(), wd, bf16_moments);
        at::manual_seed(3);
        std::vector<at::Tensor> a, b, copies;
        for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{1001}, int64_t{4099}, int64_t{5} << 20}) {
          a.push_back(at::randn({n}, f32));
          b.push_back(a.back().clone());
        }
        // A view at element 1 of a larger buffer: misaligned for 16-byte vectors.
        const at::Tensor base = at::randn({2049}, f32);
        a.push_back(base.narrow(0, 1, 2048));
        b.push_back(base.narrow(0, 1, 2048).clone());
        for (auto& t : a) t.requires_grad_(true);
        for (auto& t : b) t.requires_grad_(true);
        const auto o = torch::optim::AdamWOptions(1e-3).weight_decay(wd).betas({0.9, 0.95}).eps(1e-8);
        FusedAdamW with(a, o);
        // Note [Low-precision moments]: the reference rounds its fp32 moments to bf16 after
        // each step (exactly what bf16 storage read back as fp32 holds).
        if (bf16_moments) with.set_moments_dtype(at::kBFloat16);
        std::vector<at::Tensor> mb, vb;  // the reference's moments
        for (auto& t : b) {
          mb.push_back(at::zeros_like(t));
          vb.push_back(at::zeros_like(t));
        }
        if (copy_dtype) {
          FusedAdamW::ComputeCopies set;
          for (auto& t : a) {
            copies.push_back(at::empty({t.numel()}, f32.dtype(*copy_dtype)));
            set.tensors.emplace_back(t, copies.back());
          }
          set.current = [] { return true; };
          set.written = [] {};
          with.set_compute_copies({set});
        }
        for (int step = 0; step < 5; ++step) {
          for (size_t i = 0; i < a.size(); ++i) {
            const at::Tensor g = at::randn({a[i].numel()}, f32).mul_(1 + step).to(grad_dtype);
            a[i].mutable_grad() = g;
            b[i].mutable_grad() = g.to(at::kFloat);  // exact: what the kernel computes with
          }
          with.step();
          at::NoGradGuard no_grad;
          std::vector<at::Tensor> pd, gd, steps;
          for (auto& t : b) {
            pd.push_back(t.detach());
            gd.push_back(t.grad());
            steps.push_back(at::full({}, static_cast<double>(step + 1), f32));
          }
          at::_fused_adamw_(pd, gd, mb, vb, /*max_exp_avg_sqs=*/{}, steps, o.lr(),
                            std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(),
                            o.eps(), /*amsgrad=*/false, /*maximize=*/false);
          if (bf16_moments)
            for (size_t i = 0; i < b.size(); ++i) {
              mb[i].copy_(mb[i].to(at::kBFloat16));
              vb[i].copy_(vb[i].to(at::kBFloat16));
            }
        }
        for (size_t i = 0; i < a.size(); ++i) {
          CAPTURE(i, a[i].numel());
          auto& sa = static_cast<torch::optim::AdamWParamState&>(*with.state().at(a[i].unsafeGetTensorImpl()));
          const at::Tensor pa = a[i].detach(), pb = b[i].detach();
          CAPTURE((pa - pb).abs().max().item<double>(), (pa != pb).sum().item<int64_t>());
          CHECK(at::equal(pa, pb));
          CHECK(sa.exp_avg().scalar_type() == (bf16_moments ? at::kBFloat16 : at::kFloat));
          CHECK(at::equal(sa.exp_avg().to(at::kFloat), mb[i]));
          CHECK(at::equal(sa.exp_avg_sq().to(at::kFloat), vb[i]));
          if (copy_dtype) CHECK(at::equal(copies[i], pb.to(*copy_dtype)));
        }
      }
}

// Note [Range copies] (flat_param/range_copy_kernel.h): every dtype pair, whole and partial
// sources, misaligned pointers (the scalar path), tails, zero-fills and more ranges than one
// launch takes, against ATen's copy_ / zero_ on views, compared as bits (NaN payloads,
// infinities, values fp16 cannot hold and subnormals included).
TEST_CASE("GPU range copies: ATen's copy_ and zero_ on views, bit for bit", "[gpu][kernels]") {
  const c10::Device dev = g_comm->device();
  auto bits = [](const at::Tensor& t) {
    return t.view(t.element_size() == 4 ? at::kInt : at::kShort);
  };
  for (at::ScalarType src_dtype : {at::kFloat, at::kBFloat16, at::kHalf})
    for (at::ScalarType dst_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      CAPTURE(src_dtype, dst_dtype);
      at::manual_seed(5);
      auto source = [&](int64_t n) {
        at::Tensor f = at::randn({n}, at::TensorOptions().dtype(at::kFloat).device(dev)).mul_(300);
        if (n >= 8) {  // specials at the front
          const float specials[] = {NAN, -INFINITY, INFINITY, 70000.f, 1e-30f, -0.f, 1e-40f, 3.f};
          f.narrow(0, 0, 8).copy_(at::tensor(at::ArrayRef<float>(specials, 8)));
        }
        return f.to(src_dtype);
      };
      const int64_t total = (int64_t{5} << 20);
      const at::Tensor init = source(total).to(dst_dtype);
      at::Tensor got = init.clone(), want = init.clone();
      RangeCopies copies(got);
      std::vector<at::Tensor> keep;
      int64_t at_off = 0;
      // The next destination offset: 16-byte aligned for every dtype, or one element past.
      auto next = [&](int64_t misalign) {
        at_off = (at_off + 7) / 8 * 8 + misalign;
        return at_off;
      };
      // Whole sources: sizes with tails and a big one, at aligned and misaligned destinations.
      for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{1001}, int64_t{4099}, int64_t{1} << 20})
        for (int64_t misalign : {0, 1}) {
          keep.push_back(source(n));
          copies.copy(next(misalign), keep.back());
          want.narrow(0, at_off, n).copy_(keep.back());
          at_off += n;
        }
      // A misaligned source: a view at element 1 of a buffer.
      const at::Tensor base = source(2049);
      keep.push_back(base.narrow(0, 1, 2048));
      copies.copy(next(0), keep.back());
      want.narrow(0, at_off, 2048).copy_(keep.back());
      at_off += 2048;
      // A partial range of a 1-D source, and zero-fills.
      copies.copy(at_off, base, 5, 1000);
      want.narrow(0, at_off, 1000).copy_(base.narrow(0, 5, 1000));
      at_off += 1000;
      copies.zero(at_off, 333);
      want.narrow(0, at_off, 333).zero_();
      at_off += 400;
      // More ranges than one launch takes (kMaxRangesPerLaunch is 48).
      for (int k = 0; k < 60; ++k) {
        keep.push_back(source(17 + k));
        copies.copy(at_off, keep.back());
        want.narrow(0, at_off, 17 + k).copy_(keep.back());
        at_off += 17 + k;
        if (k % 7 == 0) {
          copies.zero(at_off, 9);
          want.narrow(0, at_off, 9).zero_();
          at_off += 9;
        }
      }
      REQUIRE(at_off <= total);
      REQUIRE(RangeCopies::uses_kernel(got));
      copies.run();
      CAPTURE((got.to(at::kFloat) != want.to(at::kFloat)).sum().item<int64_t>());
      CHECK(at::equal(bits(got), bits(want)));
    }
}

// Note [Compute copy in the step] end to end: NO_SHARD bf16 blocks trained with the step
// writing their copies equal the same training with the gather recasting, bit for bit (the
// kernel is checked above), with device sleeps before the step.
TEST_CASE("GPU compute copy in the step: the same training as the gather's recast",
          "[gpu][parity][bf16]") {
  ShardingOptions opts;
  opts.mixed_precision.param_dtype = at::kBFloat16;
  opts.mixed_precision.reduce_dtype = at::kFloat;
  auto run = [&](const char* knob) {
    setenv("FLATSHARD_STEP_COMPUTE_COPY", knob, 1);  // read at attach_optimizer
    Run r = sharded("noshard:type=Block", opts, kSleepCycles, /*fused=*/true);
    unsetenv("FLATSHARD_STEP_COMPUTE_COPY");
    return r;
  };
  const Run recast = run("0"), stepped = run("1");
  REQUIRE(recast.losses == stepped.losses);
  for (auto& kv : recast.params) {
    CAPTURE(kv.first);
    CHECK(at::equal(stepped.params.at(kv.first), kv.second));
  }
}

// Note [Low-precision master gradient] end to end: per-layer and NO_SHARD bf16 training with
// bf16 master gradients (the one-pass kernel reads them) equals the fp32-gradient training (ATen's
// fused AdamW, or the kernel with a copy), bit for bit, with device sleeps before the step.
TEST_CASE("GPU low-precision master gradients: the same training as the fp32 gradients",
          "[gpu][parity][bf16]") {
  for (const char* spec : {"type=Block", "noshard:type=Block"}) {
    CAPTURE(spec);
    ShardingOptions opts;
    opts.mixed_precision.param_dtype = at::kBFloat16;
    const Run fp32 = sharded(spec, opts, kSleepCycles, /*fused=*/true);
    opts.mixed_precision.keep_low_precision_grads = true;
    const Run kept = sharded(spec, opts, kSleepCycles, /*fused=*/true);
    REQUIRE(fp32.losses == kept.losses);
    for (auto& kv : fp32.grads0) {  // step 0's gradients (to_cpu_map upcasts the bf16 ones)
      CAPTURE(kv.first);
      CHECK(at::equal(kept.grads0.at(kv.first), kv.second));
    }
    for (auto& kv : fp32.params) {
      CAPTURE(kv.first);
      CHECK(at::equal(kept.params.at(kv.first), kv.second));
    }
  }
}

TEST_CASE("GPU CPU offload levels 1 and 2: pinned host masters, parity, under device sleeps",
          "[gpu][parity][offload]") {
  // Note [CPU offload]: the H2D uploads ride the all-gather stream and the D2H gradient copies
  // the reduce stream; sleeps before both (and before the optimizer step) make a missing wait
  // or a missing end-of-backward sync show as wrong numbers.
  const Run ref = reference(g_comm->world_size());
  for (int level : {1, 2})
    for (const char* spec : kOffloadPlans)
      for (bool sleeps : {false, true}) {
        CAPTURE(level, spec, sleeps);
        ShardingOptions opts = offload_options(level, sleeps);
        {
          auto model = flatshard_test::gpu_parity_model(g_comm->device());
          auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), *g_comm, opts);
          for (const at::Tensor& p : fsdp->parameters()) {
            REQUIRE(p.is_cpu());
            REQUIRE(p.is_pinned());
          }
        }
        require_fp32_parity(ref, sharded(spec, opts, sleeps ? kSleepCycles : 0));
      }
}

TEST_CASE("GPU chunked upload: pinned fp32 to a device bf16 shard equals the cast",
          "[gpu][offload]") {
  const at::Tensor src = host_empty(1000, at::kFloat, g_comm->device());
  src.copy_(at::randn({1000}));
  const at::Tensor dst =
      at::empty({1000}, at::TensorOptions().dtype(at::kBFloat16).device(g_comm->device()));
  upload_to_device_chunked(dst, src, /*chunk_numel=*/64);  // 16 chunks, the last one short
  REQUIRE(at::equal(dst.cpu(), src.to(at::kBFloat16)));
}

TEST_CASE("GPU offload_step backward: the CPU step during backward equals the step after it",
          "[gpu][parity][offload]") {
  // Note [Offload step in backward]: the worker waits for each unit's D2H copy by event and
  // uploads the stepped shard on its own stream (level 1), which the next gather waits for;
  // sleeps before every collective and before optimizer.step() make a missing wait show as
  // different numbers. Same host kernel over the same values: equal, not close.
  for (int level : {1, 2})
    for (const char* spec : kOffloadPlans)
      for (bool sleeps : {false, true}) {
        CAPTURE(level, spec, sleeps);
        ShardingOptions opts = offload_options(level, sleeps);
        const int64_t sleep = sleeps ? kSleepCycles : 0;
        const Run after = sharded(spec, opts, sleep, /*fused=*/true);
        opts.offload_step = OffloadStep::kBackward;
        const Run during = sharded(spec, opts, sleep, /*fused=*/true);
        REQUIRE(after.losses == during.losses);
        for (auto& [name, t] : after.params) {
          CAPTURE(name);
          REQUIRE(at::equal(t, during.params.at(name)));
        }
      }
}

TEST_CASE("GPU offload_step delayed: the same numbers with and without device sleeps",
          "[gpu][parity][offload]") {
  // Note [Delayed offload step]: the refresh is queued on the upload stream after the unit's
  // reduction, the worker waits for that upload before it writes the master, and the next
  // gathers wait for the refresh. Sleeps before every collective and before optimizer.step()
  // make a missing wait show as different numbers. The CPU-rank test checks the values
  // against an unsharded model with the delay (tests/offload_test.cpp); here the delay must
  // at least be there: the second step's loss differs from the undelayed mode's.
  for (const char* spec : kOffloadPlans) {
    CAPTURE(spec);
    ShardingOptions quiet_opts = offload_options(1, false);
    quiet_opts.offload_step = OffloadStep::kDelayed;
    const Run quiet = sharded(spec, quiet_opts, 0, /*fused=*/true);
    ShardingOptions slept_opts = offload_options(1, true);
    slept_opts.offload_step = OffloadStep::kDelayed;
    const Run slept = sharded(spec, slept_opts, kSleepCycles, /*fused=*/true);
    REQUIRE(quiet.losses == slept.losses);
    for (auto& [name, t] : quiet.params) {
      CAPTURE(name);
      REQUIRE(at::equal(t, slept.params.at(name)));
    }
    quiet_opts.offload_step = OffloadStep::kBackward;
    const Run undelayed = sharded(spec, quiet_opts, 0, /*fused=*/true);
    REQUIRE(quiet.losses.size() >= 2);
    REQUIRE(quiet.losses[0] == undelayed.losses[0]);
    REQUIRE(quiet.losses[1] != undelayed.losses[1]);
  }
}

int main(int argc, char** argv) {
  return flatshard_test::nccl_test_main("gpu_parity_test", argc, argv, g_comm);
}
