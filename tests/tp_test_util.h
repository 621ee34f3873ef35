// Shared by the tensor-parallel tests (tests/tensor_parallel_test.cpp, tests/tp_vocab_test.cpp):
// the tiny GPT and LLaMA parity specs, a shard x tp run of one spec with each rank's results next
// to its slice of the one-rank reference, the parity checks (fp32 and bf16), and one counted
// step (fsdp and tp counters) for explain's predictions.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/thread_mesh.h"
#include "fsdp/tensor_parallel.h"
#include "models/family.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "parity_util.h"
#include "wrap_policies/spec.h"

namespace flatshard_test {
namespace tp {

using namespace flatshard;


// seq_len and vocab: sequence parallelism needs a length tp divides, loss parallelism a
// vocabulary (tests below: 12 and 98).
inline ParitySpec gpt_spec(int world, int n_heads = 4, int64_t seq_len = 11, int64_t vocab = 97) {
  namespace g = flatshard::gpt;
  ParitySpec s;
  s.world = world;
  s.make_model = [n_heads, seq_len, vocab] {
    g::GPTConfig c;
    c.vocab = vocab;
    c.d_model = 36;  // head_dim 9: odd sizes, every flat parameter padded
    c.n_heads = n_heads;
    c.n_layers = 3;
    c.seq_len = seq_len;
    return std::static_pointer_cast<torch::nn::Module>(g::GPT(c, 11).ptr());
  };
  s.plan = [](torch::nn::Module& m) { return make_plan(m, parse_policy("type=Block")); };
  s.loss = [](const std::shared_ptr<torch::nn::Module>& m, int rank, int step, int micro) {
    auto model = std::static_pointer_cast<g::GPTImpl>(m);
    auto [x, y] = g::synthetic_batch(model->config(), 2, 5, rank, step * 16 + micro);
    return flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
  };
  return s;
}

// `n_kv_heads` below tp: replicated kv heads (Note [Replicated kv heads]).
inline ParitySpec llama_spec(int world, int64_t seq_len = 11, int64_t vocab = 97, bool qwen2 = false,
                      int64_t n_kv_heads = 2, int64_t n_heads = 4, int64_t hidden = 50) {
  namespace ll = flatshard::llama;
  ParitySpec s;
  s.world = world;
  s.make_model = [seq_len, vocab, qwen2, n_kv_heads, n_heads, hidden] {
    ll::LlamaConfig c;
    c.vocab = vocab;
    c.d_model = 10 * n_heads;  // head_dim 10 (RoPE needs it even)
    c.n_heads = n_heads;
    c.n_kv_heads = n_kv_heads;  // grouped-query: 2 is one kv head per tp rank at tp 2
    c.n_layers = 3;
    c.seq_len = seq_len;
    c.hidden = hidden;
    c.attention_bias = qwen2;  // Qwen2: biases on q, k and v
    return std::static_pointer_cast<torch::nn::Module>(ll::Llama(c, 11).ptr());
  };
  s.plan = [](torch::nn::Module& m) { return make_plan(m, parse_policy("type=DecoderLayer")); };
  s.loss = [](const std::shared_ptr<torch::nn::Module>& m, int rank, int step, int micro) {
    auto model = std::static_pointer_cast<ll::LlamaImpl>(m);
    auto [x, y] = ll::synthetic_batch(model->config(), 2, 5, rank, step * 16 + micro);
    return flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
  };
  return s;
}

// One rank's results next to its slice of the reference.
struct RankCheck {
  std::string where;
  std::vector<double> losses;
  std::vector<std::tuple<std::string, at::Tensor, at::Tensor>> grads, params;  // name, got, want
};

inline std::vector<RankCheck> run_tp(const ParitySpec& s, const std::string& tp_plan, int shard, int tp,
                              const ParityRun& ref, int replicate = 1) {
  std::vector<RankCheck> out(replicate * shard * tp);
  std::mutex mu;
  run_mesh(MeshShape(shard, replicate, tp), [&](const Mesh& mesh) {
    auto model = s.make_model();
    apply_freeze(s, *model);
    auto par = parallelize(model, parse_tp_plan(tp_plan), mesh);
    auto fsdp = fully_shard(model, s.plan(*model), mesh, s.options);
    const int data_rank = mesh.coord(MeshDim::kReplicate) * shard + mesh.coord(MeshDim::kShard);
    RankRun r = train_sharded_rank(s, model, *fsdp, data_rank);
    RankCheck c;
    c.where = mesh.describe_rank();
    c.losses = r.losses;
    for (auto& [name, g] : r.grads0) c.grads.emplace_back(name, g, par->local_slice(name, ref.grads.at(name)));
    for (auto& [name, p] : r.params) c.params.emplace_back(name, p, par->local_slice(name, ref.params.at(name)));
    std::lock_guard<std::mutex> lock(mu);
    out[mesh.global_rank()] = std::move(c);
  });
  return out;
}

inline void require_tp_parity(const ParityRun& ref, const std::vector<RankCheck>& ranks) {
  // The mean over every rank is the mean over the data-parallel ranks (a tp group's ranks
  // share a batch); the reference's loss is the mean over their union.
  std::vector<double> mean(ref.losses.size(), 0.0);
  for (const RankCheck& c : ranks) {
    REQUIRE(c.losses.size() == ref.losses.size());
    for (size_t i = 0; i < mean.size(); ++i) mean[i] += c.losses[i] / ranks.size();
  }
  // Step 0: the same parameters and data, only the summation order differs.
  CHECK(std::abs(mean[0] - ref.losses[0]) <= 1e-5 * (1 + std::abs(ref.losses[0])));
  for (size_t i = 1; i < mean.size(); ++i)
    CHECK(std::abs(mean[i] - ref.losses[i]) <= 1e-4 * (1 + std::abs(ref.losses[i])));
  for (const RankCheck& c : ranks) {
    CAPTURE(c.where);
    REQUIRE(c.grads.size() == ref.grads.size());
    for (const auto& [name, got, want] : c.grads) {
      CAPTURE(name);
      REQUIRE(got.sizes() == want.sizes());
      CAPTURE((got - want).abs().max().item<double>());
      CHECK(at::allclose(got, want, /*rtol=*/1e-5, /*atol=*/1e-5));
    }
    for (const auto& [name, got, want] : c.params) {
      CAPTURE(name);
      REQUIRE(got.sizes() == want.sizes());
      CAPTURE((got - want).abs().max().item<double>());
      CHECK(at::allclose(got, want, /*rtol=*/1e-4, /*atol=*/5e-5));  // tests/fsdp_test.cpp's
    }
  }
}

inline std::string gpt_plan() { return gpt::GPTConfig::family().modules().tp_plan; }
inline std::string llama_plan() { return llama::LlamaConfig::family().modules().tp_plan; }

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}



// One training step of `s` on every rank of shard x tp; each rank's fsdp and tp counters.
struct CountedStep {
  std::vector<UnitInfo> info;
  std::vector<UnitCounters> per_unit;
  TpCounters tp;
  int64_t tokens = 0;
};

inline std::vector<CountedStep> count_one_step(const ParitySpec& s, const std::string& tp_plan,
                                        int shard, int tp) {
  std::vector<CountedStep> out(shard * tp);
  std::mutex mu;
  run_mesh(MeshShape(shard, 1, tp), [&](const Mesh& mesh) {
    auto model = s.make_model();
    auto par = parallelize(model, parse_tp_plan(tp_plan), mesh);
    auto fsdp = fully_shard(model, s.plan(*model), mesh, s.options);
    fsdp->reset_counters();
    par->reset_counters();
    s.loss(model, mesh.coord(MeshDim::kShard), 0, 0).backward();
    CountedStep c;
    c.info = fsdp->units();
    c.per_unit = fsdp->counters().per_unit;
    c.tp = par->counters();
    std::lock_guard<std::mutex> lock(mu);
    out[mesh.global_rank()] = std::move(c);
  });
  return out;
}



// The family's plan with sequence parallelism, loss parallelism (a colwise lm_head) or both.
inline std::string sp_lp_plan(bool llama, bool sp, bool lp) {
  std::string plan = llama ? llama_plan() : gpt_plan();
  if (sp) plan += ";sequence_parallel";
  if (lp) plan += ";colwise:path=lm_head;loss_parallel";
  return plan;
}


// bf16 compute against the fp32 reference (tests/fsdp_test.cpp's bf16 tolerances): every step-0
// gradient (fp32 masters) within 3% relative L2 of its reference slice, the ranks' mean loss
// within 2% at every step. Each data rank's own loss against the reference's mean over both
// batches would mix data and rounding, hence the mean.
inline void require_tp_bf16_parity(const ParityRun& ref, const std::vector<RankCheck>& ranks) {
  for (const RankCheck& c : ranks) {
    CAPTURE(c.where);
    REQUIRE(c.losses.size() == ref.losses.size());
    REQUIRE(c.grads.size() == ref.grads.size());
    for (const auto& [name, got, want] : c.grads) {
      REQUIRE(got.scalar_type() == at::kFloat);  // master grads stay fp32
      REQUIRE(got.sizes() == want.sizes());
      const double rel = (got - want).norm().item<double>() / want.norm().item<double>();
      CAPTURE(name, rel);
      CHECK(rel < 3e-2);
    }
  }
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    double mean = 0;
    for (const RankCheck& c : ranks) mean += c.losses[i] / ranks.size();
    CAPTURE(i, mean, ref.losses[i]);
    CHECK(std::abs(mean - ref.losses[i]) <= 2e-2 * std::abs(ref.losses[i]));
  }
}

}  // namespace tp
}  // namespace flatshard_test
