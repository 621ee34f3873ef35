// Tensor parallelism composed with sharding (fsdp/tensor_parallel.h), ranks as threads on a
// shard x tp mesh (collectives/thread_mesh.h run_mesh). The reference is one unsharded rank over
// the union of the data-parallel ranks' batches (tests/parity_util.h): the ranks of one tp group
// see the same batch. GPT (fused qkv: colwise/3) and LLaMA with grouped-query attention (4 query
// heads over 2 kv heads), each family's default tp plan, a per-layer wrap policy, fp32:
// - step-0 loss and every gradient within 1e-5 of the reference's (each rank's gathered
//   gradient against its own slice of the reference's: TensorParallel::local_slice);
// - parameters after 5 clipped AdamW steps within tests/fsdp_test.cpp's tolerances;
// - the same with per-leaf units (each split Linear its own unit) and once on 8 ranks, HSDP
//   2 replicas x shard 2 x tp 2;
// - clip_grad_norm_'s total against the reference's norm (replicated parameters counted once);
// - misuse: heads tp does not divide, a plan rule that matches nothing, ranks that disagree on
//   the plan, a tp mesh over a model that was not parallelized, a full checkpoint (not yet). Each is refused before any
//   collective (parallelize is local) or by the setup fingerprint's agreed check, on every rank
//   alike, so run_mesh's failure propagation is enough: nothing can crash or hang.
// - explain() at tp 2 predicts the runtime exactly: each unit's sharding counters and layout, and
//   the TP collectives (TensorParallel::counters()), per step, for both families, per layer and
//   per leaf, recompute included;
// - training features under TP against the same reference: gradient accumulation with no-sync
//   micro-batches, frozen parameters, recompute, bf16 compute, and Qwen2 (biases on q/k/v).
#include <catch2/catch.hpp>

#include <cmath>
#include <mutex>
#include <set>

#include "checkpoint/checkpoint.h"
#include "collectives/thread_mesh.h"
#include "fsdp/tensor_parallel.h"
#include "models/family.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "parity_util.h"
#include "tp_test_util.h"
#include "planner/explain.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
using namespace flatshard_test;
using namespace flatshard_test::tp;

TEST_CASE("tensor parallel: GPT and LLaMA (GQA) at tp 2 x shard 1 and 2 match one rank",
          "[tp][parity]") {
  for (int shard : {1, 2}) {
    for (bool llama : {false, true}) {
      CAPTURE(shard, llama);
      ParitySpec s = llama ? llama_spec(shard) : gpt_spec(shard);
      // Below the gradient norm (~1.5 at step 0), so steps clip; far lower (0.05) pushes the
      // rare embedding rows' gradients to AdamW's eps, where float noise is amplified ~100x
      // even without tensor parallelism.
      s.clip = 0.5;
      const ParityRun ref = run_reference(s);
      double sq = 0;
      for (const auto& kv : ref.grads) sq += kv.second.pow(2).sum().item<double>();  // untied
      CHECK(std::sqrt(sq) > 2 * s.clip);
      require_tp_parity(ref, run_tp(s, llama ? llama_plan() : gpt_plan(), shard, 2, ref));
    }
  }
}

TEST_CASE("tensor parallel: per-leaf units, and HSDP 2 x shard 2 x tp 2", "[tp][parity]") {
  SECTION("per-leaf plan: each split Linear is its own unit") {
    for (bool llama : {false, true}) {
      CAPTURE(llama);
      ParitySpec s = llama ? llama_spec(2) : gpt_spec(2);
      const std::string leaves = llama ? "type=Linear|RMSNorm|Embedding" : "type=Linear|LayerNorm|Embedding";
      s.plan = [leaves](torch::nn::Module& m) { return make_plan(m, parse_policy(leaves)); };
      s.clip = 0.5;
      const ParityRun ref = run_reference(s);
      require_tp_parity(ref, run_tp(s, llama ? llama_plan() : gpt_plan(), 2, 2, ref));
    }
  }
  SECTION("8 ranks: 2 replicas of shard 2 x tp 2") {
    ParitySpec s = llama_spec(4);
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, llama_plan(), 2, 2, ref, /*replicate=*/2));
  }
}

TEST_CASE("tensor parallel: clip_grad_norm_ is the global norm, replicated parameters once",
          "[tp][clip]") {
  const ParitySpec s = gpt_spec(2);
  // The reference norm of step 0's mean loss over both data ranks' batches.
  auto ref = s.make_model();
  at::Tensor loss = (s.loss(ref, 0, 0, 0) + s.loss(ref, 1, 0, 0)) / 2;
  loss.backward();
  // Each tensor once (a tied embedding is listed under two names).
  double sq = 0;
  std::set<const void*> seen;
  for (const at::Tensor& p : ref->parameters(/*recurse=*/true))
    if (seen.insert(p.unsafeGetTensorImpl()).second) sq += p.grad().pow(2).sum().item<double>();
  const double want = std::sqrt(sq);
  std::vector<double> got(4);
  run_mesh(MeshShape(2, 1, 2), [&](const Mesh& mesh) {
    auto model = s.make_model();
    auto par = parallelize(model, parse_tp_plan(gpt_plan()), mesh);
    auto fsdp = fully_shard(model, s.plan(*model), mesh, s.options);
    s.loss(model, mesh.coord(MeshDim::kShard), 0, 0).backward();
    got[mesh.global_rank()] = fsdp->clip_grad_norm_(1e30);
  });
  for (double n : got) CHECK(n == Approx(want).epsilon(1e-5));
}

TEST_CASE("tensor parallel: misuse is refused naming the module, sizes and fix", "[tp][misuse]") {
  SECTION("heads tp does not divide") {
    const ParitySpec s = gpt_spec(1, /*n_heads=*/3);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        parallelize(s.make_model(), parse_tp_plan(gpt_plan()), mesh);
      });
    });
    CHECK_THAT(e, Catch::Contains("module 'blocks.0.attn' (CausalSelfAttention) has n_heads = 3, "
                                  "which tp 2 cannot split"));
    CHECK_THAT(e, Catch::Contains("use a tp size that divides 3"));
  }
  SECTION("GQA kv heads neither a multiple nor a divisor of tp") {
    ParitySpec s = llama_spec(1, 11, 97, false, /*n_kv_heads=*/4, /*n_heads=*/12);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 6), [&](const Mesh& mesh) {
        parallelize(s.make_model(), parse_tp_plan(llama_plan()), mesh);
      });
    });
    CHECK_THAT(e, Catch::Contains("n_heads = 12 and n_kv_heads = 4, which tp 6"));
    CHECK_THAT(e, Catch::Contains("kv heads fewer than tp are replicated"));
  }
  SECTION("a rule that matches nothing") {
    const ParitySpec s = gpt_spec(1);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        parallelize(s.make_model(), parse_tp_plan("colwise:path=*.mlp.fc;rowwise:path=*.o_proj"),
                    mesh);
      });
    });
    CHECK_THAT(e, Catch::Contains("tp plan rule 2 'rowwise:path=*.o_proj' matches no module"));
    CHECK_THAT(e, Catch::Contains("CausalSelfAttention"));
  }
  SECTION("a module that is not Linear-like") {
    const ParitySpec s = gpt_spec(1);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        parallelize(s.make_model(), parse_tp_plan("colwise:path=*.ln1|ln_f"), mesh);
      });
    });
    CHECK_THAT(e, Catch::Contains("not Linear-like"));
  }
  SECTION("ranks that disagree on the plan") {
    const ParitySpec s = gpt_spec(1);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        const std::string extra = mesh.coord(MeshDim::kTp) == 1 ? ";replicate:path=wpe" : "";
        auto model = s.make_model();
        auto par = parallelize(model, parse_tp_plan(gpt_plan() + extra), mesh);
        fully_shard(model, s.plan(*model), mesh, s.options);
      });
    });
    CHECK_THAT(e, Catch::Contains("tp plan"));
    CHECK_THAT(e, Catch::Contains("every rank must call fully_shard with the same plan"));
  }
  SECTION("a full checkpoint of a tp model (sharded ones: tests/tp_checkpoint_test.cpp)") {
    const ParitySpec s = gpt_spec(1);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        auto model = s.make_model();
        auto par = parallelize(model, parse_tp_plan(gpt_plan()), mesh);
        auto fsdp = fully_shard(model, s.plan(*model), mesh, s.options);
        CheckpointOptions o;
        o.kind = CheckpointKind::kFull;
        save_checkpoint(*fsdp, nullptr, "/nonexistent/tp_ckpt", o);
      });
    });
    CHECK_THAT(e, Catch::Contains("CheckpointKind::kFull"));
    CHECK_THAT(e, Catch::Contains("save kSharded"));
  }
  SECTION("a tp mesh over a model that was not parallelized") {
    const ParitySpec s = gpt_spec(1);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        auto model = s.make_model();
        fully_shard(model, s.plan(*model), mesh, s.options);
      });
    });
    CHECK_THAT(e, Catch::Contains("the mesh has tp 2 but the model was not parallelized"));
  }
}


TEST_CASE("tensor parallel: explain predicts the TP-local units and the TP collectives exactly",
          "[tp][explain]") {
  // synthetic_batch(config, 2, ...): 2 sequences of seq_len 11 per rank.
  const int64_t tokens = 2 * 11;
  struct Case {
    bool llama;
    std::string policy;
    bool recompute;
  };
  for (const Case& c : {Case{false, "type=Block", false}, Case{true, "type=DecoderLayer", false},
                        Case{false, "type=Linear|LayerNorm|Embedding", false},
                        Case{true, "recompute:type=DecoderLayer", true}}) {
    for (int shard : {1, 2}) {
      CAPTURE(c.llama, c.policy, shard);
      ParitySpec s = c.llama ? llama_spec(shard) : gpt_spec(shard);
      const std::string policy = c.policy;
      s.plan = [policy](torch::nn::Module& m) { return make_plan(m, parse_policy(policy)); };
      const std::string tp_plan = c.llama ? llama_plan() : gpt_plan();
      auto fresh = s.make_model();  // explained as it is before parallelize()
      const Explanation e = explain(*fresh, s.plan(*fresh), MeshShape(shard, 1, 2), s.options,
                                    std::nullopt, {}, parse_tp_plan(tp_plan));
      // The closed form: per layer, GPT 2 rowwise (attn.proj, mlp.proj) and 2 colwise (qkv,
      // fc); LLaMA 2 rowwise (o, down) and 5 colwise (q, k, v, gate, up), each colwise module
      // all-reducing its own input gradient. Recompute runs each layer's forward twice.
      const int64_t layers = 3, colwise = c.llama ? 5 : 2, d = c.llama ? 40 : 36;
      CHECK(e.tp.forward_all_reduces == layers * 2 * (c.recompute ? 2 : 1));
      CHECK(e.tp.backward_all_reduces == layers * colwise);
      CHECK(e.tp.forward_numel_per_token == layers * 2 * d * (c.recompute ? 2 : 1));
      CHECK(e.tp.backward_numel_per_token ==
            layers * (c.llama ? 3 * d + 2 * d : d + d));
      const auto ranks = count_one_step(s, tp_plan, shard, 2);
      for (const CountedStep& r : ranks) {
        const TpCounters want = e.tp.counters(tokens, at::kFloat);
        CHECK(r.tp.forward_all_reduces == want.forward_all_reduces);
        CHECK(r.tp.backward_all_reduces == want.backward_all_reduces);
        CHECK(r.tp.forward_bytes == want.forward_bytes);
        CHECK(r.tp.backward_bytes == want.backward_bytes);
        REQUIRE(r.per_unit.size() == e.units.size());
        TpCollectives unit_sum;
        for (size_t i = 0; i < e.units.size(); ++i) {
          const UnitExplanation& want_u = e.units[i];
          CAPTURE(want_u.name);
          unit_sum += want_u.tp;
          CHECK(r.info[i].name == want_u.name);
          CHECK(r.info[i].padded_numel == want_u.padded_numel);
          CHECK(r.info[i].shard_numel == want_u.shard_numel);
          CHECK(r.per_unit[i].forward_all_gathers == want_u.per_step.forward_all_gathers);
          CHECK(r.per_unit[i].backward_all_gathers == want_u.per_step.backward_all_gathers);
          CHECK(r.per_unit[i].reduce_scatters == want_u.per_step.reduce_scatters);
          CHECK(r.per_unit[i].all_reduces == want_u.per_step.all_reduces);
          CHECK(r.per_unit[i].bytes == want_u.per_step.bytes);
        }
        CHECK(unit_sum.forward_all_reduces == e.tp.forward_all_reduces);
        CHECK(unit_sum.backward_numel_per_token == e.tp.backward_numel_per_token);
      }
    }
  }
  SECTION("a parallelized model is explained as it is; a tp mesh needs a plan") {
    const ParitySpec s = gpt_spec(1);
    auto fresh = s.make_model();
    const Explanation want = explain(*fresh, s.plan(*fresh), MeshShape(1, 1, 2), s.options,
                                     std::nullopt, {}, parse_tp_plan(gpt_plan()));
    run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
      auto model = s.make_model();
      auto par = parallelize(model, parse_tp_plan(gpt_plan()), mesh);
      const Explanation got = explain(*model, s.plan(*model), MeshShape(1, 1, 2), s.options);
      TORCH_CHECK(got.total_numel == want.total_numel && got.tp.backward_all_reduces ==
                      want.tp.backward_all_reduces && got.memory.persistent_bytes ==
                      want.memory.persistent_bytes,
                  "explain of the parallelized model differs");
    });
    CHECK_THAT(error_of([&] { explain(*fresh, s.plan(*fresh), MeshShape(1, 1, 2), s.options); }),
               Catch::Contains("has tp > 1 but no tp plan was given"));
    const std::string text = want.to_string();
    CHECK_THAT(text, Catch::Contains("tensor parallel: tp 2"));
    CHECK_THAT(text, Catch::Contains("6 forward + 6 backward all-reduces over the tp group"));
  }
}

TEST_CASE("tensor parallel: accumulation, frozen parameters, recompute, bf16, Qwen2",
          "[tp][parity]") {
  SECTION("gradient accumulation with no-sync micro-batches") {
    ParitySpec s = llama_spec(2);
    s.micro_batches = 3;
    s.no_sync_accumulation = true;
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, llama_plan(), 2, 2, ref));
  }
  SECTION("frozen parameters: split (every qkv), replicated (embeddings), a wholly frozen unit") {
    ParitySpec s = gpt_spec(2);
    // tests/finetune_test.cpp's recipe.
    s.frozen = [](const std::string& n) {
      return n == "wte.weight" || n == "wpe.weight" || n.find(".attn.qkv.") != std::string::npos ||
             n.rfind("blocks.1.", 0) == 0;
    };
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, gpt_plan(), 2, 2, ref));
  }
  SECTION("recompute") {
    ParitySpec s = gpt_spec(2);
    s.plan = [](torch::nn::Module& m) {
      return make_plan(m, parse_policy("recompute:type=Block"));
    };
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, gpt_plan(), 2, 2, ref));
  }
  SECTION("Qwen2: biases on q, k and v (colwise: split with the rows)") {
    ParitySpec s = llama_spec(2);
    s.make_model = [] {
      llama::LlamaConfig c;
      c.vocab = 97;
      c.d_model = 40;
      c.n_heads = 4;
      c.n_kv_heads = 2;
      c.n_layers = 3;
      c.seq_len = 11;
      c.hidden = 50;
      c.attention_bias = true;
      return std::static_pointer_cast<torch::nn::Module>(llama::Llama(c, 11).ptr());
    };
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    REQUIRE(ref.grads.count("layers.0.attn.q.bias") == 1);
    require_tp_parity(ref, run_tp(s, llama_plan(), 2, 2, ref));
  }
  SECTION("bf16 compute, against the fp32 reference (tests/fsdp_test.cpp's bf16 tolerances)") {
    ParitySpec s = gpt_spec(2);
    const ParityRun ref = run_reference(s);  // fp32
    s.options.mixed_precision.param_dtype = at::kBFloat16;
    require_tp_bf16_parity(ref, run_tp(s, gpt_plan(), 2, 2, ref));
  }
}


TEST_CASE("tensor parallel: sequence and loss parallelism match one rank", "[tp][parity][sp]") {
  // seq_len 12 and vocab 98: tp 2 divides both.
  struct Mode {
    bool sp, lp;
  };
  // In a section of its own: code outside the sections runs again for each of them (Catch2).
  SECTION("fp32: GPT and LLaMA at tp 2 x shard 1 and 2") {
    for (int shard : {1, 2}) {
      for (bool llama : {false, true}) {
        for (const Mode m : {Mode{true, false}, Mode{false, true}, Mode{true, true}}) {
          CAPTURE(shard, llama, m.sp, m.lp);
          ParitySpec s = llama ? llama_spec(shard, 12, 98) : gpt_spec(shard, 4, 12, 98);
          s.clip = 0.5;
          const ParityRun ref = run_reference(s);
          require_tp_parity(ref, run_tp(s, sp_lp_plan(llama, m.sp, m.lp), shard, 2, ref));
        }
      }
    }
  }
  SECTION("bf16 compute with sequence parallelism, loss parallelism and both (tp 2 x shard 2)") {
    // Against the fp32 reference with the bf16 tolerances above (require_tp_bf16_parity).
    for (bool llama : {false, true}) {
      for (const Mode m : {Mode{true, false}, Mode{false, true}, Mode{true, true}}) {
        CAPTURE(llama, m.sp, m.lp);
        ParitySpec s = llama ? llama_spec(2, 12, 98) : gpt_spec(2, 4, 12, 98);
        const ParityRun ref = run_reference(s);  // fp32
        s.options.mixed_precision.param_dtype = at::kBFloat16;
        require_tp_bf16_parity(ref, run_tp(s, sp_lp_plan(llama, m.sp, m.lp), 2, 2, ref));
      }
    }
  }
  SECTION("recompute units (their backward reduces the norms' gradients once)") {
    ParitySpec s = gpt_spec(2, 4, 12, 98);
    s.plan = [](torch::nn::Module& m) {
      return make_plan(m, parse_policy("recompute:type=Block"));
    };
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, sp_lp_plan(false, true, true), 2, 2, ref));
  }
  SECTION("8 ranks: HSDP 2 replicas of shard 2 x tp 2, LLaMA with both") {
    ParitySpec s = llama_spec(4, 12, 98);
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, sp_lp_plan(true, true, true), 2, 2, ref, /*replicate=*/2));
  }
  SECTION("Qwen2 (biases on q, k, v) with both, and LLaMA per-leaf units") {
    ParitySpec s = llama_spec(2, 12, 98, /*qwen2=*/true);
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, sp_lp_plan(true, true, true), 2, 2, ref));
    ParitySpec leaves = llama_spec(2, 12, 98);
    leaves.plan = [](torch::nn::Module& m) {
      return make_plan(m, parse_policy("type=Linear|RMSNorm|Embedding"));
    };
    leaves.clip = 0.5;
    const ParityRun ref2 = run_reference(leaves);
    require_tp_parity(ref2, run_tp(leaves, sp_lp_plan(true, true, false), 2, 2, ref2));
  }
}

TEST_CASE("tensor parallel: explain predicts the sequence- and loss-parallel collectives exactly",
          "[tp][explain][sp]") {
  const int64_t tokens = 2 * 12;  // synthetic_batch(config, 2, ...) of seq_len 12 per rank
  struct Mode {
    bool sp, lp;
  };
  for (bool llama : {false, true}) {
    for (const Mode m : {Mode{true, false}, Mode{false, true}, Mode{true, true}}) {
      for (int shard : {1, 2}) {
        CAPTURE(llama, m.sp, m.lp, shard);
        const ParitySpec s = llama ? llama_spec(shard, 12, 98) : gpt_spec(shard, 4, 12, 98);
        const std::string tp_plan = sp_lp_plan(llama, m.sp, m.lp);
        auto fresh = s.make_model();
        const Explanation e = explain(*fresh, s.plan(*fresh), MeshShape(shard, 1, 2), s.options,
                                      std::nullopt, {}, parse_tp_plan(tp_plan));
        // The closed form per layer: GPT 2 colwise (qkv, fc), LLaMA 5 (q, k, v, gate, up), each
        // gathering its input; 2 rowwise (reduce-scattering their outputs); the duals in
        // backward; the lm_head of loss parallelism one more colwise. Gradients all-reduced: GPT
        // ln1, ln2 (weight, bias) and the rowwise biases per layer, ln_f; LLaMA the two norms'
        // weights per layer, norm.
        const int64_t layers = 3, colwise = llama ? 5 : 2, d = llama ? 40 : 36;
        const int64_t cols = m.sp ? layers * colwise + (m.lp ? 1 : 0) : 0;
        CHECK(e.tp.forward_all_gathers == cols);
        CHECK(e.tp.backward_reduce_scatters == cols);
        CHECK(e.tp.forward_reduce_scatters == (m.sp ? layers * 2 : 0));
        CHECK(e.tp.backward_all_gathers == (m.sp ? layers * 2 : 0));
        CHECK(e.tp.forward_all_reduces == (m.sp ? 0 : layers * 2));
        CHECK(e.tp.backward_all_reduces == (m.sp ? 0 : layers * colwise + (m.lp ? 1 : 0)));
        const int64_t grads = !m.sp ? 0 : llama ? 2 * layers + 1 : 6 * layers + 2;
        CHECK(e.tp.grad_all_reduces == grads);
        CHECK(e.tp.grad_numel ==
              (!m.sp ? 0 : llama ? grads * d : (4 * layers + 2) * d + 2 * layers * d));
        CHECK(e.tp.loss_all_reduces == (m.lp ? 3 : 0));
        const TpCounters want = e.tp.counters(tokens, at::kFloat);
        const auto ranks = count_one_step(s, tp_plan, shard, 2);
        for (const CountedStep& r : ranks) {
          TpCounters got = r.tp;
          // The model's own sequence edges (not predicted): the embeddings' shard (a backward
          // all-gather) and, before a replicated lm_head, a forward all-gather; d per token.
          CHECK(got.boundary_all_gathers == (m.sp ? (m.lp ? 1 : 2) : 0));
          CHECK(got.boundary_bytes == got.boundary_all_gathers * tokens * d * 4);
          got.boundary_all_gathers = got.boundary_bytes = 0;
          CHECK(got.forward_all_gathers == want.forward_all_gathers);
          CHECK(got.forward_reduce_scatters == want.forward_reduce_scatters);
          CHECK(got.backward_all_gathers == want.backward_all_gathers);
          CHECK(got.backward_reduce_scatters == want.backward_reduce_scatters);
          CHECK(got.forward_bytes == want.forward_bytes);
          CHECK(got.backward_bytes == want.backward_bytes);
          CHECK(got.grad_all_reduces == want.grad_all_reduces);
          CHECK(got.grad_bytes == want.grad_bytes);
          CHECK(got.loss_all_reduces == want.loss_all_reduces);
          CHECK(got.loss_bytes == want.loss_bytes);
          CHECK(got == want);
          TpCollectives unit_sum;
          for (const UnitExplanation& u : e.units) unit_sum += u.tp;
          CHECK(unit_sum.grad_all_reduces == e.tp.grad_all_reduces);
          CHECK(unit_sum.forward_all_gathers == e.tp.forward_all_gathers);
        }
      }
    }
  }
}

TEST_CASE("tensor parallel: sequence and loss parallelism refuse misuse by name",
          "[tp][misuse][sp]") {
  SECTION("a sequence length tp does not divide") {
    const ParitySpec s = gpt_spec(1, 4, /*seq_len=*/11);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        auto model = s.make_model();
        auto par = parallelize(model, parse_tp_plan(sp_lp_plan(false, true, false)), mesh);
        auto fsdp = fully_shard(model, s.plan(*model), mesh, s.options);
        s.loss(model, 0, 0, 0);
      });
    });
    CHECK_THAT(e, Catch::Contains("the sequence length 11"));
    CHECK_THAT(e, Catch::Contains("is not a multiple of tp 2"));
  }
  SECTION("sequence_parallel without a sequence rule") {
    const ParitySpec s = gpt_spec(1, 4, 12);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        parallelize(s.make_model(),
                    parse_tp_plan("colwise/3:path=*.attn.qkv;rowwise:path=*.attn.proj;"
                                  "sequence_parallel"),
                    mesh);
      });
    });
    CHECK_THAT(e, Catch::Contains("has sequence_parallel but no sequence rule"));
  }
  SECTION("a colwise head without loss_parallel, and loss_parallel without a colwise head") {
    const ParitySpec s = gpt_spec(1, 4, 12, 98);
    for (const std::string& plan :
         {gpt_plan() + ";colwise:path=lm_head", gpt_plan() + ";loss_parallel"}) {
      CAPTURE(plan);
      const std::string e = error_of([&] {
        run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
          auto model = s.make_model();
          auto par = parallelize(model, parse_tp_plan(plan), mesh);
          auto fsdp = fully_shard(model, s.plan(*model), mesh, s.options);
          s.loss(model, 0, 0, 0);
        });
      });
      CHECK_THAT(e, Catch::Contains(plan.find("loss_parallel") == std::string::npos
                                        ? "the logits have 49 classes but the vocabulary is 98"
                                        : "the logits have 98 classes per rank but the vocabulary "
                                          "is 98"));
    }
  }
  SECTION("kv heads fewer than tp (kept whole) with sequence parallelism") {
    const ParitySpec s = llama_spec(1, 12, 98, false, /*n_kv_heads=*/1);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        parallelize(s.make_model(), parse_tp_plan(sp_lp_plan(true, true, false)), mesh);
      });
    });
    CHECK_THAT(e, Catch::Contains("has 1 head groups, fewer than tp 2"));
    CHECK_THAT(e, Catch::Contains("does not combine with sequence_parallel yet"));
  }
  SECTION("a colwise head tied to the embedding") {
    namespace g = flatshard::gpt;
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        g::GPTConfig c = g::GPTConfig::preset("tiny");
        c.tie_embeddings = true;
        parallelize(g::GPT(c, 1).ptr(), parse_tp_plan(sp_lp_plan(false, false, true)), mesh);
      });
    });
    CHECK_THAT(e, Catch::Contains("module 'lm_head' (colwise) shares its parameter 'weight' with "
                                  "module 'wte' (tied weights)"));
  }
}

TEST_CASE("tensor parallel: kv heads fewer than tp are replicated and match one rank",
          "[tp][parity]") {
  // Note [Replicated kv heads]: k and v stay whole on every tp rank, each rank uses its query
  // heads' kv head, and their output gradient is summed over tp, so their gradients are the
  // unsharded ones (not split: local_slice is the identity) on every rank.
  struct Case {
    int64_t kv, heads;
    int shard, tp;
  };
  auto is_kv = [](const std::string& name) {
    return name.find(".attn.k.") != std::string::npos || name.find(".attn.v.") != std::string::npos;
  };
  for (const Case& c : {Case{1, 4, 1, 2}, Case{1, 4, 2, 2}, Case{2, 4, 1, 4}}) {
    CAPTURE(c.kv, c.heads, c.shard, c.tp);
    ParitySpec s = llama_spec(c.shard, 11, 97, false, c.kv, c.heads, /*hidden=*/48);  // tp 4 splits 48
    s.clip = 0.5;
    // At the parity tests' lr 1e-2, AdamW amplifies the all-reduce's rounding in near-zero
    // gradients: after 5 steps the parameters of the 1-rank batch (shard 1) differed by up to
    // 1.3e-4 (lm_head, replicated), over the 5e-5 + 1e-4 relative tolerance, with step-0
    // gradients within 1e-5. lr 1e-3 keeps the steps' check meaningful without that noise.
    s.lr = 1e-3;
    const ParityRun ref = run_reference(s);
    const auto ranks = run_tp(s, llama_plan(), c.shard, c.tp, ref);
    require_tp_parity(ref, ranks);
    for (const RankCheck& r : ranks) {
      CAPTURE(r.where);
      for (const auto& [name, got, want] : r.grads)
        if (is_kv(name)) {
          CAPTURE(name);
          CHECK(got.sizes() == ref.grads.at(name).sizes());  // whole, not a slice
        }
      // Replicated: every rank holds the same k and v after the steps, bit for bit.
      for (size_t i = 0; i < r.params.size(); ++i)
        if (is_kv(std::get<0>(r.params[i]))) {
          CAPTURE(std::get<0>(r.params[i]));
          CHECK(at::equal(std::get<1>(r.params[i]), std::get<1>(ranks[0].params[i])));
        }
    }
  }
  SECTION("explain predicts the replicated modules' all-reduces; placement is replicate") {
    ParitySpec s = llama_spec(1, 11, 97, false, /*n_kv_heads=*/1);
    auto fresh = s.make_model();
    const Explanation e = explain(*fresh, s.plan(*fresh), MeshShape(1, 1, 2), s.options,
                                  std::nullopt, {}, parse_tp_plan(llama_plan()));
    // Per layer: q, gate, up all-reduce their input gradient (d = 40 per token), k and v their
    // whole output's gradient (1 kv head x head_dim 10).
    CHECK(e.tp.backward_all_reduces == 3 * 5);
    CHECK(e.tp.backward_numel_per_token == 3 * (3 * 40 + 2 * 10));
    for (const CountedStep& r : count_one_step(s, llama_plan(), 1, 2)) {
      const TpCounters want = e.tp.counters(2 * 11, at::kFloat);
      CHECK(r.tp == want);
    }
    run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
      auto model = s.make_model();
      auto par = parallelize(model, parse_tp_plan(llama_plan()), mesh);
      TORCH_CHECK(par->placement("layers.0.attn.k.weight") == TpPlacement{},
                  "k is not replicated: ", to_string(par->placement("layers.0.attn.k.weight")));
      TORCH_CHECK(to_string(par->placement("layers.0.attn.q.weight")) == "colwise");
      TORCH_CHECK(par->to_string().find("colwise layers.0.attn.v (kept whole: 1 head groups < tp 2)") !=
                      std::string::npos,
                  par->to_string());
    });
  }
}
