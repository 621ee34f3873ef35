// explain and the advisor in linear time (issue 36): time budgets at 4096 / 8192 layers, the
// doubling ratio (a super-linear regression fails it), --world independence (explain looped over
// every rank: 51 s at 10^9), and flatshard-explain's command-line rules for --suggest,
// --memory-limit, --prefetch-depths and --offload-levels, run as a child process.
//
// The timed model is a GPT-shaped tree built here on meta (an Embedding, N blocks of LayerNorm +
// two Linear, a head): what is timed is make_plan + explain + to_string and suggest, not the
// model families' construction (models/), which has its own cost.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/meta_init.h"
#include "models/family.h"
#include "planner/advisor.h"
#include "planner/explain.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

#ifndef FLATSHARD_EXPLAIN_EXE
#error "FLATSHARD_EXPLAIN_EXE must be defined by CMake"
#endif

using namespace flatshard;

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", torch::nn::Linear(d, 4 * d));
    proj = register_module("proj", torch::nn::Linear(4 * d, d));
  }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(Block);

struct TowerImpl : torch::nn::Module {
  TowerImpl(int64_t layers, int64_t d, int64_t vocab) {
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(Block(d));
    lm_head = register_module("lm_head", torch::nn::Linear(d, vocab));
  }
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(Tower);

Tower meta_tower(int64_t layers) {
  MetaInit meta;
  return Tower(layers, 64, 512);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// make_plan + explain + to_string; the best of three runs (other tests share the cores).
double time_explain_once(const Tower& model, int world) {
  const auto t0 = std::chrono::steady_clock::now();
  const Plan plan = make_plan(*model, parse_policy("type=Block"));
  const Explanation e = explain(*model, plan, MeshShape(world, 1), ShardingOptions{});
  const std::string text = e.to_string();
  REQUIRE(text.size() > 0);
  return seconds_since(t0);
}

double time_explain(const Tower& model, int world) {
  double best = 1e30;
  for (int i = 0; i < 3; ++i) best = std::min(best, time_explain_once(model, world));
  return best;
}

// suggest() for `layers` layers; the best of three runs, as time_explain (a fresh-clone CI run
// saw 0.55 s at 2048 layers and 1.75 s at 4096 with other tests on both cores: 3.2x, noise).
double time_suggest_once(const Tower& model, int64_t layers) {
  AdvisorOptions a;
  a.memory_limit_bytes = int64_t{1} << 30;
  a.workload = {1, 32};
  a.shape = models::ModelConfig::preset("gpt", "tiny").transformer_shape();
  a.shape.n_layers = layers;
  a.shape.layer_type = "Block";
  a.shape.leaf_types = "Linear|LayerNorm|Embedding";
  const auto t0 = std::chrono::steady_clock::now();
  const Advice advice = suggest(*model, 2, 1, ShardingOptions{}, a);
  REQUIRE(advice.to_string().size() > 0);
  return seconds_since(t0);
}

double time_suggest(const Tower& model, int64_t layers) {
  double best = 1e30;
  for (int i = 0; i < 3; ++i) best = std::min(best, time_suggest_once(model, layers));
  return best;
}

// The child's exit status, stdout and stderr.
struct Outcome {
  int exit_code = -1;
  std::string out, err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Outcome explain_cli(const std::vector<std::string>& args) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/flatshard_explain_scaling_XXXXXX";
  REQUIRE(::mkdtemp(dir.data()) != nullptr);
  std::string cmd = "timeout -k 5 120 " + quote(FLATSHARD_EXPLAIN_EXE);
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " >" + quote(dir + "/out") + " 2>" + quote(dir + "/err") + " </dev/null";
  const int status = std::system(cmd.c_str());
  Outcome o;
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  o.out = slurp(dir + "/out");
  o.err = slurp(dir + "/err");
  (void)std::system(("rm -rf " + quote(dir)).c_str());
  return o;
}

std::vector<std::string> tiny(std::vector<std::string> more) {
  std::vector<std::string> a = {"--preset", "tiny", "--world", "2"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

}  // namespace

TEST_CASE("explain is linear in layers", "[explain][scaling][issue36]") {
  const Tower small = meta_tower(2048), big = meta_tower(8192);
  (void)time_explain(small, 8);  // warm up (allocator, type names)
  // Four times the layers, at most 10x the time: a quadratic walk gives 16x; this one measures
  // 5-7x on an idle 2-core machine (allocation and cache effects grow with the model: a 2x
  // ratio under a 3x bound measured 2.4-2.9x and flaked under load at 3.06x). A pair measured
  // under a load spike is measured again, up to 3 times: a quadratic walk fails every pair.
  double t2k = 0, t8k = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    t2k = time_explain(small, 8);
    t8k = time_explain(big, 8);
    if (t8k <= 10.0 * t2k + 0.05) break;
  }
  INFO("make_plan + explain + to_string: 2048 layers " << t2k << " s, 8192 layers " << t8k
                                                       << " s");
  CHECK(t8k < 10.0);
  CHECK(t8k <= 10.0 * t2k + 0.05);
}

TEST_CASE("explain's time does not depend on the world size", "[explain][scaling][issue36]") {
  const Tower model = meta_tower(1024);
  const double t8 = time_explain(model, 8);
  const double tbig = time_explain(model, 1000000000);
  INFO("1024 layers: world 8 " << t8 << " s, world 1e9 " << tbig << " s");
  CHECK(tbig < t8 + 2.0);
  // Same numbers as before the change: the largest trainable shard is the whole shard.
  const Plan plan = make_plan(*model, parse_policy("type=Block"));
  const Explanation e = explain(*model, plan, MeshShape(1000000000, 1), ShardingOptions{});
  for (const auto& u : e.units) REQUIRE(u.trainable_master_bytes == u.master_bytes);
}

TEST_CASE("the largest trainable shard matches a per-rank count", "[explain][issue36]") {
  // A unit with a frozen parameter in the middle: the per-rank maximum differs from the shard.
  Tower model = meta_tower(2);
  model->blocks[0]->as<BlockImpl>()->fc->weight.set_requires_grad(false);
  const Plan plan = make_plan(*model, parse_policy("type=Block"));
  for (int world : {1, 2, 3, 5, 8, 64, 1000}) {
    const Explanation e = explain(*model, plan, MeshShape(world, 1), ShardingOptions{});
    const UnitExplanation& u = e.units[1];  // blocks.0: ln.weight, ln.bias, fc.weight (frozen)...
    // The reference: every rank's count, as explain did before.
    int64_t best = 0;
    const int64_t d = 64, align = 8;
    std::vector<std::pair<int64_t, int64_t>> ranges;  // [offset, end) of trainable params
    std::vector<std::pair<int64_t, bool>> params = {
        {d, true}, {d, true}, {4 * d * d, false}, {4 * d, true}, {4 * d * d, true}, {d, true}};
    int64_t off = 0;
    for (const auto& [numel, trains] : params) {
      if (trains) ranges.emplace_back(off, off + numel);
      off = (off + numel + align - 1) / align * align;
    }
    for (int r = 0; r < world; ++r) {
      const int64_t lo = r * u.shard_numel, hi = (r + 1) * u.shard_numel;
      int64_t n = 0;
      for (const auto& [b, en] : ranges) n += std::max<int64_t>(0, std::min(hi, en) - std::max(lo, b));
      best = std::max(best, n);
    }
    CAPTURE(world, u.shard_numel);
    CHECK(u.trainable_master_bytes == best * 4);
  }
}

// The cost model's walks were O(units x layers) (CostWalk summed "every unit before q" and
// "every layer anchored before q" per unit: 3.0x the time for 2x the layers); prefix sums now.
TEST_CASE("suggest is linear in layers", "[advisor][scaling][issue36]") {
  const Tower small = meta_tower(1024), big = meta_tower(4096);
  (void)time_suggest_once(small, 1024);
  // 4x the layers: quadratic 16x, measured 6.4-7.1x idle; the bound sits between, and a pair
  // measured under load is measured again (as above: a fresh-clone CI run beside a compile saw
  // 0.14 s and 4.1 s, 29x, where the same binary alone measures 0.14 s and 0.94 s).
  double t1k = 0, t4k = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    t1k = time_suggest(small, 1024);
    t4k = time_suggest(big, 4096);
    if (t4k <= 10.0 * t1k + 0.05) break;
  }
  INFO("suggest: 1024 layers " << t1k << " s, 4096 layers " << t4k << " s");
  CHECK(t4k < 10.0);
  CHECK(t4k <= 10.0 * t1k + 0.05);
}

TEST_CASE("flatshard-explain --suggest exits 1 when no candidate fits", "[cli][issue36]") {
  const Outcome o = explain_cli(tiny({"--suggest", "--memory-limit", "1KiB"}));
  CAPTURE(o.out, o.err);
  CHECK(o.exit_code == 1);
  CHECK(o.out.find("no candidate fits") != std::string::npos);
  CHECK(o.err.find("no candidate plan fits the memory limit of 1024 bytes") != std::string::npos);
  const Outcome ok = explain_cli(tiny({"--suggest", "--memory-limit", "1GiB"}));
  CAPTURE(ok.out, ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(ok.out.find("suggested: ") != std::string::npos);
}

TEST_CASE("flatshard-explain --memory-limit: decimal digits, whole bytes, at most int64",
          "[cli][issue36]") {
  struct Case {
    std::string text, message;
  };
  for (const Case& c : std::vector<Case>{
           {"0x10GiB", "'0x10GiB' is not a size such as 40GiB (decimal digits only: hexadecimal"},
           {"0X10", "'0X10' is not a size such as 40GiB (decimal digits only: hexadecimal"},
           {"0.5", "'0.5' is below 1 byte"},
           {"1.3", "'1.3' is not a whole number of bytes"},
           {"0", "'0' is below 1 byte"},
           {"0.0001KB", "'0.0001KB' is below 1 byte"},
           {"8EiB", "'8EiB' is too large: at most 9223372036854775807 bytes"},
           {"9223372036854775808", "is too large: at most 9223372036854775807 bytes"},
           {"inf", "is not a size such as 40GiB"},
           {"-1GiB", "is not a size such as 40GiB"},
           {"40XB", "'40XB' is not a size"},
           // A bare number: a unit is required (40 meant 40 GiB, it was read as 40 bytes).
           {"40", "'40' has no unit: write 40GiB (binary), 40GB (decimal), or 40B"},
           {"1e3", "'1e3' has no unit"}}) {
    const Outcome o = explain_cli(tiny({"--memory-limit", c.text}));
    CAPTURE(c.text, o.out, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.find(c.message) != std::string::npos);
  }
  struct Good {
    std::string text, shown;
  };
  for (const Good& g : std::vector<Good>{{"1.5KiB", "limit 1.5 KiB"},
                                         {"9223372036854775807B", "limit "},
                                         {"0.5KiB", "limit 512 B"},
                                         {"1e3B", "limit 1000 B"},
                                         {"2GB", "limit "}}) {
    const Outcome o = explain_cli(tiny({"--memory-limit", g.text}));
    CAPTURE(g.text, o.out, o.err);
    CHECK(o.exit_code == 0);
    CHECK(o.out.find(g.shown) != std::string::npos);
  }
}

TEST_CASE("flatshard-explain --prefetch-depths / --offload-levels: no empty item, no repeat",
          "[cli][issue36]") {
  struct Case {
    std::string flag, value, message;
  };
  for (const Case& c : std::vector<Case>{
           {"--prefetch-depths", "1,1,1,1", "1 is given twice in '1,1,1,1'"},
           {"--prefetch-depths", "1,,2", "empty item in '1,,2'"},
           {"--prefetch-depths", "1,", "empty item"},
           {"--prefetch-depths", "65", "'65' is not an integer in [0, 64]"},
           {"--prefetch-depths", "1.5", "'1.5' is not an integer"},
           {"--offload-levels", "0,0", "0 is given twice in '0,0'"},
           {"--offload-levels", ",1", "empty item"},
           {"--offload-levels", "3", "'3' is not an integer in [0, 2]"}}) {
    const Outcome o =
        explain_cli(tiny({"--suggest", "--memory-limit", "1GiB", c.flag, c.value}));
    CAPTURE(c.flag, c.value, o.out, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.find(c.message) != std::string::npos);
  }
  const Outcome ok = explain_cli(
      tiny({"--suggest", "--memory-limit", "1GiB", "--prefetch-depths", "2,1", "--offload-levels",
            "0,1"}));
  CAPTURE(ok.out, ok.err);
  CHECK(ok.exit_code == 0);
}

TEST_CASE("flatshard-explain: the cost constants have physical bounds", "[cli][issue36]") {
  // --collective-latency-us 1e308 printed a 300-digit latency share; now a usage error.
  const Outcome huge = explain_cli(tiny({"--collective-latency-us", "1e308"}));
  CAPTURE(huge.out, huge.err);
  CHECK(huge.exit_code == 2);
  CHECK(huge.err.find("--collective-latency-us") != std::string::npos);
  CHECK(huge.err.find("<= 1e+06") != std::string::npos);
  const Outcome step = explain_cli(tiny({"--reference-step-ms", "1e300"}));
  CAPTURE(step.out, step.err);
  CHECK(step.exit_code == 2);
  const Outcome ok = explain_cli(tiny({"--collective-latency-us", "80"}));
  CAPTURE(ok.out, ok.err);
  CHECK(ok.exit_code == 0);
}
