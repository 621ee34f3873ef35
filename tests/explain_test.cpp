// flatshard-explain's numbers (planner/explain.h), label diagnostics.
//
// Independent references: unit sizes, padding and bytes are written out by hand from the GPT
// shapes (comments show the arithmetic), and the per-step collectives are compared with what the
// runtime counts when the same tiny GPT trains on 2-3 ranks (threads); per-unit settings and
// bytes with what a ShardedModel built from the same plan reports. The memory estimate is
// checked against a hand simulation of one plan; the warnings' numbers are worked out by hand.
#include <catch2/catch.hpp>

#include <chrono>
#include <mutex>
#include <utility>
#include <vector>

#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "flat_param/collective_plan.h"
#include "fsdp/call.h"
#include "fsdp/meta_init.h"
#include "fsdp/resolve.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "planner/explain.h"
#include "support/format.h"
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
  return explain(*model, make_plan(*model, parse_policy(spec)), MeshShape(world, 1), o, limit);
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
    const auto e = explain(*model, make_plan(*model, parse_policy(kPerLeaf)), MeshShape(2, 1), {});
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
  // flat_param/quantized_gather.h: the wire's bytes, and fp8's amax all-reduce per gather.
  // fp8_delayed (Note [Delayed fp8 amax]): the second step (what run_tiny counts) sends no
  // amax all-reduce at all, only the all-gathers of its wire.
  ShardingOptions fp8 = bf16, int8 = bf16, fp8d = bf16;
  fp8.mixed_precision.gather_dtype = GatherDtype::kFp8;
  int8.mixed_precision.gather_dtype = GatherDtype::kInt8;
  fp8d.mixed_precision.gather_dtype = GatherDtype::kFp8Delayed;
  const std::vector<Case> cases = {
      {kPerLayer, 2, fp8d},
      {kPerLeaf, 3, fp8d},
      {kPerLayer, 2, fp8},
      {"noshard:path=lm_head;grad_op:path=blocks.1;type=Block", 3, fp8},
      {kPerLayer, 3, int8},
      {kPerLeaf, 2, int8},
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
      CHECK(got.gather_all_reduces == want.per_step.gather_all_reduces);
      CHECK(got.bytes == want.per_step.bytes);
    }
    // The wire agrees too: the communicator saw exactly these collectives and bytes.
    CHECK(run.comm.all_gathers ==
          e.per_step.forward_all_gathers + e.per_step.backward_all_gathers);
    CHECK(run.comm.reduce_scatters == e.per_step.reduce_scatters);
    CHECK(run.comm.all_reduces == e.per_step.all_reduces + e.per_step.gather_all_reduces);
    CHECK(run.comm.bytes == e.per_step.bytes);
  }
}

TEST_CASE("explain: a quantized gather's wire buffer in the memory breakdown",
          "[diagnostics][explain][quantized_gather]") {
  // The closed form written out (flat_param/quantized_gather.h's wire formats): every rank's
  // part of one gather's wire. fp8: 1 B per element of the padded buffer; int8: per rank 4 B
  // per 256-element block, then 1 B per element, to a multiple of 4; fp8_delayed: per rank 4 B
  // per parameter, then 1 B per element, to a multiple of 4, plus the padded buffer once more
  // (the ranks' fp8 parts made contiguous). The largest unit's counts.
  for (GatherDtype g : {GatherDtype::kFp8, GatherDtype::kInt8, GatherDtype::kFp8Delayed})
    for (int world : {1, 2, 3}) {
      CAPTURE(gather_dtype_name(g), world);
      ShardingOptions o;
      o.mixed_precision.param_dtype = c10::kBFloat16;
      o.mixed_precision.gather_dtype = g;
      const auto e = explain_tiny(kPerLayer, world, o);
      int64_t want = 0;
      std::string at;
      for (const auto& u : e.units) {
        const int64_t n = u.shard_numel, pad4 = (n + 3) / 4 * 4;
        int64_t w = u.padded_numel;
        if (g == GatherDtype::kInt8) w = world * (4 * ((n + 255) / 256) + pad4);
        if (g == GatherDtype::kFp8Delayed) w = world * (4 * u.num_params + pad4) + u.padded_numel;
        CHECK(u.wire_buffer_bytes == w);
        if (w > want) {
          want = w;
          at = u.name;
        }
      }
      REQUIRE(want > 0);
      CHECK(e.memory.wire_bytes == want);
      CHECK(e.memory.wire_unit == at);
      CHECK(e.memory.total() == e.memory.persistent_bytes + e.memory.peak_transient_bytes + want);
      CHECK_THAT(e.to_string(), Catch::Contains("+ wire buffer " + format_bytes(want) +
                                                " (quantized gather of " + at + ")"));
    }
  // A gather in the param dtype has none, and the breakdown does not mention it.
  const auto plain = explain_tiny(kPerLayer, 2);
  CHECK(plain.memory.wire_bytes == 0);
  CHECK_THAT(plain.to_string(), !Catch::Contains("wire buffer"));
}

TEST_CASE("explain with HSDP agrees with the runtime's counters on a 2x2 mesh",
          "[diagnostics][explain][hsdp]") {
  // Per-layer with a NO_SHARD head and bf16 compute / fp32 reduction: every kind of unit.
  const std::string spec = "noshard:path=lm_head;type=Block";
  ShardingOptions o;
  o.mixed_precision.param_dtype = c10::kBFloat16;
  o.mixed_precision.reduce_dtype = c10::kFloat;
  auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
  const auto e =
      explain(*model, make_plan(*model, parse_policy(spec)), MeshShape(2, /*replicate_size=*/2), o);
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
  CHECK_THROWS_WITH(explain(*model, make_plan(*model, parse_policy(spec)), MeshShape(2, 0), o),
                    Catch::Contains("mesh sizes must be >= 1, got shard 2, replicate 0, tp 1"));
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

TEST_CASE("explain: keep_low_precision_grads counts the master gradients in the reduce dtype",
          "[diagnostics][explain]") {
  // Note [Low-precision master gradient] (flat_param/collective_plan.h). Tiny per-layer, world
  // 2, bf16: fp32 masters (33856 + 2 * 24992 elements per rank) with fp32 gradients (4 + 4 B
  // per element), or bf16 ones (4 + 2 B); a reduce dtype of fp32 keeps fp32 gradients.
  const int64_t shard = 33856 + 2 * 24992;
  ShardingOptions o;
  o.mixed_precision.param_dtype = c10::kBFloat16;
  CHECK(explain_tiny(kPerLayer, 2, o).memory.persistent_bytes == shard * 8);
  o.mixed_precision.keep_low_precision_grads = true;
  const auto e = explain_tiny(kPerLayer, 2, o);
  CHECK(e.memory.persistent_bytes == shard * 6);
  CHECK(unit(e, "blocks.0").master_grad_bytes == 24992 * 2);
  o.mixed_precision.reduce_dtype = c10::kFloat;
  CHECK(explain_tiny(kPerLayer, 2, o).memory.persistent_bytes == shard * 8);
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
  const auto e = explain(*model, plan, MeshShape(8, 1), {});
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
  const auto limited = explain(*model, plan, MeshShape(8, 1), deep, at1.total());
  CHECK(limited.fitting_prefetch == 1);
  REQUIRE_FALSE(limited.warnings.empty());
  CHECK(limited.warnings.back().find("prefetch depth 1 fits") != std::string::npos);

  const auto whole =
      explain(*model, make_plan(*model, parse_policy("every=16,type=Block")), MeshShape(8, 1), {});
  bool dominant = false;
  for (const auto& w : whole.warnings)
    dominant = dominant || w.find("unit 'blocks.0-15' holds") != std::string::npos;
  CHECK(dominant);

  const auto nothing =
      explain(*model, make_plan(*model, parse_policy("type=NoSuchModule")), MeshShape(8, 1), {});
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
  const auto a = explain(*real, make_plan(*real, parse_policy(kPerLeaf)), MeshShape(4, 1), {});
  const auto b =
      explain(*meta_model, make_plan(*meta_model, parse_policy(kPerLeaf)), MeshShape(4, 1), {});
  CHECK(a.to_string() == b.to_string());
  CHECK_FALSE(real->wte->weight.is_meta());
}

TEST_CASE("resolve_unit: the rules, written out", "[diagnostics][explain][resolve]") {
  // Each row: the plan entry's options, whether it is the root, the default options -> what the
  // unit must get. The rules as fsdp/resolve.h states them, independent of its code.
  using S = ShardingStrategy;
  struct Row {
    std::optional<S> unit_strategy;
    std::optional<bool> unit_reshard;
    bool root;
    S default_strategy;
    bool default_reshard;
    S strategy;
    bool reshard;
  };
  const std::vector<Row> rows = {
      {{}, {}, false, S::kFullShard, true, S::kFullShard, true},
      {{}, {}, true, S::kFullShard, true, S::kFullShard, false},  // the root keeps by default
      {{}, true, true, S::kFullShard, true, S::kFullShard, true},  // root:full
      {{}, false, false, S::kFullShard, true, S::kFullShard, false},  // keep:
      {{}, {}, false, S::kFullShard, false, S::kFullShard, false},
      {{}, true, false, S::kFullShard, false, S::kFullShard, true},
      {S::kShardGradOp, true, false, S::kFullShard, true, S::kShardGradOp, false},  // FULL only
      {{}, {}, false, S::kShardGradOp, true, S::kShardGradOp, false},
      {S::kNoShard, {}, false, S::kFullShard, true, S::kNoShard, false},
      {S::kFullShard, {}, false, S::kNoShard, true, S::kFullShard, true},
      {{}, true, true, S::kNoShard, true, S::kNoShard, false},
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    CAPTURE(i);
    UnitSpec spec;
    spec.name = r.root ? "<root>" : "u";
    spec.is_root = r.root;
    spec.options.strategy = r.unit_strategy;
    spec.options.reshard_after_forward = r.unit_reshard;
    ShardingOptions o;
    o.strategy = r.default_strategy;
    o.reshard_after_forward = r.default_reshard;
    o.mixed_precision.param_dtype = c10::kBFloat16;
    o.align = 16;
    o.sync_module_states = false;
    const ResolvedUnit got = resolve_unit(spec, o, /*shard_world_size=*/4);
    CHECK(got.strategy == r.strategy);
    CHECK(got.reshard_after_forward == r.reshard);
    CHECK(got.flat.sharded == (r.strategy != S::kNoShard));
    CHECK(got.layout_world_size == (r.strategy == S::kNoShard ? 1 : 4));
    CHECK(got.flat.param_dtype == c10::kBFloat16);
    CHECK(got.flat.reduce_dtype == c10::kBFloat16);  // unset: the param dtype
    CHECK(got.flat.align == 16);
    CHECK_FALSE(got.flat.sync_module_states);
  }
  ShardingOptions fp32_reduce;
  fp32_reduce.mixed_precision.param_dtype = c10::kBFloat16;
  fp32_reduce.mixed_precision.reduce_dtype = c10::kFloat;
  CHECK(resolve_unit(UnitSpec{}, fp32_reduce, 2).flat.reduce_dtype == c10::kFloat);
  CHECK_THROWS_WITH(resolve_unit(UnitSpec{}, {}, 0), Catch::Contains("world size must be >= 1, got 0"));
}

TEST_CASE("explain agrees with the built ShardedModel over a sweep of plans and options",
          "[diagnostics][explain][resolve]") {
  // Per-unit strategy and reshard overrides, the root's options, every default strategy, keep,
  // mixed precision, world 2 and 3, and HSDP: what explain predicts for each unit is what the
  // ShardedModel built from the same plan and options reports (no step is run).
  const std::vector<std::string> specs = {
      kPerLayer,
      kPerLeaf,
      "noshard:path=lm_head;grad_op:path=blocks.1;type=Block",
      "keep:path=blocks.0;type=Block;root:full",
      "full:path=blocks.1;noshard:path=blocks.0.ln1|ln_f;type=Block;root:noshard",
      "every=2,type=Block;root:grad_op",
  };
  std::vector<std::pair<std::string, ShardingOptions>> options(5);
  options[0].first = "defaults";
  options[1].first = "grad_op";
  options[1].second.strategy = ShardingStrategy::kShardGradOp;
  options[2].first = "noshard";
  options[2].second.strategy = ShardingStrategy::kNoShard;
  options[3].first = "keep";
  options[3].second.reshard_after_forward = false;
  options[4].first = "bf16/fp32, align 4";
  options[4].second.mixed_precision.param_dtype = c10::kBFloat16;
  options[4].second.mixed_precision.reduce_dtype = c10::kFloat;
  options[4].second.align = 4;

  struct Built {
    UnitInfo info;
    int64_t all_gather_bytes, reduce_bytes, replicate_bytes;
  };
  auto compare = [](const Explanation& e, const std::vector<Built>& got) {
    REQUIRE(got.size() == e.units.size());
    for (size_t i = 0; i < e.units.size(); ++i) {
      const auto& want = e.units[i];
      CAPTURE(want.name);
      CHECK(got[i].info.name == want.name);
      CHECK(got[i].info.strategy == want.strategy);
      CHECK(got[i].info.reshard_after_forward == want.reshard_after_forward);
      CHECK(got[i].info.numel == want.numel);
      CHECK(got[i].info.padded_numel == want.padded_numel);
      CHECK(got[i].info.shard_numel == want.shard_numel);
      CHECK(static_cast<int64_t>(got[i].info.num_params) == want.num_params);
      if (want.strategy != ShardingStrategy::kNoShard)
        CHECK(got[i].all_gather_bytes == want.all_gather_bytes);
      CHECK(got[i].reduce_bytes == want.reduce_bytes);
      CHECK(got[i].replicate_bytes == want.per_step.replicate_bytes);
    }
  };
  auto built_units = [](const ShardedModel& fsdp) {
    std::vector<Built> out;
    const auto info = fsdp.units();
    for (size_t i = 0; i < fsdp.num_units(); ++i) {
      const FlatParam& f = fsdp.unit(i).flat();
      out.push_back({info[i], f.gather_plan().bytes(), f.reduce_plan().bytes(),
                     f.reduce_plan().replicate_bytes()});
    }
    return out;
  };

  for (const auto& spec : specs) {
    for (const auto& entry : options) {
      const std::string& label = entry.first;
      const ShardingOptions& o = entry.second;
      for (int world : {2, 3}) {
        CAPTURE(spec, label, world);
        const auto e = explain_tiny(spec, world, o);
        std::vector<Built> got;
        std::mutex mu;
        run_ranks(world, [&](Communicator& comm) {
          auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
          auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), comm, o);
          if (comm.rank() != world - 1) return;  // the last rank: its shard is the padded one
          std::lock_guard<std::mutex> lock(mu);
          got = built_units(*fsdp);
        });
        compare(e, got);
      }
    }
  }

  SECTION("HSDP 2 x 2") {
    for (const auto& spec : {specs[2], specs[4]}) {
      CAPTURE(spec);
      ShardingOptions o = options[4].second;
      auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
      const auto e = explain(*model, make_plan(*model, parse_policy(spec)), MeshShape(2, 2), o);
      std::vector<Built> got;
      std::mutex mu;
      run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
        auto m = g::GPT(g::GPTConfig::preset("tiny"), 0);
        auto fsdp =
            fully_shard(m.ptr(), make_plan(*m, parse_policy(spec)), ShardingMesh(shard, &rep), o);
        if (rep.rank() != 1 || shard.rank() != 1) return;
        std::lock_guard<std::mutex> lock(mu);
        got = built_units(*fsdp);
      });
      compare(e, got);
    }
  }
}

namespace {

g::GPT meta_gpt_1b() {
  MetaInit meta;
  return g::GPT(g::GPTConfig::preset("1b"), 0);
}

std::vector<std::string> warnings_with(const Explanation& e, const std::string& what) {
  std::vector<std::string> out;
  for (const auto& w : e.warnings)
    if (w.find(what) != std::string::npos) out.push_back(w);
  return out;
}

}  // namespace

TEST_CASE("explain warns about fragmented plans: the per-leaf 1B GPT", "[diagnostics][explain]") {
  // 1B GPT: d = 2048, 16 layers. Per leaf: wte, wpe, 16 x (ln1, qkv, proj, ln2, fc, mlp.proj),
  // ln_f, lm_head = 100 units (the root owns nothing), each FULL_SHARD: 2 all-gathers + 1
  // reduce-scatter = 300 collectives; x 50 us = 15.0 ms = 15% of the 100 ms reference step.
  // The 33 LayerNorms are 2 * 2048 fp32 = 16 KiB each: a third of the units.
  auto model = meta_gpt_1b();
  const auto leaf = explain(*model, make_plan(*model, parse_policy(kPerLeaf)), MeshShape(8, 1), {});
  REQUIRE(leaf.units.size() == 101);
  CHECK(leaf.collectives_per_step == 300);
  CHECK(leaf.collective_latency_ms() == Approx(15.0));
  const auto frag = warnings_with(leaf, "fragmented plan");
  REQUIRE(frag.size() == 1);
  CAPTURE(frag[0]);
  CHECK_THAT(frag[0], Catch::Contains("300 collectives per step x ~50.0 us latency = 15.0 ms, 15% "
                                      "of a 100.0 ms reference step"));
  CHECK_THAT(frag[0], Catch::Contains("33 of 100 units hold less than 1 MiB each (median 16.0 KiB"));
  CHECK_THAT(frag[0], Catch::Contains("one unit per Block (by_type(\"Block\"))"));
  CHECK_THAT(leaf.to_string(), Catch::Contains("collective latency: 300 collectives per step"));

  // Per layer: the root (wte, wpe, ln_f, lm_head; kept: 1 AG + 1 RS) + 16 blocks x 3 = 50
  // collectives = 2.5 ms = 2.5%, and no unit below 1 MiB: no warning.
  const auto layer =
      explain(*model, make_plan(*model, parse_policy(kPerLayer)), MeshShape(8, 1), {});
  CHECK(layer.collectives_per_step == 50);
  CHECK(warnings_with(layer, "fragmented plan").empty());
  CHECK(warnings_with(layer, "less than 1 MiB").empty());

  SECTION("the latency constant and the reference step are the caller's to set") {
    ExplainOptions slow;
    slow.collective_latency_us = 200;  // 50 x 200 us = 10 ms = 10%: latency alone warns
    const auto e = explain(*model, make_plan(*model, parse_policy(kPerLayer)), MeshShape(8, 1), {},
                           std::nullopt, slow);
    const auto w = warnings_with(e, "fragmented plan");
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0], Catch::Contains("50 collectives per step x ~200.0 us latency = 10.0 ms, 10%"));
    CHECK(w[0].find("less than 1 MiB") == std::string::npos);
    ExplainOptions long_step;
    long_step.reference_step_ms = 1000;  // 15 ms = 1.5%: only the tiny units warn
    const auto f = explain(*model, make_plan(*model, parse_policy(kPerLeaf)), MeshShape(8, 1), {},
                           std::nullopt, long_step);
    const auto v = warnings_with(f, "fragmented plan");
    REQUIRE(v.size() == 1);
    CHECK(v[0].find("collectives per step x") == std::string::npos);
    CHECK_THAT(v[0], Catch::Contains("33 of 100 units hold less than 1 MiB"));
    ExplainOptions bad;
    bad.reference_step_ms = 0;
    CHECK_THROWS_WITH(explain(*model, make_plan(*model, parse_policy(kPerLayer)), MeshShape(8, 1),
                              {}, std::nullopt, bad),
                      Catch::Contains("reference_step_ms > 0"));
  }
}

namespace {

// A 4-layer model without a type called Block: layers of LayerNorm(16) + 2 x Linear(16, 16)
// (32 + 272 + 272 = 576 elements, 2.25 KiB fp32 each), and a Linear(16, 4) head.
struct MixerBlockImpl : torch::nn::Module {
  MixerBlockImpl() {
    register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    register_module("mix", torch::nn::Linear(16, 16));
    register_module("out", torch::nn::Linear(16, 16));
  }
};
TORCH_MODULE(MixerBlock);

struct MixerImpl : torch::nn::Module {
  MixerImpl() {
    auto blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(MixerBlock());
    register_module("head", torch::nn::Linear(16, 4));
  }
};
TORCH_MODULE(Mixer);

}  // namespace

TEST_CASE("explain's fragmentation advice names the model's own types, in the caller's "
          "language, and never groups more than there are",
          "[diagnostics][explain]") {
  // Before: "use --policy type=Block, or every=k (k=64 ...)" whatever the model and the caller.
  auto model = Mixer();
  const Plan leaves = make_plan(*model, parse_policy("type=Linear|LayerNorm"));
  const auto cpp = warnings_with(explain(*model, leaves, MeshShape(2, 1), {}), "fragmented plan");
  REQUIRE(cpp.size() == 1);
  CAPTURE(cpp[0]);
  // A C++ caller gets the builders (wrap_policies/policy.h) and the model's own layer type; the
  // leaves come 3 to a layer, so grouping them goes up to 3.
  CHECK_THAT(cpp[0], Catch::Contains("one unit per MixerBlock (by_type(\"MixerBlock\"))"));
  CHECK_THAT(cpp[0], Catch::Contains("group the matches 3 at a time (every(3, rule)): all 3 tiny "
                                     "siblings under one parent"));
  CHECK_THAT(cpp[0], !Catch::Contains("--policy") && !Catch::Contains("type=Block"));

  // flatshard-explain's callers get --policy text in the same names.
  ExplainOptions cli;
  cli.advice = ExplainOptions::Advice::kSpec;
  const auto spec = warnings_with(explain(*model, leaves, MeshShape(2, 1), {}, std::nullopt, cli),
                                  "fragmented plan");
  REQUIRE(spec.size() == 1);
  CAPTURE(spec[0]);
  CHECK_THAT(spec[0], Catch::Contains("one unit per MixerBlock (--policy type=MixerBlock)"));
  CHECK_THAT(spec[0], Catch::Contains("(every=3,<terms>)"));
  CHECK_THAT(spec[0], !Catch::Contains("by_type"));

  // One unit per layer is still tiny: every=k groups the 4 layers, never more (1 MiB would
  // need 1 MiB / 2.25 KiB = 456 of them), and no enclosing type is offered.
  const auto layers = warnings_with(
      explain(*model, make_plan(*model, parse_policy("type=MixerBlock")), MeshShape(2, 1), {}),
      "fragmented plan");
  REQUIRE(layers.size() == 1);
  CAPTURE(layers[0]);
  CHECK_THAT(layers[0], Catch::Contains("group the matches 4 at a time (every(4, rule)): all 4 "
                                        "tiny siblings under one parent; 1 MiB would need 456"));
  CHECK_THAT(layers[0], !Catch::Contains("one unit per") && !Catch::Contains("every(456"));
}

TEST_CASE("explain warns about replicated NO_SHARD state, naming units and bytes",
          "[diagnostics][explain]") {
  auto model = meta_gpt_1b();
  // lm_head replicated at world 8: 32768 * 2048 = 67108864 elements (a multiple of 64: no
  // padding); master + grad + 2 AdamW moments, fp32: 67108864 * 16 B = 1.0 GiB on every rank.
  // Sharded over 8 ranks it would be 1/8 of that: 896 MiB saved per rank.
  const auto heavy =
      explain(*model, make_plan(*model, parse_policy("noshard:path=lm_head;type=Block")),
              MeshShape(8, 1), {});
  const auto w = warnings_with(heavy, "NO_SHARD unit(s) replicate");
  REQUIRE(w.size() == 1);
  CAPTURE(w[0]);
  CHECK_THAT(w[0], Catch::Contains("1 NO_SHARD unit(s) replicate 1.0 GiB"));
  CHECK_THAT(w[0], Catch::Contains("(lm_head 1.0 GiB)"));
  CHECK_THAT(w[0], Catch::Contains("sharding them over 8 ranks saves 896.0 MiB per rank"));
  CHECK_THAT(w[0], Catch::Contains("shard these units"));

  // Two replicated blocks: 49.2M parameters each (12d^2 + 13d = 50358272) -> 768.4 MiB each.
  const auto blocks =
      explain(*model, make_plan(*model, parse_policy("noshard:path=blocks.0|blocks.1;type=Block")),
              MeshShape(8, 1), {});
  const auto b = warnings_with(blocks, "NO_SHARD unit(s) replicate");
  REQUIRE(b.size() == 1);
  CHECK_THAT(b[0], Catch::Contains("2 NO_SHARD unit(s) replicate 1.5 GiB"));
  CHECK_THAT(b[0], Catch::Contains("blocks.0 768.4 MiB,blocks.1 768.4 MiB"));

  // A replicated final LayerNorm (2 * 2048 elements, 64 KiB of state) is noise: no warning.
  const auto norm = explain(*model, make_plan(*model, parse_policy("noshard:path=ln_f;type=Block")),
                            MeshShape(8, 1), {});
  CHECK(warnings_with(norm, "replicate").empty());
  // One rank: sharding saves nothing, so nothing to warn about.
  const auto one =
      explain(*model, make_plan(*model, parse_policy("noshard:path=lm_head;type=Block")),
              MeshShape(1, 1), {});
  CHECK(warnings_with(one, "replicate").empty());
}

namespace {

// The memory rules of planner/explain.h written out pair by pair, as directly as they read:
// O(n^2) per call, the reference the O(n) estimate_memory is checked against.
MemoryEstimate reference_memory(const std::vector<UnitExplanation>& units, int fwd, int bwd) {
  auto inside = [](const std::string& inner, const std::string& outer) {
    return inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
           inner[outer.size()] == '.';
  };
  auto encloses = [&](const UnitExplanation& j, const UnitExplanation& k) {
    if (j.is_root) return !k.is_root;
    if (k.is_root) return false;
    for (const auto& o : j.modules)
      for (const auto& i : k.modules)
        if (inside(i, o)) return true;
    return false;
  };
  const int n = static_cast<int>(units.size());
  auto transient = [&](int j) {
    return units[j].strategy == ShardingStrategy::kNoShard ? int64_t{0} : units[j].gathered_bytes;
  };
  auto kept = [&](int j) {
    return units[j].strategy != ShardingStrategy::kNoShard && !units[j].reshard_after_forward;
  };
  MemoryEstimate m;
  for (const auto& u : units) {
    m.persistent_bytes += 2 * u.master_bytes;
    if (u.strategy == ShardingStrategy::kNoShard) m.persistent_bytes += u.gathered_bytes;
    m.adamw_state_bytes += 2 * u.master_bytes;
  }
  auto consider = [&](int64_t b, const std::string& at) {
    if (b > m.peak_transient_bytes) m.peak_transient_bytes = b, m.peak_at = at;
  };
  for (int k = 0; k < n; ++k) {
    int64_t b = 0;
    for (int j = 0; j < n; ++j)
      if (j == k || (j < k && (kept(j) || encloses(units[j], units[k]))) ||
          (j > k && j <= k + fwd))
        b += transient(j);
    consider(b, "forward of " + units[k].name);
  }
  int root = -1;
  for (int j = 0; j < n; ++j)
    if (units[j].is_root) root = j;
  int previous = -1;
  for (int k = n - 1; k >= 0; --k) {
    if (k == root) continue;
    int64_t b = 0;
    int prefetched = 0;
    for (int j = n - 1; j >= 0; --j) {
      bool gathered = j == k || j == root || (j < k && kept(j)) || encloses(units[j], units[k]);
      if (j < k && j != root && prefetched < bwd) ++prefetched, gathered = true;
      if (gathered) b += transient(j);
      if (j == k || j == root || (j != root && encloses(units[j], units[k])))
        b += units[j].grad_buffer_bytes;
    }
    if (previous >= 0) b += units[previous].grad_buffer_bytes;
    consider(b, "backward of " + units[k].name);
    previous = k;
  }
  if (root >= 0) {
    int64_t b = transient(root) + units[root].grad_buffer_bytes;
    if (previous >= 0) b += units[previous].grad_buffer_bytes;
    consider(b, "backward of " + units[root].name);
  }
  return m;
}

// `n` units over a module tree "b<i>" with nested "b<i>.mlp" and "b<i>.mlp.fc" units, a root
// at a random position, random strategies, keep flags and sizes.
std::vector<UnitExplanation> random_units(int n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  auto next = [&x] { return x = x * 1664525u + 1013904223u, x >> 8; };
  std::vector<UnitExplanation> units(n);
  const int root = static_cast<int>(next() % n);
  for (int i = 0; i < n; ++i) {
    UnitExplanation& u = units[i];
    u.index = i;
    u.is_root = i == root;
    u.name = u.is_root ? "<root>" : "u" + std::to_string(i);
    const int block = static_cast<int>(next() % (n / 3 + 1));
    const char* depth[] = {"", ".mlp", ".mlp.fc", ".attn"};
    u.modules = {u.is_root ? "wte" : "b" + std::to_string(block) + depth[next() % 4]};
    if (next() % 5 == 0) u.modules.push_back("b" + std::to_string(next() % (n / 3 + 1)));
    const uint32_t s = next() % 4;
    u.strategy = s == 0 ? ShardingStrategy::kNoShard
                 : s == 1 ? ShardingStrategy::kShardGradOp
                          : ShardingStrategy::kFullShard;
    u.reshard_after_forward = u.strategy == ShardingStrategy::kFullShard && next() % 3 != 0;
    u.gathered_bytes = 1 + next() % 1000;
    u.grad_buffer_bytes = 1 + next() % 1000;
    u.master_bytes = 1 + next() % 100;
    u.master_grad_bytes = u.master_bytes;  // an fp32 gradient
  }
  return units;
}

}  // namespace

TEST_CASE("explain: the memory estimate equals the pairwise rules on random nested plans",
          "[diagnostics][explain]") {
  for (uint32_t seed = 0; seed < 300; ++seed) {
    const int n = 1 + static_cast<int>(seed % 40);
    const auto units = random_units(n, seed);
    for (const auto& [fwd, bwd] : std::vector<std::pair<int, int>>{{0, 0}, {1, 1}, {2, 0},
                                                                    {0, 3}, {5, 7}, {100, 100}}) {
      const MemoryEstimate want = reference_memory(units, fwd, bwd);
      const MemoryEstimate got = estimate_memory(units, fwd, bwd);
      CAPTURE(seed, n, fwd, bwd);
      REQUIRE(got.peak_transient_bytes == want.peak_transient_bytes);
      REQUIRE(got.peak_at == want.peak_at);
      REQUIRE(got.persistent_bytes == want.persistent_bytes);
      REQUIRE(got.adamw_state_bytes == want.adamw_state_bytes);
    }
  }
}

TEST_CASE("explain: 200k units and a deep prefetch search take seconds, not hours",
          "[diagnostics][explain]") {
  // Pairwise (the old estimate) this is 4e10 unit pairs per estimate, and explain's search for a
  // fitting prefetch depth ran one estimate per depth: hours. Linear, a fraction of a second.
  // Bounded generously (the machine may be shared): 30 s fails only a superlinear estimate.
  const auto start = std::chrono::steady_clock::now();
  auto units = random_units(200000, 7);
  const MemoryEstimate m = estimate_memory(units, 1, 1);
  CHECK(m.peak_transient_bytes > 0);
  const MemoryEstimate deep = estimate_memory(units, 100000, 100000);
  CHECK(deep.peak_transient_bytes >= m.peak_transient_bytes);
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(s < 30);
}
