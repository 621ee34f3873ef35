// One vocabulary across the tools (issue 33, docs/vocabulary.md): the same flag names in
// flatshard-bench and flatshard-explain with the old ones as noted aliases, named plans wherever a
// policy is, "did you mean" for flags, sizes with a unit, options a combination ignores said
// aloud, no typo warning for deliberate root-only plans, one trace file per bench run that
// flatshard-trace finds from the FLATSHARD_TRACE value, unit kinds as policies write them, and
// verdicts that agree with their numbers. The tools run as child processes under timeout(1).
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "planner/trace_summary.h"
#include "temp_dir.h"
#include "tool_run.h"
#include "cli/exit.h"
#include "cli/named_plans.h"
#include "wrap_policies/policy.h"

namespace {

struct Run : flatshard_test::ToolRun {
  int count(const std::string& needle, const std::string& in) const {
    int n = 0;
    for (size_t at = in.find(needle); at != std::string::npos; at = in.find(needle, at + 1)) ++n;
    return n;
  }
};

const std::string& dir() {
  static flatshard_test::TempDir d;
  return d.path();
}

using flatshard_test::slurp;

// `exe args` in dir() (so relative trace paths land there), with `env` added.
Run run(const char* exe, const std::vector<std::string>& args,
        const std::vector<std::string>& env = {}) {
  Run r;
  static_cast<flatshard_test::ToolRun&>(r) =
      flatshard_test::run_tool(dir(), exe, args, {120, 0, env, dir()});
  return r;
}

Run explain(std::vector<std::string> args) {
  args.insert(args.begin(), {"--preset", "tiny", "--world", "2"});
  return run(FLATSHARD_EXPLAIN_EXE, args);
}

bool has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// The lines of `text` from the first one starting with "units:" (the summary below the table)
// on: what two runs of explain on the same plan must agree on.
std::string from_units(const std::string& text) {
  const size_t at = text.find("\nunits: ");
  return at == std::string::npos ? "" : text.substr(at);
}

}  // namespace

TEST_CASE("edit distance and the closest name", "[tools][vocabulary]") {
  using flatshard::tools::closest_name;
  using flatshard::tools::edit_distance;
  CHECK(edit_distance("", "") == 0);
  CHECK(edit_distance("abc", "") == 3);
  CHECK(edit_distance("--polcy", "--policy") == 1);
  CHECK(edit_distance("kitten", "sitting") == 3);
  CHECK(closest_name("--polcy", {"--prefetch", "--policy", "--preset"}) == "--policy");
  CHECK(closest_name("--zzzzzz", {"--policy", "--preset"}).empty());  // too far: no guess
  CHECK(closest_name("leef", flatshard::tools::named_plan_names()) == "leaf");
}

TEST_CASE("named plans: the same specs in both tools", "[tools][vocabulary]") {
  using flatshard::tools::named_plan_spec;
  CHECK(*named_plan_spec("layer", "type=Block", "type=Linear") == "type=Block");
  CHECK(*named_plan_spec("leaf", "type=Block", "type=Linear") == "type=Linear");
  CHECK(*named_plan_spec("every-3", "type=Block", "type=Linear") == "every=3,type=Block");
  CHECK(*named_plan_spec("model", "type=Block", "type=Linear") == "none");
  CHECK(*named_plan_spec("noshard", "type=Block", "") == "noshard:type=Block;root:noshard");
  CHECK(named_plan_spec("local", "type=Block", "")->empty());
  CHECK_FALSE(named_plan_spec("type=Block", "type=Block", "").has_value());
  CHECK_THROWS_WITH(named_plan_spec("every-0", "type=Block", ""),
                    Catch::Contains("every-K with K a positive integer"));
  CHECK_THROWS_WITH(named_plan_spec("leaf", "type=Block", ""), Catch::Contains("leaf types"));
}

TEST_CASE("explain --policy takes the named plans bench and the advisor print",
          "[tools][vocabulary]") {
  const Run leaf = explain({"--policy", "leaf"});
  CAPTURE(leaf.out, leaf.err);
  REQUIRE(leaf.exit_code == 0);
  CHECK(has(leaf.out, "policy: type=Linear|LayerNorm|Embedding (leaf)"));
  const Run spec = explain({"--policy", "type=Linear|LayerNorm|Embedding"});
  REQUIRE(spec.exit_code == 0);
  CHECK(from_units(leaf.out) == from_units(spec.out));
  CHECK_FALSE(from_units(leaf.out).empty());
  const Run every = explain({"--policy", "every-2"});
  REQUIRE(every.exit_code == 0);
  CHECK(has(every.out, "policy: every=2,type=Block (every-2)"));

  const Run local = explain({"--policy", "local"});
  CHECK(local.exit_code == 2);
  CHECK(has(local.err, "'local' is flatshard-bench's unsharded floor"));
  const Run typo = explain({"--policy", "leef"});
  CHECK(typo.exit_code == 2);
  CHECK(has(typo.err, "(did you mean 'leaf'?)"));
}

TEST_CASE("old flag names still work, each with one note naming the new one",
          "[tools][vocabulary]") {
  const Run old_names = explain({"--n-layers", "3", "--n-heads", "2", "--seq-len", "16"});
  const Run new_names = explain({"--layers", "3", "--heads", "2", "--seq", "16"});
  CAPTURE(old_names.err, new_names.err);
  REQUIRE(old_names.exit_code == 0);
  REQUIRE(new_names.exit_code == 0);
  CHECK(old_names.out == new_names.out);
  CHECK(has(new_names.out, "n_heads=2 n_layers=3 seq_len=16"));
  CHECK(old_names.count("note:", old_names.err) == 3);
  CHECK(has(old_names.err, "flatshard-explain: note: --n-layers is deprecated, use --layers\n"));
  CHECK(has(old_names.err, "--seq-len is deprecated, use --seq"));
  CHECK(new_names.err.empty());
  const Run both = explain({"--layers", "3", "--n-layers=4"});
  CHECK(both.exit_code == 2);
  CHECK(has(both.err, "--layers is given twice: once as --layers and once as --n-layers"));

  // bench: --nproc / --granularity are --world / --policy.
  const Run bench = run(FLATSHARD_BENCH_EXE, {"--preset", "tiny", "--steps", "1", "--warmup", "0",
                                              "--nproc", "1", "--granularity", "layer"});
  CAPTURE(bench.out, bench.err);
  REQUIRE(bench.exit_code == 0);
  CHECK(has(bench.err, "flatshard-bench: note: --granularity is deprecated, use --policy"));
  CHECK(has(bench.err, "flatshard-bench: note: --nproc is deprecated, use --world"));
  CHECK(has(bench.out, "1 ranks"));
}

TEST_CASE("a mistyped flag names the closest one, in every tool", "[tools][vocabulary]") {
  const Run e = explain({"--polcy", "leaf"});
  CHECK(e.exit_code == 2);
  CHECK(e.err == "flatshard-explain: error: unknown option --polcy (did you mean --policy?)\n");
  const Run e2 = explain({"--memory-limt=4GiB"});
  CHECK(has(e2.err, "unknown option --memory-limt (did you mean --memory-limit?)"));
  const Run t = run(FLATSHARD_TRACE_EXE, {"x.json", "--mege", "m.json"});
  CHECK(t.exit_code == 2);
  CHECK(has(t.err, "unknown option --mege (did you mean --merge?)"));
  const Run far = explain({"--completely-unrelated"});
  CHECK(has(far.err, "unknown option --completely-unrelated (--help lists the options)"));
}

TEST_CASE("explain --seq: one meaning, the model bench builds; ignored options are said",
          "[tools][vocabulary]") {
  // --seq sets the reference model's seq_len (as bench's --seq), also without --batch.
  const Run seq = explain({"--seq", "64"});
  CAPTURE(seq.err);
  REQUIRE(seq.exit_code == 0);
  CHECK(has(seq.out, "seq_len=64"));
  const Run batch = explain({"--seq", "64", "--batch", "1"});
  REQUIRE(batch.exit_code == 0);
  CHECK(has(batch.out, "batch 1 x seq 64"));
  // Options this combination does not read: a warning each, the output unchanged.
  const Run ignored = explain({"--prefetch-depths", "1", "--profile", "p.json", "--prefetch", "2",
                               "--forward-prefetch", "3"});
  CAPTURE(ignored.err);
  REQUIRE(ignored.exit_code == 0);
  CHECK(has(ignored.err, "warning: --prefetch-depths is read only with --suggest: ignored"));
  CHECK(has(ignored.err, "warning: --profile is read only with --batch or --suggest"));
  CHECK(has(ignored.err, "warning: --forward-prefetch is overridden by --prefetch"));
  CHECK_FALSE(has(ignored.err, "--prefetch is ignored"));
}

TEST_CASE("--memory-limit needs a unit and says which peak it is held against",
          "[tools][vocabulary]") {
  const Run bare = explain({"--memory-limit", "40"});
  CHECK(bare.exit_code == 2);
  CHECK(has(bare.err, "'40' has no unit: write 40GiB (binary), 40GB (decimal), or 40B"));
  const Run plain = explain({"--memory-limit", "1GiB"});
  REQUIRE(plain.exit_code == 0);
  CHECK(has(plain.out, "limit 1.0 GiB checked against this total (no activations"));
  const Run full = explain({"--memory-limit", "1KiB", "--batch", "1"});
  CAPTURE(full.out);
  REQUIRE(full.exit_code == 0);
  CHECK(has(full.out, "warning: memory limit 1.0 KiB against the predicted peak with activations"));
  const Run fits = explain({"--memory-limit", "1GiB", "--batch", "1"});
  CHECK(has(fits.out, "memory limit 1.0 GiB against the predicted peak with activations"));
  CHECK(has(fits.out, ": fits\n"));
  const Run suggest = explain({"--memory-limit", "1GiB", "--suggest"});
  CAPTURE(suggest.out, suggest.err);
  REQUIRE(suggest.exit_code == 0);
  CHECK(has(suggest.out, "held against the predicted peak with activations"));
  CHECK(has(suggest.out, "--policy '"));  // the advisor's command lines use the new name
}

TEST_CASE("a deliberate one-unit plan gets no typo warning; a typo gets it once",
          "[tools][vocabulary][policy]") {
  for (const std::string p : {"none", "model"}) {
    const Run e = explain({"--policy", p});
    CAPTURE(p, e.out);
    REQUIRE(e.exit_code == 0);
    CHECK_FALSE(has(e.out, "matched no module"));
  }
  const Run typo = explain({"--policy", "type=Blok"});
  CHECK(typo.count("the policy matched no module", typo.out) == 1);
  // bench's 'model' and 'none' runs on 2 ranks as threads: no warning on any rank.
  const Run bench = run(FLATSHARD_BENCH_EXE, {"--preset", "tiny", "--steps", "1", "--warmup", "0",
                                              "--policy", "model", "--policy", "none"});
  CAPTURE(bench.err);
  REQUIRE(bench.exit_code == 0);
  CHECK_FALSE(has(bench.err, "matched no module"));
  CHECK_FALSE(has(bench.err, "arning"));
}

TEST_CASE("FLATSHARD_TRACE over several bench runs: one file set per run, said, and found",
          "[tools][vocabulary][trace]") {
  const Run bench = run(FLATSHARD_BENCH_EXE,
                        {"--preset", "tiny", "--steps", "1", "--warmup", "1", "--policy",
                         "local,layer,leaf"},
                        {"FLATSHARD_TRACE=run.json"});
  CAPTURE(bench.err);
  REQUIRE(bench.exit_code == 0);
  CHECK(has(bench.err, "flatshard-bench: trace of run 'layer': run.layer.rank0.json, "
                       "run.layer.rank1.json\n"));
  CHECK(has(bench.err, "flatshard-bench: trace of run 'leaf': run.leaf.rank0.json"));
  CHECK_FALSE(has(bench.err, "run 'local'"));  // local has no ShardedModel, no trace
  const std::string layer = slurp(dir() + "/run.layer.rank0.json");
  const std::string leaf = slurp(dir() + "/run.leaf.rank1.json");
  REQUIRE_FALSE(layer.empty());
  REQUIRE_FALSE(leaf.empty());
  CHECK(layer != leaf);
  // Unit kinds as a policy writes them, not LibTorch's class names.
  CHECK(has(layer, "\"kind\":\"Block\""));
  CHECK(has(leaf, "\"kind\":\"Linear\""));
  CHECK_FALSE(has(leaf, "Impl"));

  // The value the user set: two runs' files, so the error lists both runs.
  const Run both = run(FLATSHARD_TRACE_EXE, {"run.json"});
  CAPTURE(both.err);
  CHECK(both.exit_code == 2);
  CHECK(has(both.err, "'run.json' does not exist"));
  CHECK(has(both.err, "run 'layer': run.layer.rank0.json run.layer.rank1.json"));
  CHECK(has(both.err, "run 'leaf': run.leaf.rank0.json run.leaf.rank1.json"));
  // One run's name: its rank files are read, with a note.
  const Run one = run(FLATSHARD_TRACE_EXE, {"run.layer.json"});
  CAPTURE(one.err);
  REQUIRE(one.exit_code == 0);
  CHECK(has(one.err, "reading its rank files: run.layer.rank0.json run.layer.rank1.json"));
  CHECK(has(one.out, "2 rank(s)"));
  CHECK(has(one.out, "\nBlock "));  // the per-kind table
  const Run none = run(FLATSHARD_TRACE_EXE, {"nothing.json"});
  CHECK(none.exit_code == 2);
  CHECK(has(none.err, "'nothing.json' does not exist, nor do rank files of it"));
}

TEST_CASE("unit kinds: LibTorch names as a policy writes them", "[tools][vocabulary]") {
  using flatshard::policy_type_name;
  CHECK(policy_type_name("torch::nn::LinearImpl") == "Linear");
  CHECK(policy_type_name("flatshard::gpt::BlockImpl") == "Block");
  CHECK(policy_type_name("<root>") == "<root>");
  CHECK(policy_type_name("Norm") == "Norm");
  CHECK(policy_type_name("Impl") == "Impl");
  CHECK(flatshard::type_name_matches("torch::nn::LinearImpl",
                                     policy_type_name("torch::nn::LinearImpl")));
}

TEST_CASE("trace summary: host vs GPU within 10% is called nearly equal, not 'runs ahead'",
          "[tools][vocabulary][trace]") {
  flatshard::TraceSummary s;
  s.gpu = true;
  s.ranks = 1;
  s.steps_total = 2;
  s.steps_used = {1};
  struct Case {
    double host, gpu;
    const char* says;
  };
  for (const Case& c : {Case{30.15e3, 86.28e3, "(the host runs ahead of the GPU)"},
                        Case{85.0e3, 86.28e3, "(nearly equal, within 10%"},
                        Case{86.28e3, 85.0e3, "(nearly equal, within 10%"},
                        Case{120e3, 86.28e3, "(host-bound: the host issues slower"}}) {
    s.host_issue_us = c.host;
    s.gpu_span_us = c.gpu;
    const std::string text = s.to_string();
    CAPTURE(c.host, c.gpu, text);
    CHECK(has(text, c.says));
  }
}

TEST_CASE("explain --tp: the TP-local model and the TP collectives", "[tools][vocabulary][tp]") {
  // tiny GPT: d 64, 2 layers, vocab 512, seq 32. At tp 2 each layer keeps half of qkv (12288 +
  // 192), attn.proj's weight (4096; its bias 64 whole), fc (16384 + 256) and mlp.proj's weight
  // (16384; bias 64 whole), the norms whole (2 x 128): 25184 per layer; the root (wte 32768,
  // wpe 2048, ln_f 128, lm_head 32768) 67712. Per layer 2 rowwise and 2 colwise modules, each
  // all-reducing 64 elements per token: at batch 1 x seq 32 in fp32, 4 x 64 x 32 x 4 B.
  const Run r = explain({"--tp", "2", "--batch", "1"});
  CAPTURE(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(has(r.out, "params numel: " + std::to_string(67712 + 2 * 25184)));
  CHECK(has(r.out, "tensor parallel: tp 2 (4 ranks, shard 2 x tp 2)"));
  CHECK(has(r.out, "4 forward + 4 backward all-reduces over the tp group"));
  CHECK(has(r.out, "4 forward all-reduces, 32.0 KiB (32768 B); 4 backward all-reduces, 32.0 KiB "
                   "(32768 B) per rank"));
  // --suggest --tp 2: tp 1 and tp 2 compete on the 2 x 2 ranks (planner/advisor.h).
  const Run suggest = explain({"--tp", "2", "--suggest", "--memory-limit", "1GiB"});
  CAPTURE(suggest.out, suggest.err);
  CHECK(suggest.exit_code == 0);
  CHECK(has(suggest.out, "tensor parallelism: each tp group trains on one batch"));
  CHECK(has(suggest.out, " tp "));  // the table's column
  // --tp 6 over --world 2 (12 ranks): tp 2 and 6 compete with tp 1, tp 3 cannot split 4 heads
  // (nor can 6): skipped, said why.
  const Run suggest6 = explain({"--tp", "6", "--suggest", "--memory-limit", "1GiB"});
  CAPTURE(suggest6.out, suggest6.err);
  CHECK(suggest6.exit_code == 0);
  CHECK(has(suggest6.out, "skipped tp 3: "));
  CHECK(has(suggest6.out, "n_heads = 4, which tp 3 cannot split"));
  CHECK(has(suggest6.out, "skipped tp 6: "));
  const Run zero = explain({"--tp", "0"});
  CHECK(zero.exit_code == 2);
  CHECK(has(zero.err, "--tp: must be >= 1, got 0"));
  const Run heads = explain({"--tp", "3"});
  CHECK(heads.exit_code == 1);
  CHECK(has(heads.err, "n_heads = 4, which tp 3 cannot split"));
}
