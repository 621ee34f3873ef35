// Hugging Face checkpoints against transformers itself (issue 32): tests/hf_reference.py writes
// small random Llama-2-style, Llama-3.1-style (llama3 RoPE scaling, a sequence past the original
// context, an explicit head_dim), Qwen2-style (q/k/v biases, tied embeddings) and Mistral-style
// (a sliding window shorter than the sequence) models with transformers from PyPI, and their
// fp32 logits. Each directory is read with models::hf_config + models::hf_loader into a
// meta-built model, sharded per layer at world 1 and 2 on CPU ranks, and its logits must agree
// with transformers' to 1e-4. Bad configs are one clear error each.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "models/hf.h"
#include "models/hf_config.h"
#include "models/llama.h"
#include "temp_dir.h"
#include "wrap_policies/spec.h"

#ifndef FLATSHARD_PYTHON_EXE
#error "FLATSHARD_PYTHON_EXE (the venv's python) must be defined by CMake"
#endif
#ifndef FLATSHARD_SOURCE_DIR
#error "FLATSHARD_SOURCE_DIR must be defined by CMake"
#endif

namespace {

using flatshard::Communicator;
namespace fm = flatshard::models;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// The reference models, written once per test run.
const std::string& reference_dir() {
  static flatshard_test::TempDir tmp;
  static const bool written = [] {
    const std::string cmd = std::string(FLATSHARD_PYTHON_EXE) + " -W ignore " +
                            FLATSHARD_SOURCE_DIR + "/tests/hf_reference.py " + tmp.path() +
                            " > " + (tmp / "log.txt") + " 2>&1";
    const int rc = std::system(cmd.c_str());
    INFO("hf_reference.py:\n" << read_file(tmp / "log.txt")
                              << "\n(transformers missing? tools/setup_deps.sh installs it)");
    REQUIRE(rc == 0);
    return true;
  }();
  (void)written;
  return tmp.path();
}

at::Tensor read_tensor(const std::string& path, std::vector<int64_t> shape, at::ScalarType dtype) {
  const std::string bytes = read_file(path);
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  REQUIRE(static_cast<size_t>(t.nbytes()) == bytes.size());
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

// transformers' logits and ours for `name`, sharded per layer over `world` CPU ranks.
void check_case(const std::string& name, int world) {
  const std::string dir = reference_dir() + "/" + name;
  std::istringstream dims(read_file(dir + "/seq.txt"));
  int64_t seq = 0, vocab = 0;
  dims >> seq >> vocab;
  const at::Tensor idx = read_tensor(dir + "/idx.bin", {2, seq}, at::kLong);
  const at::Tensor want = read_tensor(dir + "/logits.bin", {2, seq, vocab}, at::kFloat);
  const fm::ModelConfig cfg = fm::hf_config(dir);
  CAPTURE(name, world, cfg.to_string());
  std::vector<at::Tensor> got(static_cast<size_t>(world));
  std::mutex mu;
  flatshard::run_ranks(world, [&](Communicator& comm) {
    std::shared_ptr<torch::nn::Module> model;
    {
      flatshard::MetaInit meta;
      model = cfg.build(/*seed=*/0);
    }
    flatshard::ShardingOptions options;
    options.load = fm::hf_loader(dir, cfg);
    auto fsdp = flatshard::fully_shard(model, flatshard::parse_policy("type=DecoderLayer"), comm,
                                       options);
    auto* llama = dynamic_cast<flatshard::llama::LlamaImpl*>(model.get());
    REQUIRE(llama != nullptr);
    at::NoGradGuard no_grad;
    const at::Tensor logits = flatshard::enter(model, [&] { return llama->forward(idx); });
    std::lock_guard<std::mutex> lock(mu);
    got[static_cast<size_t>(comm.rank())] = logits.clone();
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const double err = (got[r] - want).abs().max().item<double>();
    CAPTURE(err);
    CHECK(err < 1e-4);
  }
}

}  // namespace

TEST_CASE("hf: four architectures load and match transformers' logits at world 1 and 2",
          "[hf][python]") {
  for (const char* name : {"llama2", "llama31", "qwen2", "mistral"})
    for (int world : {1, 2}) check_case(name, world);
}

TEST_CASE("hf: configs carry what the models need", "[hf][python]") {
  const std::string dir = reference_dir();
  const auto l31 = fm::hf_config(dir + "/llama31").as<flatshard::llama::LlamaConfig>();
  CHECK(l31.head_dim() == 24);
  CHECK(l31.rope_scaling.type == flatshard::llama::RopeScaling::Type::kLlama3);
  CHECK(l31.rope_scaling.original_max_position_embeddings == 16);
  CHECK(l31.rope_theta == 500000.0);
  const auto q = fm::hf_config(dir + "/qwen2").as<flatshard::llama::LlamaConfig>();
  CHECK(q.attention_bias);
  CHECK(q.tie_embeddings);
  const auto m = fm::hf_config(dir + "/mistral").as<flatshard::llama::LlamaConfig>();
  CHECK(m.sliding_window == 8);
  CHECK_FALSE(m.attention_bias);
  // The parameter count follows head_dim and the biases (transformers' own count: the python
  // side's safetensors file holds exactly these tensors).
  CHECK(fm::ModelConfig::of(q).num_parameters() ==
        128 * 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 64 + 2 * 32) + 64);
}

TEST_CASE("hf: what flatshard cannot express is a clear error naming the field", "[hf]") {
  flatshard_test::TempDir tmp;
  auto config = [&](const std::string& extra) {
    return std::string(R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 128,
      "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2)") +
           extra + "}";
  };
  auto fails = [&](const std::string& extra, const std::string& what) {
    write_file(tmp / "config.json", config(extra));
    CAPTURE(extra);
    CHECK_THROWS_WITH(fm::hf_config(tmp.path()), Catch::Contains(what));
  };
  fails(R"(, "rope_parameters": {"rope_type": "yarn", "factor": 4.0})", "rope type 'yarn'");
  fails(R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})", "rope type 'dynamic'");
  fails(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0})", "low_freq_factor");
  fails(R"(, "hidden_act": "gelu")", "hidden_act 'gelu'");
  fails(R"(, "mlp_bias": true)", "mlp_bias");
  write_file(tmp / "config.json", R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8,
      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "use_sliding_window": true})");
  CHECK_THROWS_WITH(fm::hf_config(tmp.path()), Catch::Contains("use_sliding_window"));
  write_file(tmp / "config.json", R"({"architectures": ["GPT2LMHeadModel"], "n_embd": 8})");
  CHECK_THROWS_WITH(fm::hf_config(tmp.path()), Catch::Contains("not known to flatshard"));
  // The linear scaling divides every inverse frequency (transformers' rule).
  write_file(tmp / "config.json",
             config(R"(, "rope_scaling": {"rope_type": "linear", "factor": 4.0})"));
  const auto lin = fm::hf_config(tmp.path()).as<flatshard::llama::LlamaConfig>();
  const at::Tensor plain = flatshard::llama::rope_inv_freq(16, 10000.0);
  const at::Tensor scaled = flatshard::llama::rope_inv_freq(16, 10000.0, lin.rope_scaling);
  CHECK(at::allclose(scaled * 4.0, plain));
  CHECK_THROWS_WITH(fm::hf_parameter_name("layers.0.attn.rope.weight"),
                    Catch::Contains("layers.0.attn.rope.weight"));
}
