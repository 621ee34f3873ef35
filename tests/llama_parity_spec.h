// The reference LLaMA as a parity subject (tests/parity_util.h): odd sizes (d_model 36, vocab
// 97, hidden 50, seq 11) so every flat parameter needs padding at every world size > 1; 3 heads
// over 1 kv head (grouped-query attention); 3 layers so every-2 leaves a group of one. Shared by
// the LLaMA parity and the fine-tuning tests.
#pragma once

#include "fsdp/call.h"
#include "models/llama.h"
#include "parity_util.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

namespace flatshard_test {

namespace ll = flatshard::llama;

inline ll::LlamaConfig parity_llama_config() {
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

inline ParitySpec llama_spec(int world, const std::string& policy_spec, bool tied = false) {
  ParitySpec s;
  s.world = world;
  s.make_model = [tied] {
    auto c = parity_llama_config();
    c.tie_embeddings = tied;
    return std::static_pointer_cast<torch::nn::Module>(ll::Llama(c, 11).ptr());
  };
  s.plan = [policy_spec](torch::nn::Module& m) {
    return flatshard::make_plan(m, policy_spec.empty() ? flatshard::Policy{} : flatshard::parse_policy(policy_spec));
  };
  s.loss = [](const std::shared_ptr<torch::nn::Module>& m, int rank, int step, int micro) {
    auto model = std::static_pointer_cast<ll::LlamaImpl>(m);
    auto [x, y] = ll::synthetic_batch(model->config(), 2, 5, rank, step * 16 + micro);
    return flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
  };
  return s;
}


}  // namespace flatshard_test
