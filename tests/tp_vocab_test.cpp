// Vocabulary-parallel embeddings (the tp plan's `vocab` style, fsdp/tensor_parallel.h; issue 51
// item 1): an Embedding's rows split over tp, each rank looking up the ids of its range (others
// zero rows), the output all-reduced over tp, backward local (Megatron's VocabParallelEmbedding).
// CPU ranks as threads; the reference is one unsharded rank over the union of the data-parallel
// batches (tests/tp_test_util.h, as tests/tensor_parallel_test.cpp):
// - GPT (wte) and LLaMA (embed_tokens) at tp 2 x shard 1 and tp 2 x shard 2, per-layer plan,
//   untied: step-0 loss and gradients within 1e-5 (each rank's gradient of the embedding against
//   its rows of the reference's), parameters after 5 clipped AdamW steps within the parity
//   tolerances; GPT also with loss parallelism (vocab embedding and colwise head: no rank holds
//   a whole vocabulary matrix) and per-leaf units (the embedding its own unit);
// - explain() predicts the counters exactly: one more forward all-reduce of d per token;
// - the placement is colwise (dim 0 split): to_string, and the rows each rank holds;
// - misuse is refused by name: a vocabulary tp does not divide, tied embeddings, sequence
//   parallelism, a module that is not Embedding-like, ids outside the vocabulary.
// Checkpoints of a vocab-parallel model: tests/tp_checkpoint_test.cpp.
#include <catch2/catch.hpp>

#include "planner/explain.h"
#include "tp_test_util.h"

using namespace flatshard;
using namespace flatshard_test;
using namespace flatshard_test::tp;

namespace {

// vocab 98: tp 2 divides it. seq_len 12, as the sequence- and loss-parallel tests: at seq_len
// 11 and vocab 98 GPT at tp 2 x shard 1 drifts 8e-5 from the reference after 5 AdamW steps
// (fc.weight) with or without the vocab split (AdamW amplifying rounding in near-zero gradients:
// tests/tensor_parallel_test.cpp's kv-heads case), over the 5e-5 tolerance.
constexpr int64_t kVocab = 98;

std::string vocab_plan(bool llama, bool loss_parallel = false) {
  if (getenv("NOVOCAB")) return sp_lp_plan(llama, false, loss_parallel);
  return sp_lp_plan(llama, false, loss_parallel) +
         (llama ? ";vocab:path=embed_tokens" : ";vocab:path=wte");
}

}  // namespace

TEST_CASE("tp vocab: GPT and LLaMA with a vocabulary-parallel embedding match one rank",
          "[tp][parity][vocab]") {
  SECTION("per-layer units, tp 2 x shard 1 and tp 2 x shard 2") {
    for (int shard : {1, 2}) {
      for (bool llama : {false, true}) {
        CAPTURE(shard, llama);
        ParitySpec s = llama ? llama_spec(shard, 12, kVocab) : gpt_spec(shard, 4, 12, kVocab);
        s.clip = 0.5;
        const ParityRun ref = run_reference(s);
        require_tp_parity(ref, run_tp(s, vocab_plan(llama), shard, 2, ref));
      }
    }
  }
  SECTION("with loss parallelism, and per-leaf units") {
    ParitySpec s = gpt_spec(2, 4, 12, kVocab);
    s.clip = 0.5;
    const ParityRun ref = run_reference(s);
    require_tp_parity(ref, run_tp(s, vocab_plan(false, /*loss_parallel=*/true), 2, 2, ref));
    ParitySpec leaves = llama_spec(2, 12, kVocab);
    leaves.plan = [](torch::nn::Module& m) {
      return make_plan(m, parse_policy("type=Linear|RMSNorm|Embedding"));
    };
    leaves.clip = 0.5;
    const ParityRun ref2 = run_reference(leaves);
    require_tp_parity(ref2, run_tp(leaves, vocab_plan(true), 2, 2, ref2));
  }
}

TEST_CASE("tp vocab: explain predicts the embedding's all-reduce; the placement is colwise",
          "[tp][explain][vocab]") {
  const int64_t tokens = 2 * 12;  // synthetic_batch(config, 2, ...) of seq_len 12 per rank
  for (bool llama : {false, true}) {
    for (int shard : {1, 2}) {
      CAPTURE(llama, shard);
      const ParitySpec s = llama ? llama_spec(shard, 12, kVocab) : gpt_spec(shard, 4, 12, kVocab);
      const std::string plan = vocab_plan(llama);
      auto fresh = s.make_model();
      const Explanation e = explain(*fresh, s.plan(*fresh), MeshShape(shard, 1, 2), s.options,
                                    std::nullopt, {}, parse_tp_plan(plan));
      // The closed form: 2 rowwise all-reduces per layer and the embedding's one, each of d per
      // token; the embedding adds nothing backward.
      const int64_t layers = 3, colwise = llama ? 5 : 2, d = llama ? 40 : 36;
      CHECK(e.tp.forward_all_reduces == layers * 2 + 1);
      CHECK(e.tp.forward_numel_per_token == (layers * 2 + 1) * d);
      CHECK(e.tp.backward_all_reduces == layers * colwise);
      const TpCounters want = e.tp.counters(tokens, at::kFloat);
      for (const CountedStep& r : count_one_step(s, plan, shard, 2)) {
        CHECK(r.tp.forward_all_reduces == want.forward_all_reduces);
        CHECK(r.tp.forward_bytes == want.forward_bytes);
        CHECK(r.tp.backward_all_reduces == want.backward_all_reduces);
        CHECK(r.tp == want);
        // The embedding's weight is split: each unit's layout is the TP-local one.
        REQUIRE(r.info.size() == e.units.size());
        for (size_t i = 0; i < e.units.size(); ++i) {
          CAPTURE(e.units[i].name);
          CHECK(r.info[i].padded_numel == e.units[i].padded_numel);
          CHECK(r.info[i].shard_numel == e.units[i].shard_numel);
        }
      }
    }
  }
  SECTION("placement, rows and to_string") {
    const ParitySpec s = gpt_spec(1, 4, 11, kVocab);
    auto full = s.make_model();
    const at::Tensor wte = full->named_parameters()["wte.weight"].detach().clone();
    run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
      auto model = s.make_model();
      auto par = parallelize(model, parse_tp_plan(vocab_plan(false)), mesh);
      const int k = mesh.coord(MeshDim::kTp);
      TORCH_CHECK(to_string(par->placement("wte.weight")) == "colwise",
                  to_string(par->placement("wte.weight")));
      const at::Tensor got = model->named_parameters()["wte.weight"];
      TORCH_CHECK(at::equal(got, wte.narrow(0, k * kVocab / 2, kVocab / 2)),
                  "tp rank ", k, " does not hold rows [", k * kVocab / 2, ", ",
                  (k + 1) * kVocab / 2, ")");
      TORCH_CHECK(par->to_string().find("vocab wte\n") != std::string::npos, par->to_string());
      TORCH_CHECK(par->is_split(got));
    });
  }
}

TEST_CASE("tp vocab: misuse is refused naming the module, sizes and fix", "[tp][misuse][vocab]") {
  auto parallelize_error = [](const ParitySpec& s, const std::string& plan) {
    return error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        parallelize(s.make_model(), parse_tp_plan(plan), mesh);
      });
    });
  };
  SECTION("a vocabulary tp does not divide") {
    const std::string e = parallelize_error(gpt_spec(1, 4, 11, 97), vocab_plan(false));
    CHECK_THAT(e, Catch::Contains("module 'wte' (Embedding, vocab) has a vocabulary of 97 rows, "
                                  "which tp 2 cannot split evenly; pad the vocabulary to a "
                                  "multiple of 2 (e.g. 98)"));
  }
  SECTION("tied embeddings, alone and with a colwise head") {
    ParitySpec s = gpt_spec(1, 4, 11, kVocab);
    s.make_model = [] {
      gpt::GPTConfig c = gpt::GPTConfig::preset("tiny");
      c.tie_embeddings = true;
      return std::static_pointer_cast<torch::nn::Module>(gpt::GPT(c, 1).ptr());
    };
    CHECK_THAT(parallelize_error(s, vocab_plan(false)),
               Catch::Contains("module 'wte' (vocab) shares its parameter 'weight' with module "
                               "'lm_head' (tied weights)"));
    CHECK_THAT(parallelize_error(s, vocab_plan(false, /*loss_parallel=*/true)),
               Catch::Contains("share their parameter 'weight' (tied weights)"));
  }
  SECTION("sequence parallelism") {
    const std::string e =
        parallelize_error(llama_spec(1, 12, kVocab),
                          sp_lp_plan(true, true, false) + ";vocab:path=embed_tokens");
    CHECK_THAT(e, Catch::Contains("module 'embed_tokens' (Embedding, vocab) is "
                                  "vocabulary-parallel, which does not combine with "
                                  "sequence_parallel yet"));
  }
  SECTION("a module that is not Embedding-like") {
    const std::string e = parallelize_error(gpt_spec(1, 4, 11, kVocab),
                                            "vocab:path=ln_f;" + gpt_plan());
    CHECK_THAT(e, Catch::Contains("module 'ln_f' (LayerNorm, vocab) is not Embedding-like"));
  }
  SECTION("ids outside the vocabulary") {
    const ParitySpec s = gpt_spec(1, 4, 11, kVocab);
    const std::string e = error_of([&] {
      run_mesh(MeshShape(1, 1, 2), [&](const Mesh& mesh) {
        auto model = std::static_pointer_cast<gpt::GPTImpl>(s.make_model());
        auto par = parallelize(model, parse_tp_plan(vocab_plan(false)), mesh);
        model->forward(at::full({1, 3}, kVocab, at::kLong));
      });
    });
    CHECK_THAT(e, Catch::Contains("module 'wte' (vocab) got ids in [98, 98] outside its "
                                  "vocabulary [0, 98)"));
  }
}
