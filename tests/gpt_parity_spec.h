// The reference GPT as a parity subject (tests/parity_util.h): a small model with odd sizes
// (d_model 36, vocab 97, seq 11) so every flat parameter needs padding at every world size > 1,
// and 3 layers so every-2 leaves a group of one. Shared by the CPU parity and HSDP tests.
#pragma once

#include "fsdp/call.h"
#include "models/gpt.h"
#include "parity_util.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

namespace flatshard_test {

inline flatshard::gpt::GPTConfig parity_gpt_config() {
  flatshard::gpt::GPTConfig c;
  c.vocab = 97;
  c.d_model = 36;
  c.n_heads = 3;
  c.n_layers = 3;
  c.seq_len = 11;
  return c;
}

// `world` ranks train parity_gpt_config() (seed 11) planned by `policy_spec` ("" = the root
// unit only), 2 sequences per rank per micro-batch from synthetic_batch(seed 5).
inline ParitySpec gpt_parity_spec(int world, const std::string& policy_spec) {
  namespace g = flatshard::gpt;
  ParitySpec s;
  s.world = world;
  s.make_model = [] {
    return std::static_pointer_cast<torch::nn::Module>(g::GPT(parity_gpt_config(), 11).ptr());
  };
  s.plan = [policy_spec](torch::nn::Module& m) {
    return flatshard::make_plan(
        m, policy_spec.empty() ? flatshard::Policy{} : flatshard::parse_policy(policy_spec));
  };
  s.loss = [](const std::shared_ptr<torch::nn::Module>& m, int rank, int step, int micro) {
    auto model = std::static_pointer_cast<g::GPTImpl>(m);
    auto [x, y] = g::synthetic_batch(model->config(), 2, 5, rank, step * 16 + micro);
    return flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
  };
  return s;
}

}  // namespace flatshard_test
