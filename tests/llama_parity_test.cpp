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

#include "llama_parity_spec.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
using namespace flatshard_test;


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
