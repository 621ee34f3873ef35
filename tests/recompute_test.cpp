// Activation checkpointing per unit (Note [Recompute], fsdp/recompute.h), on CPU with ranks as
// threads:
// - the spec forms ("recompute:", "keep+recompute:", either order) and each error, with column
//   and caret; the Policy builder and Plan::to_string; root and nested-unit rejections; enter();
// - GPT and LLaMA at world 1-4 with every layer recomputed, FULL_SHARD and keep (no reshard
//   after forward): parity with the unsharded model (tests/parity_util.h, its tolerances) and
//   bitwise equality with the same sharded run without recompute (the recompute runs the same
//   kernels on the same inputs, so nothing may differ);
// - collectives: a recomputed FULL_SHARD unit still does exactly 1 forward and 1 backward
//   all-gather per step (the recompute reuses the pre-backward gather), the same numbers as
//   without recompute; keep: 0 backward gathers;
// - memory: the bytes a forward leaves alive for backward (counting CPU allocator) drop to a
//   fraction with recompute;
// - dropout draws the same mask in the recompute, and backward leaves the caller's RNG stream as
//   without recompute; a unit called twice per forward and two forwards before one backward;
//   eval (NoGradGuard) runs normally; mixed precision (bf16) matches bitwise;
// - ranks that disagree on the option fail at setup (the fingerprint names it).
#include <catch2/catch.hpp>

#include <torch/nn/modules/linear.h>

#include <mutex>

#include "collectives/thread_communicator.h"
#include "planner/explain.h"
#include "fsdp/resolve.h"
#include "gpt_parity_spec.h"
#include "models/llama.h"
#include "parity_util.h"
#include "profiling/counting_allocator.h"
#include "tiny_net.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"
#include "rank_require.h"

using namespace flatshard;
using namespace flatshard_test;
namespace g = flatshard::gpt;
namespace ll = flatshard::llama;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  FAIL("expected a c10::Error");
  return "";
}

// The spec error names `column` and puts the caret under it (spec.h's error format).
void require_spec_error(const std::string& spec, int column, const std::string& what,
                        const std::string& expected) {
  const std::string msg = error_of([&] { parse_policy(spec); });
  INFO("spec '" << spec << "' ->\n" << msg);
  REQUIRE(msg.find(what) != std::string::npos);
  REQUIRE(msg.find(" at column " + std::to_string(column) + " (expected ") != std::string::npos);
  REQUIRE(msg.find(expected) != std::string::npos);
  REQUIRE(msg.find("\n  " + spec + "\n" + std::string(2 + column - 1, ' ') + "^") !=
          std::string::npos);
}

// Every layer's rule with `prefix` ("recompute", "keep+recompute", "" for none).
std::string layers(const std::string& prefix, const std::string& type) {
  return (prefix.empty() ? "" : prefix + ":") + "type=" + type;
}

ParitySpec llama_spec(int world, const std::string& policy_spec) {
  ParitySpec s;
  s.world = world;
  s.make_model = [] {
    ll::LlamaConfig c;  // odd sizes as in llama_parity_test.cpp: padding at every world > 1
    c.vocab = 97;
    c.d_model = 36;
    c.n_heads = 3;
    c.n_kv_heads = 1;
    c.n_layers = 3;
    c.seq_len = 11;
    c.hidden = 50;
    return std::static_pointer_cast<torch::nn::Module>(ll::Llama(c, 11).ptr());
  };
  s.plan = [policy_spec](torch::nn::Module& m) {
    return make_plan(m, policy_spec.empty() ? Policy{} : parse_policy(policy_spec));
  };
  s.loss = [](const std::shared_ptr<torch::nn::Module>& m, int rank, int step, int micro) {
    auto model = std::static_pointer_cast<ll::LlamaImpl>(m);
    auto [x, y] = ll::synthetic_batch(model->config(), 2, 5, rank, step * 16 + micro);
    return enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
  };
  return s;
}

void require_identical(const ParityRun& a, const ParityRun& b) {
  REQUIRE(a.losses == b.losses);
  REQUIRE(a.grads.size() == b.grads.size());
  for (const auto& [name, t] : a.grads) {
    CAPTURE(name);
    REQUIRE(at::equal(t, b.grads.at(name)));
  }
  for (const auto& [name, t] : a.params) {
    CAPTURE(name);
    REQUIRE(at::equal(t, b.params.at(name)));
  }
}

void require_same_counters(const StepCounters& a, const StepCounters& b) {
  REQUIRE(a.per_unit.size() == b.per_unit.size());
  for (size_t i = 0; i < a.per_unit.size(); ++i) {
    CAPTURE(i);
    CHECK(a.per_unit[i].forward_all_gathers == b.per_unit[i].forward_all_gathers);
    CHECK(a.per_unit[i].backward_all_gathers == b.per_unit[i].backward_all_gathers);
    CHECK(a.per_unit[i].reduce_scatters == b.per_unit[i].reduce_scatters);
    CHECK(a.per_unit[i].all_reduces == b.per_unit[i].all_reduces);
    CHECK(a.per_unit[i].bytes == b.per_unit[i].bytes);
  }
}

// GPT or LLaMA, every layer recomputed under `prefix`, worlds 1-4: parity with the unsharded
// model, bitwise equality with the run without recompute, and the collective counts.
void check_family(const std::function<ParitySpec(int, const std::string&)>& make,
                  const std::string& layer_type) {
  for (int world = 1; world <= 4; ++world) {
    const ParityRun ref = run_reference(make(world, ""));
    for (const std::string strategy : {"", "keep"}) {
      CAPTURE(world, strategy);
      const ParityRun plain = run_sharded(make(world, layers(strategy, layer_type)));
      const std::string rc = strategy.empty() ? "recompute" : strategy + "+recompute";
      const ParityRun got = run_sharded(make(world, layers(rc, layer_type)));
      require_parity(ref, got);
      require_identical(plain, got);
      require_same_counters(plain.last_step_counters, got.last_step_counters);
      const auto& units = got.last_step_counters.per_unit;
      REQUIRE(units.size() == 4u);  // the root + 3 layers
      for (size_t i = 1; i < units.size(); ++i) {
        CAPTURE(i);
        CHECK(units[i].forward_all_gathers == 1);
        // One gather serves the backward and the recompute (keep: the forward's is kept).
        CHECK(units[i].backward_all_gathers == (strategy.empty() ? 1 : 0));
        CHECK(units[i].reduce_scatters == 1);
      }
    }
  }
}

// A unit with dropout inside: LayerNorm-free residual Linear + dropout, so masks matter.
struct DropBlockImpl : torch::nn::Module {
  explicit DropBlockImpl(int64_t d) : fc(register_module("fc", torch::nn::Linear(d, d))) {}
  at::Tensor forward(const at::Tensor& x) {
    return x + at::dropout(at::tanh(flatshard::call(fc, x)), 0.4, /*train=*/true);
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(DropBlock);

struct DropNetImpl : torch::nn::Module {
  DropNetImpl()
      : inp(register_module("inp", torch::nn::Linear(5, 9))),
        b0(register_module("b0", DropBlock(9))),
        b1(register_module("b1", DropBlock(9))),
        head(register_module("head", torch::nn::Linear(9, 2))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = flatshard::call(inp, x);
    h = flatshard::call(b0, h);
    h = flatshard::call(b1, h);
    return flatshard::call(head, h);
  }
  torch::nn::Linear inp;
  DropBlock b0, b1;
  torch::nn::Linear head;
};
TORCH_MODULE(DropNet);

}  // namespace

TEST_CASE("recompute spec: accepted forms, the builder, round trips and to_string",
          "[recompute][spec]") {
  const std::pair<const char*, UnitOptions> cases[] = {
      {"recompute:type=Block", recompute()},
      {"keep+recompute:type=Block", recompute(full_shard_keep())},
      {"recompute+keep:type=Block", recompute(full_shard_keep())},
      {" recompute + grad_op : type=Block", recompute(shard_grad_op())},
      {"noshard+recompute:type=Block", recompute(no_shard())},
      {"full+recompute:type=Block", recompute(full_shard())},
  };
  for (const auto& [spec, options] : cases) {
    CAPTURE(spec);
    const Policy p = parse_policy(spec);
    REQUIRE(p.rules.size() == 1);
    CHECK(p.rules[0].options == options);
    CHECK(p.rules[0].options.recompute == true);
    // to_spec is canonical (strategy first) and parses back to the same options.
    CHECK(parse_policy(p.to_spec()).rules[0].options == options);
  }
  CHECK(parse_policy("recompute+keep:type=Block").to_spec() == "keep+recompute:type=Block");
  CHECK(parse_policy("recompute:type=Block;root:keep").to_spec() ==
        "recompute:type=Block;root:keep");
  // Not recompute unless asked: the existing prefixes leave it unset.
  CHECK(!parse_policy("keep:type=Block").rules[0].options.recompute.has_value());
  // recompute=false has no spec form: to_spec says so rather than dropping it.
  UnitOptions off;
  off.recompute = false;
  CHECK(single(with_options(by_type("Block"), off)).to_spec().find("recompute=false") !=
        std::string::npos);

  auto model = g::GPT(parity_gpt_config(), 11);
  const Plan plan = make_plan(*model, parse_policy("keep+recompute:type=Block"));
  REQUIRE(plan.units.size() == 4u);
  CHECK(!plan.units[0].options.recompute.has_value());
  for (size_t i = 1; i < plan.units.size(); ++i) CHECK(plan.units[i].options.recompute == true);
  const std::string table = plan.to_string();
  CHECK(table.find("FULL_SHARD keep recompute") != std::string::npos);
}

TEST_CASE("recompute spec: each error names the column and carets it", "[recompute][spec]") {
  struct Case {
    const char* spec;
    int column;
    const char* what;
    const char* expected;
  };
  const Case cases[] = {
      {"recompute+recompute:type=Block", 11, "'recompute' given twice", "at most one"},
      {"keep+full:type=Block", 6, "second strategy 'full' after 'keep'", "one strategy per rule"},
      {"keep+:type=Block", 6, "unexpected ':' after '+'", "one of: noshard"},
      {"keep+", 6, "missing option after '+'", "recompute"},
      {"recompute+fast:type=Block", 11, "unknown option 'fast'",
       "keep, recompute, offload, offload0, offload1, offload2, gather_param, gather_fp8, "
       "gather_int8, gather_fp8_delayed, root"},
      {"keep+recompute type=Block", 16, "unexpected 'type' after the options",
       "keep+recompute:type=Block"},
      {"root:recompute", 6, "'recompute' on the root unit", "not recomputed"},
      {"root:keep+recompute", 10, "'+' after the root option", "never recomputed"},
      {"type=Block,recompute:path=x", 12, "option prefix 'recompute:' in the middle of a rule",
       "a rule takes one prefix"},
      {"recomput:type=Block", 1, "unknown option 'recomput'", "recompute"},
  };
  for (const auto& c : cases) require_spec_error(c.spec, c.column, c.what, c.expected);
}

TEST_CASE("recompute: the root, units nested in a recompute unit, and enter() are rejected",
          "[recompute]") {
  auto model = g::GPT(parity_gpt_config(), 11);
  // The root (from the C++ Policy API; the spec cannot say it): resolve, fully_shard, explain.
  Policy root_rc = single(by_type("Block"));
  root_rc.set_root_options(recompute());
  const Plan root_plan = make_plan(*model, root_rc);
  const std::string root_msg =
      error_of([&] { resolve_unit(root_plan.units[0], ShardingOptions{}, 2); });
  CHECK(root_msg.find("unit '<root>': recompute is not supported on the root unit") !=
        std::string::npos);
  run_ranks(1, [&](Communicator& comm) {
    auto m = std::static_pointer_cast<torch::nn::Module>(g::GPT(parity_gpt_config(), 11).ptr());
    CHECK(error_of([&] { fully_shard(m, make_plan(*m, root_rc), comm); }).find("root unit") !=
          std::string::npos);
  });

  // A unit inside a recompute unit: both named, by check_recompute_plan, explain and fully_shard.
  const Plan nested = make_plan(*model, parse_policy("recompute:type=Block;type=Linear"));
  const std::string nested_msg = error_of([&] { check_recompute_plan(nested); });
  INFO(nested_msg);
  CHECK(nested_msg.find("unit 'blocks.0' is recomputed but its member module 'blocks.0' "
                        "contains module 'blocks.0.") != std::string::npos);
  CHECK(nested_msg.find("nested inside a recompute unit") != std::string::npos);
  CHECK(error_of([&] {
          explain(*model, nested, MeshShape(2, 1), ShardingOptions{});
        }).find("nested inside a recompute unit") != std::string::npos);
  // The other way round (a recompute unit inside an ordinary one) is fine.
  check_recompute_plan(make_plan(*model, parse_policy("type=Block;recompute:type=Linear")));
  // explain shows the flag.
  const Plan ok = make_plan(*model, parse_policy("recompute:type=Block"));
  CHECK(explain(*model, ok, MeshShape(2, 1), ShardingOptions{})
            .to_string()
            .find("FULL_SHARD recompute") != std::string::npos);

  // enter() cannot know a closure's tensor inputs: an error in grad mode, allowed without grad.
  run_ranks(1, [&](Communicator& comm) {
    auto net = TinyNet(5, 7, 2);
    init_params(*net, 3);
    auto fsdp = fully_shard(
        net.ptr(), manual_plan(*net, {{"blocks.0"}, {"blocks.1"}}, {recompute(), recompute()}),
        comm);
    const at::Tensor x = at::randn({4, 7});
    auto& blk = net->typed[0];
    const std::string msg = error_of([&] { enter(blk, [&] { return blk->forward(x); }); });
    CHECK(msg.find("unit 'blocks.0' has the recompute option; enter it with flatshard::call") !=
          std::string::npos);
    at::NoGradGuard no_grad;
    CHECK(enter(blk, [&] { return blk->forward(x); }).sizes() == x.sizes());
  });
}

TEST_CASE("GPT with every Block recomputed matches unsharded training at worlds 1-4",
          "[recompute][parity][gpt]") {
  check_family(gpt_parity_spec, "Block");
}

TEST_CASE("LLaMA with every DecoderLayer recomputed matches unsharded training at worlds 1-4",
          "[recompute][parity][llama]") {
  check_family(llama_spec, "DecoderLayer");
}

TEST_CASE("recompute units nested in ordinary units, grouped, NO_SHARD, and in bf16",
          "[recompute][parity][gpt]") {
  // Per-leaf recompute inside per-layer units: the Linear leaves are entered from a Block's
  // forward with a temporary argument (x.reshape).
  {
    const ParityRun plain = run_sharded(gpt_parity_spec(2, "type=Block;type=Linear"));
    const ParityRun got = run_sharded(gpt_parity_spec(2, "type=Block;recompute:type=Linear"));
    require_parity(run_reference(gpt_parity_spec(2, "")), got);
    require_identical(plain, got);
    require_same_counters(plain.last_step_counters, got.last_step_counters);
  }
  // Grouped units (two Blocks per unit: a recompute node per member call) and a NO_SHARD
  // recompute unit (nothing to gather; the recompute reads the replicated copy).
  for (const auto& [plain_spec, rc_spec] : std::vector<std::pair<std::string, std::string>>{
           {"every=2,type=Block", "recompute:every=2,type=Block"},
           {"noshard:path=blocks.1;type=Block",
            "noshard+recompute:path=blocks.1;recompute:type=Block"}}) {
    CAPTURE(rc_spec);
    const ParityRun plain = run_sharded(gpt_parity_spec(3, plain_spec));
    const ParityRun got = run_sharded(gpt_parity_spec(3, rc_spec));
    require_parity(run_reference(gpt_parity_spec(3, "")), got);
    require_identical(plain, got);
    require_same_counters(plain.last_step_counters, got.last_step_counters);
  }
  // bf16 compute: the recompute sees the same casted inputs, so the same bits come out.
  auto bf16 = [](const std::string& spec) {
    ParitySpec s = gpt_parity_spec(2, spec);
    s.steps = 2;
    s.options.mixed_precision.param_dtype = at::kBFloat16;
    return s;
  };
  require_identical(run_sharded(bf16("type=Block")), run_sharded(bf16("recompute:type=Block")));
}

TEST_CASE("recompute keeps a fraction of the activations alive between forward and backward",
          "[recompute][memory]") {
  auto& alloc = profiling::CountingCpuAllocator::install();  // before any model is built
  g::GPTConfig c = parity_gpt_config();
  c.d_model = 48;
  c.n_heads = 4;
  c.n_layers = 4;
  c.seq_len = 48;
  // Bytes alive after the forward (the graph holds what backward needs) minus before it, and
  // the step-0 gradients.
  auto measure = [&](const std::string& spec) {
    int64_t held = 0;
    std::vector<std::pair<std::string, at::Tensor>> grads;
    run_ranks(1, [&](Communicator& comm) {
      auto model = g::GPT(c, 11);
      auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), comm);
      auto [x, y] = g::synthetic_batch(c, 8, 5, 0, 0);
      const int64_t before = alloc.current_bytes();
      at::Tensor loss = enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
      held = alloc.current_bytes() - before;
      loss.backward();
      grads = fsdp->gather_full_grads();
    });
    return std::make_pair(held, grads);
  };
  const auto [plain_bytes, plain_grads] = measure("type=Block");
  const auto [rc_bytes, rc_grads] = measure("recompute:type=Block");
  CAPTURE(plain_bytes, rc_bytes);
  // Without recompute each Block keeps ~20 tensors of [8, 48, 48] plus attention state; with it,
  // only its input. The root's embeddings and logits stay in both.
  REQUIRE(plain_bytes > 0);
  CHECK(rc_bytes < plain_bytes / 3);
  REQUIRE(plain_grads.size() == rc_grads.size());
  for (size_t i = 0; i < plain_grads.size(); ++i) {
    CAPTURE(plain_grads[i].first);
    CHECK(at::equal(plain_grads[i].second, rc_grads[i].second));
  }
}

TEST_CASE("recompute: dropout masks, RNG stream, repeated calls, two forwards, eval",
          "[recompute]") {
  // Dropout at world 1 (ranks as threads share the CPU generator, so more ranks would race on
  // it with or without recompute): the same mask in the recompute, and the generator after
  // backward where it would be without recompute.
  struct DropResult {
    std::vector<std::pair<std::string, at::Tensor>> grads;
    at::Tensor after;  // a draw after backward
    StepCounters counters;
  };
  auto drop_run = [](bool rc) {
    DropResult r;
    run_ranks(1, [&](Communicator& comm) {
      auto net = DropNet();
      init_params(*net, 7);
      const UnitOptions o = rc ? recompute() : UnitOptions{};
      auto fsdp = fully_shard(net.ptr(), manual_plan(*net, {{"b0"}, {"b1"}}, {o, o}), comm);
      at::manual_seed(1234);
      const at::Tensor x = at::randn({6, 5});
      at::Tensor loss = enter(net, [&] { return net->forward(x); }).pow(2).sum();
      loss.backward();
      r.after = at::rand({8});
      r.grads = fsdp->gather_full_grads();
      r.counters = fsdp->counters();
    });
    return r;
  };
  const DropResult plain = drop_run(false), rc = drop_run(true);
  REQUIRE(plain.grads.size() == rc.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    CAPTURE(plain.grads[i].first);
    CHECK(at::equal(plain.grads[i].second, rc.grads[i].second));
  }
  CHECK(at::equal(plain.after, rc.after));
  // No zero gradient hides a lost one: b0's weight got a real gradient.
  for (const auto& [name, t] : rc.grads)
    if (name == "b0.fc.weight") CHECK(t.abs().sum().item<double>() > 0);
  require_same_counters(plain.counters, rc.counters);

  // A unit called twice per forward (TinyNet's repeat_first) and two forwards summed before one
  // backward, world 2: the engine sums each parameter's gradients before its AccumulateGrad
  // runs once, so the unit reduces once with everything in.
  auto tiny_run = [](bool rc) {
    std::vector<std::pair<std::string, at::Tensor>> grads;
    StepCounters counters;
    at::Tensor eval_out;
    std::mutex mu;
    run_ranks(2, [&](Communicator& comm) {
      auto net = TinyNet(5, 7, 3, /*repeat_first=*/true);
      init_params(*net, 3);
      const UnitOptions o = rc ? recompute() : UnitOptions{};
      auto fsdp = fully_shard(
          net.ptr(), manual_plan(*net, {{"blocks.0"}, {"blocks.1"}, {"blocks.2"}}, {o, o, o}),
          comm);
      auto gen = at::detail::createCPUGenerator(40 + comm.rank());
      const at::Tensor x1 = at::randn({4, 5}, gen), x2 = at::randn({3, 5}, gen);
      at::Tensor loss = enter(net, [&] { return net->forward(x1); }).sum() +
                        enter(net, [&] { return net->forward(x2); }).pow(2).mean();
      loss.backward();
      auto gathered = fsdp->gather_full_grads();
      auto c = fsdp->counters();
      at::Tensor out;
      {
        at::NoGradGuard no_grad;  // eval: a recompute unit runs normally
        fsdp->reset_counters();
        out = enter(net, [&] { return net->forward(x1); });
        for (size_t i = 1; i < fsdp->num_units(); ++i)
          RANK_CHECK(fsdp->unit(i).state() == UnitState::kSharded);
      }
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0) {
        grads = gathered;
        counters = c;
        eval_out = out;
      }
    });
    return std::make_tuple(grads, counters, eval_out);
  };
  const auto [pg, pc, pe] = tiny_run(false);
  const auto [rg, rc2, re] = tiny_run(true);
  REQUIRE(pg.size() == rg.size());
  for (size_t i = 0; i < pg.size(); ++i) {
    CAPTURE(pg[i].first);
    CHECK(at::allclose(pg[i].second, rg[i].second, 1e-6, 1e-7));
  }
  require_same_counters(pc, rc2);
  CHECK(at::equal(pe, re));
}

TEST_CASE("ranks that disagree on recompute fail at setup, naming the unit and the option",
          "[recompute][fingerprint]") {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](Communicator& comm) {
    auto net = TinyNet(5, 7, 2);
    const UnitOptions o = comm.rank() == 1 ? recompute() : UnitOptions{};
    errors[comm.rank()] = error_of([&] {
      fully_shard(net.ptr(), manual_plan(*net, {{"blocks.0"}, {"blocks.1"}}, {UnitOptions{}, o}),
                  comm);
    });
  });
  for (const std::string& e : errors) {
    CAPTURE(e);
    CHECK(e.find("rank 1 differs from rank 0 at unit 2 'blocks.1': recompute true vs default") !=
          std::string::npos);
  }
}
