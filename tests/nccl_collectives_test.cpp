// Closed-form checks of the NCCL backend on the launched world (one process per GPU), the same
// expectations as tests/collectives_test.cpp: counts 0, 1, odd and large, float32, bfloat16 and
// float16, in-place variants, sum and avg, every broadcast root; plus argument errors, grouped
// launches, lane concurrency, stream ordering, shutdown, and a timeout that must end in an error
// (not a hang) when one rank skips a collective.
//
// Multi-process: launch with
//   python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python
//       build/tests/nccl_collectives_test
// Every rank runs every test case in the same order. Result checks use CHECK (not REQUIRE) so a
// wrong value on one rank does not skip that rank's later collectives and hang the others.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdlib>
#include <thread>

#include "collectives/env.h"
#include "collectives/launch_env.h"
#include "collectives/nccl_communicator.h"
#include "flat_param/upcast.h"
#include "nccl_test_main.h"

using flatshard::Lane;
using flatshard::NcclCommunicator;
using flatshard::ReduceOp;

namespace {

NcclCommunicator* g_comm = nullptr;  // owned by main()

NcclCommunicator& comm() { return *g_comm; }

// Rank r's element i is (r + 1) + (i % 7): small integers, exact in bf16 and in sums over up to
// 16 ranks, so sums compare exactly.
at::Tensor rank_tensor(int r, int64_t n, at::ScalarType dt, int64_t offset = 0) {
  auto idx = at::arange(offset, offset + n, at::kLong);
  return (idx.remainder(7) + (r + 1)).to(dt);
}

at::TensorOptions gpu(at::ScalarType dt) {
  return at::TensorOptions().dtype(dt).device(comm().device());
}

// Sum over ranks q of (q + 1) + ((base + i) % 7), optionally divided by world.
at::Tensor reduced(int world, int64_t n, int64_t base, ReduceOp op) {
  auto s = at::arange(base, base + n, at::kLong).remainder(7).to(at::kDouble) * world +
           world * (world + 1) / 2.0;
  return op == ReduceOp::kAvg ? s / world : s;
}

// Sums are exact; avg is exact when world is a power of two (NCCL scales by 1/world in the
// element type), else compared with the element type's tolerance.
bool matches(const at::Tensor& got, const at::Tensor& expect_double, ReduceOp op, int world) {
  const auto dt = got.scalar_type();
  auto g = got.cpu();
  const bool pow2 = (world & (world - 1)) == 0;
  if (op == ReduceOp::kSum || pow2) return at::equal(g, expect_double.to(dt));
  const double rtol = dt == at::kBFloat16 ? 1e-2 : dt == at::kHalf ? 1e-3 : 1e-6;
  return at::allclose(g.to(at::kDouble), expect_double, rtol, 1e-6);
}

const std::vector<int64_t> kCounts = {0, 1, 7, 1000, 65537, (int64_t{1} << 22) + 3};
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf};

}  // namespace

TEST_CASE("all_gather: output slot r holds rank r's input", "[nccl]") {
  auto& c = comm();
  const int world = c.world_size(), r = c.rank();
  for (int64_t n : kCounts)
    for (auto dt : kDtypes)
      for (bool in_place : {false, true}) {
        CAPTURE(world, r, n, dt, in_place);
        auto out = at::full({n * world}, -1.0, gpu(dt));
        at::Tensor in = rank_tensor(r, n, dt).to(c.device());
        if (in_place) {
          out.narrow(0, r * n, n).copy_(in);
          in = out.narrow(0, r * n, n);
        }
        c.all_gather(in, out, c.current_stream());
        auto host = out.cpu();
        for (int q = 0; q < world; ++q) CHECK(at::equal(host.narrow(0, q * n, n), rank_tensor(q, n, dt)));
      }
}

// Not a collective, but GPU-only: flat_param/upcast.h's kernel (Note [Vectorized upcast]) against
// ATen's conversion, bit for bit, at sizes around its 8-element vectors and with every special
// value (signed zeros, subnormals, infinities, NaN payloads) among random bits.
TEST_CASE("to_float: the vectorized bf16 -> fp32 kernel equals ATen's conversion bitwise",
          "[upcast]") {
  auto& c = comm();
  const auto dev = c.device();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{4099},
                    (int64_t{1} << 22) + 5}) {
    CAPTURE(n);
    // Every 16-bit pattern, cycled, then shuffled: all specials occur once n >= 65536.
    at::Tensor bits = at::arange(n, at::TensorOptions().dtype(at::kInt)).remainder(65536);
    bits = bits.index_select(0, at::randperm(n, at::TensorOptions().dtype(at::kLong)));
    at::Tensor bf = bits.to(at::kShort).view(at::kBFloat16).to(dev);
    at::Tensor got = flatshard::to_float(bf);
    CHECK(got.scalar_type() == at::kFloat);
    CHECK(got.sizes() == bf.sizes());
    const at::Tensor want = bf.cpu().to(at::kFloat);
    CHECK(at::equal(got.cpu().view(at::kInt), want.view(at::kInt)));
#if FLATSHARD_WITH_CUDA_KERNELS
    if (n > 0 && flatshard::env::upcast_kernel()) CHECK(flatshard::uses_upcast_kernel(bf));
#endif
  }
  // Misaligned (offset 1 element) and strided inputs take ATen's path and still convert.
  at::Tensor base = at::randn({1001}, gpu(at::kBFloat16));
  CHECK_FALSE(flatshard::uses_upcast_kernel(base.narrow(0, 1, 1000)));
  CHECK(at::equal(flatshard::to_float(base.narrow(0, 1, 1000)).cpu(),
                  base.narrow(0, 1, 1000).cpu().to(at::kFloat)));
  CHECK(at::equal(flatshard::to_float(base.slice(0, 0, 1001, 2)).cpu(),
                  base.slice(0, 0, 1001, 2).cpu().to(at::kFloat)));
}

// copy_to_float (the one-rank reduction's upcast into slices of the master gradient): the same
// bits as ATen into aligned slices (the kernel) and misaligned ones (ATen's copy), with the
// elements around the slice untouched.
TEST_CASE("copy_to_float writes ATen's conversion bitwise into slices", "[upcast]") {
  auto& c = comm();
  const auto dev = c.device();
  for (int64_t n : {int64_t{1}, int64_t{8}, int64_t{4099}, (int64_t{1} << 20) + 3}) {
    at::Tensor bits = at::arange(n, at::TensorOptions().dtype(at::kInt)).remainder(65536);
    bits = bits.index_select(0, at::randperm(n, at::TensorOptions().dtype(at::kLong)));
    const at::Tensor bf = bits.to(at::kShort).view(at::kBFloat16).to(dev);
    const at::Tensor want = bf.cpu().to(at::kFloat);
    for (int64_t offset : {int64_t{0}, int64_t{8}, int64_t{3}}) {  // 8 x 4 B: aligned; 3: not
      CAPTURE(n, offset);
      at::Tensor dst = at::full({n + 16}, -7.0f, at::TensorOptions().dtype(at::kFloat).device(dev));
      flatshard::copy_to_float(dst.narrow(0, offset, n), bf);
      const at::Tensor out = dst.cpu();
      CHECK(at::equal(out.narrow(0, offset, n).view(at::kInt), want.view(at::kInt)));
      CHECK(out.narrow(0, 0, offset).eq(-7.0f).all().item<bool>());
      CHECK(out.narrow(0, offset + n, 16 - offset).eq(-7.0f).all().item<bool>());
    }
  }
}

TEST_CASE("reduce_scatter: sum and avg over ranks of the rank's slice", "[nccl]") {
  auto& c = comm();
  const int world = c.world_size(), r = c.rank();
  for (int64_t n : kCounts)
    for (auto dt : kDtypes)
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg})
        for (bool in_place : {false, true}) {
          CAPTURE(world, r, n, dt, flatshard::to_string(op), in_place);
          auto in = rank_tensor(r, n * world, dt).to(c.device());
          at::Tensor out = in_place ? in.narrow(0, r * n, n) : at::full({n}, -1.0, in.options());
          c.reduce_scatter(in, out, op, c.current_stream());
          CHECK(matches(out, reduced(world, n, r * n, op), op, world));
        }
}

TEST_CASE("all_reduce: sum and avg, in place, on both lanes", "[nccl]") {
  auto& c = comm();
  const int world = c.world_size();
  for (int64_t n : kCounts)
    for (auto dt : kDtypes)
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg})
        for (auto lane : {Lane::kReduce, Lane::kAllGather}) {
          CAPTURE(world, c.rank(), n, dt, flatshard::to_string(op), static_cast<int>(lane));
          auto t = rank_tensor(c.rank(), n, dt).to(c.device());
          c.all_reduce(t, op, c.current_stream(), lane);
          CHECK(matches(t, reduced(world, n, 0, op), op, world));
        }
}

TEST_CASE("broadcast: every rank ends with the root's tensor", "[nccl]") {
  auto& c = comm();
  for (int64_t n : kCounts)
    for (auto dt : kDtypes)
      for (int root = 0; root < c.world_size(); ++root) {
        CAPTURE(c.rank(), n, dt, root);
        auto t = rank_tensor(c.rank(), n, dt).to(c.device());
        c.broadcast(t, root, c.current_stream());
        CHECK(at::equal(t.cpu(), rank_tensor(root, n, dt)));
      }
}

TEST_CASE("collectives run on the given stream, after the work queued before them", "[nccl]") {
  auto& c = comm();
  c10::cuda::CUDAGuard guard(c.device());
  auto side = c10::cuda::getStreamFromPool(false, c.device().index());
  auto t = at::zeros({1 << 20}, gpu(at::kFloat));
  // `side` waits for t's zero-fill, then sleeps and fills t; the all-reduce must come after.
  at::cuda::CUDAEvent filled;
  filled.record(c10::cuda::getCurrentCUDAStream(c.device().index()));
  filled.block(side);
  {
    c10::cuda::CUDAStreamGuard sg(side);
    at::cuda::sleep(50 * 1000 * 1000);  // ~25 ms: a collective on another stream would run first
    t.fill_(static_cast<double>(c.rank() + 1));
  }
  c.all_reduce(t, ReduceOp::kSum, side.unwrap());
  const cudaError_t q = cudaStreamQuery(side.stream());
  (void)cudaGetLastError();  // "not ready" also lands in the last-error slot
  CHECK(q == cudaErrorNotReady);  // the call did not block
  at::cuda::CUDAEvent done;
  done.record(side);
  done.block(c10::cuda::getCurrentCUDAStream(c.device().index()));
  const double expect = c.world_size() * (c.world_size() + 1) / 2.0;
  CHECK(at::equal(t.cpu(), at::full({1 << 20}, expect, at::kFloat)));
}

TEST_CASE("an all-gather and a reduce-scatter in flight together on two lanes", "[nccl]") {
  auto& c = comm();
  const int world = c.world_size(), r = c.rank();
  const int64_t n = (1 << 22) + 1;
  auto s1 = c10::cuda::getStreamFromPool(false, c.device().index());
  auto s2 = c10::cuda::getStreamFromPool(false, c.device().index());
  auto ag_in = rank_tensor(r, n, at::kBFloat16).to(c.device());
  auto ag_out = at::empty({n * world}, ag_in.options());
  auto rs_in = rank_tensor(r, n * world, at::kFloat).to(c.device());
  auto rs_out = at::empty({n}, rs_in.options());
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(c.device().index()));
  ready.block(s1);
  ready.block(s2);
  for (int it = 0; it < 3; ++it) {
    c.all_gather(ag_in, ag_out, s1.unwrap());
    c.reduce_scatter(rs_in, rs_out, ReduceOp::kSum, s2.unwrap());
  }
  for (auto* s : {&s1, &s2}) {
    at::cuda::CUDAEvent e;
    e.record(*s);
    e.block(c10::cuda::getCurrentCUDAStream(c.device().index()));
  }
  auto host = ag_out.cpu();
  for (int q = 0; q < world; ++q)
    CHECK(at::equal(host.narrow(0, q * n, n), rank_tensor(q, n, at::kBFloat16)));
  CHECK(matches(rs_out, reduced(world, n, r * n, ReduceOp::kSum), ReduceOp::kSum, world));
}

TEST_CASE("grouped collectives are fused and correct", "[nccl]") {
  auto& c = comm();
  const int world = c.world_size(), r = c.rank();
  std::vector<at::Tensor> ins, outs;
  for (int64_t n : {int64_t{5}, int64_t{0}, int64_t{1000}}) {
    ins.push_back(rank_tensor(r, n, at::kBFloat16).to(c.device()));
    outs.push_back(at::empty({n * world}, ins.back().options()));
  }
  auto ar = rank_tensor(r, 33, at::kFloat).to(c.device());
  c.group_start(Lane::kAllGather);
  for (size_t i = 0; i < ins.size(); ++i) c.all_gather(ins[i], outs[i], c.current_stream());
  c.all_reduce(ar, ReduceOp::kSum, c.current_stream(), Lane::kAllGather);
  c.group_end(Lane::kAllGather);
  for (size_t i = 0; i < ins.size(); ++i) {
    const int64_t n = ins[i].numel();
    auto host = outs[i].cpu();
    for (int q = 0; q < world; ++q) CHECK(at::equal(host.narrow(0, q * n, n), rank_tensor(q, n, at::kBFloat16)));
  }
  CHECK(matches(ar, reduced(world, 33, 0, ReduceOp::kSum), ReduceOp::kSum, world));
}

TEST_CASE("counters count calls and bytes; barrier does not count", "[nccl]") {
  auto& c = comm();
  c.reset_counters();
  const int world = c.world_size();
  auto in = at::ones({5}, gpu(at::kFloat));
  auto out = at::empty({5 * world}, gpu(at::kFloat));
  c.all_gather(in, out, c.current_stream());
  c.reduce_scatter(out, in, ReduceOp::kSum, c.current_stream());
  c.all_reduce(in, ReduceOp::kSum, c.current_stream());
  c.broadcast(in, 0, c.current_stream());
  c.barrier();
  CHECK(c.counters().all_gathers == 1);
  CHECK(c.counters().reduce_scatters == 1);
  CHECK(c.counters().all_reduces == 1);
  CHECK(c.counters().broadcasts == 1);
  CHECK(c.counters().bytes == (5 + 5 * world + 5 + 5) * 4);
  CHECK(c.outstanding() == 0);  // barrier waited for (and reaped) every earlier collective
}

TEST_CASE("bad arguments give clear errors naming call and rank", "[nccl][errors]") {
  auto& c = comm();
  const auto s = c.current_stream();
  const std::string me = "(rank " + std::to_string(c.rank()) + ")";
  const int world = c.world_size();
  REQUIRE_THROWS_WITH(c.all_gather(at::ones({3}, gpu(at::kFloat)), at::empty({3 * world + 1}, gpu(at::kFloat)), s),
                      Catch::Contains("all_gather " + me + ": output has"));
  REQUIRE_THROWS_WITH(c.all_gather(at::ones({3}, gpu(at::kFloat)), at::empty({3 * world}, gpu(at::kBFloat16)), s),
                      Catch::Contains("input dtype Float differs from output dtype BFloat16"));
  REQUIRE_THROWS_WITH(c.all_reduce(at::ones({3}, gpu(at::kDouble)), ReduceOp::kSum, s),
                      Catch::Contains("dtype Double") &&
                          Catch::Contains("float32, bfloat16 and float16"));
  REQUIRE_THROWS_WITH(c.all_reduce(at::ones({4, 4}, gpu(at::kFloat)).t(), ReduceOp::kSum, s),
                      Catch::Contains("must be contiguous"));
  REQUIRE_THROWS_WITH(c.all_reduce(at::ones({3}), ReduceOp::kSum, s),
                      Catch::Contains("is on cpu but this communicator works on cuda"));
  REQUIRE_THROWS_WITH(c.all_reduce(at::ones({3}, gpu(at::kFloat)), ReduceOp::kSum,
                                   c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU))),
                      Catch::Contains("is not a stream of this communicator's device"));
  REQUIRE_THROWS_WITH(c.reduce_scatter(at::ones({5 * world + 1}, gpu(at::kFloat)), at::empty({5}, gpu(at::kFloat)), ReduceOp::kSum, s),
                      Catch::Contains("reduce_scatter " + me + ": input has"));
  REQUIRE_THROWS_WITH(c.broadcast(at::ones({2}, gpu(at::kFloat)), world, s),
                      Catch::Contains("root " + std::to_string(world) + " out of range"));
  if (world > 1) {  // overlap that is not NCCL's in-place form
    auto out = at::zeros({4 * world}, gpu(at::kFloat));
    const int wrong = (c.rank() + 1) % world;
    REQUIRE_THROWS_WITH(c.all_gather(out.narrow(0, wrong * 4, 4), out, s),
                        Catch::Contains("overlap but not in NCCL's in-place form"));
    REQUIRE_THROWS_WITH(c.reduce_scatter(out, out.narrow(0, wrong * 4, 4), ReduceOp::kSum, s),
                        Catch::Contains("overlap but not in NCCL's in-place form"));
  }
  REQUIRE_THROWS_WITH(c.group_end(Lane::kAllGather), Catch::Contains("no open group"));
  c.barrier();  // the communicator is still healthy
  CHECK_FALSE(c.failed());
}

TEST_CASE("a one-rank communicator: every collective is exact to the last element", "[nccl]") {
  // Each rank alone in its own communicator, as the shard group of a 2x1 HSDP mesh. NCCL before
  // 2.29.7 leaves the tail of a one-rank ncclAvg reduction unwritten (Note [One-rank NCCL]);
  // outputs start as NaN so that any element left unwritten fails.
  auto& c = comm();
  auto solo = NcclCommunicator::create(c.store(), 0, 1, c.device(),
                                       std::chrono::milliseconds(60000),
                                       "solo_" + std::to_string(c.rank()));
  const auto st = solo->current_stream();
  for (at::ScalarType dt : kDtypes)
    for (int64_t n : {int64_t{1}, int64_t{43984}, int64_t{1000003}}) {
      CAPTURE(dt, n);
      const at::Tensor in = rank_tensor(c.rank(), n, dt).to(c.device());
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        auto out = at::full({n}, NAN, gpu(dt));
        solo->reduce_scatter(in, out, op, st);
        CHECK(at::equal(out.cpu(), in.cpu()));
        auto t = in.clone();
        solo->all_reduce(t, op, st, Lane::kAllGather);
        CHECK(at::equal(t.cpu(), in.cpu()));
      }
      auto out = at::full({n}, NAN, gpu(dt));
      solo->all_gather(in, out, st);
      CHECK(at::equal(out.cpu(), in.cpu()));
      auto b = in.clone();
      solo->broadcast(b, 0, st);
      CHECK(at::equal(b.cpu(), in.cpu()));
    }
  // One per dtype, size and op: 3 sizes x 2 ops per dtype (kDtypes gained fp16 with issue 34).
  CHECK(solo->counters().reduce_scatters == static_cast<int64_t>(kDtypes.size()) * 3 * 2);
  solo->barrier();
  solo->shutdown();
}

TEST_CASE("shutdown is collective; later calls throw", "[nccl]") {
  auto& c = comm();
  auto other = NcclCommunicator::create(c.store(), c.rank(), c.world_size(), c.device(),
                                        std::chrono::milliseconds(60000), "shutdown_test");
  auto t = at::ones({8}, gpu(at::kFloat));
  other->all_reduce(t, ReduceOp::kSum, other->current_stream());
  other->shutdown();
  CHECK(at::equal(t.cpu(), at::full({8}, static_cast<double>(c.world_size()))));
  REQUIRE_THROWS_WITH(other->all_reduce(t, ReduceOp::kSum, other->current_stream()),
                      Catch::Contains("shut down"));
  other->shutdown();  // idempotent
}

namespace {

// Rank 0 issues a collective on a fresh communicator that every other rank skips. `warm` first
// runs one collective on all ranks; cold, the skipped one is the communicator's first, which
// with NCCL's lazy connection would block the launching call on the host forever (seen), and
// must not (eager connect). Either way the launch returns, the collective hangs on the device,
// rank 0's watchdog reports a timeout within timeout + slack, its stream drains, nothing hangs.
void skip_collective_scenario(bool warm, const std::string& name) {
  auto& c = comm();
  flatshard::NcclOptions opt;
  opt.timeout = std::chrono::milliseconds(2000);
  opt.watchdog_poll = std::chrono::milliseconds(50);
  opt.terminate_on_error = false;  // this test wants the error, not an exit
  auto tc = NcclCommunicator::create(c.store(), c.rank(), c.world_size(), c.device(), opt, name);
  auto t = at::ones({1024}, gpu(at::kFloat));
  // A pool stream, as the runtime uses: a kernel stuck on the legacy default stream would also
  // block every blocking stream's work, NCCL's own included.
  auto side = c10::cuda::getStreamFromPool(false, c.device().index());
  at::cuda::CUDAEvent made;
  made.record(c10::cuda::getCurrentCUDAStream(c.device().index()));
  made.block(side);
  if (warm) {
    tc->all_reduce(t, ReduceOp::kSum, side.unwrap());
    tc->barrier();
  }
  auto& store = *c.store();
  const std::string done_key = name + "/rank0_done";
  if (c.rank() == 0) {
    // Whatever happens below, release the other ranks.
    flatshard_test::SetKeyOnExit release{store, done_key};
    const auto t0 = std::chrono::steady_clock::now();
    std::string first_error;
    try {
      tc->all_reduce(t, ReduceOp::kSum, side.unwrap());  // the others never join
    } catch (const c10::Error& e) {
      first_error = e.what_without_backtrace();  // cold: the launch itself timed out
    }
    while (!tc->failed() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const auto elapsed = std::chrono::steady_clock::now() - t0;
    REQUIRE(tc->failed());
    CHECK(elapsed >= opt.timeout);
    CHECK(elapsed < opt.timeout + std::chrono::seconds(5));
    CHECK(first_error.empty());  // the launch itself returned at once
    // (Catch2 v2 combined matchers keep references to their parts: build them in place.)
    const std::string which = "collective #" + std::to_string(warm ? 2 : 0) + " all_reduce";
    CHECK_THAT(tc->error(), Catch::Contains("rank 0") && Catch::Contains(which) &&
                                Catch::Contains("timed out") &&
                                Catch::Contains("not complete within 2000 ms"));
    REQUIRE_THROWS_WITH(tc->all_reduce(t, ReduceOp::kSum, side.unwrap()),
                        Catch::Contains("rank 0") && Catch::Contains(which) &&
                            Catch::Contains("timed out"));
    REQUIRE_THROWS_WITH(tc->barrier(), Catch::Contains("timed out"));
    // The abort released whatever was stuck: the stream drains without a hang.
    const cudaStream_t s = side.stream();
    const auto t1 = std::chrono::steady_clock::now();
    cudaError_t q = cudaErrorNotReady;
    while ((q = cudaStreamQuery(s)) == cudaErrorNotReady &&
           std::chrono::steady_clock::now() - t1 < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    (void)cudaGetLastError();
    CHECK(q == cudaSuccess);
  } else {
    store.wait({done_key});
    tc->abort("rank 0 finished " + name);  // never finalize: rank 0's side is gone
  }
  const auto t2 = std::chrono::steady_clock::now();
  tc.reset();  // destructor after an abort: must not hang
  CHECK(std::chrono::steady_clock::now() - t2 < std::chrono::seconds(10));
  c.barrier();  // the main communicator is unaffected
  CHECK_FALSE(c.failed());
}

}  // namespace

TEST_CASE("a rank that skips a launched collective: the watchdog ends the other with an error",
          "[nccl][errors][timeout]") {
  if (comm().world_size() < 2) {
    WARN("needs at least 2 ranks; skipped");
    return;
  }
  skip_collective_scenario(/*warm=*/true, "timeout_device");
}

TEST_CASE("a rank that skips the first collective of a communicator: same, no host-side hang",
          "[nccl][errors][timeout]") {
  if (comm().world_size() < 2) {
    WARN("needs at least 2 ranks; skipped");
    return;
  }
  skip_collective_scenario(/*warm=*/false, "timeout_first");
}

int main(int argc, char** argv) {
  return flatshard_test::nccl_test_main("nccl_collectives_test", argc, argv, g_comm);
}
