// Fine-tuning under fully_shard (issue 16 items 1-2): frozen parameters, inside units mixed with
// trainable ones and as whole frozen units, and per-parameter optimizer views
// (ShardedModel::named_parameters) for parameter groups by name — against the same model
// fine-tuned unsharded (tests/parity_util.h), at world 1-4, for both reference families.
//
// The frozen set, per family: the token (and GPT's position) embedding, the attention input
// projections of every layer (GPT's fused qkv; LLaMA's q and k) — so every layer's unit mixes
// frozen and trainable parameters — and all of layer 1, a wholly frozen unit whose input
// requires grad (layer 0 trains), so its backward gathers it but reduces nothing. Weight decay
// is on (0.1): a frozen value that reached an optimizer would move.
// Tolerances: ParityTolerance's defaults (see tests/gpt_parity_test.cpp); frozen values are
// compared bit for bit with a freshly built model's.
#include <catch2/catch.hpp>

#include <torch/optim/adamw.h>

#include "checkpoint/checkpoint.h"
#include "planner/explain.h"
#include "optim/fused_adamw.h"
#include "gpt_parity_spec.h"
#include "llama_parity_spec.h"
#include "parity_util.h"
#include "rank_require.h"
#include "temp_dir.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

bool gpt_frozen(const std::string& n) {
  return n == "wte.weight" || n == "wpe.weight" || contains(n, ".attn.qkv.") ||
         n.rfind("blocks.1.", 0) == 0;
}
bool llama_frozen(const std::string& n) {
  return n == "embed_tokens.weight" || contains(n, ".attn.q.") || contains(n, ".attn.k.") ||
         n.rfind("layers.1.", 0) == 0;
}
// The usual recipe: no weight decay on norms and biases.
bool no_decay(const std::string& n) {
  return contains(n, "bias") || contains(n, "ln") || contains(n, "norm");
}

enum class Family { kGpt, kLlama };
const char* name_of(Family f) { return f == Family::kGpt ? "gpt" : "llama"; }

ParitySpec spec_for(Family f, int world, const std::string& policy) {
  ParitySpec s = f == Family::kGpt ? gpt_parity_spec(world, policy) : llama_spec(world, policy);
  return s;
}
std::string layer_policy(Family f) {
  return f == Family::kGpt ? "type=Block" : "type=DecoderLayer";
}
std::string leaf_policy(Family f) {
  return f == Family::kGpt ? "type=Linear|LayerNorm|Embedding" : "type=Linear|RMSNorm|Embedding";
}
std::string frozen_layer_unit(Family f) { return f == Family::kGpt ? "blocks.1" : "layers.1"; }

// Frozen parameters of `run` equal the freshly built model's, bit for bit.
void require_frozen_unchanged(const ParitySpec& s, const ParityRun& run) {
  auto fresh = s.make_model();
  int64_t frozen = 0;
  for (auto& p : fresh->named_parameters()) {
    if (!s.frozen(p.key())) continue;
    CAPTURE(p.key());
    REQUIRE(run.params.count(p.key()));
    REQUIRE(at::equal(run.params.at(p.key()), p.value()));
    ++frozen;
  }
  REQUIRE(frozen > 0);
}

}  // namespace

TEST_CASE("Frozen parameters: fine-tuning matches unsharded and frozen values never move",
          "[finetune][frozen]") {
  for (Family f : {Family::kGpt, Family::kLlama}) {
    for (int world = 1; world <= 4; ++world) {
      ParitySpec base = spec_for(f, world, "");
      base.frozen = f == Family::kGpt ? gpt_frozen : llama_frozen;
      const ParityRun ref = run_reference(base);
      require_frozen_unchanged(base, ref);  // the reference itself: frozen and decayed = still
      for (const std::string& policy : {layer_policy(f), leaf_policy(f)}) {
        CAPTURE(name_of(f), world, policy);
        ParitySpec s = spec_for(f, world, policy);
        s.frozen = base.frozen;
        const ParityRun got = run_sharded(s);
        require_parity(ref, got);
        require_frozen_unchanged(s, got);
        if (policy != layer_policy(f)) continue;
        // The wholly frozen layer: gathered for its backward (its input requires grad), never
        // reduced; the mixed layers reduce once. The plan: root, layer 0, 1, 2.
        const auto& units = got.last_step_counters.per_unit;
        REQUIRE(units.size() == 4);
        CHECK(units[2].forward_all_gathers == 1);
        CHECK(units[2].backward_all_gathers == 1);
        CHECK(units[2].reduce_scatters == 0);
        CHECK(units[1].reduce_scatters == 1);
        CHECK(units[3].reduce_scatters == 1);
        // explain() predicts the same collectives (it reads requires_grad from the model).
        auto model = s.make_model();
        apply_freeze(s, *model);
        const Explanation e = explain(*model, s.plan(*model), MeshShape(world, 1), s.options);
        for (size_t i = 0; i < units.size(); ++i) {
          CAPTURE(i);
          CHECK(e.units[i].per_step.forward_all_gathers == units[i].forward_all_gathers);
          CHECK(e.units[i].per_step.backward_all_gathers == units[i].backward_all_gathers);
          CHECK(e.units[i].per_step.reduce_scatters == units[i].reduce_scatters);
        }
        CHECK(e.units[2].frozen);
      }
    }
  }
}

TEST_CASE("Frozen parameters: a frozen norm at the head of a trainable layer", "[finetune][frozen]") {
  // Note [Frozen parameters] (fsdp/unit.cpp): the frozen norm's backward (its input's gradient)
  // runs after every trainable gradient of its unit is in; the unit must not reshard before it.
  // Resharding on the last trainable gradient made it read a guarded parameter ("read while the
  // unit is sharded"), at any world size and with or without tensor parallelism.
  for (Family f : {Family::kGpt, Family::kLlama}) {
    const std::string head = f == Family::kGpt ? "blocks.1.ln1." : "layers.1.input_norm.";
    for (int world : {1, 2, 3}) {
      CAPTURE(name_of(f), world);
      ParitySpec s = spec_for(f, world, layer_policy(f));
      s.frozen = [head](const std::string& n) { return n.rfind(head, 0) == 0; };
      const ParityRun ref = run_reference(s);
      const ParityRun got = run_sharded(s);
      require_parity(ref, got);
      require_frozen_unchanged(s, got);
      // The mixed layer still reduces once per step, after its backward.
      CHECK(got.last_step_counters.per_unit[2].reduce_scatters == 1);
    }
  }
}

TEST_CASE("Frozen parameters: a frozen unit is not an optimizer parameter", "[finetune][frozen]") {
  std::vector<int64_t> optimizer_numel(2, -1);
  std::vector<int> holds_frozen(2, -1);
  int64_t trainable = 0;
  run_ranks(2, [&](Communicator& comm) {
    ParitySpec s = gpt_parity_spec(2, "type=Block");
    s.frozen = gpt_frozen;
    auto model = s.make_model();
    apply_freeze(s, *model);
    auto fsdp = fully_shard(model, s.plan(*model), comm);
    // parameters(): views of the trainable parameters of mixed units (every unit but blocks.1
    // mixes: wte/wpe in the root, qkv in the blocks), nothing of the frozen blocks.1.
    const Unit& frozen = fsdp->unit(2);
    int64_t numel = 0;
    int holds = frozen.name() == "blocks.1" && !frozen.flat().any_trainable() ? 0 : 1;
    for (const auto& p : fsdp->parameters()) {
      if (!p.requires_grad()) holds = 1;
      if (p.unsafeGetTensorImpl() == frozen.flat().master().unsafeGetTensorImpl()) holds = 1;
      for (const auto& v : frozen.flat().shard_views())
        if (p.unsafeGetTensorImpl() == v.tensor.unsafeGetTensorImpl()) holds = 1;
      numel += p.numel();
    }
    optimizer_numel[comm.rank()] = numel;
    holds_frozen[comm.rank()] = holds;
    if (comm.rank() == 0)
      for (auto& p : model->parameters())
        if (p.requires_grad()) trainable += p.numel();
  });
  REQUIRE(holds_frozen == std::vector<int>{0, 0});
  // Summed over both ranks the optimizer parameters cover exactly the trainable elements.
  REQUIRE(optimizer_numel[0] + optimizer_numel[1] == trainable);
}

TEST_CASE("Parameter groups by name over per-parameter views match unsharded",
          "[finetune][groups]") {
  for (Family f : {Family::kGpt, Family::kLlama}) {
    for (int world = 1; world <= 4; ++world) {
      ParitySpec base = spec_for(f, world, "");
      base.no_decay = no_decay;
      const ParityRun ref = run_reference(base);
      for (const std::string& policy : {layer_policy(f), leaf_policy(f)}) {
        CAPTURE(name_of(f), world, policy);
        ParitySpec s = spec_for(f, world, policy);
        s.no_decay = no_decay;
        s.fused_adamw = world == 2;  // FusedAdamW over the views: one launch per group
        require_parity(ref, run_sharded(s));
      }
    }
  }
  // Groups and frozen parameters together, with gradient accumulation (zero_grad on views
  // between steps, two micro-batches, sync only on the last).
  for (Family f : {Family::kGpt, Family::kLlama}) {
    CAPTURE(name_of(f));
    ParitySpec base = spec_for(f, 3, "");
    base.no_decay = no_decay;
    base.frozen = f == Family::kGpt ? gpt_frozen : llama_frozen;
    base.micro_batches = 2;
    ParitySpec s = spec_for(f, 3, layer_policy(f));
    s.no_decay = base.no_decay;
    s.frozen = base.frozen;
    s.micro_batches = 2;
    s.no_sync_accumulation = true;
    s.clip = 0.5;
    base.clip = 0.5;
    const ParityRun got = run_sharded(s);
    require_parity(run_reference(base), got);
    require_frozen_unchanged(s, got);
  }
}

TEST_CASE("named_parameters: each view is this rank's part of its parameter's master shard",
          "[finetune][groups]") {
  for (int world : {1, 3}) {
    CAPTURE(world);
    std::map<std::string, int64_t> covered;
    std::vector<std::string> wrong;  // what a rank found wrong (checked on the test's thread)
    std::mutex mu;
    run_ranks(world, [&](Communicator& comm) {
      ParitySpec s = gpt_parity_spec(world, "type=Block");
      auto model = s.make_model();
      auto fsdp = fully_shard(model, s.plan(*model), comm);
      const auto full = fsdp->gather_full_params();
      const auto named = fsdp->named_parameters();
      std::vector<std::string> bad;
      size_t aliases = 0;  // gather_full_params() lists tied parameters under every name
      for (const auto& t : fsdp->plan().tied) aliases += t.second.size();
      if (named.size() != full.size() - aliases) bad.push_back("named_parameters() size");
      std::map<std::string, int64_t> mine;
      for (size_t u = 0; u < fsdp->num_units(); ++u) {
        const FlatParam& flat = fsdp->unit(u).flat();
        for (size_t i = 0; i < flat.params().size(); ++i) {
          const ShardView& v = flat.shard_views()[i];
          const std::string& name = flat.params()[i].name;
          const std::string where = "rank " + std::to_string(comm.rank()) + " '" + name + "': ";
          // The same tensor as named_parameters() lists, a leaf sharing the master's memory.
          auto it = std::find_if(named.begin(), named.end(),
                                 [&](const auto& kv) { return kv.first == name; });
          if (it == named.end() || it->second.unsafeGetTensorImpl() != v.tensor.unsafeGetTensorImpl()) {
            bad.push_back(where + "not in named_parameters()");
            continue;
          }
          if (v.tensor.numel() != v.numel() || !v.tensor.is_leaf() || v.tensor.is_view())
            bad.push_back(where + "shape or leaf");
          if (v.numel() > 0 &&
              v.tensor.data_ptr<float>() != flat.master().data_ptr<float>() + v.begin)
            bad.push_back(where + "not the master's memory");
          // Its values: the parameter's flattened elements [param_begin, +numel).
          at::Tensor whole;
          for (const auto& kv : full)
            if (kv.first == name) whole = kv.second.reshape({-1});
          if (v.param_begin < 0 || v.param_begin + v.numel() > whole.numel() ||
              !at::equal(v.tensor, whole.narrow(0, v.param_begin, v.numel())))
            bad.push_back(where + "values");
          mine[name] += v.numel();
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [name, n] : mine) covered[name] += n;
      wrong.insert(wrong.end(), bad.begin(), bad.end());
    });
    CAPTURE(wrong);
    REQUIRE(wrong.empty());
    // Over all ranks the views tile every parameter exactly once.
    auto model = gpt_parity_spec(world, "").make_model();
    REQUIRE(covered.size() == model->named_parameters().size());
    for (auto& p : model->named_parameters()) {
      CAPTURE(p.key());
      REQUIRE(covered[p.key()] == p.value().numel());
    }
  }
}

namespace {

// Trains `steps` steps of ParitySpec `s` on an existing sharded model with `opt`.
void train(const ParitySpec& s, const std::shared_ptr<torch::nn::Module>& model,
           torch::optim::Optimizer& opt, int rank, int first_step, int steps) {
  for (int step = first_step; step < first_step + steps; ++step) {
    opt.zero_grad();
    s.loss(model, rank, step, 0).backward();
    opt.step();
  }
}

std::unique_ptr<torch::optim::AdamW> grouped_adamw(const ParitySpec& s, ShardedModel& fsdp) {
  return std::make_unique<torch::optim::AdamW>(param_groups(s, fsdp.named_parameters()),
                                               torch::optim::AdamWOptions(s.lr));
}

}  // namespace

TEST_CASE("Checkpoints save and load optimizer state by parameter name through views",
          "[finetune][checkpoint]") {
  // Optimizer state per parameter is the same thing whether the optimizer holds the unit's
  // master or the views: save from one, load into the other (and across world sizes), and
  // training continues bit for bit (same world) as if never interrupted.
  ParitySpec s = gpt_parity_spec(2, "type=Block");
  s.no_decay = [](const std::string&) { return false; };  // one decayed group, like parameters()
  // A wholly frozen unit; the others train entirely, so parameters() holds their masters.
  s.frozen = [](const std::string& n) { return n.rfind("blocks.1.", 0) == 0; };
  TempDir dir;
  std::map<std::string, at::Tensor> uninterrupted, from_master_ckpt;
  std::mutex mu;
  for (const char* saver : {"views", "master"}) {
    CAPTURE(saver);
    const std::string path = dir / saver;
    // Reference: the optimizer on views (the groups path), 4 steps, saved after 2.
    run_ranks(2, [&](Communicator& comm) {
      auto model = s.make_model();
      apply_freeze(s, *model);
      auto fsdp = fully_shard(model, s.plan(*model), comm);
      std::unique_ptr<torch::optim::AdamW> opt;
      if (std::string(saver) == "views") {
        opt = grouped_adamw(s, *fsdp);  // group 0: every trainable view, decayed; group 1 empty
      } else {
        opt = std::make_unique<torch::optim::AdamW>(
            fsdp->parameters(), torch::optim::AdamWOptions(s.lr).weight_decay(s.weight_decay));
      }
      train(s, model, *opt, comm.rank(), 0, 2);
      save_checkpoint(*fsdp, opt.get(), path);
      train(s, model, *opt, comm.rank(), 2, 2);
      auto p = fsdp->gather_full_params();
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0)
        for (auto& kv : p) (std::string(saver) == "views" ? uninterrupted : from_master_ckpt)[kv.first] = kv.second;
    });
  }
  // Both optimizers compute the same per-element update: the runs agree bit for bit.
  for (auto& [name, t] : uninterrupted) {
    CAPTURE(name);
    REQUIRE(at::equal(t, from_master_ckpt.at(name)));
  }
  // Load each checkpoint into a views optimizer at world 2 (bitwise) and at world 3 (reshard).
  for (const char* saved : {"views", "master"}) {
    for (int world : {2, 3}) {
      CAPTURE(saved, world);
      std::map<std::string, at::Tensor> resumed;
      run_ranks(world, [&](Communicator& comm) {
        ParitySpec w = s;
        w.world = world;
        auto model = w.make_model();
        apply_freeze(w, *model);
        auto fsdp = fully_shard(model, w.plan(*model), comm);
        auto opt = grouped_adamw(w, *fsdp);
        load_checkpoint(*fsdp, opt.get(), dir / saved);
        // The loaded state is per view: a trainable view with elements has step 2.
        for (const auto& group : opt->param_groups())
          for (const auto& p : group.params()) {
            if (p.numel() == 0) continue;
            auto it = opt->state().find(p.unsafeGetTensorImpl());
            RANK_REQUIRE(it != opt->state().end());
            RANK_REQUIRE(static_cast<torch::optim::AdamWParamState&>(*it->second).step() == 2);
          }
        train(w, model, *opt, comm.rank(), 2, 2);
        auto p = fsdp->gather_full_params();
        std::lock_guard<std::mutex> lock(mu);
        if (comm.rank() == 0)
          for (auto& kv : p) resumed[kv.first] = kv.second;
      });
      if (world == 3) continue;  // other batches: the state loaded (above), the values differ
      for (auto& [name, t] : uninterrupted) {
        CAPTURE(name);
        REQUIRE(at::equal(t, resumed.at(name)));
      }
    }
  }
}

TEST_CASE("Fine-tuning misuse gives errors", "[finetune][misuse]") {
  SECTION("requires_grad changed after fully_shard") {
    run_ranks(1, [](Communicator& comm) {
      ParitySpec s = gpt_parity_spec(1, "type=Block");
      auto model = s.make_model();
      auto fsdp = fully_shard(model, s.plan(*model), comm);
      s.loss(model, 0, 0, 0).backward();
      model->named_parameters()["blocks.0.ln1.weight"].requires_grad_(false);
      RANK_REQUIRE_THROWS_WITH(s.loss(model, 0, 1, 0),
                          Catch::Contains("blocks.0.ln1.weight") &&
                              Catch::Contains("set requires_grad before fully_shard"));
    });
  }
  SECTION("an optimizer on both the masters and the views") {
    run_ranks(1, [](Communicator& comm) {
      ParitySpec s = gpt_parity_spec(1, "type=Block");
      auto model = s.make_model();
      auto fsdp = fully_shard(model, s.plan(*model), comm);
      std::vector<at::Tensor> both = fsdp->parameters();
      for (auto& [name, v] : fsdp->named_parameters()) both.push_back(v);
      torch::optim::AdamW opt(both);
      RANK_REQUIRE_THROWS_WITH(fsdp->check_optimizer(opt), Catch::Contains("not both"));
    });
  }
  SECTION("ranks that freeze different parameters") {
    std::vector<std::string> errors(2);
    run_ranks(2, [&](Communicator& comm) {
      ParitySpec s = gpt_parity_spec(2, "type=Block");
      auto model = s.make_model();
      if (comm.rank() == 1) model->named_parameters()["blocks.2.mlp.fc.weight"].requires_grad_(false);
      try {
        fully_shard(model, s.plan(*model), comm);
      } catch (const c10::Error& e) {
        errors[comm.rank()] = e.what_without_backtrace();
      }
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      REQUIRE(contains(e, "blocks.2.mlp.fc.weight"));
      REQUIRE(contains(e, "requires_grad"));
    }
  }
}

TEST_CASE("zero_grad on the views frees the master gradients before the next forward",
          "[finetune][groups]") {
  // With the optimizer over the views, zero_grad(set_to_none) clears only the views' .grad; the
  // masters' gradients must go at the next step's start too (as zero_grad on parameters()
  // frees them), or a step holds the previous step's gradients through its forward.
  std::vector<int> held(2, -1);
  run_ranks(1, [&](Communicator& comm) {
    ParitySpec s = gpt_parity_spec(1, "type=Block");
    s.no_decay = no_decay;
    auto model = s.make_model();
    auto fsdp = fully_shard(model, s.plan(*model), comm);
    torch::optim::AdamW opt(param_groups(s, fsdp->named_parameters()),
                            torch::optim::AdamWOptions(s.lr));
    s.loss(model, 0, 0, 0).backward();
    opt.step();
    int before = 0, after = 0;
    for (size_t u = 0; u < fsdp->num_units(); ++u)
      before += fsdp->unit(u).flat().master().grad().defined() ? 1 : 0;
    opt.zero_grad();
    at::Tensor loss = s.loss(model, 0, 1, 0);  // the next forward: its root entry released them
    for (size_t u = 0; u < fsdp->num_units(); ++u)
      after += fsdp->unit(u).flat().master().grad().defined() ? 1 : 0;
    held = {before, after};
    loss.backward();
  });
  REQUIRE(held[0] == 4);  // every unit had its gradient after the backward
  REQUIRE(held[1] == 0);
}
