// Reliability of the NCCL path on real GPUs (one process per GPU, launched by torchrun):
// - a rank that stalls mid-step, or throws mid-backward and stops issuing collectives: the
//   surviving rank's watchdog fails its communicator within timeout + slack and the next
//   flatshard call throws the timeout error (never a hang);
// - 100 training steps of the tiny GPT: CUDA caching-allocator "allocated" bytes do not grow
//   after warm-up.
// The CPU counterparts are tests/reliability_fault_test.cpp and reliability_memory_test.cpp.
// Run: python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python \
//        build/tests/nccl_reliability_test
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "collectives/launch_env.h"
#include "collectives/nccl_communicator.h"
#include "nccl_test_main.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "wrap_policies/spec.h"

using namespace flatshard;

namespace {

NcclCommunicator* g_comm = nullptr;  // owned by main(); used for the store and host barriers

struct Trainer {
  gpt::GPT model{nullptr};
  std::unique_ptr<ShardedModel> fsdp;
  std::unique_ptr<torch::optim::AdamW> opt;
  Trainer(Communicator& comm) {
    model = gpt::GPT(gpt::GPTConfig::preset("tiny"), /*seed=*/0);
    model->to(comm.device());
    fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), comm);
    opt = std::make_unique<torch::optim::AdamW>(fsdp->parameters(),
                                                torch::optim::AdamWOptions(1e-3));
  }
  at::Tensor forward(int rank, int step) {
    auto [x, y] = gpt::synthetic_batch(model->config(), 4, /*seed=*/1, rank, step);
    x = x.to(fsdp->comm().device());
    y = y.to(fsdp->comm().device());
    return enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
  }
};

enum class Fault { kStall, kThrowInBackward };

// Rank 1 misbehaves in step 2 after its forward; rank 0 must see its communicator fail with a
// timeout within timeout + 5 s and every later flatshard call throw, then release rank 1.
void fault_scenario(Fault fault, const std::string& name) {
  auto& main_comm = *g_comm;
  NcclOptions opt;
  opt.timeout = std::chrono::milliseconds(3000);
  opt.watchdog_poll = std::chrono::milliseconds(50);
  opt.terminate_on_error = false;  // the test wants the error, not an exit
  auto tc = NcclCommunicator::create(main_comm.store(), main_comm.rank(), main_comm.world_size(),
                                     main_comm.device(), opt, name);
  auto& store = *main_comm.store();
  const std::string done_key = name + "/rank0_done";
  {
    Trainer t(*tc);
    for (int step = 0; step < 2; ++step) {
      t.opt->zero_grad();
      t.forward(tc->rank(), step).backward();
      t.opt->step();
    }
    t.opt->zero_grad();
    auto loss = t.forward(tc->rank(), 2);
    if (tc->rank() == 1) {
      if (fault == Fault::kThrowInBackward) {
        loss.register_hook([](const at::Tensor&) -> at::Tensor {
          throw std::runtime_error("injected failure in rank 1's backward");
        });
        CHECK_THROWS_WITH(loss.backward(), Catch::Contains("injected failure"));
      }
      store.wait({done_key});  // stalled (or dead after the throw) until rank 0 is done
      tc->abort("rank 0 finished " + name);
    } else if (tc->rank() == 0) {
      // Whatever happens below, release rank 1.
      flatshard_test::SetKeyOnExit release{store, done_key};
      const auto t0 = std::chrono::steady_clock::now();
      std::string first_error;
      try {
        loss.backward();  // launches collectives rank 1 never joins
        t.opt->step();
      } catch (const c10::Error& e) {
        first_error = e.what_without_backtrace();
      }
      while (!tc->failed() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const auto elapsed = std::chrono::steady_clock::now() - t0;
      CAPTURE(first_error, tc->error());
      REQUIRE(tc->failed());
      CHECK(elapsed >= opt.timeout);
      CHECK(elapsed < opt.timeout + std::chrono::seconds(5));
      CHECK_THAT(tc->error(), Catch::Contains("rank 0") && Catch::Contains("timed out"));
      // The next step's flatshard collectives throw the same error instead of hanging.
      REQUIRE_THROWS_WITH(t.forward(0, 3).backward(), Catch::Contains("timed out"));
    }
    // Ranks > 1 (if launched with more) just wait for rank 0 like rank 1.
    if (tc->rank() > 1) {
      store.wait({done_key});
      tc->abort("rank 0 finished " + name);
    }
  }  // the ShardedModel is destroyed after the abort: must not hang or throw
  tc.reset();
  main_comm.barrier();  // the main communicator is unaffected
  CHECK_FALSE(main_comm.failed());
}

}  // namespace

TEST_CASE("NCCL: a rank that stalls mid-step ends the others with a timeout error",
          "[gpu][reliability][timeout]") {
  if (g_comm->world_size() < 2) {
    WARN("needs at least 2 ranks; skipped");
    return;
  }
  fault_scenario(Fault::kStall, "reliability_stall");
}

TEST_CASE("NCCL: a rank that throws mid-backward ends the others with a timeout error",
          "[gpu][reliability][timeout]") {
  if (g_comm->world_size() < 2) {
    WARN("needs at least 2 ranks; skipped");
    return;
  }
  fault_scenario(Fault::kThrowInBackward, "reliability_throw");
}

TEST_CASE("NCCL: 100 GPT steps, no growth of CUDA allocated memory after warm-up",
          "[gpu][reliability][memory]") {
  const int dev = g_comm->device().index();
  auto allocated = [&] {
    c10::cuda::device_synchronize();
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .current;
  };
  Trainer t(*g_comm);
  int64_t after_warmup = 0, max_after = 0;
  for (int step = 0; step < 100; ++step) {
    t.opt->zero_grad();
    t.forward(g_comm->rank(), step % 4).backward();
    t.fsdp->clip_grad_norm_(1.0);
    t.opt->step();
    const int64_t now = allocated();
    if (step == 10) after_warmup = now;
    if (step >= 10) max_after = std::max(max_after, now);
  }
  CAPTURE(after_warmup, max_after);
  CHECK(after_warmup > 0);
  // "allocated" counts live tensors, not cached blocks: a per-step leak of even one small
  // tensor adds up over 90 steps; 64 KiB leaves room for a lazily created library workspace.
  CHECK(max_after - after_warmup < 64 * 1024);
  g_comm->barrier();
}

int main(int argc, char** argv) {
  return flatshard_test::nccl_test_main("nccl_reliability_test", argc, argv, g_comm);
}
