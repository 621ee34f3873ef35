// CPU offload (issue 17, Note [CPU offload] in flat_param/offload.h) on CPU ranks: the host
// optimizer path — masters, gradients and optimizer state as host tensors, the compute-dtype
// shard refreshed from the master when it changed, gradients delivered to the host and added to
// an existing one after the step's sync — against the unsharded model trained the same way
// (tests/parity_util.h) and, bit for bit, against the same sharded run without offload (on CPU
// ranks the copies are exact, and with offload the one-rank shortcut is off, whose values equal
// the general path's). The device copies themselves (pinned memory, streams) are checked on the
// GPU (tests/gpu_parity_test.cpp, the offload case).
#include <catch2/catch.hpp>

#include <torch/optim/adamw.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "collectives/env.h"
#include "flat_param/collective_plan.h"
#include "flat_param/offload_state.h"
#include "fsdp/trace.h"
#include "optim/fused_adamw.h"
#include "planner/explain.h"
#include "planner/trace_summary.h"
#include "gpt_parity_spec.h"
#include "llama_parity_spec.h"
#include "parity_util.h"
#include "rank_require.h"
#include "temp_dir.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

// Device bytes a unit holds between gathers (level 1's resident shard; 0 without an offload copy).
int64_t resident_bytes_of(const FlatParam& f) {
  const OffloadCopy* copy = f.gather_plan().extras().offload;
  return copy ? copy->resident_bytes() : 0;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

void require_equal_runs(const ParityRun& a, const ParityRun& b) {
  REQUIRE(a.losses == b.losses);
  REQUIRE(a.params.size() == b.params.size());
  for (auto& [name, t] : a.params) {
    CAPTURE(name);
    REQUIRE(at::equal(t, b.params.at(name)));
  }
  for (auto& [name, t] : a.grads) {
    CAPTURE(name);
    REQUIRE(at::equal(t, b.grads.at(name)));
  }
}

// Parameter groups over shard views (no decay for biases and norms), a frozen parameter (a
// mixed unit) and two micro-batches accumulated without sync.
void add_groups_frozen_accumulation(ParitySpec& s, bool llama) {
  s.micro_batches = 2;
  s.no_sync_accumulation = true;
  s.no_decay = [](const std::string& n) {
    return contains(n, "bias") || contains(n, "norm") || contains(n, "ln");
  };
  s.frozen = [llama](const std::string& n) {
    return n == (llama ? "layers.1.mlp.up.weight" : "wpe.weight");
  };
}

}  // namespace

TEST_CASE("offload levels 1 and 2 train like the unsharded model and bit for bit like no offload",
          "[offload][parity]") {
  struct Case {
    bool llama;
    int world;
    const char* policy;
  };
  const Case cases[] = {
      {false, 1, "type=Block"},
      {false, 2, "type=Block"},
      {false, 3, "type=Linear|LayerNorm|Embedding"},
      {true, 2, "type=DecoderLayer"},
      {true, 3, "type=DecoderLayer"},
  };
  for (const Case& c : cases) {
    for (int level : {1, 2}) {
      CAPTURE(c.llama, c.world, c.policy, level);
      ParitySpec s = c.llama ? llama_spec(c.world, c.policy) : gpt_parity_spec(c.world, c.policy);
      s.steps = 4;
      const ParityRun plain = run_sharded(s);
      s.options.offload = level;
      const ParityRun off = run_sharded(s);
      require_parity(run_reference(s), off);
      require_equal_runs(plain, off);
    }
  }
}

TEST_CASE("offload with parameter groups, fused AdamW, no-sync accumulation and clipping",
          "[offload][parity]") {
  for (int world : {1, 2}) {
    CAPTURE(world);
    ParitySpec s = gpt_parity_spec(world, "type=Block");
    s.steps = 3;
    s.micro_batches = 2;
    s.no_sync_accumulation = true;
    s.clip = 0.5;
    s.fused_adamw = true;  // ATen's fused CPU AdamW over the host masters' views
    s.no_decay = [](const std::string& n) { return contains(n, "bias") || contains(n, "ln"); };
    s.frozen = [](const std::string& n) { return n == "wpe.weight"; };
    const ParityRun plain = run_sharded(s);
    s.options.offload = 1;
    const ParityRun off = run_sharded(s);
    require_equal_runs(plain, off);
    // The reference runs torch's AdamW: FusedAdamW agrees to rounding, not bitwise.
    require_parity(run_reference(s), off);
  }
}

// The offload_step parity cases: both families, world 1-3, per-block and per-leaf plans, a
// NO_SHARD unit, a unit kept on the device (offload0).
namespace {
struct StepCase {
  bool llama;
  int world;
  const char* policy;
  bool groups;  // parameter groups + a frozen parameter + 2 no-sync micro-batches
};
const StepCase kStepCases[] = {
    {false, 1, "type=Block", false},
    {false, 2, "type=Block", true},
    {false, 3, "type=Linear|LayerNorm|Embedding", true},
    {false, 2, "noshard:path=blocks.0;offload0:path=blocks.1;type=Block", true},
    {true, 2, "type=DecoderLayer", true},
    {true, 3, "type=DecoderLayer", false},
};
}  // namespace

TEST_CASE("offload_step backward: each unit steps during backward, bit for bit like after it",
          "[offload][offload_step][parity]") {
  // Note [Offload step in backward] (fsdp/offload_step.h): the same fused kernel over the same
  // host tensors, in per-unit lists on the stepper's thread instead of one list in
  // optimizer.step(): the results must be equal, not close. Cases cover both families, world
  // 1-3, per-block and per-leaf plans, a NO_SHARD unit, levels 1 and 2, parameter groups over
  // shard views, a frozen parameter (a mixed unit), and no-sync accumulation (the stepper
  // steps only in the synced backward). Some units stay on the device (offload0): they are
  // stepped by optimizer.step() itself.
  for (const StepCase& c : kStepCases) {
    for (int level : {1, 2}) {
      CAPTURE(c.llama, c.world, c.policy, c.groups, level);
      ParitySpec s = c.llama ? llama_spec(c.world, c.policy) : gpt_parity_spec(c.world, c.policy);
      s.steps = 3;
      s.fused_adamw = true;
      s.options.offload = level;
      if (c.groups) add_groups_frozen_accumulation(s, c.llama);
      const ParityRun after = run_sharded(s);
      s.options.offload_step = OffloadStep::kBackward;
      const ParityRun during = run_sharded(s);
      require_equal_runs(after, during);
      require_parity(run_reference(s), during);  // and it trains: against the unsharded model
    }
  }
}

TEST_CASE("offload_step backward and delayed with bf16: the host compute copy path is bit for "
          "bit the fp32 host path", "[offload][offload_step][parity]") {
  // Note [Host compute copy] (flat_param/collective_plan.h): bf16 gradients come down as they
  // are and the CPU step writes the bf16 copy that goes up. The reference is the same run with
  // FLATSHARD_OFFLOAD_HOST_COPY=0 (device upcast, fp32 down and up, device cast), and for the
  // backward mode also the step after backward. Step-0 gradients are not compared: with the
  // copy path an offloaded unit's .grad stays undefined (what its step consumed), which the
  // gathered gradients show as zeros; that they do proves the path ran.
  struct Env {  // FLATSHARD_OFFLOAD_HOST_COPY for one run (read when the model is built)
    explicit Env(const char* v) { setenv(env::kOffloadHostCopy, v, 1); }
    ~Env() { unsetenv(env::kOffloadHostCopy); }
  };
  auto equal_params = [](const ParityRun& a, const ParityRun& b) {
    REQUIRE(a.losses == b.losses);
    REQUIRE(a.params.size() == b.params.size());
    for (auto& [name, t] : a.params) {
      CAPTURE(name);
      REQUIRE(at::equal(t, b.params.at(name)));
    }
  };
  for (const StepCase& c : kStepCases) {
    if (c.llama && c.world == 3) continue;  // LLaMA at world 2 covers the family here
    for (const OffloadStep mode : {OffloadStep::kBackward, OffloadStep::kDelayed}) {
      for (int level : {1, 2}) {
        if (mode == OffloadStep::kDelayed && level == 2) continue;  // refused at setup
        CAPTURE(c.llama, c.world, c.policy, c.groups, level, mode == OffloadStep::kDelayed);
        ParitySpec s =
            c.llama ? llama_spec(c.world, c.policy) : gpt_parity_spec(c.world, c.policy);
        s.steps = 3;
        s.fused_adamw = true;
        s.options.offload = level;
        s.options.mixed_precision.param_dtype = at::kBFloat16;
        if (c.groups) add_groups_frozen_accumulation(s, c.llama);
        s.options.offload_step = mode;
        ParityRun fp32_path, copy_path;
        {
          Env off("0");
          fp32_path = run_sharded(s);
        }
        {
          Env on("1");
          copy_path = run_sharded(s);
        }
        equal_params(fp32_path, copy_path);
        if (mode == OffloadStep::kBackward) {
          s.options.offload_step = OffloadStep::kAfterBackward;
          equal_params(run_sharded(s), copy_path);
        }
        // An offloaded unit's gradient went to its step in bf16: zeros where the fp32 path
        // (backward mode) has the gradient.
        if (mode == OffloadStep::kBackward && !c.groups) {
          bool zero_somewhere = false;
          for (auto& [name, g] : copy_path.grads)
            if (g.abs().max().item<double>() == 0 &&
                fp32_path.grads.at(name).abs().max().item<double>() > 0)
              zero_somewhere = true;
          REQUIRE(zero_somewhere);
        }
      }
    }
  }
}

TEST_CASE("offload_step backward and delayed: the trace has the CPU optimizer track, a wait and "
          "a step per unit per step", "[offload][offload_step][trace]") {
  // fsdp/trace.h: the stepper's thread records on its own track (tid 4, "CPU optimizer"); the
  // summary (planner/trace_summary.h) sums it per unit and prints it.
  for (const OffloadStep mode : {OffloadStep::kBackward, OffloadStep::kDelayed}) {
    CAPTURE(mode == OffloadStep::kDelayed);
    TempDir dir;
    ParitySpec s = gpt_parity_spec(2, "type=Block");
    s.steps = 3;
    s.fused_adamw = true;
    s.options.offload = 1;
    s.options.offload_step = mode;
    s.options.trace.path = dir / "t.json";
    run_sharded(s);
    std::vector<std::string> files;
    for (int rank = 0; rank < 2; ++rank) {
      files.push_back(trace_file_for_rank(s.options.trace.path, rank, 2));
      const nlohmann::json doc = nlohmann::json::parse(read_bytes(files.back()));
      const size_t units = doc.at("otherData").at("units").size();
      std::map<std::pair<std::string, int>, int> steps, waits;  // (unit, step) -> events
      bool named = false;
      for (const auto& e : doc.at("traceEvents")) {
        if (e.at("ph") == "M" && e.value("tid", -1) == 4)
          named = named || e.at("args").at("name") == "CPU optimizer";
        if (e.at("ph") != "X" || e.at("tid") != 4) continue;
        const auto key = std::make_pair(e.at("args").at("unit").get<std::string>(),
                                        e.at("args").at("step").get<int>());
        ++(e.at("cat") == "offload_step" ? steps : waits)[key];
        REQUIRE(e.at("dur").get<double>() >= 0);
      }
      CAPTURE(rank, units);
      REQUIRE(named);
      REQUIRE(steps.size() == units * 3);  // every unit, every step, once
      REQUIRE(waits.size() == units * 3);
      for (const auto& [key, n] : steps) REQUIRE(n == 1);
    }
    const TraceSummary sum = summarize(read_trace_files(files));
    REQUIRE(sum.offload_step_us > 0);
    for (const auto& u : sum.units) {
      CAPTURE(u.unit);
      REQUIRE(u.offload_step_us > 0);
    }
    REQUIRE(contains(sum.to_string(), "CPU optimizer track"));
  }
}

TEST_CASE("offload_step backward: offloaded masters change in backward, the rest in opt.step()",
          "[offload][offload_step]") {
  // What makes the parity above mean something: the offloaded units really step during
  // backward (their masters are new before opt.step() is called), opt.step() leaves them alone
  // and steps only the unit kept on the device.
  ParitySpec s = gpt_parity_spec(2, "offload0:path=blocks.1;type=Block");
  s.options.offload = 1;
  s.options.offload_step = OffloadStep::kBackward;
  run_ranks(2, [&](Communicator& comm) {
    auto model = s.make_model();
    auto fsdp = fully_shard(model, s.plan(*model), comm, s.options);
    auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    fsdp->attach_optimizer(opt);
    auto masters = [&] {
      std::vector<at::Tensor> out;
      for (size_t u = 0; u < fsdp->num_units(); ++u)
        out.push_back(fsdp->unit(u).flat().master().detach().clone());
      return out;
    };
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      const auto before = masters();
      s.loss(model, comm.rank(), step, 0).backward();
      fsdp->wait_offload_steps();
      const auto after_backward = masters();
      opt->step();
      const auto after_step = masters();
      // Units that break the rule, named (CAPTURE is not safe on rank threads: rank_require.h).
      std::vector<std::string> wrong;
      for (size_t u = 0; u < fsdp->num_units(); ++u) {
        const Unit& unit = fsdp->unit(u);
        if (unit.flat().master().numel() == 0) continue;
        const bool offloaded = unit.flat().config().offload > 0;
        if (offloaded != !at::equal(before[u], after_backward[u]) ||
            offloaded != at::equal(after_backward[u], after_step[u]))
          wrong.push_back("step " + std::to_string(step) + " unit " + unit.name());
      }
      RANK_REQUIRE(wrong == std::vector<std::string>{});
    }
  });
}

TEST_CASE("offload_step backward: two backward passes over a retained graph step twice, exactly",
          "[offload][offload_step]") {
  // Every synced backward is a step: two passes over one graph (no forward between, no
  // zero_grad) equal, bit for bit, the default mode stepping after each pass. The second pass
  // gathers and reduces units the worker may still be stepping: it must wait for them.
  ParitySpec s = gpt_parity_spec(2, "type=Block");
  s.options.offload = 1;
  auto run = [&](bool during) {
    std::map<std::string, at::Tensor> out;
    std::mutex mu;
    ShardingOptions o = s.options;
    if (during) o.offload_step = OffloadStep::kBackward;
    run_ranks(2, [&](Communicator& comm) {
      auto model = s.make_model();
      auto fsdp = fully_shard(model, s.plan(*model), comm, o);
      auto opt =
          std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
      if (during) fsdp->attach_optimizer(opt);
      at::Tensor loss = s.loss(model, comm.rank(), 0, 0);
      loss.backward({}, /*retain_graph=*/true);
      if (!during) opt->step();
      loss.backward();
      opt->step();
      auto full = fsdp->gather_full_params();
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0)
        for (auto& [n, t] : full) out[n] = t;
    });
    return out;
  };
  const auto after = run(false), during = run(true);
  REQUIRE(after.size() == during.size());
  for (auto& [n, t] : after) {
    CAPTURE(n);
    REQUIRE(at::equal(t, during.at(n)));
  }
}

TEST_CASE("offload_step delayed: trains like the unsharded model with a one-step delay",
          "[offload][offload_step][parity]") {
  // Note [Delayed offload step] (fsdp/offload_step.h): step k's forward and backward read the
  // offloaded parameters of after step k-2. The reference applies exactly that delay to the
  // same parameters (all of them, or all but a unit kept on the device); and the run must
  // differ from the undelayed reference, else the delay was not applied at all.
  struct Case {
    bool llama;
    int world;
    const char* policy;
    bool groups;  // parameter groups + a frozen parameter + 2 no-sync micro-batches
    const char* kept;  // parameters of a unit left on the device (not delayed), or nullptr
  };
  const Case cases[] = {
      {false, 1, "type=Block", false, nullptr},
      {false, 2, "type=Block", true, nullptr},
      {false, 3, "type=Linear|LayerNorm|Embedding", true, nullptr},
      {false, 2, "noshard:path=blocks.0;offload0:path=blocks.1;type=Block", true, "blocks.1."},
      {true, 2, "type=DecoderLayer", true, nullptr},
  };
  for (const Case& c : cases) {
    CAPTURE(c.llama, c.world, c.policy, c.groups);
    ParitySpec s = c.llama ? llama_spec(c.world, c.policy) : gpt_parity_spec(c.world, c.policy);
    s.steps = 4;
    s.fused_adamw = true;
    s.options.offload = 1;
    if (c.groups) add_groups_frozen_accumulation(s, c.llama);
    s.options.offload_step = OffloadStep::kDelayed;
    ParityRun got = run_sharded(s);
    const ParityRun undelayed = run_reference(s);
    const std::string kept = c.kept ? c.kept : "";
    s.delayed = [kept](const std::string& n) { return kept.empty() || n.rfind(kept, 0) != 0; };
    ParityRun ref = run_reference(s);
    // After backward the offloaded units' gradients belong to their queued steps (undefined).
    got.grads.clear();
    ref.grads.clear();
    require_parity(ref, got);
    REQUIRE(got.losses[0] == Approx(undelayed.losses[0]).epsilon(1e-5));  // nothing stepped yet
    double diff = 0;
    for (auto& [n, t] : undelayed.params)
      diff = std::max(diff, (t - got.params.at(n)).abs().max().item<double>());
    CAPTURE(diff);
    REQUIRE(diff > 1e-3);
  }
}

TEST_CASE("offload_step delayed: the device copy is one step behind; sync_offload_params ends it",
          "[offload][offload_step]") {
  ParitySpec s = gpt_parity_spec(1, "type=Block");
  s.options.offload = 1;
  s.options.offload_step = OffloadStep::kDelayed;
  run_ranks(1, [&](Communicator& comm) {
    auto model = s.make_model();
    auto fsdp = fully_shard(model, s.plan(*model), comm, s.options);
    auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    fsdp->attach_optimizer(opt);
    auto eval_loss = [&] {
      at::NoGradGuard no_grad;
      return s.loss(model, 0, 0, 0).item<double>();
    };
    const double l0 = eval_loss();
    opt->zero_grad();
    s.loss(model, 0, 0, 0).backward();
    opt->step();
    fsdp->wait_offload_steps();
    // The masters moved, the forward still reads the parameters of before the step...
    RANK_REQUIRE(eval_loss() == l0);
    for (size_t u = 0; u < fsdp->num_units(); ++u)
      RANK_REQUIRE(!fsdp->unit(u).flat().master().grad().defined());
    // ...until sync_offload_params(), after which it reads the newest.
    fsdp->sync_offload_params();
    const double l1 = eval_loss();
    RANK_REQUIRE(l1 != l0);
    // Stepping again holds the device copy at the values sync_offload_params uploaded.
    opt->zero_grad();
    s.loss(model, 0, 0, 0).backward();
    opt->step();
    RANK_REQUIRE(eval_loss() == l1);
  });
}

TEST_CASE("offload_step delayed: a gradient written after backward is an error, not a second step",
          "[offload][offload_step]") {
  // Note [Delayed offload step]: after backward the offloaded tensors' gradients are undefined
  // (their steps are queued). A loop that fills "missing" gradients with zeros used to make
  // opt.step() step them again (AdamW's step count 4 after two iterations); it is now the
  // backward mode's error, before anything is stepped, and a clean loop steps each tensor once
  // per iteration.
  ParitySpec s = gpt_parity_spec(2, "type=Block");
  s.options.offload = 1;
  s.options.offload_step = OffloadStep::kDelayed;
  run_ranks(2, [&](Communicator& comm) {
    auto model = s.make_model();
    auto fsdp = fully_shard(model, s.plan(*model), comm, s.options);
    auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    fsdp->attach_optimizer(opt);
    std::vector<at::Tensor> params;
    for (const auto& g : opt->param_groups())
      for (const auto& p : g.params()) params.push_back(p);
    auto steps = [&] {  // AdamW's step count per tensor (0: no state yet)
      fsdp->wait_offload_steps();
      std::vector<int64_t> out;
      for (const auto& p : params) {
        auto it = opt->state().find(p.unsafeGetTensorImpl());
        out.push_back(it == opt->state().end()
                          ? 0
                          : static_cast<torch::optim::AdamWParamState&>(*it->second).step());
      }
      return out;
    };
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      s.loss(model, comm.rank(), step, 0).backward();
      int filled = 0;
      for (auto& p : params)
        if (!p.grad().defined()) {
          p.mutable_grad() = at::zeros_like(p);
          ++filled;
        }
      RANK_REQUIRE(filled == static_cast<int>(params.size()));  // every unit is offloaded
      RANK_REQUIRE_THROWS_WITH(opt->step(), Catch::Contains("was modified") &&
                                                Catch::Contains("already stepped during backward"));
      RANK_REQUIRE(steps() == std::vector<int64_t>(params.size(), step + 1));
    }
    // Without the write: one step per tensor per iteration.
    opt->zero_grad();
    s.loss(model, comm.rank(), 2, 0).backward();
    opt->step();
    RANK_REQUIRE(steps() == std::vector<int64_t>(params.size(), 3));
  });
}

TEST_CASE("offload: a unit's spec level overrides the default; explain counts host and device bytes",
          "[offload][explain]") {
  ParitySpec s = gpt_parity_spec(2, "offload2:path=blocks.0;offload0:path=blocks.1;type=Block");
  s.options.offload = 1;
  run_ranks(2, [&](Communicator& comm) {
    auto model = s.make_model();
    const Plan plan = s.plan(*model);
    const Explanation e = explain(*model, plan, MeshShape(2, 1), s.options);
    auto fsdp = fully_shard(model, plan, comm, s.options);
    int64_t host = 0, resident = 0, padding = 0;
    for (size_t u = 0; u < fsdp->num_units(); ++u) {
      const Unit& unit = fsdp->unit(u);
      const UnitExplanation& x = e.units[u];
      const int want = unit.name() == "blocks.0" ? 2 : unit.name() == "blocks.1" ? 0 : 1;
      RANK_REQUIRE(unit.flat().config().offload == want);
      RANK_REQUIRE(x.offload == want);
      RANK_REQUIRE(x.resident_bytes == resident_bytes_of(unit.flat()));
      if (want > 0) {
        host += 4 * unit.flat().master().nbytes();  // master, grad, AdamW's two moments
        padding += x.padding();
      }
      resident += resident_bytes_of(unit.flat());
    }
    RANK_REQUIRE(resident > 0);
    // explain counts AdamW state for the parameters' elements of the fullest shard, AdamW
    // allocates it over the whole shard, padding too.
    RANK_REQUIRE(e.memory.host_bytes <= host);
    RANK_REQUIRE(e.memory.host_bytes >= host - 8 * padding);
    // A level-1 unit keeps its shard in the compute dtype (fp32 here) on the device.
    RANK_REQUIRE(resident_bytes_of(fsdp->unit(0).flat()) ==
                 fsdp->unit(0).flat().layout().shard_numel * 4);
    RANK_REQUIRE(contains(e.to_string(), "offloaded to host"));
  });
}

TEST_CASE("offload: gradients accumulate on the host across synced backward passes",
          "[offload]") {
  // Two backward passes, both reducing, without zero_grad between: the second reduction lands
  // in the staging buffer and is added to the host gradient after the step's sync.
  auto accumulated = [](int level) {
    std::map<std::string, at::Tensor> grads;
    ParitySpec s = gpt_parity_spec(2, "type=Block");
    s.options.offload = level;
    run_ranks(2, [&](Communicator& comm) {
      auto model = s.make_model();
      auto fsdp = fully_shard(model, s.plan(*model), comm, s.options);
      for (int pass = 0; pass < 2; ++pass) s.loss(model, comm.rank(), pass, 0).backward();
      auto g = fsdp->gather_full_grads();
      if (comm.rank() == 0)
        for (auto& [n, t] : g) grads[n] = t;
    });
    return grads;
  };
  const auto plain = accumulated(0), off = accumulated(1);
  REQUIRE(plain.size() == off.size());
  for (auto& [n, t] : plain) {
    CAPTURE(n);
    REQUIRE(at::equal(t, off.at(n)));
  }
}

TEST_CASE("offload: a checkpoint loaded into an offloaded model is what its next forward reads",
          "[offload][checkpoint]") {
  // Model B has uploaded its resident shards (it ran a step); loading A's checkpoint changes
  // its masters, so B's next forward must take the new values, as A's does.
  TempDir dir;
  ParitySpec s = gpt_parity_spec(2, "type=Block");
  s.options.offload = 1;
  run_ranks(2, [&](Communicator& comm) {
    auto model_a = s.make_model();
    auto a = fully_shard(model_a, s.plan(*model_a), comm, s.options);
    torch::optim::AdamW opt_a(a->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      opt_a.zero_grad();
      s.loss(model_a, comm.rank(), step, 0).backward();
      opt_a.step();
    }
    save_checkpoint(*a, &opt_a, dir.path() + "/ckpt");

    auto model_b = s.make_model();
    auto b = fully_shard(model_b, s.plan(*model_b), comm, s.options);
    torch::optim::AdamW opt_b(b->parameters(), torch::optim::AdamWOptions(1e-2));
    opt_b.zero_grad();
    s.loss(model_b, comm.rank(), 7, 0).backward();
    opt_b.step();
    load_checkpoint(*b, &opt_b, dir.path() + "/ckpt");
    for (int step = 2; step < 4; ++step) {
      opt_a.zero_grad();
      opt_b.zero_grad();
      at::Tensor la = s.loss(model_a, comm.rank(), step, 0);
      at::Tensor lb = s.loss(model_b, comm.rank(), step, 0);
      RANK_REQUIRE(la.item<double>() == lb.item<double>());
      la.backward();
      lb.backward();
      opt_a.step();
      opt_b.step();
    }
  });
}

TEST_CASE("offload spec options parse, print and are checked", "[offload][spec]") {
  REQUIRE(parse_policy("offload:type=Block").rules[0].options.offload == 1);
  REQUIRE(parse_policy("offload1:type=Block").rules[0].options.offload == 1);
  REQUIRE(parse_policy("offload0:type=Block").rules[0].options.offload == 0);
  const Policy p = parse_policy("keep+offload2:type=Block");
  REQUIRE(p.rules[0].options == offload(full_shard_keep(), 2));
  REQUIRE(p.to_spec() == "keep+offload2:type=Block");
  REQUIRE(parse_policy("offload+recompute:type=Block").to_spec() ==
          "recompute+offload:type=Block");
  REQUIRE(parse_policy(p.to_spec()).rules[0].options == p.rules[0].options);
  auto message = [](const std::string& spec) {
    try {
      parse_policy(spec);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    FAIL("no error for " << spec);
    return std::string();
  };
  REQUIRE(contains(message("offload+offload2:type=Block"), "second offload option 'offload2'"));
  REQUIRE(contains(message("offload3:type=Block"), "unknown option 'offload3'"));
  REQUIRE(contains(message("type=Block,offload:path=x"), "in the middle of a rule"));
  REQUIRE_THROWS_WITH(offload({}, 3), Catch::Contains("0, 1 or 2, got 3"));

  // Out-of-range levels from code are rejected at setup, naming the unit; NO_SHARD units keep
  // their compute copy on the device, so level 2 is level 1 for them.
  ParitySpec s = gpt_parity_spec(1, "noshard+offload2:path=blocks.0;type=Block");
  auto model = s.make_model();
  Plan plan = s.plan(*model);
  ShardingOptions bad;
  bad.offload = 5;
  REQUIRE_THROWS_WITH(resolve_unit(plan.units[2], bad, 1),
                      Catch::Contains("offload level must be 0, 1 or 2, got 5"));
  const Explanation e = explain(*model, plan, MeshShape(2, 1), ShardingOptions{});
  for (const auto& u : e.units)
    if (u.name == "blocks.0") REQUIRE(u.offload == 1);
}
