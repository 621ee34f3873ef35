// Dead, stalled and failing ranks on the threads backend: the surviving ranks end with a clear
// error within the collective timeout plus a small slack, or at once when a rank throws —
// never a hang. (The NCCL counterpart is tests/nccl_reliability_test.cpp, GPU only.)
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <thread>

#include "parity_util.h"
#include "reliability_util.h"
#include "tiny_net.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

enum class Fault { kStall, kReturn, kThrowInBackward };

struct Outcome {
  std::string rank0_error;       // what rank 0 saw
  double rank0_seconds = -1;     // from rank 0 entering the faulty step's backward to its error
  std::string run_error;         // what run_ranks reported
};

// Two ranks train TinyNet per-layer; in step 2, after the forward, rank 1 misbehaves.
Outcome train_with_fault(Fault fault, std::chrono::milliseconds timeout) {
  Outcome out;
  std::mutex mu;
  try {
    run_ranks(2, [&](Communicator& comm) {
      auto net = TinyNet(5, 7, 3);
      init_params(*net, 1);
      auto fsdp = fully_shard(net.ptr(), manual_plan(*net, {{"blocks.0"}, {"blocks.1"}, {"blocks.2"}}), comm);
      torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 4; ++step) {
        opt.zero_grad();
        auto y = flatshard::call(net, at::randn({3, 5}));
        if (step == 2 && comm.rank() == 1) {
          if (fault == Fault::kStall) std::this_thread::sleep_for(timeout * 3);
          if (fault == Fault::kReturn) return;  // a dead rank: it never calls again
          if (fault == Fault::kThrowInBackward)
            y.register_hook([](const at::Tensor&) -> at::Tensor {
              throw std::runtime_error("injected failure in rank 1's backward");
            });
        }
        const auto t0 = std::chrono::steady_clock::now();
        try {
          y.pow(2).mean().backward();
        } catch (const std::exception& e) {
          if (comm.rank() == 0) {
            std::lock_guard<std::mutex> lock(mu);
            out.rank0_seconds = seconds_since(t0);
            out.rank0_error = e.what();
          }
          throw;
        }
        opt.step();
      }
    }, timeout);
  } catch (const c10::Error& e) {
    out.run_error = e.what_without_backtrace();
  }
  return out;
}

}  // namespace

TEST_CASE("a stalled rank: the others fail with the timeout error in time", "[reliability][timeout]") {
  const auto timeout = std::chrono::milliseconds(300);
  const Outcome o = train_with_fault(Fault::kStall, timeout);
  CAPTURE(o.rank0_error, o.run_error, o.rank0_seconds);
  CHECK_THAT(o.rank0_error, Catch::Contains("rank 0 timed out after 300 ms") &&
                                Catch::Contains("ranks that have not reached it: 1"));
  CHECK(o.rank0_seconds >= 0.3);
  CHECK(o.rank0_seconds < 0.3 + 2.0);  // slack: scheduling on a loaded 2-core CI machine
  CHECK_THAT(o.run_error, Catch::Contains("timed out"));
}

TEST_CASE("a dead rank (returns mid-step): the others time out", "[reliability][timeout]") {
  const Outcome o = train_with_fault(Fault::kReturn, std::chrono::milliseconds(300));
  CAPTURE(o.rank0_error, o.run_error, o.rank0_seconds);
  CHECK_THAT(o.rank0_error, Catch::Contains("timed out after 300 ms"));
  CHECK(o.rank0_seconds >= 0.3);
  CHECK(o.rank0_seconds < 0.3 + 2.0);
}

TEST_CASE("a rank that throws mid-backward makes the others fail fast", "[reliability][timeout]") {
  // A 30 s timeout that must not be waited for: the failing rank aborts the world.
  const Outcome o = train_with_fault(Fault::kThrowInBackward, std::chrono::milliseconds(30000));
  CAPTURE(o.rank0_error, o.run_error, o.rank0_seconds);
  CHECK_THAT(o.rank0_error, Catch::Contains("aborted") &&
                                Catch::Contains("injected failure in rank 1's backward"));
  CHECK(o.rank0_seconds >= 0);
  CHECK(o.rank0_seconds < 3.0);
  // run_ranks reports the root cause, not the secondary abort.
  CHECK_THAT(o.run_error, Catch::StartsWith("rank 1: ") &&
                              Catch::Contains("injected failure in rank 1's backward"));
}
