// A minimal trainer built against the installed package: the reference GPT wrapped with a
// per-layer policy, trained a few steps on 2 ranks (threads), checkpointed, and the checkpoint
// loaded into a plain (unsharded) model; exits non-zero unless the loss falls and the loaded
// weights equal the trained ones.
#include <flatshard/version.h>

#include <torch/optim/adamw.h>

#include <cstdio>
#include <mutex>

#include "checkpoint/checkpoint.h"
#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "wrap_policies/spec.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer CHECKPOINT_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::printf("flatshard %s\n", flatshard::version());
  std::mutex mu;
  double first = 0, last = 0;
  at::Tensor trained_head;
  flatshard::run_ranks(2, [&](flatshard::Communicator& comm) {
    namespace g = flatshard::gpt;
    auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
    auto fsdp = flatshard::fully_shard(model.ptr(), flatshard::parse_policy("type=Block"), comm);
    torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(3e-3));
    for (int step = 0; step < 30; ++step) {
      auto batch = g::synthetic_batch(model->config(), 8, 1, comm.rank(), step);
      opt.zero_grad();
      auto loss = flatshard::enter(model, [&] { return model->loss(batch.first, batch.second); });
      loss.backward();
      opt.step();
      if (comm.rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        (step == 0 ? first : last) = loss.item<double>();
      }
    }
    flatshard::save_checkpoint(*fsdp, &opt, dir);
    for (auto& kv : fsdp->gather_full_params())
      if (kv.first == "lm_head.weight" && comm.rank() == 0) trained_head = kv.second;
  });
  auto plain = flatshard::gpt::GPT(flatshard::gpt::GPTConfig::preset("tiny"), 123);
  flatshard::load_full_into_module(*plain, dir);
  const bool same = at::equal(plain->lm_head->weight.detach(), trained_head);
  std::printf("loss %.4f -> %.4f; checkpoint reloaded into a plain model: %s\n", first, last,
              same ? "identical" : "DIFFERENT");
  return last < first - 0.5 && same ? 0 : 1;
}
