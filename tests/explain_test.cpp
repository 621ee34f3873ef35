// flatshard-explain's numbers (fsdp/explain.h), label diagnostics.
//
// Independent references: unit sizes, padding and bytes are written out by hand from the GPT
// shapes (comments show the arithmetic), and the per-step collectives are compared with what the
// runtime counts when the same tiny GPT trains on 2-3 ranks (threads). The memory estimate is
// checked against a hand simulation of one plan.
#include <catch2/catch.hpp>

#include <mutex>

#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "fsdp/call.h"
#include "fsdp/explain.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
namespace g = flatshard::gpt;

namespace {

const char* kPerLayer = "type=Block";
const char* kPerLeaf = "type=Linear|LayerNorm|Embedding";

Explanation explain_tiny(const std::string& spec, int world, const ShardingOptions& o = {},
                         std::optional<int64_t> limit = std::nullopt) {
  auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
  return explain(*model, make_plan(*model, parse_policy(spec)), world, o, limit);
}

const UnitExplanation& unit(const Explanation& e, const std::string& name) {
  for (const auto& u : e.units)
    if (u.name == name) return u;
  FAIL("no unit " << name);
  return e.units.front();
}

void require_unit(const Explanation& e, const std::string& name, int64_t numel, int64_t padded,
                  int64_t shard, int64_t fwd_ag, int64_t bwd_ag, int64_t rs, int64_t ar,
                  int64_t bytes) {
  CAPTURE(name);
  const auto& u = unit(e, name);
  CHECK(u.numel == numel);
  CHECK(u.padded_numel == padded);
  CHECK(u.shard_numel == shard);
  CHECK(u.padding() == padded - numel);
  CHECK(u.per_step.forward_all_gathers == fwd_ag);
  CHECK(u.per_step.backward_all_gathers == bwd_ag);
  CHECK(u.per_step.reduce_scatters == rs);
  CHECK(u.per_step.all_reduces == ar);
  CHECK(u.per_step.bytes == bytes);
}

// Trains the tiny GPT sharded with `spec` for two steps and returns rank 0's per-unit counters
// of the second step (steady state: forward prefetch is on) and the communicator's totals.
struct RuntimeCounts {
  StepCounters units;
  CommCounters comm;
  std::vector<UnitInfo> info;
};
RuntimeCounts run_tiny(const std::string& spec, int world, const ShardingOptions& o) {
  RuntimeCounts out;
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), comm, o);
    for (int step = 0; step < 2; ++step) {
      fsdp->reset_counters();
      comm.reset_counters();
      auto [x, y] = g::synthetic_batch(model->config(), 2, 3, comm.rank(), step);
      auto loss = flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
      loss.backward();
    }
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out.units = fsdp->counters();
      out.comm = comm.counters();
      out.info = fsdp->units();
    }
  });
  return out;
}

}  // namespace

TEST_CASE("explain: tiny GPT per-layer, exact sizes and collectives", "[diagnostics][explain]") {
  // d = 64, V = 512, T = 32. A Block: ln1 2d, qkv 3d²+3d, proj d²+d, ln2 2d, fc 4d²+4d,
  // mlp.proj 4d²+d = 12d²+13d = 49984; every parameter a multiple of 8 (no inner padding).
  // Root: wte Vd + wpe Td + ln_f 2d + lm_head Vd = 32768 + 2048 + 128 + 32768 = 67712.
  SECTION("world 2: padded to multiples of 16, no padding needed") {
    const auto e = explain_tiny(kPerLayer, 2);
    REQUIRE(e.units.size() == 3);
    // Root keeps its parameters: 1 forward AG, no backward AG. fp32: AG sends shard*4, RS padded*4.
    require_unit(e, "<root>", 67712, 67712, 33856, 1, 0, 1, 0, 33856 * 4 + 67712 * 4);
    require_unit(e, "blocks.0", 49984, 49984, 24992, 1, 1, 1, 0, 2 * 24992 * 4 + 49984 * 4);
    require_unit(e, "blocks.1", 49984, 49984, 24992, 1, 1, 1, 0, 2 * 24992 * 4 + 49984 * 4);
    CHECK(e.per_step.forward_all_gathers == 3);
    CHECK(e.per_step.backward_all_gathers == 2);
    CHECK(e.per_step.reduce_scatters == 3);
    CHECK(e.total_numel == g::num_parameters(g::GPTConfig::preset("tiny")));
    CHECK(e.total_padding == 0);
    CHECK(unit(e, "<root>").modules == std::vector<std::string>{"wte", "wpe", "ln_f", "lm_head"});
  }
  SECTION("world 3: multiples of 24 need padding") {
    const auto e = explain_tiny(kPerLayer, 3);
    // 49984 = 24 * 2082 + 16 -> 24 * 2083 = 49992; 67712 = 24 * 2821 + 8 -> 67728.
    require_unit(e, "<root>", 67712, 67728, 22576, 1, 0, 1, 0, 22576 * 4 + 67728 * 4);
    require_unit(e, "blocks.1", 49984, 49992, 16664, 1, 1, 1, 0, 2 * 16664 * 4 + 49992 * 4);
    CHECK(e.total_padding == 16 + 2 * 8);
  }
}

TEST_CASE("explain: tiny GPT per-leaf at world 2", "[diagnostics][explain]") {
  const auto e = explain_tiny(kPerLeaf, 2);
  REQUIRE(e.units.size() == 17);  // root + wte + wpe + 2 x 6 + ln_f + lm_head
  require_unit(e, "<root>", 0, 0, 0, 0, 0, 0, 0, 0);  // owns nothing: issues nothing
  // numel -> shard (all multiples of 16): bytes = 2 AGs of (numel/2)*4 + RS of numel*4
  const std::vector<std::pair<std::string, int64_t>> leaves = {
      {"wte", 32768},           {"wpe", 2048},         {"blocks.0.ln1", 128},
      {"blocks.0.attn.qkv", 12480}, {"blocks.0.attn.proj", 4160}, {"blocks.1.mlp.fc", 16640},
      {"blocks.1.mlp.proj", 16448}, {"ln_f", 128},          {"lm_head", 32768}};
  for (const auto& [name, n] : leaves) require_unit(e, name, n, n, n / 2, 1, 1, 1, 0, 2 * (n / 2) * 4 + n * 4);
  CHECK(e.per_step.forward_all_gathers == 16);
  CHECK(e.per_step.bytes == 8 * g::num_parameters(g::GPTConfig::preset("tiny")));
  // Every unit is far below 1 MiB: the latency warning fires.
  bool warned = false;
  for (const auto& w : e.warnings) warned = warned || w.find("less than 1 MiB") != std::string::npos;
  CHECK(warned);
}

TEST_CASE("explain: inner alignment and mixed strategies and dtypes", "[diagnostics][explain]") {
  SECTION("odd sizes: every parameter starts at a multiple of align") {
    g::GPTConfig c;
    c.vocab = 97, c.d_model = 36, c.n_heads = 3, c.n_layers = 1, c.seq_len = 11;
    auto model = g::GPT(c, 0);
    const auto e = explain(*model, make_plan(*model, parse_policy(kPerLeaf)), 2, {});
    // LayerNorm: weight 36 at 0, bias at 40 (next multiple of 8) -> 76 used -> 80 (x16).
    require_unit(e, "blocks.0.ln1", 72, 80, 40, 1, 1, 1, 0, 2 * 40 * 4 + 80 * 4);
    // qkv: weight 3*36*36 = 3888 at 0, bias 108 at 3888 -> 3996 -> 4000.
    require_unit(e, "blocks.0.attn.qkv", 3996, 4000, 2000, 1, 1, 1, 0, 2 * 2000 * 4 + 4000 * 4);
    // wte 97*36 = 3492 -> 3504.
    require_unit(e, "wte", 3492, 3504, 1752, 1, 1, 1, 0, 2 * 1752 * 4 + 3504 * 4);
  }
  SECTION("NO_SHARD, SHARD_GRAD_OP, FULL_SHARD; bf16 params, fp32 reduction") {
    ShardingOptions o;
    o.mixed_precision.param_dtype = c10::kBFloat16;
    o.mixed_precision.reduce_dtype = c10::kFloat;
    const auto e = explain_tiny("noshard:path=lm_head;grad_op:path=blocks.1;type=Block", 2, o);
    // lm_head replicated: layout at world 1, one all-reduce of 32768 fp32.
    require_unit(e, "lm_head", 32768, 32768, 32768, 0, 0, 0, 1, 32768 * 4);
    // SHARD_GRAD_OP: one AG of the bf16 shard, one fp32 reduce-scatter.
    require_unit(e, "blocks.1", 49984, 49984, 24992, 1, 0, 1, 0, 24992 * 2 + 49984 * 4);
    require_unit(e, "blocks.0", 49984, 49984, 24992, 1, 1, 1, 0, 2 * 24992 * 2 + 49984 * 4);
    // Root: wte + wpe + ln_f = 34944 = 16 * 2184.
    require_unit(e, "<root>", 34944, 34944, 17472, 1, 0, 1, 0, 17472 * 2 + 34944 * 4);
  }
}

TEST_CASE("explain agrees with the runtime's counters", "[diagnostics][explain]") {
  struct Case {
    std::string spec;
    int world;
    ShardingOptions options;
  };
  ShardingOptions bf16;
  bf16.mixed_precision.param_dtype = c10::kBFloat16;
  bf16.mixed_precision.reduce_dtype = c10::kFloat;
  ShardingOptions grad_op;
  grad_op.strategy = ShardingStrategy::kShardGradOp;
  grad_op.forward_prefetch = 2;
  const std::vector<Case> cases = {
      {kPerLayer, 2, {}},
      {kPerLeaf, 2, {}},
      {"noshard:path=lm_head;grad_op:path=blocks.1;type=Block", 2, bf16},
      {"every=2,type=Block;root:full", 3, {}},
      {kPerLayer, 3, grad_op},
  };
  for (const auto& c : cases) {
    CAPTURE(c.spec, c.world);
    const auto e = explain_tiny(c.spec, c.world, c.options);
    const auto run = run_tiny(c.spec, c.world, c.options);
    REQUIRE(run.units.per_unit.size() == e.units.size());
    for (size_t i = 0; i < e.units.size(); ++i) {
      const auto& want = e.units[i];
      const auto& got = run.units.per_unit[i];
      CAPTURE(want.name);
      CHECK(run.info[i].name == want.name);
      CHECK(run.info[i].padded_numel == want.padded_numel);
      CHECK(run.info[i].shard_numel == want.shard_numel);
      CHECK(run.info[i].strategy == want.strategy);
      CHECK(run.info[i].reshard_after_forward == want.reshard_after_forward);
      CHECK(got.forward_all_gathers == want.per_step.forward_all_gathers);
      CHECK(got.backward_all_gathers == want.per_step.backward_all_gathers);
      CHECK(got.reduce_scatters == want.per_step.reduce_scatters);
      CHECK(got.all_reduces == want.per_step.all_reduces);
      CHECK(got.bytes == want.per_step.bytes);
    }
    // The wire agrees too: the communicator saw exactly these collectives and bytes.
    CHECK(run.comm.all_gathers ==
          e.per_step.forward_all_gathers + e.per_step.backward_all_gathers);
    CHECK(run.comm.reduce_scatters == e.per_step.reduce_scatters);
    CHECK(run.comm.all_reduces == e.per_step.all_reduces);
    CHECK(run.comm.bytes == e.per_step.bytes);
  }
}

TEST_CASE("explain with HSDP agrees with the runtime's counters on a 2x2 mesh",
          "[diagnostics][explain][hsdp]") {
  // Per-layer with a NO_SHARD head and bf16 compute / fp32 reduction: every kind of unit.
  const std::string spec = "noshard:path=lm_head;type=Block";
  ShardingOptions o;
  o.mixed_precision.param_dtype = c10::kBFloat16;
  o.mixed_precision.reduce_dtype = c10::kFloat;
  auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
  const auto e = explain(*model, make_plan(*model, parse_policy(spec)), /*world_size=*/2, o,
                         std::nullopt, /*replicate_size=*/2);
  StepCounters got;
  std::mutex mu;
  run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
    auto m = g::GPT(g::GPTConfig::preset("tiny"), 0);
    auto fsdp = fully_shard(m.ptr(), make_plan(*m, parse_policy(spec)), ShardingMesh(shard, &rep), o);
    for (int step = 0; step < 2; ++step) {
      fsdp->reset_counters();
      auto [x, y] = g::synthetic_batch(m->config(), 2, 3, rep.rank() * 2 + shard.rank(), step);
      auto loss = flatshard::enter(m, [&, &x = x, &y = y] { return m->loss(x, y); });
      loss.backward();
    }
    if (rep.rank() == 0 && shard.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      got = fsdp->counters();
    }
  });
  REQUIRE(got.per_unit.size() == e.units.size());
  int64_t replicated = 0;
  for (size_t i = 0; i < e.units.size(); ++i) {
    const auto& want = e.units[i].per_step;
    const auto& have = got.per_unit[i];
    CAPTURE(e.units[i].name);
    CHECK(have.forward_all_gathers == want.forward_all_gathers);
    CHECK(have.backward_all_gathers == want.backward_all_gathers);
    CHECK(have.reduce_scatters == want.reduce_scatters);
    CHECK(have.all_reduces == want.all_reduces);
    CHECK(have.replicate_all_reduces == want.replicate_all_reduces);
    CHECK(have.replicate_bytes == want.replicate_bytes);
    CHECK(have.bytes == want.bytes);
    replicated += want.replicate_bytes > 0;
  }
  CHECK(replicated == static_cast<int64_t>(e.units.size()));  // every unit has elements here
  CHECK(e.per_step.replicate_all_reduces == static_cast<int64_t>(e.units.size()) - 1);  // not lm_head
  const std::string text = e.to_string();
  CHECK_THAT(text, Catch::Contains("world 2 per shard group x 2 replicas (HSDP: 4 ranks)"));
  CHECK_THAT(text, Catch::Contains("rAR 1"));
  CHECK_THAT(text, Catch::Contains("AR 1x2"));
  CHECK_THROWS_WITH(explain(*model, make_plan(*model, parse_policy(spec)), 2, o, std::nullopt, 0),
                    Catch::Contains("replicate_size must be >= 1, got 0"));
}

TEST_CASE("explain: memory estimate by hand", "[diagnostics][explain]") {
  // Tiny per-layer, world 2, fp32, prefetch 1. Gathered (= flat gradient) bytes: root
  // 67712*4 = 270848, block 49984*4 = 199936.
  const int64_t R = 270848, B = 199936;
  const auto e = explain_tiny(kPerLayer, 2);
  // forward of blocks.0: root + blocks.0 + prefetched blocks.1 = R + 2B.
  // backward of blocks.1: root, blocks.1, prefetched blocks.0 + flat grads of root and blocks.1
  //   = 2R + 3B; backward of blocks.0: root, blocks.0 + grads of root, blocks.0 and the held
  //   reduction buffer of blocks.1 = 2R + 3B (not larger: the first one is reported).
  CHECK(e.memory.peak_transient_bytes == 2 * R + 3 * B);
  CHECK(e.memory.peak_at == "backward of blocks.1");
  // fp32 master shards and their grads: (33856 + 2 * 24992) * 4 * 2.
  CHECK(e.memory.persistent_bytes == (33856 + 2 * 24992) * 4 * 2);
  // The forward peak alone: prefetch 3 cannot exceed R + 2B in forward.
  const auto m = estimate_memory(e.units, 3, 0);
  CHECK(m.peak_transient_bytes == 2 * R + 3 * B);

  SECTION("a limit below the estimate warns; no depth helps here") {
    // With prefetch 0 the backward of blocks.0 still holds 2R + 3B.
    const auto tight = explain_tiny(kPerLayer, 2, {}, e.memory.total() - 1);
    CHECK(tight.fitting_prefetch == -1);
    REQUIRE_FALSE(tight.warnings.empty());
    CHECK(tight.warnings.back().find("no prefetch depth fits") != std::string::npos);
    const auto fits = explain_tiny(kPerLayer, 2, {}, e.memory.total());
    CHECK(fits.fitting_prefetch == 1);
    for (const auto& w : fits.warnings) CHECK(w.find("exceeds the limit") == std::string::npos);
  }
}

TEST_CASE("explain: 1B GPT on the meta device, and warnings", "[diagnostics][explain]") {
  auto cfg = g::GPTConfig::preset("1b");
  g::GPT model{nullptr};
  {
    MetaInit meta;
    model = g::GPT(cfg, 0);
  }
  REQUIRE_NOTHROW(check_on_meta(*model));
  REQUIRE(model->blocks()[0]->mlp->fc->weight.is_meta());
  const auto plan = make_plan(*model, parse_policy(kPerLayer));
  const auto e = explain(*model, plan, 8, {});
  REQUIRE(e.units.size() == 17);
  const int64_t d = 2048;
  const int64_t block = 12 * d * d + 13 * d;  // a multiple of 64: no padding at world 8
  require_unit(e, "blocks.7", block, block, block / 8, 1, 1, 1, 0, 2 * block / 8 * 4 + block * 4);
  CHECK(e.total_numel == g::num_parameters(cfg));
  // wte + lm_head are 14% of the model and left to the root.
  bool root_warning = false;
  for (const auto& w : e.warnings)
    root_warning = root_warning || (w.find("root unit owns") != std::string::npos &&
                                    w.find("path=wte|lm_head") != std::string::npos);
  CHECK(root_warning);

  // A limit between the estimates at depth 1 and 2 names depth 1.
  ShardingOptions deep;
  deep.forward_prefetch = deep.backward_prefetch = 2;
  const auto at1 = estimate_memory(e.units, 1, 1), at2 = estimate_memory(e.units, 2, 2);
  REQUIRE(at1.total() < at2.total());
  const auto limited = explain(*model, plan, 8, deep, at1.total());
  CHECK(limited.fitting_prefetch == 1);
  REQUIRE_FALSE(limited.warnings.empty());
  CHECK(limited.warnings.back().find("prefetch depth 1 fits") != std::string::npos);

  const auto whole = explain(*model, make_plan(*model, parse_policy("every=16,type=Block")), 8, {});
  bool dominant = false;
  for (const auto& w : whole.warnings)
    dominant = dominant || w.find("unit 'blocks.0-15' holds") != std::string::npos;
  CHECK(dominant);

  const auto nothing = explain(*model, make_plan(*model, parse_policy("type=NoSuchModule")), 8, {});
  REQUIRE(nothing.units.size() == 1);
  CHECK(nothing.warnings.front().find("matched no module") != std::string::npos);

  // Explaining a meta model gives what explaining the real one gives (small preset on CPU).
  auto small_cfg = g::GPTConfig::preset("small");
  auto real = g::GPT(small_cfg, 0);
  g::GPT meta_model{nullptr};
  {
    MetaInit meta;
    meta_model = g::GPT(small_cfg, 0);
  }
  const auto a = explain(*real, make_plan(*real, parse_policy(kPerLeaf)), 4, {});
  const auto b = explain(*meta_model, make_plan(*meta_model, parse_policy(kPerLeaf)), 4, {});
  CHECK(a.to_string() == b.to_string());
  CHECK_FALSE(real->wte->weight.is_meta());
}
