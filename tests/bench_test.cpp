// flatshard-bench end to end (CPU, ranks as threads): runs the binary on the tiny preset, reads
// its JSON back and checks the numbers against closed forms — collective counts per
// granularity from the plan shape, bytes from the parameter count, timing sanity, the loss
// check — plus CSV/SVG output and one-line usage errors with exit code 2.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_report.h"
#include "models/family.h"
#include "wrap_policies/tp_plan.h"
#include "profiling/kernel_profile.h"
#include "support/input_file.h"
#include "support/json.h"

#ifndef FLATSHARD_BENCH_EXE
#error "FLATSHARD_BENCH_EXE (path of flatshard-bench) must be defined by CMake"
#endif

namespace {

struct Outcome {
  int exit_code = -1;
  std::string out, err;
};

std::string read_file(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Single-quotes `s` for /bin/sh.
std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// A private temporary folder (mkdtemp under $TMPDIR or /tmp) and the files the tests put in it,
// all removed at exit. POSIX calls rather than std::filesystem: libtorch.so exports its own
// std::filesystem symbols, and calling those from a static destructor crashed at exit.
class Scratch {
 public:
  Scratch() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/flatshard_bench_test_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = pattern;
  }
  ~Scratch() {
    for (const auto& f : files_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string file(const std::string& name) {
    const std::string path = dir_ + "/" + name;
    if (std::find(files_.begin(), files_.end(), path) == files_.end()) files_.push_back(path);
    return path;
  }

 private:
  std::string dir_;
  std::vector<std::string> files_;
};

std::string scratch(const std::string& name) {
  static Scratch dir;
  return dir.file(name);
}

// `env`: NAME=value pairs set for the child only (through env(1)), e.g. a launcher's variables.
Outcome run_bench(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  std::string cmd;
  if (!env.empty()) {
    cmd = "env";
    for (const auto& kv : env) cmd += " " + quote(kv);
    cmd += " ";
  }
  cmd += quote(FLATSHARD_BENCH_EXE);
  for (const auto& a : args) cmd += " " + quote(a);
  const std::string out = scratch("stdout.txt"), err = scratch("stderr.txt");
  cmd += " >" + quote(out) + " 2>" + quote(err) + " </dev/null";
  const int status = std::system(cmd.c_str());
  Outcome o;
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  o.out = read_file(out);
  o.err = read_file(err);
  return o;
}

// A JSON report read back: the document and its root (errors name the file and the key).
struct JsonFile {
  explicit JsonFile(const std::string& path)
      : doc(flatshard::read_json_file(path, int64_t{1} << 30, "bench output")), root(doc, path) {}
  JsonFile(const JsonFile&) = delete;
  JsonFile& operator=(const JsonFile&) = delete;
  const flatshard::json::Json doc;
  const flatshard::json::Node root;  // refers to doc
};

flatshard::json::Node run_named(const flatshard::json::Node& doc, const std::string& name) {
  for (const auto& r : doc.at("runs").items())
    if (r.at("granularity").as_string() == name) return r;
  throw std::runtime_error("no run named '" + name + "' in the JSON");
}

// The default granularities on the tiny preset, 2 ranks, 2 measured steps — shared by the
// tests below (one run of the binary).
const flatshard::json::Node& default_run() {
  static const JsonFile report = [] {
    const std::string json = scratch("default.json");
    const Outcome o =
        run_bench({"--preset", "tiny", "--nproc", "2", "--steps", "2", "--warmup", "1", "--json",
                   json});
    INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
    REQUIRE(o.exit_code == 0);
    return JsonFile(json);
  }();
  return report.root;
}

}  // namespace

TEST_CASE("JSON of the default granularities: schema and sane numbers", "[bench]") {
  const auto& doc = default_run();
  const auto& model = doc.at("model");
  CHECK(model.at("preset").as_string() == "tiny");
  CHECK(model.at("n_layers").as_number() == 2);
  CHECK(model.at("params").as_number() == 167680);
  CHECK(doc.at("world_size").as_number() == 2);
  CHECK(doc.at("all_ok").as_bool());
  CHECK(doc.at("optimizer").as_string() == "adamw");

  std::vector<std::string> names;
  for (const auto& r : doc.at("runs").items()) names.push_back(r.at("granularity").as_string());
  CHECK(names == std::vector<std::string>{"local", "leaf", "layer", "every-2", "model", "noshard"});

  const double tokens = doc.at("batch").as_number() * model.at("seq_len").as_number();
  const double local_median = run_named(doc, "local").at("step_ms").at("median").as_number();
  const double loss0 = run_named(doc, "local").at("loss_step0").as_number();
  CHECK(loss0 > 0);
  for (const auto& r : doc.at("runs").items()) {
    CAPTURE(r.at("granularity").as_string());
    for (const char* key : {"world_size", "units", "forward_all_gathers", "backward_all_gathers",
                            "reduce_scatters", "all_reduces", "bytes_per_step",
                            "tokens_per_s_per_gpu", "peak_memory_bytes", "loss_step0",
                            "ratio_to_local"})
      CHECK(r.at(key).as_number() >= 0);
    const auto& t = r.at("step_ms");
    CHECK(t.at("min").as_number() > 0);
    CHECK(t.at("min").as_number() <= t.at("median").as_number());
    CHECK(t.at("median").as_number() <= t.at("max").as_number());
    CHECK(t.at("all").items().size() == 2);
    // The two phases are parts of a step: positive, and together no longer than the step.
    const double fb = r.at("fwd_bwd_ms_median").as_number();
    const double op = r.at("optimizer_ms_median").as_number();
    CHECK(fb > 0);
    CHECK(op > 0);
    CHECK(fb + op <= t.at("max").as_number() * 1.001);
    // Issuing a step is part of it (on CPU, where work is synchronous, nearly all of it).
    const double host = r.at("host_issue_ms_median").as_number();
    CHECK(host > 0);
    CHECK(host <= t.at("max").as_number() * 1.001);
    // Of which flatshard's hooks (none for local): inside the issue time, forward and backward.
    if (r.at("granularity").as_string() == "local") {
      CHECK(r.at("hook_forward_ms_median").is_null());
      CHECK(r.at("hook_backward_ms_median").is_null());
    } else {
      const double hf = r.at("hook_forward_ms_median").as_number();
      const double hb = r.at("hook_backward_ms_median").as_number();
      CHECK(hf > 0);
      CHECK(hb > 0);
      CHECK(hf + hb <= t.at("max").as_number() * 1.001);
    }
    CHECK(r.at("tokens_per_s_per_gpu").as_number() == Approx(tokens / (t.at("median").as_number() * 1e-3)));
    CHECK(r.at("ratio_to_local").as_number() == Approx(t.at("median").as_number() / local_median));
    CHECK(r.at("mfu").is_null());  // no --peak-tflops on CPU
    CHECK(r.at("peak_memory_bytes").as_number() > 0);
    CHECK(r.at("check").as_string() == "ok");
    CHECK(r.at("kernel_profile").is_null());  // only with --kernel-profile (cuda)
    CHECK(std::abs(r.at("loss_step0").as_number() - loss0) <= 1e-4 * loss0);
    const bool local = r.at("granularity").as_string() == "local";
    CHECK(r.at("world_size").as_number() == (local ? 1 : 2));
    if (local) {
      CHECK(r.at("exposed_comm_share").is_null());
    } else {
      CHECK(r.at("exposed_comm_share").as_number() > 0);
      CHECK(r.at("exposed_comm_share").as_number() <= 1);
    }
  }
}

TEST_CASE("collective counts per step follow the plan shape", "[bench]") {
  const auto& doc = default_run();
  const int64_t L = static_cast<int64_t>(doc.at("model").at("n_layers").as_number());
  struct Want {
    const char* name;
    int64_t units, fwd, bwd, rs, ar;
  };
  // The root keeps its parameters from forward to backward (no backward all-gather). `leaf`
  // leaves the root without parameters: 6 leaves per Block + wte, wpe, ln_f, lm_head.
  const int64_t leaves = 6 * L + 4;
  const int64_t groups = (L + 1) / 2 + 1;
  const std::vector<Want> want = {{"local", 0, 0, 0, 0, 0},
                                  {"leaf", leaves, leaves, leaves, leaves, 0},
                                  {"layer", L + 1, L + 1, L, L + 1, 0},
                                  {"every-2", groups, groups, groups - 1, groups, 0},
                                  {"model", 1, 1, 0, 1, 0},
                                  {"noshard", L + 1, 0, 0, 0, L + 1}};
  for (const auto& w : want) {
    CAPTURE(w.name);
    const auto& r = run_named(doc, w.name);
    CHECK(r.at("units").as_number() == w.units);
    CHECK(r.at("forward_all_gathers").as_number() == w.fwd);
    CHECK(r.at("backward_all_gathers").as_number() == w.bwd);
    CHECK(r.at("reduce_scatters").as_number() == w.rs);
    CHECK(r.at("all_reduces").as_number() == w.ar);
  }
}

TEST_CASE("bytes per step are consistent with the parameter count", "[bench]") {
  const auto& doc = default_run();
  const double N = doc.at("model").at("params").as_number();
  const double f = 4.0;  // fp32 everywhere by default; world 2 halves an all-gather's input
  auto bytes = [&](const char* name) { return run_named(doc, name).at("bytes_per_step").as_number(); };
  // Padding (alignment to 8 elements per parameter, to the world size per unit) adds < 2%.
  CHECK(bytes("local") == 0);
  CHECK(bytes("noshard") >= f * N);                      // one all-reduce of every parameter
  CHECK(bytes("noshard") <= f * N * 1.02);
  CHECK(bytes("model") >= f * N * 1.5);                  // shard in forward + full reduce-scatter
  CHECK(bytes("model") <= f * N * 1.5 * 1.02);
  for (const char* name : {"leaf", "layer", "every-2"}) {  // + backward all-gathers but the root's
    CAPTURE(name);
    CHECK(bytes(name) > f * N * 1.5);
    CHECK(bytes(name) <= f * N * 2.0 * 1.02);
  }
}

TEST_CASE("bf16, custom policy specs, CSV and SVG outputs", "[bench]") {
  const std::string json = scratch("bf16.json"), csv = scratch("bf16.csv"),
                    svg = scratch("bf16.svg");
  const Outcome o = run_bench({"--preset", "tiny", "--steps", "1", "--warmup", "0",
                               "--param-dtype", "bf16", "--granularity",
                               "layer,every=2,type=Block", "--granularity", "size>=1e4",
                               "--granularity", "path=lm_head|x\"y\\z",
                               "--json", json, "--csv", csv, "--plot", svg});
  INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
  REQUIRE(o.exit_code == 0);
  const JsonFile report(json);
  const flatshard::json::Node& doc = report.root;
  CHECK(doc.at("param_dtype").as_string() == "bf16");
  std::vector<std::string> names;
  for (const auto& r : doc.at("runs").items()) names.push_back(r.at("granularity").as_string());
  // The last spec has a quote and a backslash: JSON and CSV must escape them.
  CHECK(names == std::vector<std::string>{"layer", "every=2,type=Block", "size>=1e4",
                                          "path=lm_head|x\"y\\z"});
  CHECK(doc.at("check_reference").as_string() == "layer");  // no local run: the first one
  for (const auto& r : doc.at("runs").items()) CHECK(r.at("check").as_string() == "ok");

  std::vector<std::string> lines;
  std::istringstream in(read_file(csv));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  REQUIRE(lines.size() == 5);
  CHECK(lines[0].rfind("granularity,world_size,units,", 0) == 0);
  CHECK(lines[2].rfind("\"every=2,type=Block\",2,", 0) == 0);  // a comma in a field is quoted
  CHECK(lines[4].rfind("\"path=lm_head|x\"\"y\\z\",2,", 0) == 0);  // quotes doubled

  const std::string s = read_file(svg);
  CHECK(s.find("<svg") != std::string::npos);
  CHECK(s.find("</svg>") != std::string::npos);
  CHECK(s.find("size&gt;=1e4") != std::string::npos);  // labels are XML-escaped
  CHECK(s.find("step time (ms)") != std::string::npos);
  CHECK(s.find("peak memory (MiB)") != std::string::npos);
}

TEST_CASE("a spec without rules is the one-unit plan, as 'model'", "[bench]") {
  // flatshard-explain --suggest prints "--policy 'none'" for the one-unit plan: pasted into
  // the bench it must run that plan, not be refused as a policy matching nothing.
  const std::string json = scratch("none.json");
  const Outcome o = run_bench({"--preset", "tiny", "--steps", "1", "--warmup", "0",
                               "--granularity", "model", "--granularity", "none", "--json", json});
  INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
  REQUIRE(o.exit_code == 0);
  const JsonFile report(json);
  const auto model = run_named(report.root, "model"), none = run_named(report.root, "none");
  CHECK(none.at("units").as_int() == 1);
  CHECK(none.at("units").as_int() == model.at("units").as_int());
  CHECK(none.at("forward_all_gathers").as_int() == model.at("forward_all_gathers").as_int());
  CHECK(none.at("check").as_string() == "ok");
}

TEST_CASE("--optimizer fused: every run uses FusedAdamW; losses still agree", "[bench]") {
  const std::string json = scratch("fused.json");
  const Outcome o = run_bench({"--preset", "tiny", "--nproc", "2", "--steps", "2", "--warmup", "1",
                               "--granularity", "local,layer", "--optimizer", "fused", "--json",
                               json});
  INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
  REQUIRE(o.exit_code == 0);
  CHECK(o.out.find("optimizer FusedAdamW") != std::string::npos);
  const JsonFile report(json);
  const flatshard::json::Node& doc = report.root;
  CHECK(doc.at("optimizer").as_string() == "fused");
  CHECK(doc.at("all_ok").as_bool());
  for (const auto& r : doc.at("runs").items()) CHECK(r.at("optimizer_ms_median").as_number() > 0);
}

TEST_CASE("--param-dtype fp16 trains with the scaler; --offload-step backward keeps the losses",
          "[bench]") {
  // fp16 (GPUs without bf16): sharded runs use ShardedGradScaler; step-0 losses still agree
  // with the local fp16 floor within the 16-bit tolerance.
  const std::string fp16 = scratch("fp16.json");
  const Outcome a = run_bench({"--preset", "tiny", "--steps", "2", "--warmup", "0",
                               "--param-dtype", "fp16", "--policy", "local,layer", "--json", fp16});
  INFO("stdout:\n" << a.out << "\nstderr:\n" << a.err);
  REQUIRE(a.exit_code == 0);
  const JsonFile r16(fp16);
  CHECK(r16.root.at("param_dtype").as_string() == "fp16");
  CHECK(r16.root.at("all_ok").as_bool());
  // Note [Offload step in backward]: the bench attaches the optimizer, labels the run and
  // checks it like any other (its exactness is tests/offload_test.cpp's).
  const std::string after = scratch("ostep_after.json"), during = scratch("ostep_during.json");
  for (const auto& [mode, path] : {std::pair<std::string, std::string>{"after", after},
                                   std::pair<std::string, std::string>{"backward", during}}) {
    const Outcome o = run_bench({"--preset", "tiny", "--steps", "2", "--warmup", "1",
                                 "--policy", "layer", "--offload", "1", "--optimizer", "fused",
                                 "--offload-step", mode, "--json", path});
    INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
    REQUIRE(o.exit_code == 0);
  }
  const JsonFile ra(after), rb(during);
  const auto run_a = run_named(ra.root, "layer+offload1");
  const auto run_b = run_named(rb.root, "layer+offload1+bwdstep");
  CHECK(run_a.at("loss_step0").as_number() == run_b.at("loss_step0").as_number());
  CHECK(run_b.at("check").as_string() == "ok");
  CHECK(run_b.at("optimizer_ms_median").as_number() >= 0);
}

TEST_CASE("--recompute and recompute specs: same collectives and loss, less activation memory",
          "[bench][recompute]") {
  // The tiny preset with 8 sequences of 128 tokens and a small vocabulary: the layers'
  // activations dominate the per-rank peak (observed 19.4 MiB without recompute, 8.7 MiB with),
  // so recomputing them lowers it; the recompute reuses each unit's backward all-gather.
  const std::string json = scratch("recompute.json");
  const Outcome o = run_bench({"--preset", "tiny", "--nproc", "2", "--steps", "1", "--warmup",
                               "1", "--batch", "8", "--seq", "128", "--layers", "4", "--vocab",
                               "128", "--granularity", "layer,recompute:type=Block", "--json",
                               json});
  INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
  REQUIRE(o.exit_code == 0);
  const Outcome flagged = run_bench({"--preset", "tiny", "--nproc", "2", "--steps", "1",
                                     "--warmup", "0", "--granularity", "local,layer",
                                     "--recompute"});
  INFO("--recompute stdout:\n" << flagged.out << "\nstderr:\n" << flagged.err);
  REQUIRE(flagged.exit_code == 0);
  CHECK(flagged.out.find("layer+recompute") != std::string::npos);
  CHECK(flagged.out.find("local+recompute") == std::string::npos);  // local has no units

  const JsonFile report(json);
  const flatshard::json::Node& doc = report.root;
  CHECK(doc.at("all_ok").as_bool());
  const auto& layer = run_named(doc, "layer");
  const auto& rc = run_named(doc, "recompute:type=Block");
  for (const char* key : {"units", "forward_all_gathers", "backward_all_gathers",
                          "reduce_scatters", "bytes_per_step"}) {
    CAPTURE(key);
    CHECK(layer.at(key).as_number() == rc.at(key).as_number());
  }
  CAPTURE(layer.at("peak_memory_bytes").as_number(), rc.at("peak_memory_bytes").as_number());
  CHECK(rc.at("peak_memory_bytes").as_number() < 0.7 * layer.at("peak_memory_bytes").as_number());
  // A nested plan is refused as a usage error, before anything runs.
  const Outcome nested = run_bench({"--preset", "tiny", "--granularity", "type=Block;type=Linear",
                                    "--recompute"});
  CHECK(nested.exit_code == 2);
  CHECK(nested.err.find("nested inside a recompute unit") != std::string::npos);
}

TEST_CASE("--init eager|deferred: same losses, setup time and peak reported", "[bench]") {
  // Deferred (the default) builds the sharded runs on meta; eager on the host. Same weights,
  // so the step-0 losses agree exactly between the two reports, for both families.
  for (const std::string family : {"gpt", "llama"}) {
    std::map<std::string, double> loss;
    for (const std::string init : {"eager", "deferred"}) {
      CAPTURE(family, init);
      const std::string json = scratch("init_" + family + "_" + init + ".json");
      const Outcome o = run_bench({"--model", family, "--preset", "tiny", "--nproc", "2",
                                   "--steps", "1", "--warmup", "0", "--granularity",
                                   "local,layer,leaf", "--init", init, "--json", json});
      INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
      REQUIRE(o.exit_code == 0);
      CHECK(o.out.find("init " + init) != std::string::npos);
      CHECK(o.out.find("setup s") != std::string::npos);
      const JsonFile report(json);
      const flatshard::json::Node& doc = report.root;
      CHECK(doc.at("init").as_string() == init);
      CHECK(doc.at("all_ok").as_bool());
      for (const auto& r : doc.at("runs").items()) {
        CAPTURE(r.at("granularity").as_string());
        CHECK(r.at("setup_s").as_number() > 0);
        CHECK(r.at("setup_peak_memory_bytes").as_number() > 0);
        const std::string key = r.at("granularity").as_string();
        const double l = r.at("loss_step0").as_number();
        if (init == "eager") {
          loss[key] = l;
        } else {
          CHECK(l == loss.at(key));
        }
      }
    }
  }
}

TEST_CASE("--tp 2 --world 4: TP collectives per step match closed forms, losses check",
          "[bench][tp]") {
  // shard 2 x tp 2 on CPU threads, deferred init (meta, parallelized, loaded from the family's
  // own init). Per layer the default plans enter each colwise module through Megatron's f (one
  // backward all-reduce of its input gradient, d_model per token) and leave each rowwise one
  // through g (one forward all-reduce of its output, d_model per token): GPT splits the fused
  // qkv and fc (2 colwise) and attn.proj, mlp.proj (2 rowwise); LLaMA q, k, v, gate, up (5) and
  // o, down (2). The losses after each step must match the unsharded reference on the two
  // data-parallel ranks' batches (the check), which covers the TP slicing and reduction.
  struct Family {
    const char* name;
    int64_t colwise, rowwise;
    std::vector<std::string> runs;
  };
  for (const Family& fam : {Family{"gpt", 2, 2, {"local", "layer", "leaf"}},
                            Family{"llama", 5, 2, {"layer"}}}) {
    CAPTURE(fam.name);
    const std::string json = scratch(std::string("tp_") + fam.name + ".json");
    std::string policies;
    for (const auto& r : fam.runs) policies += (policies.empty() ? "" : ",") + r;
    const Outcome o = run_bench({"--model", fam.name, "--preset", "tiny", "--world", "4", "--tp",
                                 "2", "--steps", "2", "--warmup", "1", "--policy", policies,
                                 "--json", json});
    INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
    REQUIRE(o.exit_code == 0);
    CHECK(o.out.find("tensor parallel: tp 2 x shard 2") != std::string::npos);
    const JsonFile report(json);
    const auto& doc = report.root;
    CHECK(doc.at("tp").as_number() == 2);
    CHECK(doc.at("tp_plan").as_string() ==
          flatshard::parse_tp_plan(flatshard::models::family(fam.name).modules().tp_plan)
              .to_spec());
    CHECK(doc.at("all_ok").as_bool());
    const double L = doc.at("model").at("n_layers").as_number();
    const double d = doc.at("model").at("d_model").as_number();
    const double tokens = doc.at("batch").as_number() * doc.at("model").at("seq_len").as_number();
    for (const auto& name : fam.runs) {
      CAPTURE(name);
      const auto& r = run_named(doc, name);
      CHECK(r.at("check").as_string() == "ok");
      const bool local = name == "local";
      CHECK(r.at("world_size").as_number() == (local ? 1 : 4));  // local: one replica
      CHECK(r.at("tp").as_number() == (local ? 1 : 2));
      CHECK(r.at("tp_forward_all_reduces").as_number() == (local ? 0 : fam.rowwise * L));
      CHECK(r.at("tp_backward_all_reduces").as_number() == (local ? 0 : fam.colwise * L));
      CHECK(r.at("tp_forward_bytes").as_number() == (local ? 0 : fam.rowwise * L * tokens * d * 4));
      CHECK(r.at("tp_backward_bytes").as_number() == (local ? 0 : fam.colwise * L * tokens * d * 4));
      if (!local) CHECK(r.at("losses_max_rel_diff").as_number() <= 1e-4);
    }
  }
}

TEST_CASE("usage errors: one line on stderr, exit code 2", "[bench][errors]") {
  struct Case {
    std::vector<std::string> args;
    const char* says;
    std::vector<std::string> env = {};  // launcher variables
  };
  const std::vector<Case> cases = {
      {{"--bogus"}, "--bogus"},
      {{"--heads", "5"}, "does not divide"},
      {{"--policy", "type=Blok"}, "matched no module ('type=Blok'): the root unit would hold"},
      {{"--policy", "type=Block;sise>=1e7"}, "column 12"},
      {{"--policy", "foo"}, "unknown plan 'foo'"},
      {{"--policy", "leef"}, "unknown plan 'leef' (names: local, leaf, layer, every-K, model, "
                             "noshard) (did you mean 'leaf'?)"},
      {{"--policy", "every-0"}, "every-K"},
      {{"--world", "0"}, "--world must be >= 1, got 0"},
      {{"--polcy", "layer"}, "unknown option --polcy (did you mean --policy?)"},
      {{"--granularity", "layer", "--granularity=leaf", "--polcy", "x"},
       "did you mean --policy?"},  // old names renamed first, then the typo
      {{"--world", "2", "--nproc", "2"}, "--world is given twice: once as --world and once as "
                                         "--nproc, its old name"},
      {{"--preset", "huge"}, "huge"},
      {{"--steps", "0"}, "--steps must be >= 1, got 0"},
      {{"--optimizer", "sgd"}, "sgd"},
      {{"--init", "lazy"}, "lazy"},
      {{"--offload-step", "backward", "--offload", "1"}, "add --optimizer fused"},
      {{"--offload-step", "backward", "--optimizer", "fused", "--param-dtype", "fp16"},
       "cannot run with --offload-step backward"},
      {{"--kernel-profile", "0", "--device", "cuda"}, "--kernel-profile must be >= 1, got 0"},
      {{"--kernel-profile", "1"}, "needs --device cuda"},
      {{"--sync-debug"}, "--sync-debug watches CUDA synchronisation: it needs --device cuda"},
      // Note [CUDA graph step]: CUDA only, and not with what a capture cannot replay.
      {{"--cuda-graph"}, "--cuda-graph captures CUDA work: it needs --device cuda"},
      {{"--cuda-graph", "--device", "cuda", "--offload", "0,1"}, "cannot run with --offload 1"},
      {{"--cuda-graph", "--device", "cuda", "--recompute"}, "cannot run with --recompute"},
      {{"--cuda-graph", "--device", "cuda", "--param-groups"}, "cannot run with --param-groups"},
      {{"--cuda-graph", "--device", "cuda", "--param-dtype", "fp16"},
       "cannot run with --param-dtype fp16"},
      // Without the CUDA path (e.g. the sanitizer builds) the flag itself is refused.
      {{"--device", "cuda", "--world", "4096"}, FLATSHARD_WITH_CUDA ? "GPU" : "has no CUDA"},
      {{"--json", "/nonexistent-dir/x.json"}, "/nonexistent-dir/x.json"},
      {{"--world", "3", "--tp", "2"}, "--world 3 is not a multiple of --tp 2"},
      {{"--tp-plan", "colwise:path=*.mlp.fc"}, "add --tp N"},
      {{"--tp", "2", "--tp-plan", "colwise:pth=x"}, "--tp-plan: tp plan:"},
      {{"--tp", "2", "--tp-plan", "rowwise:path=*.nothing"}, "matches no module"},
      {{"--tp", "3", "--world", "3"}, "tp 3"},  // 4 heads
      {{"--tp", "2", "--world", "4", "--write-profile", "/tmp/x.json"}, "without --tp 2"},
      // Launcher variables, parsed by the library (collectives/launch_env.h), name the variable.
      {{}, "RANK='abc' is not an integer", {"RANK=abc", "WORLD_SIZE=2", "LOCAL_RANK=0"}},
      {{}, "RANK=2 is out of range [0, 1]", {"RANK=2", "WORLD_SIZE=2", "LOCAL_RANK=0"}},
      {{}, "SLURM_NTASKS is not set", {"SLURM_PROCID=0", "SLURM_LOCALID=0"}},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"--preset", "tiny"};  // every case fails before running
    args.insert(args.end(), c.args.begin(), c.args.end());
    const Outcome o = run_bench(args, c.env);
    CAPTURE(c.args, c.env, o.out, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.out.empty());
    CHECK(o.err.rfind("flatshard-bench: error: ", 0) == 0);
    CHECK(std::count(o.err.begin(), o.err.end(), '\n') == 1);
    CHECK(o.err.find(c.says) != std::string::npos);
  }
}

TEST_CASE("launcher variables: a usage error is shown whatever RANK says", "[bench][errors]") {
  // Launched ranks all fail on a bad flag, and each says why (issue 36: with RANK=1 set by hand,
  // a silent exit 2 explained nothing).
  const Outcome r1 = run_bench({"--preset", "tiny", "--steps", "0"},
                               {"RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1"});
  CHECK(r1.exit_code == 2);
  CHECK(r1.err.find("--steps must be >= 1, got 0") != std::string::npos);
  const Outcome r0 = run_bench({"--preset", "tiny", "--steps", "0"},
                               {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0"});
  CHECK(r0.exit_code == 2);
  CHECK(r0.err.find("--steps must be >= 1, got 0") != std::string::npos);
}

TEST_CASE("kernel profile summary: unions, overlap, categories against hand-computed values",
          "[bench][kernel_profile]") {
  using flatshard::profiling::KernelRecord;
  const uint64_t ms = 1000000;
  // Two identical steps; per step: a GEMM [0,10) and an elementwise kernel [12,14) on the compute
  // stream, an NCCL all-gather [5,20) on another stream, a memset [25,26).
  std::vector<KernelRecord> recs;
  for (uint64_t base : {uint64_t{0}, 100 * ms}) {
    recs.push_back({"nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", 7, base, base + 10 * ms});
    recs.push_back({"ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 13,
                    base + 5 * ms, base + 20 * ms});
    recs.push_back({"void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>", 7,
                    base + 12 * ms, base + 14 * ms});
    recs.push_back({"Memset (Device)", 7, base + 25 * ms, base + 26 * ms});
  }
  const auto p = flatshard::profiling::summarize_kernels(recs, 2, /*top_n=*/3);
  CHECK(p.steps == 2);
  CHECK(p.span_ms == Approx(126.0 / 2));  // first start 0, last end 126
  CHECK(p.busy_ms == Approx(21.0));       // [0,20) + [25,26)
  CHECK(p.comm_ms == Approx(15.0));
  CHECK(p.compute_ms == Approx(13.0));    // 10 + 2 + 1
  CHECK(p.overlap_ms == Approx(7.0));     // [5,10) + [12,14)
  REQUIRE(p.categories.size() == 4);
  CHECK(p.categories[0].name == "nccl");
  CHECK(p.categories[0].ms == Approx(15.0));
  CHECK(p.categories[0].count == Approx(1.0));
  CHECK(p.categories[1].name == "gemm");
  CHECK(p.categories[2].name == "elementwise");
  CHECK(p.categories[3].name == "memcpy/memset");
  CHECK(p.categories[3].ms == Approx(1.0));
  REQUIRE(p.kernels.size() == 3);  // top_n cuts the fourth
  CHECK(p.kernels[1].name.rfind("nvjet", 0) == 0);
  REQUIRE(p.streams.size() == 2);
  CHECK(p.streams[0].name == "stream 13");  // [5,20): 15 ms, busier than stream 7's 13 ms
  CHECK(p.streams[0].ms == Approx(15.0));
  CHECK(p.streams[1].ms == Approx(13.0));
  CHECK(p.streams[1].count == Approx(3.0));

  using flatshard::profiling::kernel_category;
  CHECK(kernel_category("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>") ==
        "attention");
  CHECK(kernel_category("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel") ==
        "norm/reduce");
  CHECK(kernel_category("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") ==
        "optimizer");
  CHECK(kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm");
  CHECK(kernel_category("Memcpy DtoD (Device -> Device)") == "memcpy/memset");
  CHECK(kernel_category("some_custom_kernel") == "other");
  CHECK(flatshard::profiling::summarize_kernels({}, 1).busy_ms == 0);
  CHECK_THROWS_WITH(flatshard::profiling::summarize_kernels(recs, 0),
                    Catch::Contains("steps must be >= 1, got 0"));
}

TEST_CASE("the check covers the steps: losses after the optimizer vs an unsharded reference",
          "[bench][check]") {
  // Before: only the step-0 loss was compared, computed before any reduction or optimizer step.
  // Now every sharded run's losses after 1..N optimizer steps are compared with an fp32
  // unsharded model trained on the mean loss of every rank's batch (the ranks' averaged
  // gradients); on CPU fp32 with 2 ranks they are bitwise equal.
  const std::string json = scratch("steps.json");
  const Outcome o = run_bench({"--preset", "tiny", "--policy", "local,leaf,layer,noshard",
                               "--steps", "2", "--warmup", "1", "--json", json});
  CAPTURE(o.out, o.err);
  REQUIRE(o.exit_code == 0);
  CHECK(o.out.find("the losses after 1..2 optimizer steps (reduction + optimizer) of 3 runs vs "
                   "an unsharded fp32 reference trained on every rank's batch, within 0.0001 "
                   "relative (largest difference 0: bitwise equal; local runs: step 0 only): "
                   "all ok") != std::string::npos);
  const JsonFile report(json);
  CHECK(report.root.at("check_steps_tolerance").as_number() == 1e-4);
  CHECK(run_named(report.root, "local").at("losses_max_rel_diff").is_null());
  for (const char* name : {"leaf", "layer", "noshard"})
    CHECK(run_named(report.root, name).at("losses_max_rel_diff").as_number() == 0.0);
}

TEST_CASE("the check fails a run whose losses leave the reference after step 0",
          "[bench][check]") {
  // A sharded run right at step 0 but wrong after its first update (a broken reduction or
  // optimizer step) fails; local's own trajectory is not compared (its replicas train alone).
  namespace fb = flatshard::bench;
  fb::BenchOptions o;
  o.model = flatshard::models::ModelConfig::preset("gpt", "tiny");
  o.batch = 2;
  o.steps = 2;
  auto run = [](const std::string& label, std::vector<double> losses) {
    fb::RunResult r;
    r.granularity = label;
    r.step_ms = {1.0, 1.0};
    r.loss_step0 = losses[0];
    r.losses = std::move(losses);
    return r;
  };
  const std::vector<double> reference = {6.0, 5.5, 5.0};
  const fb::Report rep = fb::make_report(
      o, 2, "cpu", {},
      {run("local", {6.0, 5.9, 5.8}), run("layer", {6.0, 5.5, 5.0}),
       run("leaf", {6.0, 5.5 * (1 + 2e-4), 5.0})},
      reference);
  REQUIRE(rep.rows.size() == 3);
  CHECK(rep.rows[0].ok);
  CHECK_FALSE(rep.rows[0].steps_max_rel.has_value());
  CHECK(rep.rows[1].ok);
  CHECK(*rep.rows[1].steps_max_rel == 0.0);
  CHECK_FALSE(rep.rows[2].ok);
  CHECK(*rep.rows[2].steps_max_rel == Approx(2e-4));
  CHECK_FALSE(rep.all_ok());
}

TEST_CASE("--fp8: the layers run fp8 matmuls, the unsharded reference too; the check holds",
          "[bench]") {
  // models/fp8_linear.h on CPU ranks, with fp8 gathers: local and layer agree at step 0 and the
  // steps stay on the unsharded fp8 reference (benchmarks/bench_report.h's low-precision bar).
  const std::string json = scratch("fp8.json");
  const Outcome o = run_bench({"--preset", "tiny", "--nproc", "2", "--steps", "2", "--warmup",
                               "1", "--granularity", "local,layer", "--gather-dtype", "fp8",
                               "--fp8", "--json", json});
  INFO("stdout:\n" << o.out << "\nstderr:\n" << o.err);
  REQUIRE(o.exit_code == 0);
  CHECK(o.out.find("params fp32, fp8 matmuls, reduce fp32") != std::string::npos);
  const JsonFile report(json);
  CHECK(report.root.at("all_ok").as_bool());
  // The recipe is on: the step-0 loss differs from the same run without --fp8.
  const std::string plain_json = scratch("fp8_off.json");
  const Outcome plain = run_bench({"--preset", "tiny", "--nproc", "2", "--steps", "2", "--warmup",
                                   "1", "--granularity", "local", "--gather-dtype", "fp8",
                                   "--json", plain_json});
  REQUIRE(plain.exit_code == 0);
  const JsonFile off(plain_json);
  const double a = run_named(report.root, "local").at("loss_step0").as_number();
  const double b = run_named(off.root, "local").at("loss_step0").as_number();
  CHECK(std::abs(a - b) > 1e-5);
}
