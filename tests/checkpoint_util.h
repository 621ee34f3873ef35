// Checkpoint test harness: train the reference GPT sharded on N ranks (threads), optionally
// loading a checkpoint first and saving one after some steps, and report per-step losses and
// the full parameters at the save (or load) point.
//
// Data are world-size independent: step s trains on one global batch of 12 rows, which the
// ranks split evenly (12 is divisible by 1, 2, 3 and 4). Each rank's loss is the mean over its
// rows and flatshard averages gradients over ranks, so every world size computes the gradient
// of the same global mean loss, and runs at different world sizes differ only in float
// summation order.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "models/gpt.h"
#include "optim/fused_adamw.h"
#include "temp_dir.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

namespace flatshard_test {

namespace g = flatshard::gpt;

// Odd sizes (d_model 36, vocab 97, seq 11) so flat parameters need padding at every world size.
inline g::GPTConfig ckpt_cfg(bool tied = false) {
  g::GPTConfig c;
  c.vocab = 97;
  c.d_model = 36;
  c.n_heads = 3;
  c.n_layers = 3;
  c.seq_len = 11;
  c.tie_embeddings = tied;
  return c;
}

constexpr int64_t kGlobalRows = 12;

// This rank's share of the global batch of `step`, entered through flatshard::enter.
inline at::Tensor ckpt_loss(g::GPT model, int rank, int world, int step) {
  auto [x, y] = g::synthetic_batch(model->config(), kGlobalRows, /*seed=*/5, /*rank=*/0, step);
  const int64_t rows = kGlobalRows / world;
  at::Tensor xs = x.narrow(0, rank * rows, rows), ys = y.narrow(0, rank * rows, rows);
  return flatshard::enter(model, [&] { return model->loss(xs, ys); });
}

inline flatshard::Plan ckpt_plan(torch::nn::Module& m, const std::string& spec) {
  return flatshard::make_plan(m,
                              spec.empty() ? flatshard::Policy{} : flatshard::parse_policy(spec));
}

inline torch::optim::AdamWOptions ckpt_adamw() {
  return torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
}

using Params = std::map<std::string, at::Tensor>;

inline Params to_map(const std::vector<std::pair<std::string, at::Tensor>>& v) {
  Params m;
  for (const auto& [k, t] : v) m[k] = t;
  return m;
}

// Empty string when equal bit for bit, else the first difference.
inline std::string diff_params(const Params& want, const Params& got) {
  if (want.size() != got.size())
    return "sizes differ: " + std::to_string(want.size()) + " vs " + std::to_string(got.size());
  for (const auto& [k, t] : want) {
    auto it = got.find(k);
    if (it == got.end()) return "missing " + k;
    if (!at::equal(t, it->second))
      return k + " differs by " + std::to_string((t - it->second).abs().max().item<double>());
  }
  return "";
}

// Loads `dir` into a fresh model on a 1-rank world with another plan (every=2,type=Block) and
// AdamW; its full parameters.
inline Params load_fresh(const std::string& dir) {
  Params out;
  flatshard::run_ranks(1, [&](flatshard::Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), 3);
    auto fsdp = flatshard::fully_shard(model.ptr(), ckpt_plan(*model, "every=2,type=Block"), comm);
    torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
    flatshard::load_checkpoint(*fsdp, &opt, dir);
    out = to_map(fsdp->gather_full_params());
  });
  return out;
}

struct CkptRun {
  int world = 2;
  std::string plan = "type=Block";
  bool tied = false;
  uint64_t seed = 11;                // initial values (a load overwrites them)
  int from = 0, to = 6;              // trains steps [from, to)
  std::string load_dir;              // loaded before step `from`
  std::string full_save_after_load;  // a kFull save right after the load
  int save_at = -1;                  // save before step save_at
  bool bf16_moments = false;         // FusedAdamW with bf16 moments (Note [Low-precision moments])
  std::vector<std::pair<std::string, flatshard::CheckpointOptions>> saves;
};

struct CkptResult {
  std::map<int, double> losses;  // mean over ranks
  Params at_save;                // full parameters when saving (or right after loading)
  Params final_params;
};

inline CkptResult run_ckpt(const CkptRun& r) {
  CkptResult out;
  std::mutex mu;
  flatshard::run_ranks(r.world, [&](flatshard::Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(r.tied), r.seed);
    auto fsdp = flatshard::fully_shard(model.ptr(), ckpt_plan(*model, r.plan), comm);
    std::unique_ptr<torch::optim::AdamW> owned;
    if (r.bf16_moments) {
      auto fused = std::make_unique<flatshard::FusedAdamW>(fsdp->parameters(), ckpt_adamw());
      fused->set_moments_dtype(at::kBFloat16);
      owned = std::move(fused);
    } else {
      owned = std::make_unique<torch::optim::AdamW>(fsdp->parameters(), ckpt_adamw());
    }
    torch::optim::AdamW& opt = *owned;
    auto snapshot = [&] {
      auto p = to_map(fsdp->gather_full_params());
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0) out.at_save = p;
    };
    if (!r.load_dir.empty()) {
      flatshard::load_checkpoint(*fsdp, &opt, r.load_dir);
      snapshot();
      if (!r.full_save_after_load.empty()) {
        flatshard::CheckpointOptions o;
        o.kind = flatshard::CheckpointKind::kFull;
        flatshard::save_checkpoint(*fsdp, &opt, r.full_save_after_load, o);
      }
    }
    for (int step = r.from; step < r.to; ++step) {
      if (step == r.save_at) {
        for (const auto& [dir, o] : r.saves) flatshard::save_checkpoint(*fsdp, &opt, dir, o);
        snapshot();
      }
      opt.zero_grad();
      at::Tensor loss = ckpt_loss(model, comm.rank(), comm.world_size(), step);
      loss.backward();
      opt.step();
      std::lock_guard<std::mutex> lock(mu);
      out.losses[step] += loss.item<double>() / comm.world_size();
    }
    auto p = to_map(fsdp->gather_full_params());
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) out.final_params = p;
  });
  return out;
}

}  // namespace flatshard_test
