// flatshard-fused-adamw-bench: the CPU optimizer step of one offloaded unit, by path.
//
// Note [Host compute copy] (flat_param/collective_plan.h, optim/fused_adamw.h): FusedAdamW's
// step over bf16 gradients that also writes the bf16 copy, against the fp32 step it replaces,
// on the calling thread and on a fresh thread (as the offload stepper runs it), best of 5.
// Usage: flatshard-fused-adamw-bench [elements=50000000] [pinned=0|1 (CUDA builds)]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "flat_param/offload.h"
#include "optim/fused_adamw.h"

namespace {

int run(long long n, bool pinned) {
  // host_empty: pinned (registered) host memory for a CUDA device, as offloaded units have.
  const c10::Device dev = pinned ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  auto make = [&](at::ScalarType t) { return flatshard::host_empty(n, t, dev); };
  at::Tensor p = make(at::kFloat).normal_();
  p.set_requires_grad(true);
  p.mutable_grad() = make(at::kFloat).normal_();
  at::Tensor grad16 = make(at::kBFloat16);
  grad16.copy_(p.grad());
  at::Tensor copy16 = make(at::kBFloat16);
  flatshard::FusedAdamW opt(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(1e-3));
  const auto located = opt.located({p});
  auto best_ms = [](const auto& fn) {
    fn();
    double best = 1e30;
    for (int i = 0; i < 5; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      best = std::min(
          best,
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  auto row = [&](const char* name, const auto& fn) {
    const double here = best_ms(fn);
    double there = 0;
    std::exception_ptr failed;  // an exception must not leave the thread (std::terminate)
    std::thread t([&] {
      try {
        there = best_ms(fn);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    t.join();
    if (failed) std::rethrow_exception(failed);
    std::printf("%-40s %8.2f ms %7.3f ns/elem   on a fresh thread %8.2f ms\n", name, here,
                here * 1e6 / static_cast<double>(n), there);
  };
  std::printf("%lld elements, %s host memory, %d intra-op threads\n", n,
              pinned ? "pinned" : "pageable", at::get_num_threads());
  row("fp32 gradient, no copy (the fp32 path)",
      [&] { opt.run_step(opt.capture_located(located)); });
  row("bf16 gradient + bf16 copy (host copy)", [&] {
    opt.run_step(opt.capture_located(
        located, [&](const at::Tensor&) { return grad16; },
        [&](const at::Tensor&) { return copy16; }));
  });
  row("upcast, fp32 step, cast as three ops", [&] {
    at::NoGradGuard no_grad;
    const at::Tensor g = grad16.to(at::kFloat);
    opt.run_step(opt.capture_located(located, [&](const at::Tensor&) { return g; }));
    copy16.copy_(p.detach());
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Arguments are untrusted: the element count parses whole and is bounded (8 B per element of
  // each of five tensors and the optimizer's state must fit the host).
  long long n = 50'000'000;
  if (argc > 1) {
    char* end = nullptr;
    errno = 0;
    n = std::strtoll(argv[1], &end, 10);
    if (errno != 0 || end == argv[1] || *end != '\0' || n <= 0 || n > (1LL << 34)) {
      std::fprintf(stderr,
                   "flatshard-fused-adamw-bench: elements must be an integer in 1..2^34, got "
                   "'%s'\n",
                   argv[1]);
      return 2;
    }
  }
  const std::string pin = argc > 2 ? argv[2] : "0";
  if (pin != "0" && pin != "1") {
    std::fprintf(stderr, "flatshard-fused-adamw-bench: pinned must be 0 or 1, got '%s'\n",
                 pin.c_str());
    return 2;
  }
  try {
    return run(n, pin == "1");
  } catch (const c10::Error& e) {  // no CUDA device for pinned memory, no host memory
    std::fprintf(stderr, "flatshard-fused-adamw-bench: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flatshard-fused-adamw-bench: %s\n", e.what());
    return 1;
  }
}
