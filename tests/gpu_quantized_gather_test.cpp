// GPU check of the quantized gathers' CUDA path (Note [Quantize kernels],
// flat_param/quantized_gather.h): the reference GPT of the GPU parity tests, sharded per block
// with gather dtype fp8, int8 and fp8_delayed over NCCL (one process per GPU under torchrun,
// world 1 or 2), against the same model sharded over as many CPU thread ranks in the same
// process, whose gathers run ATen's ops (the reference, itself checked against Python bit for bit
// by tests/quantized_gather_test.cpp). Every unit's gathered buffer must be bit-equal (fp32 and
// bf16 param dtypes: the kernels round as ATen does) and the step-0 loss (fp32) within 1e-5
// relative (cuBLAS and the CPU differ only in summation order). Then a non-finite master: every
// rank fails with the same error naming the unit, the rank and the block or parameter, out of
// backward(), before any optimizer step; and a forward under long device sleeps before every
// all-gather returns on the host long before the device is done: no host wait per gather
// (Note [Deferred gather check]; the old host-side check waited for each).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "collectives/nccl_communicator.h"
#include "collectives/thread_communicator.h"
#include "flat_param/collective_plan.h"
#include "fsdp/sharded_model.h"
#include "gpu_gpt_parity.h"
#include "nccl_test_main.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;

namespace {

NcclCommunicator* g_comm = nullptr;

struct Step0 {
  double loss = 0;                 // mean over ranks
  std::vector<at::Tensor> fulls;   // per unit (plan order), the gathered buffer on the CPU
  std::vector<std::string> plans;  // per unit, the gather plan's name
};

ShardingOptions quantized(GatherDtype g, at::ScalarType param_dtype) {
  ShardingOptions opts;
  opts.mixed_precision.param_dtype = param_dtype;
  opts.mixed_precision.reduce_dtype = at::kFloat;
  opts.mixed_precision.gather_dtype = g;
  return opts;
}

// The parity GPT on `dev`, sharded per block over `comm`: every unit gathered once (then
// resharded), and the step-0 loss averaged over the ranks.
Step0 step0(Communicator& comm, const c10::Device& dev, const ShardingOptions& opts) {
  auto model = flatshard_test::gpu_parity_model(dev);
  auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), comm, opts);
  Step0 r;
  for (size_t i = 0; i < fsdp->num_units(); ++i) {
    FlatParam& f = fsdp->unit(i).flat();
    r.plans.push_back(f.gather_plan().name());
    f.unshard(comm.current_stream());
    r.fulls.push_back(f.full().to(at::kCPU).clone());
    f.reshard();
  }
  at::Tensor l = flatshard_test::gpu_parity_loss(model, comm.rank(), 0, dev);
  at::Tensor lt = l.detach().reshape({1}).to(at::kFloat).contiguous();
  comm.all_reduce(lt, ReduceOp::kAvg, comm.current_stream());
  r.loss = lt.item<double>();
  return r;
}

// The same over `world` CPU thread ranks: the ATen path. Rank 0's (every rank's is the same).
Step0 cpu_reference(int world, const ShardingOptions& opts) {
  Step0 ref;
  run_ranks(world, [&](Communicator& c) {
    Step0 got = step0(c, c10::Device(c10::kCPU), opts);
    if (c.rank() == 0) ref = std::move(got);
  });
  return ref;
}

std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

}  // namespace

TEST_CASE("GPU quantized gathers equal the CPU path bit for bit; step-0 loss within 1e-5",
          "[gpu][quantized_gather]") {
  const int world = g_comm->world_size();
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8, GatherDtype::kFp8Delayed})
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      CAPTURE(gather_dtype_name(g), dtype, world);
      const ShardingOptions opts = quantized(g, dtype);
      const Step0 ref = cpu_reference(world, opts);
      const Step0 got = step0(*g_comm, g_comm->device(), opts);
      REQUIRE(got.fulls.size() == ref.fulls.size());
      for (size_t i = 0; i < ref.fulls.size(); ++i) {
        CAPTURE(i, got.plans[i]);
        CHECK(got.plans[i] == (g == GatherDtype::kInt8 ? "Int8AllGather" : "Fp8AllGather"));
        REQUIRE(got.fulls[i].scalar_type() == ref.fulls[i].scalar_type());
        REQUIRE(got.fulls[i].numel() == ref.fulls[i].numel());
        CAPTURE(
            (got.fulls[i].to(at::kFloat) - ref.fulls[i].to(at::kFloat)).abs().max().item<double>());
        CHECK(bytes_of(got.fulls[i]) == bytes_of(ref.fulls[i]));
      }
      if (dtype == at::kFloat) {
        CAPTURE(ref.loss, got.loss);
        CHECK(std::isfinite(got.loss));
        CHECK(std::abs(got.loss - ref.loss) <= 1e-5 * std::abs(ref.loss));
      }
    }
}

TEST_CASE("GPU quantized gathers: a non-finite master fails every rank the same way, no step",
          "[gpu][quantized_gather][nonfinite]") {
  const c10::Device dev = g_comm->device();
  const int world = g_comm->world_size();
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8, GatherDtype::kFp8Delayed}) {
    CAPTURE(gather_dtype_name(g), world);
    auto model = flatshard_test::gpu_parity_model(dev);
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), *g_comm,
                            quantized(g, at::kFloat));
    // Unit 0 (plan order): element 5 of rank 0's master shard (its first parameter's: rank
    // 0's shard starts at the flat buffer's start, so it is no padding).
    Unit& u = fsdp->unit(0);
    const std::string name = u.name();
    if (g_comm->rank() == 0) {
      at::NoGradGuard no_grad;
      u.flat().master()[5] = std::numeric_limits<float>::quiet_NaN();
    }
    std::string error;
    bool stepped = false;
    try {
      at::Tensor l = flatshard_test::gpu_parity_loss(model, g_comm->rank(), 0, dev);
      l.backward();
      stepped = true;  // the optimizer step would come here
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    CAPTURE(error);
    CHECK_FALSE(stepped);
    CHECK_THAT(error, Catch::Contains("unit '" + name + "'") && Catch::Contains("inf or nan"));
    if (g == GatherDtype::kInt8)
      CHECK_THAT(error,
                 Catch::Contains("the fp32 master of rank 0 holds inf or nan in int8 block 0"));
    // Every rank got it: a rank that did not would hang in the next collective.
    at::Tensor ok = at::full({1}, error.empty() ? 0.0f : 1.0f, at::TensorOptions(dev));
    g_comm->all_reduce(ok, ReduceOp::kSum, g_comm->current_stream());
    CHECK(ok.item<float>() == static_cast<float>(world));
  }
}

TEST_CASE("GPU quantized gathers: no host wait per gather (the check is deferred)",
          "[gpu][quantized_gather][nosync]") {
  const c10::Device dev = g_comm->device();
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8}) {
    CAPTURE(gather_dtype_name(g));
    ShardingOptions opts = quantized(g, at::kFloat);
    opts.debug_sleep_before_all_gather_cycles = 200'000'000;  // ~0.1 s per gather at ~2 GHz
    auto model = flatshard_test::gpu_parity_model(dev);
    auto fsdp =
        fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), *g_comm, opts);
    auto [x, y] = gpt::synthetic_batch(model->config(), flatshard_test::kGpuParityBatch, 7,
                                       g_comm->rank(), 0);
    x = x.to(dev);
    y = y.to(dev);
    auto loss = [&] { return enter(model, [&] { return model->loss(x, y); }); };
    loss().backward();  // warm-up: the allocator's first blocks, NCCL's first calls
    c10::cuda::device_synchronize();
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    at::Tensor l = loss();  // 4 units: 4 gathers, each behind a device sleep
    const auto t1 = Clock::now();
    c10::cuda::device_synchronize();
    const auto t2 = Clock::now();
    const double host_s = std::chrono::duration<double>(t1 - t0).count();
    const double total_s = std::chrono::duration<double>(t2 - t0).count();
    CAPTURE(host_s, total_s, fsdp->num_units());
    CHECK(total_s > 0.1);  // the sleeps ran
    CHECK(host_s < 0.5 * total_s);
    l.backward();
  }
}

int main(int argc, char** argv) {
  return flatshard_test::nccl_test_main("gpu_quantized_gather_test", argc, argv, g_comm);
}
