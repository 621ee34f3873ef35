// Parity on the reference LLaMA (models/llama.h; CPU, ranks as threads): for world sizes 1-4,
// per-layer (type=DecoderLayer) and per-leaf (type=Linear|RMSNorm|Embedding) plans made by the
// policy library, FULL_SHARD, 5 AdamW steps of the sharded model match the same model trained
// unsharded on one rank over the union of the ranks' batches (tests/parity_util.h): step-0
// gradients, every step's loss and the final parameters. Plus every-2 layers with a NO_SHARD
// layer and tied embeddings at world 3.
//
// Sizes are odd (d_model 36, vocab 97, hidden 50, seq 11) so every flat parameter needs
// padding at every world size > 1; 3 heads over 1 kv head (grouped-query attention); 3 layers
// so every-2 leaves a group of one. The rotary buffer is not sharded and not trained: it is
// broadcast at setup and the same on both sides.
// Tolerances (fp32): ParityTolerance's defaults, for the reasons tests/gpt_parity_test.cpp
// gives (only the summation order differs; AdamW on ~1e-8 gradients of rare embedding rows
// makes parameters the loosest check at atol 2e-4, while a lost or doubled gradient moves them
// by ~lr = 1e-2).
#include <catch2/catch.hpp>

#include "models/llama.h"
#include "parity_util.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
using namespace flatshard_test;
namespace ll = flatshard::llama;

namespace {

ll::LlamaConfig parity_llama_config() {
  ll::LlamaConfig c;
  c.vocab = 97;
  c.d_model = 36;
  c.n_heads = 3;
  c.n_kv_heads = 1;
  c.n_layers = 3;
  c.seq_len = 11;
  c.hidden = 50;
  return c;
}

ParitySpec llama_spec(int world, const std::string& policy_spec, bool tied = false) {
  ParitySpec s;
  s.world = world;
  s.make_model = [tied] {
    auto c = parity_llama_config();
    c.tie_embeddings = tied;
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

}  // namespace

TEST_CASE("LLaMA: sharded training matches unsharded training", "[parity][llama]") {
  const std::vector<std::pair<std::string, std::string>> plans = {
      {"per-layer", "type=DecoderLayer"},
      {"per-leaf", "type=Linear|RMSNorm|Embedding"},
  };
  for (int world = 1; world <= 4; ++world) {
    const ParityRun ref = run_reference(llama_spec(world, ""));
    for (auto& [name, spec] : plans) {
      CAPTURE(world, name);
      const ParityRun got = run_sharded(llama_spec(world, spec));
      require_parity(ref, got);
      // The plan really sharded per layer / per leaf: the root + 3 layers, or the root + 30
      // leaves (9 per layer; embed_tokens, norm, lm_head).
      CHECK(got.last_step_counters.per_unit.size() == (name == "per-layer" ? 4u : 31u));
    }
  }
}

TEST_CASE("LLaMA: every-2 layers with a NO_SHARD layer, and tied embeddings", "[parity][llama]") {
  const int world = 3;
  {
    const ParityRun ref = run_reference(llama_spec(world, ""));
    auto got = run_sharded(llama_spec(world, "noshard:path=layers.1;every=2,type=DecoderLayer"));
    require_parity(ref, got);
  }
  {
    auto s = llama_spec(world, "type=Linear|RMSNorm|Embedding", /*tied=*/true);
    require_parity(run_reference(s), run_sharded(s));
  }
}
