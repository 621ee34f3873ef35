// One naming for Hugging Face models (issue 49): the policy flatshard-explain --weights prints
// for a directory (Hugging Face names: path=model.layers.[0-9], type=LlamaDecoderLayer) works
// unchanged on the model models::hf_config(dir).build() makes, whose own names are layers.N /
// DecoderLayer (Note [Module aliases], wrap_policies/match.h; models/hf_config.h:
// hf_module_alias). The directories are written by transformers from PyPI (the venv's python).
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "fsdp/meta_init.h"
#include "fsdp/resolve.h"
#include "fsdp/sharded_model.h"
#include "models/family.h"
#include "models/hf.h"
#include "models/hf_config.h"
#include "models/llama.h"
#include "temp_dir.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

#ifndef FLATSHARD_PYTHON_EXE
#error "FLATSHARD_PYTHON_EXE (the venv's python) must be defined by CMake"
#endif
#ifndef FLATSHARD_EXPLAIN_EXE
#error "FLATSHARD_EXPLAIN_EXE must be defined by CMake"
#endif

namespace {

using namespace flatshard;
namespace fm = flatshard::models;
using Strings = std::vector<std::string>;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Tiny random models of three architectures, saved by transformers' save_pretrained: 2 layers.
const std::string& hf_dirs() {
  static flatshard_test::TempDir tmp;
  static const bool written = [] {
    const std::string script = tmp / "write.py";
    std::ofstream(script) << R"(import sys
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)
common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
for name, cls, cfg in [("llama", LlamaForCausalLM, LlamaConfig(**common)),
                       ("mistral", MistralForCausalLM, MistralConfig(**common)),
                       ("qwen2", Qwen2ForCausalLM, Qwen2Config(**common, tie_word_embeddings=True))]:
    cls(cfg).save_pretrained(sys.argv[1] + "/" + name, safe_serialization=True)
)";
    const std::string cmd = std::string(FLATSHARD_PYTHON_EXE) + " -W ignore " + script + " " +
                            tmp.path() + " > " + (tmp / "log.txt") + " 2>&1";
    const int rc = std::system(cmd.c_str());
    INFO("write.py:\n" << read_file(tmp / "log.txt")
                       << "\n(transformers missing? tools/setup_deps.sh installs it)");
    REQUIRE(rc == 0);
    return true;
  }();
  (void)written;
  return tmp.path();
}

// The spec on flatshard-explain's "policy: SPEC (note)" line.
std::string explain_policy(const std::string& dir, const Strings& extra) {
  static int n = 0;
  const std::string out = hf_dirs() + "/explain" + std::to_string(n++) + ".txt";
  std::string cmd = std::string(FLATSHARD_EXPLAIN_EXE) + " --world 2 --weights " + dir;
  for (const auto& a : extra) cmd += " " + a;
  cmd += " > " + out + " 2>&1";
  const int status = std::system(cmd.c_str());
  const std::string text = read_file(out);
  INFO(cmd << "\n" << text);
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  const size_t at = text.find("policy: ");
  REQUIRE(at != std::string::npos);
  const size_t start = at + 8;
  return text.substr(start, text.find_first_of(" \n", start) - start);
}

struct WarningCollector : c10::WarningHandler {
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  std::vector<std::string> messages;
};

Strings unit_names(const Plan& p) {
  Strings s;
  for (const auto& u : p.units) s.push_back(u.name);
  return s;
}

}  // namespace

TEST_CASE("hf: the policy flatshard-explain --weights prints shards hf_config(dir).build() "
          "per layer, without a warning",
          "[hf][python][policy]") {
  // Before: the printed names (path=model.layers.[0-9], type=LlamaDecoderLayer) matched no
  // module of the C++ model: one root unit and a warning.
  for (const char* arch : {"llama", "mistral", "qwen2"}) {
    const std::string dir = hf_dirs() + "/" + arch;
    const fm::ModelConfig cfg = fm::hf_config(dir);
    REQUIRE(cfg.n_layers() == 2);
    for (const Strings& flags : {Strings{}, Strings{"--policy", "layer"},
                                 Strings{"--policy", "leaf"}}) {
      const std::string spec = explain_policy(dir, flags);
      CAPTURE(arch, flags, spec);
      const bool leaf = flags.size() == 2 && flags[1] == "leaf";
      if (flags.empty()) CHECK(spec.find("model.layers.") != std::string::npos);
      if (!flags.empty() && !leaf) CHECK(spec.find("DecoderLayer") != std::string::npos);
      run_ranks(1, [&](Communicator& comm) {
        WarningCollector collector;
        c10::WarningUtils::WarningHandlerGuard guard(&collector);
        auto model = cfg.build(0);  // tiny: built eagerly
        auto fsdp = fully_shard(model, parse_policy(spec), comm);
        CHECK(collector.messages.empty());
        if (leaf) {
          // Every Linear, RMSNorm and Embedding: embed_tokens, 9 per layer, norm, lm_head.
          CHECK(fsdp->plan().matched_modules == 3 + 9 * 2);
        } else {
          CHECK(unit_names(fsdp->plan()) == Strings{"<root>", "layers.0", "layers.1"});
        }
      });
    }
  }
}

TEST_CASE("hf: the LLaMA family answers to its Hugging Face names in policies", "[hf][policy]") {
  auto cfg = fm::ModelConfig::preset("llama", "tiny");
  cfg.n_layers() = 3;
  std::shared_ptr<torch::nn::Module> model;
  {
    MetaInit meta;
    model = cfg.build(0);
  }
  const Strings layers{"<root>", "layers.0", "layers.1", "layers.2"};
  for (const std::string spec : {"type=DecoderLayer", "type=LlamaDecoderLayer",
                                 "path=model.layers.[0-9]", "path=layers.[0-9]",
                                 "path=model.layers.*,type=DecoderLayer"}) {
    CAPTURE(spec);
    const Plan p = make_plan(*model, parse_policy(spec));
    CHECK(unit_names(p) == layers);
    CHECK(p.unmatched_warning().empty());
  }
  // Inside a layer, and the leaves: transformers' names of each module.
  CHECK(make_plan(*model, parse_policy("path=model.layers.1.self_attn.q_proj")).units.at(1).name ==
        "layers.1.attn.q");
  CHECK(make_plan(*model, parse_policy("type=LlamaAttention")).units.size() == 1 + 3);
  CHECK(make_plan(*model, parse_policy("type=LlamaMLP")).units.size() == 1 + 3);
  // Per layer 2 norms, plus the final one; input_layernorm is input_norm.
  CHECK(make_plan(*model, parse_policy("type=LlamaRMSNorm")).units.size() == 1 + 2 * 3 + 1);
  CHECK(make_plan(*model, parse_policy("path=*.input_layernorm")).units.at(1).name ==
        "layers.0.input_norm");
  CHECK(make_plan(*model, parse_policy("path=model.embed_tokens")).units.at(1).name ==
        "embed_tokens");
  // The prefix is the config's architecture's.
  auto mistral = cfg;
  mistral.as<llama::LlamaConfig>().architecture = llama::LlamaConfig::Architecture::kMistral;
  const auto m = mistral.build(0);
  CHECK(unit_names(make_plan(*m, parse_policy("type=MistralDecoderLayer"))) == layers);
  CHECK(make_plan(*m, parse_policy("type=LlamaDecoderLayer")).matched_modules == 0);
  // rope holds no parameter and is no module of a checkpoint: no alias.
  CHECK_FALSE(fm::hf_module_alias(cfg.as<llama::LlamaConfig>(), "rope").path.has_value());
  CHECK(fm::hf_module_alias(cfg.as<llama::LlamaConfig>(), "").type == "LlamaForCausalLM");
  // The recompute check of the root reads the same names (one home for matching): recompute
  // on the root's Hugging Face type would silently recompute nothing.
  const Policy root = parse_policy("recompute:type=LlamaForCausalLM");
  CHECK_THROWS_WITH(check_recompute_policy(root, *model, make_plan(*model, root)),
                    Catch::Contains("unit '<root>'") &&
                        Catch::Contains("recompute:type=LlamaForCausalLM"));
}
