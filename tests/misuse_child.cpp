// The misuse scenarios of tests/misuse_test.cpp, one per process: `misuse_child <scenario>
// <world>` runs it on <world> ranks as threads and prints "ERROR: <message>" (exit 3) when it
// throws, "OK" (exit 0) when it does not. A crash (the bug these tests guard against) ends the
// process with a signal and a hang is killed by the caller's timeout: either fails the test,
// never the test runner.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdio>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <tuple>

#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "optim/fused_adamw.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "parity_util.h"

using namespace flatshard;

namespace {

// x * weight after normalising, as LLaMA's RMSNorm: the elementwise first use of a parameter
// that segfaulted on a freed buffer.
struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t d) : weight(register_parameter("weight", at::ones({d}))) {}
  at::Tensor forward(const at::Tensor& x) {
    return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6) * weight;
  }
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// inp -> norm (RMSNorm) -> ln (LayerNorm) -> fc (Linear), each a unit; `forget` names the
// one whose call site calls forward() directly instead of flatshard::call.
struct ForgetfulImpl : torch::nn::Module {
  ForgetfulImpl()
      : inp(register_module("inp", torch::nn::Linear(5, 6))),
        norm(register_module("norm", RMSNorm(6))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})))),
        fc(register_module("fc", torch::nn::Linear(6, 3))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = forget == "inp" ? inp->forward(x) : flatshard::call(inp, x);
    h = forget == "norm" ? norm->forward(h) : flatshard::call(norm, h);
    h = forget == "ln" ? ln->forward(h) : flatshard::call(ln, h);
    return forget == "fc" ? fc->forward(h) : flatshard::call(fc, h);
  }
  torch::nn::Linear inp;
  RMSNorm norm;
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc;
  std::string forget;
};
TORCH_MODULE(Forgetful);

Plan plan_of(torch::nn::Module& m) {
  return flatshard_test::manual_plan(m, {{"inp"}, {"norm"}, {"ln"}, {"fc"}});
}

at::Tensor batch(int rank) {
  auto gen = at::detail::createCPUGenerator(7 + rank);
  return at::randn({4, 5}, gen);
}

// One training step through the root; returns the model's output.
void train_step(Forgetful& net, int rank) {
  auto loss = flatshard::call(net, batch(rank)).pow(2).mean();
  loss.backward();
}

using Scenario = std::function<void(Communicator&)>;

std::map<std::string, Scenario> scenarios() {
  std::map<std::string, Scenario> s;
  // A forgotten call site in forward, with each kind of first use of the parameters.
  for (const char* unit : {"inp", "norm", "ln", "fc"}) {
    s[std::string("forgot_call_") + unit] = [unit](Communicator& comm) {
      auto net = Forgetful();
      net->forget = unit;
      auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
      train_step(net, comm.rank());
    };
  }
  // User code reading a sharded parameter between steps, several ways.
  const std::map<std::string, std::function<void(const at::Tensor&)>> reads = {
      {"sum", [](const at::Tensor& p) { (void)p.detach().sum(); }},
      {"item", [](const at::Tensor& p) { (void)p[0].item<float>(); }},
      {"clone", [](const at::Tensor& p) { (void)p.clone(); }},
      {"to_double", [](const at::Tensor& p) { (void)p.to(at::kDouble); }},
      {"mul", [](const at::Tensor& p) { (void)(p * 2); }},
      {"print", [](const at::Tensor& p) { (void)p.toString(); std::ostringstream o; o << p; }},
  };
  for (const auto& [name, read] : reads) {
    s["read_between_steps_" + name] = [read = read](Communicator& comm) {
      auto net = Forgetful();
      auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
      train_step(net, comm.rank());
      read(net->norm->weight);
    };
  }
  // A prefetched unit is gathered but not entered: still guarded.
  s["read_prefetched"] = [](Communicator& comm) {
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
    train_step(net, comm.rank());  // records the order, so the next forward prefetches
    net->forget = "norm";          // inp's entry prefetches norm; its forward() is direct
    train_step(net, comm.rank());
  };
  // After the ShardedModel is destroyed: reading a parameter, and a forward (now plain calls).
  s["after_destroy_read"] = [](Communicator& comm) {
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
    train_step(net, comm.rank());
    fsdp.reset();
    (void)net->fc->weight.sum();
  };
  s["after_destroy_forward"] = [](Communicator& comm) {
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
    train_step(net, comm.rank());
    fsdp.reset();
    train_step(net, comm.rank());
  };
  s["backward_after_destroy"] = [](Communicator& comm) {
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
    auto loss = flatshard::call(net, batch(comm.rank())).pow(2).mean();
    fsdp.reset();
    loss.backward();
  };
  // fully_shard twice on one model, and on a part of a sharded model; the first ShardedModel
  // still trains afterwards.
  s["fully_shard_twice"] = [](Communicator& comm) {
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
    try {
      auto again = fully_shard(net.ptr(), plan_of(*net), comm);
    } catch (const c10::Error&) {
      train_step(net, comm.rank());  // the first one is intact
      throw;
    }
  };
  s["fully_shard_part_of_sharded"] = [](Communicator& comm) {
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
    auto part = fully_shard(net->norm.ptr(), flatshard_test::manual_plan(*net->norm, {}), comm);
  };
  // Deferred initialization (fsdp/deferred_init.h): the parameters began as meta tensors and
  // were given storage in place; the guards must hold as for an eager model, and a model left
  // partly materialised by a failed init must give an error when used, not a crash.
  auto meta_net = [] {
    Forgetful net{nullptr};
    MetaInit meta;
    net = Forgetful();
    return net;
  };
  s["deferred_read_between_steps"] = [meta_net](Communicator& comm) {
    auto net = meta_net();
    ShardingOptions o;
    o.init = [](const std::string&, const at::Tensor& v) { v.fill_(0.1); };
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    train_step(net, comm.rank());
    (void)net->norm->weight.sum();
  };
  s["deferred_use_after_failed_init"] = [meta_net](Communicator& comm) {
    auto net = meta_net();
    ShardingOptions o;
    const bool fails = comm.rank() == comm.world_size() - 1;  // the last rank only
    o.init = [fails](const std::string& name, const at::Tensor& v) {
      if (fails && name == "ln.weight") throw std::runtime_error("no values");
      v.fill_(0.1);
    };
    try {
      auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    } catch (const c10::Error&) {
    }
    train_step(net, comm.rank());
  };
  s["deferred_correct"] = [meta_net](Communicator& comm) {
    auto net = meta_net();
    ShardingOptions o;
    o.init = [](const std::string&, const at::Tensor& v) { v.fill_(0.1); };
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    train_step(net, comm.rank());
    train_step(net, comm.rank());
    for (auto& [name, t] : fsdp->gather_full_params()) (void)t.sum().item<double>();
  };
  // Note [Offload step in backward] (fsdp/offload_step.h): what the backward-time CPU step
  // refuses, and its control (a correct loop: exit 0).
  auto offload_run = [](Communicator& comm, bool attach,
                        const std::function<void(ShardedModel&, FusedAdamW&)>& after_backward) {
    auto net = Forgetful();
    ShardingOptions o;
    o.offload = 1;
    o.offload_step = OffloadStep::kBackward;
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    if (attach) fsdp->attach_optimizer(opt);
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      train_step(net, comm.rank());
      after_backward(*fsdp, *opt);
      opt->step();
    }
  };
  s["offload_step_correct"] = [offload_run](Communicator& comm) {
    offload_run(comm, true, [](ShardedModel&, FusedAdamW&) {});
  };
  s["offload_step_no_optimizer"] = [offload_run](Communicator& comm) {
    offload_run(comm, false, [](ShardedModel&, FusedAdamW&) {});
  };
  s["offload_step_clip"] = [offload_run](Communicator& comm) {
    offload_run(comm, true, [](ShardedModel& fsdp, FusedAdamW&) { fsdp.clip_grad_norm_(1.0); });
  };
  s["offload_step_grad_write"] = [offload_run](Communicator& comm) {
    offload_run(comm, true, [](ShardedModel&, FusedAdamW& opt) {
      at::NoGradGuard no_grad;
      for (auto& p : opt.param_groups()[0].params())
        if (p.grad().defined()) p.mutable_grad().mul_(0.5);  // hand-written clipping
    });
  };
  // Note [Compute copy in the step]: an attached optimizer that outlives its model steps on
  // (its copies are never current again) instead of reaching into the freed units.
  s["step_copy_outlives_model"] = [](Communicator& comm) {
    ShardingOptions o;
    o.strategy = ShardingStrategy::kNoShard;
    o.mixed_precision.param_dtype = at::kBFloat16;
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    fsdp->attach_optimizer(opt);
    flatshard::call(net, batch(comm.rank()).to(at::kBFloat16)).to(at::kFloat).pow(2).mean().backward();
    opt->step();
    fsdp.reset();
    for (auto& p : opt->param_groups()[0].params()) p.mutable_grad() = at::ones_like(p);
    opt->step();
  };
  s["offload_step_attach_default"] = [](Communicator& comm) {
    auto net = Forgetful();
    ShardingOptions o;
    o.offload = 1;
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    fsdp->attach_optimizer(
        std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2)));
  };
  // Note [Delayed offload step]: the delayed mode's own refusals.
  auto delayed_model = [](Communicator& comm, int level) {
    auto net = Forgetful();
    ShardingOptions o;
    o.offload = level;
    o.offload_step = OffloadStep::kDelayed;
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    fsdp->attach_optimizer(opt);
    return std::make_tuple(net, std::move(fsdp), opt);
  };
  s["offload_delayed_correct"] = [delayed_model](Communicator& comm) {
    auto [net, fsdp, opt] = delayed_model(comm, 1);
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      train_step(net, comm.rank());
      opt->step();
    }
    fsdp->sync_offload_params();
  };
  s["offload_delayed_amsgrad"] = [](Communicator& comm) {
    auto net = Forgetful();
    ShardingOptions o;
    o.offload = 1;
    o.offload_step = OffloadStep::kDelayed;
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm, o);
    fsdp->attach_optimizer(std::make_shared<FusedAdamW>(
        fsdp->parameters(), torch::optim::AdamWOptions(1e-2).amsgrad(true)));
  };
  s["offload_delayed_level2"] = [delayed_model](Communicator& comm) { delayed_model(comm, 2); };
  s["offload_delayed_clip"] = [delayed_model](Communicator& comm) {
    auto [net, fsdp, opt] = delayed_model(comm, 1);
    train_step(net, comm.rank());
    fsdp->clip_grad_norm_(1.0);
  };
  s["offload_delayed_retained"] = [delayed_model](Communicator& comm) {
    auto [net, fsdp, opt] = delayed_model(comm, 1);
    auto loss = flatshard::call(net, batch(comm.rank())).pow(2).mean();
    loss.backward({}, /*retain_graph=*/true);
    opt->step();
    loss.backward();
  };
  // Control: the correct program runs (exit 0), so the scenarios above fail for their misuse.
  s["correct"] = [](Communicator& comm) {
    auto net = Forgetful();
    auto fsdp = fully_shard(net.ptr(), plan_of(*net), comm);
    train_step(net, comm.rank());
    train_step(net, comm.rank());
    auto full = fsdp->gather_full_params();
    for (auto& [name, t] : full) (void)t.sum().item<double>();
  };
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: misuse_child <scenario> <world>\n");
    return 2;
  }
  auto all = scenarios();
  auto it = all.find(argv[1]);
  if (it == all.end()) {
    std::fprintf(stderr, "unknown scenario '%s'\n", argv[1]);
    return 2;
  }
  try {
    run_ranks(std::stoi(argv[2]), it->second);
  } catch (const c10::Error& e) {
    std::printf("ERROR: %s\n", e.what_without_backtrace());
    return 3;
  } catch (const std::exception& e) {
    std::printf("ERROR: %s\n", e.what());
    return 3;
  }
  std::printf("OK\n");
  return 0;
}
