// Bad input and API misuse, each a clear error (or a documented behaviour) naming what to fix:
// an optimizer on the original parameters, stepping before gradients are reduced, mixed dtypes
// or devices in one unit, backward twice, bad flatshard-explain flags.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <mutex>
#include <sys/wait.h>

#include "parity_util.h"
#include "reliability_util.h"
#include "fsdp/step_guard.h"
#include "tiny_net.h"
#include "rank_require.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

Plan per_layer(torch::nn::Module& m) { return manual_plan(m, {{"blocks.0"}, {"blocks.1"}}); }

TinyNet make_net() {
  auto net = TinyNet(5, 7, 2);
  init_params(*net, 1);
  return net;
}

at::Tensor loss_of(TinyNet& net, int rank, int step) {
  auto gen = at::detail::createCPUGenerator(100 * step + rank);
  return flatshard::call(net, at::randn({3, 5}, gen)).pow(2).mean();
}

// Collects TORCH_WARN messages of this thread.
struct WarningCollector : c10::WarningHandler {
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  std::vector<std::string> messages;
};

}  // namespace

TEST_CASE("check_optimizer names a parameter that is not a master shard", "[reliability][misuse]") {
  run_ranks(2, [](Communicator& comm) {
    auto net = make_net();
    auto fsdp = fully_shard(net.ptr(), per_layer(*net), comm);
    torch::optim::AdamW good(fsdp->parameters());
    fsdp->check_optimizer(good);  // no throw
    torch::optim::AdamW originals(net->parameters());
    RANK_REQUIRE_THROWS_WITH(fsdp->check_optimizer(originals),
                        Catch::Contains("param group 0 index 0 is the model's original parameter "
                                        "'inp.weight'") &&
                            Catch::Contains("ShardedModel::parameters()"));
    torch::optim::SGD stranger({at::zeros({3}, at::requires_grad())}, torch::optim::SGDOptions(0.1));
    RANK_REQUIRE_THROWS_WITH(fsdp->check_optimizer(stranger),
                        Catch::Contains("is not one of ShardedModel::parameters()"));
  });
}

TEST_CASE("an optimizer on the original parameters is noticed automatically (warning)",
          "[reliability][misuse]") {
  auto warnings_when = [](bool on_originals) {
    std::vector<std::string> rank0;
    std::mutex mu;
    run_ranks(2, [&](Communicator& comm) {
      WarningCollector collector;
      c10::WarningUtils::WarningHandlerGuard guard(&collector);
      auto net = make_net();
      auto fsdp = fully_shard(net.ptr(), per_layer(*net), comm);
      torch::optim::AdamW opt(on_originals ? net->parameters() : fsdp->parameters());
      for (int step = 0; step <= StepGuard::kStaleStepsBeforeWarning + 1; ++step) {
        opt.zero_grad();
        loss_of(net, comm.rank(), step).backward();
        opt.step();
      }
      if (comm.rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        rank0 = collector.messages;
      }
    });
    return rank0;
  };
  auto bad = warnings_when(true);
  REQUIRE(bad.size() == 1);  // once, not every step
  CHECK_THAT(bad[0], Catch::Contains("no master shard changed") &&
                         Catch::Contains("original parameters"));
  CHECK(warnings_when(false).empty());
}

TEST_CASE("stepping the optimizer before gradients are reduced is an error",
          "[reliability][misuse]") {
  auto run = [](bool step_early) {
    std::string error;
    std::mutex mu;
    run_ranks(2, [&](Communicator& comm) {
      auto net = make_net();
      auto fsdp = fully_shard(net.ptr(), per_layer(*net), comm);
      torch::optim::AdamW opt(fsdp->parameters());
      loss_of(net, comm.rank(), 0).backward();  // a normal step: masters get gradients
      opt.step();
      fsdp->set_requires_gradient_sync(false);
      loss_of(net, comm.rank(), 1).backward();  // accumulated locally, not reduced
      if (step_early) opt.step();               // the mistake: stale gradients
      fsdp->set_requires_gradient_sync(true);
      try {
        loss_of(net, comm.rank(), 2).backward();
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (comm.rank() == 0) error = e.what_without_backtrace();
        throw;
      }
      opt.step();
    });
    return error;
  };
  CHECK(run(false).empty());
  REQUIRE_THROWS_WITH(run(true), Catch::Contains("set_requires_gradient_sync(false)") &&
                                     Catch::Contains("stale gradients") &&
                                     Catch::Contains("unit '<root>'"));
}

namespace {
// The message of the c10::Error `fn` throws ("" if none).
std::string error_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}
}  // namespace

TEST_CASE("mixed dtypes or devices inside one unit fail at fully_shard", "[reliability][misuse]") {
  run_ranks(2, [](Communicator& comm) {
    auto net = make_net();
    net->typed[0]->fc1->to(at::kDouble);
    // fully_shard is collective: run it outside the assertion lock, assert on its message.
    const std::string e = error_text([&] { fully_shard(net.ptr(), per_layer(*net), comm); });
    RANK_REQUIRE_THAT(e, Catch::Contains("unit 'blocks.0'") &&
                             Catch::Contains("blocks.0.fc1.weight") && Catch::Contains("Double"));
  });
  run_ranks(2, [](Communicator& comm) {
    // (Module::to(kMeta) cannot move a CPU parameter in place; register one on meta instead.)
    auto net = TwoPath();
    net->register_parameter("extra", at::zeros({3}, at::device(at::kMeta)));
    const std::string e =
        error_text([&] { fully_shard(net.ptr(), manual_plan(*net, {{"a"}, {"b"}}), comm); });
    RANK_REQUIRE_THAT(e, Catch::Contains("parameter 'extra' is on meta") &&
                             Catch::Contains("move the model there"));
  });
}

TEST_CASE("backward twice: an autograd error without retain_graph, accumulation with it",
          "[reliability][misuse]") {
  auto grads_after = [](int backwards, bool retain) {
    std::map<std::string, at::Tensor> grads;
    std::mutex mu;
    run_ranks(2, [&](Communicator& comm) {
      auto net = make_net();
      auto fsdp = fully_shard(net.ptr(), per_layer(*net), comm);
      auto loss = loss_of(net, comm.rank(), 0);
      for (int i = 0; i < backwards; ++i) loss.backward({}, /*retain_graph=*/retain);
      auto g = fsdp->gather_full_grads();
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0)
        for (auto& kv : g) grads[kv.first] = kv.second;
    });
    return grads;
  };
  REQUIRE_THROWS_WITH(grads_after(2, false), Catch::Contains("backward through the graph a second time"));
  // With retain_graph the second pass adds to the reduced gradients, as unsharded PyTorch does.
  auto once = grads_after(1, true);
  auto twice = grads_after(2, true);
  REQUIRE(once.size() == twice.size());
  for (auto& kv : once) {
    CAPTURE(kv.first);
    CHECK(kv.second.abs().sum().item<double>() > 0);
    CHECK(at::allclose(twice.at(kv.first), kv.second * 2, 1e-5, 1e-7));
  }
}

TEST_CASE("flatshard-explain: bad flags and specs say what to fix: usage 2, bad input 1",
          "[reliability][cli]") {
  // Command-line errors exit 2 with one line "flatshard-explain: error: ..." (cli/exit.h,
  // flatshard-bench's convention); a valid command line whose input is wrong (a policy that does
  // not parse) exits 1.
  struct Case {
    std::string args;
    const char* says;
    int code = 2;
  };
  const std::vector<Case> cases = {
      {"--world 2 --bogus", "--bogus"},
      {"--preset tiny", "--world is required"},
      {"--world 0", "--world"},
      {"--world 2 --preset huge", "huge"},
      {"--world 2 --memory-limit 40XB", "'40XB' is not a size"},
      {"--world 2 --policy 'type=Block;sise>=1e7'", "column 12", 1},
      {"--world 2 --strategy half", "half"},
      {"--world 2 --reference-step-ms 0", "--reference-step-ms"},
      {"--world 2 --collective-latency-us -1", "--collective-latency-us"},
  };
  for (const auto& c : cases) {
    const std::string cmd = std::string(FLATSHARD_EXPLAIN_EXE) + " " + c.args + " 2>&1 </dev/null";
    FILE* p = ::popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    std::string out;
    char buf[512];
    while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
    const int status = ::pclose(p);
    CAPTURE(c.args, out);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == c.code);
    CHECK(out.find(c.says) != std::string::npos);
    if (c.code == 2) CHECK(out.find("flatshard-explain: error: ") != std::string::npos);
  }
}

TEST_CASE("flatshard-explain: the latency flags reach the fragmentation warning",
          "[reliability][cli]") {
  // Per-layer tiny GPT at world 2: root + 2 blocks = 3 + 2 + 3 = 8 collectives per step (the
  // root keeps its parameters). 8 x 500 us = 4 ms = 40% of a 10 ms reference step.
  const std::string cmd = std::string(FLATSHARD_EXPLAIN_EXE) +
                          " --preset tiny --world 2 --collective-latency-us 500"
                          " --reference-step-ms 10 2>&1 </dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int status = ::pclose(p);
  CAPTURE(out);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(out.find("8 collectives per step x ~500.0 us latency = 4.0 ms, 40% of a 10.0 ms "
                 "reference step") != std::string::npos);
}
