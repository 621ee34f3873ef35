// A minimal trainer built against the installed package: the reference GPT wrapped with a
// per-layer policy, trained a few steps on 2 ranks (threads); exits non-zero unless the loss falls.
#include <flatshard/version.h>

#include <torch/optim/adamw.h>

#include <cstdio>
#include <mutex>

#include "benchmarks/gpt.h"
#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "wrap_policies/spec.h"

int main() {
  std::printf("flatshard %s\n", flatshard::version());
  std::mutex mu;
  double first = 0, last = 0;
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
  });
  std::printf("loss %.4f -> %.4f\n", first, last);
  return last < first - 0.5 ? 0 : 1;
}
