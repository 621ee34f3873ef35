// Real-training-code misuse (issue 16), each ending in a stated error, never a crash or a hang:
// forgotten flatshard::call sites, sharded parameters read between steps or after the
// ShardedModel is gone, fully_shard twice (run in a child process: tests/misuse_child.cpp, so
// a crash fails the test instead of killing the runner); a policy that matches nothing; non-
// finite gradients in clip_grad_norm_; and eval forwards (with and without NoGradGuard)
// against the unsharded model, with the memory they leave behind.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <sys/wait.h>

#include "parity_util.h"
#include "profiling/counting_allocator.h"
#include "rank_require.h"
#include "tiny_net.h"
#include "planner/explain.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

struct ChildResult {
  bool exited = false;  // false: killed by a signal (a crash) or by the timeout
  int code = -1;
  std::string out;
};

// Runs `misuse_child <scenario> <world>` (optionally with FLATSHARD_DEBUG=1) under a 120 s
// timeout; a crash shows as !exited, a hang as code 124.
ChildResult run_child(const std::string& scenario, int world, bool debug = false) {
  const std::string cmd = std::string(debug ? "FLATSHARD_DEBUG=1 " : "") + "timeout 120 " +
                          MISUSE_CHILD_EXE + " " + scenario + " " + std::to_string(world) +
                          " 2>&1 </dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  ChildResult r;
  char buf[512];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exited = WIFEXITED(status);
  if (r.exited) r.code = WEXITSTATUS(status);
  return r;
}

// The child threw a c10::Error (exit 3) whose message contains every piece of `says`.
void require_error(const std::string& scenario, int world, const std::vector<std::string>& says,
                   bool debug = false) {
  const ChildResult r = run_child(scenario, world, debug);
  CAPTURE(scenario, world, debug, r.out, r.code);
  REQUIRE(r.exited);  // not a crash (signal)
  REQUIRE(r.code == 3);
  for (const auto& s : says) CHECK(r.out.find(s) != std::string::npos);
}

// Collects TORCH_WARN messages of this thread.
struct WarningCollector : c10::WarningHandler {
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  std::vector<std::string> messages;
};

const std::string kGuardAdvice = "instead of calling its forward() directly";

}  // namespace

TEST_CASE("misuse child: the correct program exits 0 (control)", "[misuse]") {
  for (int world : {1, 2}) {
    const ChildResult r = run_child("correct", world);
    CAPTURE(world, r.out);
    REQUIRE(r.exited);
    CHECK(r.code == 0);
  }
}

TEST_CASE("offload_step backward: misuse is an error saying what to do, never a crash",
          "[misuse][offload_step]") {
  // Note [Offload step in backward]: the control trains; each refusal names its cause.
  for (int world : {1, 2}) {
    const ChildResult r = run_child("offload_step_correct", world);
    CAPTURE(world, r.out);
    REQUIRE(r.exited);
    CHECK(r.code == 0);
    require_error("offload_step_no_optimizer", world,
                  {"no optimizer is attached", "attach_optimizer", "rank "});
    require_error("offload_step_clip", world,
                  {"clip_grad_norm_", "took their gradients during backward", "rank "});
    require_error("offload_step_grad_write", world,
                  {"was modified", "already stepped during backward"});
    require_error("offload_step_attach_default", world,
                  {"attach_optimizer", "OffloadStep::kBackward", "rank "});
  }
}

TEST_CASE("An optimizer attached for compute copies outlives its model without a crash",
          "[misuse][optim]") {
  // Note [Compute copy in the step]: the step after the model is gone is a plain step.
  for (int world : {1, 2}) {
    const ChildResult r = run_child("step_copy_outlives_model", world);
    CAPTURE(world, r.out);
    REQUIRE(r.exited);
    CHECK(r.code == 0);
  }
}

TEST_CASE("offload_step delayed: misuse is an error saying what to do, never a crash",
          "[misuse][offload_step]") {
  // Note [Delayed offload step]: the control trains; each refusal names its cause.
  for (int world : {1, 2}) {
    const ChildResult r = run_child("offload_delayed_correct", world);
    CAPTURE(world, r.out);
    REQUIRE(r.exited);
    CHECK(r.code == 0);
    require_error("offload_delayed_amsgrad", world, {"attach_optimizer", "amsgrad", "rank "});
    require_error("offload_delayed_level2", world, {"offload level 2", "offload_step = delayed"});
    require_error("offload_delayed_clip", world,
                  {"clip_grad_norm_", "offload_step = delayed", "rank "});
    require_error("offload_delayed_retained", world,
                  {"retained graph", "offload_step = delayed", "rank "});
  }
}

TEST_CASE("a forgotten flatshard::call is an error naming the unit and the parameter",
          "[misuse]") {
  // The first use differs per unit: addmm on a transposed weight (Linear), x * weight
  // (RMSNorm: this one segfaulted), layer_norm's kernel (LayerNorm).
  for (int world : {1, 2, 3, 4}) {
    for (const std::string unit : {"inp", "norm", "ln", "fc"}) {
      require_error("forgot_call_" + unit, world,
                    {"of unit '" + unit + "'", "parameter '" + unit + ".", "was read while the unit is sharded",
                     "flatshard::call(module", kGuardAdvice});
    }
  }
  // FLATSHARD_DEBUG's cross-rank order check does not get in the way (ranks agree).
  require_error("forgot_call_norm", 2, {"parameter 'norm.weight' of unit 'norm'", kGuardAdvice},
                /*debug=*/true);
  // Gathered by a prefetch but not entered: still guarded.
  require_error("read_prefetched", 2, {"parameter 'norm.weight' of unit 'norm'", kGuardAdvice});
}

TEST_CASE("reading a sharded parameter between steps is an error saying how to read it",
          "[misuse]") {
  for (const char* how : {"sum", "item", "clone", "to_double", "mul", "print"}) {
    require_error(std::string("read_between_steps_") + how, 2,
                  {"parameter 'norm.weight' of unit 'norm' (rank ", "gather_full_params()"});
  }
}

TEST_CASE("sharded parameters after the ShardedModel is destroyed: an error, not a crash",
          "[misuse]") {
  require_error("after_destroy_read", 2,
                {"parameter 'fc.weight' of unit 'fc'", "After the ShardedModel is destroyed"});
  require_error("after_destroy_forward", 2, {"of unit '", "After the ShardedModel is destroyed"});
  require_error("backward_after_destroy", 2,
                {"backward through unit '<root>' (rank ", "after its ShardedModel was destroyed"});
}

TEST_CASE("deferred init: guarded like an eager model; a failed init leaves errors, not crashes",
          "[misuse][deferred]") {
  for (int world : {1, 2}) {
    const ChildResult r = run_child("deferred_correct", world);
    CAPTURE(world, r.out);
    REQUIRE(r.exited);
    CHECK(r.code == 0);
  }
  require_error("deferred_read_between_steps", 2,
                {"parameter 'norm.weight' of unit 'norm' (rank ", "gather_full_params()"});
  // fully_shard failed on every rank (the last one's init threw); the model, part meta, part
  // guarded, is then used anyway.
  for (int world : {1, 3}) require_error("deferred_use_after_failed_init", world, {"unit '"});
}

TEST_CASE("fully_shard twice is an error before anything is built", "[misuse]") {
  // The first ShardedModel trains a step after the failed second call (inside the scenario).
  require_error("fully_shard_twice", 2,
                {"module '<root>' already belongs to unit '<root>'", "applied twice"});
  require_error("fully_shard_part_of_sharded", 2,
                {"module '<root>' already belongs to unit 'norm'", "applied twice"});
}

TEST_CASE("a policy that matches nothing: fully_shard fails listing the model's types and "
          "paths; strict_plan = false warns with explain's text",
          "[misuse][policy]") {
  // Before: fully_shard only warned (strict_plan defaulted to false) and the text named no
  // type and no path of the model.
  auto net = TinyNet(5, 7, 2);
  const Policy typo = parse_policy("type=TinyBlok");
  const std::string text = make_plan(*net, typo).unmatched_warning();
  REQUIRE(text.find("the policy matched no module ('type=TinyBlok')") != std::string::npos);
  // The model's types (as a policy writes them) and its top-level paths (tiny_net.h).
  CHECK(text.find("the model's types are Linear, ModuleList, TinyBlock, LayerNorm") !=
        std::string::npos);
  CHECK(text.find("its top-level paths are inp, blocks, head") != std::string::npos);
  // explain() prints the same sentence.
  const Explanation e = explain(*net, make_plan(*net, typo), MeshShape(2, 1), ShardingOptions{});
  CHECK(std::find(e.warnings.begin(), e.warnings.end(), text) != e.warnings.end());

  // The default: an error on every rank, naming the rank and the way out.
  REQUIRE_THROWS_WITH(run_ranks(2,
                                [&](Communicator& comm) {
                                  auto model = TinyNet(5, 7, 2);
                                  fully_shard(model.ptr(), typo, comm);
                                }),
                      Catch::Contains("fully_shard: " + text) && Catch::Contains("(rank 0)") &&
                          Catch::Contains("strict_plan = false"));
  run_ranks(2, [&](Communicator& comm) {
    WarningCollector collector;
    c10::WarningUtils::WarningHandlerGuard guard(&collector);
    // A policy that matches, and one without rules ('none', bench's 'model': the root alone
    // on purpose): no error, no warning.
    auto other = TinyNet(5, 7, 2);
    auto ok = fully_shard(other.ptr(), parse_policy("type=TinyBlock"), comm);
    auto root_only = TinyNet(5, 7, 2);
    auto whole = fully_shard(root_only.ptr(), parse_policy("none"), comm);
    RANK_CHECK(collector.messages.empty());
    // The opt-out: a warning, once per run (rank 0; the other ranks have the same plan).
    ShardingOptions lenient;
    lenient.strict_plan = false;
    auto model = TinyNet(5, 7, 2);
    auto fsdp = fully_shard(model.ptr(), typo, comm, lenient);
    const size_t warned = comm.rank() == 0 ? 1 : 0;
    RANK_REQUIRE(collector.messages.size() == warned);
    if (warned) RANK_CHECK(collector.messages[0] == "fully_shard: " + text);
  });
}

TEST_CASE("a rule that matches nothing because an earlier rule claimed its modules warns, "
          "naming both rules",
          "[misuse][policy]") {
  // Before: `type=TinyBlock;recompute:type=TinyBlock` trained without recompute, silently.
  auto net = TinyNet(5, 7, 2);
  const Policy shadowed = parse_policy("type=TinyBlock;recompute:type=TinyBlock");
  const Plan plan = make_plan(*net, shadowed);
  REQUIRE(plan.warnings.size() == 1);
  const std::string& w = plan.warnings[0];
  CHECK(w.find("policy rule 2 'recompute:type=TinyBlock' matches no module") != std::string::npos);
  CHECK(w.find("rule 1 'type=TinyBlock' comes first and claimed it") != std::string::npos);
  CHECK(w.find("'blocks.") != std::string::npos);
  for (const UnitSpec& u : plan.units) CHECK_FALSE(u.options.recompute.value_or(false));
  // explain() lists it; fully_shard warns with it once (rank 0).
  const Explanation e = explain(*net, plan, MeshShape(2, 1), ShardingOptions{});
  CHECK(std::find(e.warnings.begin(), e.warnings.end(), w) != e.warnings.end());
  run_ranks(2, [&](Communicator& comm) {
    WarningCollector collector;
    c10::WarningUtils::WarningHandlerGuard guard(&collector);
    auto model = TinyNet(5, 7, 2);
    auto fsdp = fully_shard(model.ptr(), shadowed, comm);
    RANK_REQUIRE(collector.messages.size() == (comm.rank() == 0 ? 1u : 0u));
    if (comm.rank() == 0) RANK_CHECK(collector.messages[0] == "fully_shard: " + w);
  });
  // Not shadowed: the later rule matches modules of its own, or its terms hold nowhere.
  for (const std::string ok : {"path=blocks.0;recompute:type=TinyBlock",
                               "type=TinyBlock;type=Conv2d"}) {
    CAPTURE(ok);
    const Plan p = make_plan(*net, parse_policy(ok));
    CHECK(p.warnings.empty());
  }
  // A size term is judged on what the module had unclaimed, as when matching: a TinyBlock(7)
  // holds 14 + 120 + 112 = 246 elements, each Linear inside it less than 200.
  const Plan sized = make_plan(*net, parse_policy("type=TinyBlock;noshard:size>=200"));
  REQUIRE(sized.warnings.size() == 1);
  CHECK(sized.warnings[0].find("rule 2 'noshard:size>=200' matches no module") !=
        std::string::npos);
  CHECK(make_plan(*net, parse_policy("type=TinyBlock;noshard:size>=300")).warnings.empty());
}

namespace {

Plan per_layer(torch::nn::Module& m) { return manual_plan(m, {{"blocks.0"}, {"blocks.1"}}); }

TinyNet fresh_net() {
  auto net = TinyNet(5, 7, 2);
  init_params(*net, 3);
  return net;
}

at::Tensor batch_of(int rank, int step = 0) {
  auto gen = at::detail::createCPUGenerator(1000 * step + rank);
  return at::randn({3, 5}, gen);
}

// The union of the ranks' batches: the unsharded reference's input.
at::Tensor union_batch(int world, int step = 0) {
  std::vector<at::Tensor> xs;
  for (int r = 0; r < world; ++r) xs.push_back(batch_of(r, step));
  return at::cat(xs);
}

// Sharded units whose parameters are gathered now.
int gathered_units(const ShardedModel& m) {
  int n = 0;
  for (size_t i = 0; i < m.num_units(); ++i)
    if (m.unit(i).strategy() != ShardingStrategy::kNoShard &&
        m.unit(i).state() == UnitState::kUnsharded)
      ++n;
  return n;
}

}  // namespace

TEST_CASE("clip_grad_norm_ returns the unsharded global norm; non-finite gradients name the unit",
          "[misuse][parity]") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    // Reference: the unsharded model on the union batch (the mean loss, as the ranks' average).
    auto ref = fresh_net();
    flatshard::call(ref, union_batch(world)).pow(2).mean().backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1e9);
    REQUIRE(ref_norm > 0);

    std::mutex mu;
    std::vector<double> norms(world);
    run_ranks(world, [&](Communicator& comm) {
      auto net = fresh_net();
      auto fsdp = fully_shard(net.ptr(), per_layer(*net), comm);
      flatshard::call(net, batch_of(comm.rank())).pow(2).mean().backward();
      const double n = fsdp->clip_grad_norm_(1e9, /*error_if_nonfinite=*/true);
      std::lock_guard<std::mutex> lock(mu);
      norms[comm.rank()] = n;
    });
    for (double n : norms) CHECK(n == Approx(ref_norm).epsilon(1e-5));

    // A NaN (or inf) in one shard of 'blocks.1' on the last rank only: every rank throws naming
    // that unit, and leaves the gradients as they were.
    for (const float bad : {NAN, INFINITY}) {
      CAPTURE(bad);
      std::vector<std::string> errors(world);
      run_ranks(world, [&](Communicator& comm) {
        auto net = fresh_net();
        auto fsdp = fully_shard(net.ptr(), per_layer(*net), comm);
        flatshard::call(net, batch_of(comm.rank())).pow(2).mean().backward();
        RANK_REQUIRE(fsdp->unit(2).name() == "blocks.1");
        if (comm.rank() == world - 1) fsdp->unit(2).flat().master().mutable_grad()[0] = bad;
        const at::Tensor before = fsdp->unit(1).flat().master().grad().clone();
        try {
          fsdp->clip_grad_norm_(1e-3, /*error_if_nonfinite=*/true);
        } catch (const c10::Error& e) {
          std::lock_guard<std::mutex> lock(mu);
          errors[comm.rank()] = e.what_without_backtrace();
        }
        RANK_CHECK(at::equal(fsdp->unit(1).flat().master().grad(), before));  // not clipped
        // Without the option: no error, the non-finite norm is returned (as torch does).
        const double n = fsdp->clip_grad_norm_(1e-3);
        RANK_CHECK(!std::isfinite(n));
      });
      for (int r = 0; r < world; ++r) {
        CAPTURE(r, errors[r]);
        CHECK(errors[r].find("the first unit with a non-finite gradient is 'blocks.1'") !=
              std::string::npos);
        CHECK(errors[r].find("(rank " + std::to_string(r) + ")") != std::string::npos);
        CHECK(errors[r].find("error_if_nonfinite=false") != std::string::npos);
      }
    }
  }
}

TEST_CASE("eval under NoGradGuard equals the unsharded model and reshards every unit",
          "[misuse][parity][eval]") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    auto ref = fresh_net();
    at::Tensor expected;
    {
      at::NoGradGuard no_grad;
      expected = flatshard::call(ref, union_batch(world));
    }
    std::mutex mu;
    std::vector<at::Tensor> outs(world);
    run_ranks(world, [&](Communicator& comm) {
      auto net = fresh_net();
      // blocks.0 SHARD_GRAD_OP: it would keep its parameters for a backward in grad mode.
      UnitOptions grad_op;
      grad_op.strategy = ShardingStrategy::kShardGradOp;
      auto fsdp = fully_shard(net.ptr(), manual_plan(*net, {{"blocks.0"}, {"blocks.1"}}, {grad_op}),
                              comm);
      for (int rep = 0; rep < 2; ++rep) {  // the second forward prefetches (order recorded)
        at::NoGradGuard no_grad;
        at::Tensor out = flatshard::call(net, batch_of(comm.rank()));
        RANK_CHECK(gathered_units(*fsdp) == 0);
        std::lock_guard<std::mutex> lock(mu);
        outs[comm.rank()] = out;
      }
    });
    CHECK(at::allclose(at::cat(outs), expected, 1e-5, 1e-6));
  }
}

TEST_CASE("eval that forgot NoGradGuard frees the gathered parameters when its outputs go",
          "[misuse][eval]") {
  // The rule (Note [Forward without backward], fsdp/runtime.cpp): a forward in grad mode keeps
  // what a backward needs (the root, SHARD_GRAD_OP units) while any of its outputs' graph is
  // alive; once the last is dropped without a backward, every unit reshards. Measured with the
  // counting allocator: live CPU bytes (both ranks) return to what they were before the forward.
  auto& counter = profiling::CountingCpuAllocator::install();
  const int world = 2;
  auto ref = fresh_net();
  const at::Tensor expected = flatshard::call(ref, union_batch(world)).detach();
  ref->zero_grad();
  flatshard::call(ref, union_batch(world, 1)).pow(2).mean().backward();
  std::map<std::string, at::Tensor> ref_grads;
  for (auto& p : ref->named_parameters()) ref_grads[p.key()] = p.value().grad();

  int64_t base = 0, held = 0, after = 0, first_base = 0, kept_bytes = 0;
  std::vector<std::array<int64_t, 3>> bytes;  // per measured forward: before, held, after
  std::mutex mu;
  std::vector<at::Tensor> outs(world);
  std::map<std::string, at::Tensor> grads;
  run_ranks(world, [&](Communicator& comm) {
    auto net = fresh_net();
    UnitOptions grad_op;
    grad_op.strategy = ShardingStrategy::kShardGradOp;
    auto fsdp = fully_shard(net.ptr(), manual_plan(*net, {{"blocks.0"}, {"blocks.1"}}, {grad_op}),
                            comm);
    const at::Tensor x = batch_of(comm.rank());
    for (int rep = 0; rep < 3; ++rep) {
      comm.barrier();
      if (comm.rank() == 0) base = counter.current_bytes();
      if (comm.rank() == 0 && rep == 0) first_base = base;
      comm.barrier();
      {
        at::Tensor out = flatshard::call(net, x);  // grad mode, no backward: an eval loop's bug
        RANK_CHECK(gathered_units(*fsdp) == 2);         // the root and blocks.0 wait for a backward
        if (comm.rank() == 0 && rep == 0)  // what they hold gathered on one rank
          for (const UnitInfo& u : fsdp->units())
            if (u.name == "<root>" || u.name == "blocks.0") kept_bytes += 4 * u.padded_numel;
        comm.barrier();
        if (comm.rank() == 0) held = counter.current_bytes();
        comm.barrier();
        std::lock_guard<std::mutex> lock(mu);
        outs[comm.rank()] = out.detach().clone();
      }
      RANK_CHECK(gathered_units(*fsdp) == 0);  // the output (and its graph) is gone: step closed
      comm.barrier();
      if (comm.rank() == 0) after = counter.current_bytes();
      comm.barrier();
      // (rep 0's base lacks the kept copy of the output)
      if (comm.rank() == 0 && rep > 0) bytes.push_back({base, held, after});
    }
    // Training afterwards is unaffected: the gradients equal the unsharded model's.
    flatshard::call(net, batch_of(comm.rank(), 1)).pow(2).mean().backward();
    auto g = fsdp->gather_full_grads();
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0)
      for (auto& kv : g) grads[kv.first] = kv.second;
  });
  REQUIRE(bytes.size() == 2);
  for (const auto& [before, with_output, dropped] : bytes) {
    CAPTURE(before, with_output, dropped);
    CHECK(with_output > before);
    CHECK(dropped <= before);
    // Against the first forward's start: only the kept output copies (a few dozen bytes) more.
    // The old rule left the root and blocks.0 gathered on both ranks: 2 x kept_bytes more.
    CAPTURE(first_base, kept_bytes);
    CHECK(dropped - first_base < kept_bytes);
  }
  CHECK(at::allclose(at::cat(outs), expected, 1e-5, 1e-6));
  REQUIRE(grads.size() == ref_grads.size());
  for (auto& [name, g] : ref_grads) {
    CAPTURE(name);
    CHECK(at::allclose(grads.at(name), g, 1e-5, 1e-6));
  }
}
