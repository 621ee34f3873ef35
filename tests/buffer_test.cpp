// Buffers under fully_shard (fsdp/buffers.h, fsdp/fingerprint.h), CPU ranks as threads, world
// sizes 1-4 and an HSDP grid: with sync_module_states a rank that built a buffer differently
// ends up with (global) rank 0's values, bit for bit, for every dtype; with it off the setup
// fails naming the buffer and the ranks; a buffer shape mismatch is named by the fingerprint;
// bf16 compute leaves the LLaMA's fp32 inv_freq alone while buffer_dtype casts on request.
// The reference for "rank 0's values" is rank 0's own copy taken before fully_shard.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <mutex>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "fsdp/sharded_model.h"
#include "models/llama.h"
#include "parity_util.h"
#include "wrap_policies/spec.h"
#include "rank_require.h"

using namespace flatshard;
using namespace flatshard_test;
namespace ll = flatshard::llama;

namespace {

ll::LlamaConfig small_llama() {
  ll::LlamaConfig c = ll::LlamaConfig::preset("tiny");
  c.n_layers = 1;
  return c;
}

// A module with one buffer of each kind broadcast_buffers must carry: fp32 (as floats), and
// int64, bf16 and bool (as bytes). `n` sets the fp32 buffer's length (shape mismatch tests).
struct BufferNetImpl : torch::nn::Module {
  explicit BufferNetImpl(int rank, int64_t n = 5) : torch::nn::Module("BufferNet") {
    lin = register_module("lin", torch::nn::Linear(4, 3));
    stats = register_buffer("stats", at::arange(n, at::kFloat) * (1.0 + rank) + 0.1);
    steps = register_buffer("steps", at::full({2, 3}, 1000000007LL * (rank + 1), at::kLong));
    scale = register_buffer("scale", at::full({3}, 0.5 + rank, at::kBFloat16));
    mask = register_buffer(
        "mask", at::tensor({int64_t{rank % 2 == 0}, int64_t{1}, int64_t{rank > 0}}) != 0);
  }
  at::Tensor forward(const at::Tensor& x) { return lin->forward(x) * scale.to(at::kFloat); }
  torch::nn::Linear lin{nullptr};
  at::Tensor stats, steps, scale, mask;
};
TORCH_MODULE(BufferNet);

std::map<std::string, at::Tensor> buffers_of(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().clone();
  return out;
}

// Bitwise equality (NaN-safe, dtype-exact).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view({-1}).view(at::kByte), b.contiguous().view({-1}).view(at::kByte));
}

}  // namespace

TEST_CASE("sync_module_states: every rank's buffers become rank 0's, every dtype", "[fsdp][buffers]") {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    std::map<std::string, at::Tensor> rank0;
    std::vector<std::map<std::string, at::Tensor>> after(world);
    std::mutex mu;
    run_ranks(world, [&](Communicator& comm) {
      const int r = comm.rank();
      auto net = BufferNet(r);
      auto mine = buffers_of(*net);
      auto fsdp = fully_shard(net.ptr(), make_plan(*net, Policy{}), comm, ShardingOptions{});
      std::lock_guard<std::mutex> lock(mu);
      if (r == 0) rank0 = mine;
      after[r] = buffers_of(*net);
    });
    for (int r = 0; r < world; ++r)
      for (const auto& [name, want] : rank0) {
        CAPTURE(r, name);
        CHECK(same_bits(after[r].at(name), want));
      }
    if (world > 1)  // the ranks really started different (the check above is not vacuous)
      CHECK_FALSE(at::equal(BufferNet(1)->stats, rank0.at("stats")));
  }
}

TEST_CASE("LLaMA: a rank with another inv_freq trains with rank 0's after fully_shard",
          "[fsdp][buffers][llama]") {
  for (int world = 2; world <= 4; ++world) {
    CAPTURE(world);
    std::vector<at::Tensor> inv(world);
    std::vector<double> loss(world);
    std::mutex mu;
    const at::Tensor want = ll::Llama(small_llama(), 3)->rope->inv_freq.clone();
    run_ranks(world, [&](Communicator& comm) {
      const int r = comm.rank();
      auto model = ll::Llama(small_llama(), 3);
      if (r > 0) model->rope->inv_freq.mul_(1.0 + r);  // e.g. another theta on this rank
      auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=DecoderLayer")),
                              comm, ShardingOptions{});
      auto [x, y] = ll::synthetic_batch(small_llama(), 2, 1, /*rank=*/0);  // same data on all
      const double l = enter(model, [&, &x = x, &y = y] { return model->loss(x, y); }).item<double>();
      std::lock_guard<std::mutex> lock(mu);
      inv[r] = model->rope->inv_freq.clone();
      loss[r] = l;
    });
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(at::equal(inv[r], want));
      CHECK(loss[r] == loss[0]);  // same parameters, data and now rotary angles
    }
  }
}

TEST_CASE("HSDP sync: buffers become global rank 0's across replicas", "[fsdp][buffers][hsdp]") {
  const int R = 2, S = 2;
  std::vector<std::map<std::string, at::Tensor>> after(R * S);
  std::map<std::string, at::Tensor> rank0;
  std::mutex mu;
  run_ranks_2d(R, S, [&](Communicator& shard, Communicator& replicate) {
    const int g = replicate.rank() * S + shard.rank();
    auto net = BufferNet(g);
    auto mine = buffers_of(*net);
    auto fsdp = fully_shard(net.ptr(), make_plan(*net, Policy{}), ShardingMesh(shard, &replicate),
                            ShardingOptions{});
    std::lock_guard<std::mutex> lock(mu);
    if (g == 0) rank0 = mine;
    after[g] = buffers_of(*net);
  });
  for (int g = 0; g < R * S; ++g)
    for (const auto& [name, want] : rank0) {
      CAPTURE(g, name);
      CHECK(same_bits(after[g].at(name), want));
    }
}

TEST_CASE("sync off: differing buffer values fail at setup naming the buffer and the ranks",
          "[fsdp][buffers][reliability]") {
  for (int world = 2; world <= 4; ++world) {
    CAPTURE(world);
    const int odd = world - 1;  // the last rank differs
    std::vector<std::string> errors(world);
    std::mutex mu;
    run_ranks(world, [&](Communicator& comm) {
      const int r = comm.rank();
      auto model = ll::Llama(small_llama(), 3);
      if (r == odd) model->rope->inv_freq.mul_(2.0);
      ShardingOptions o;
      o.sync_module_states = false;
      try {
        auto fsdp = fully_shard(model.ptr(), make_plan(*model, Policy{}), comm, o);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors[r] = e.what_without_backtrace();
      }
    }, std::chrono::milliseconds(20000));
    for (int r = 0; r < world; ++r) {
      CAPTURE(r, errors[r]);
      CHECK_THAT(errors[r], Catch::Contains("rank " + std::to_string(odd) +
                                            " differs from rank 0 at setup: buffer "
                                            "'rope.inv_freq' values") &&
                                Catch::Contains("sync_module_states is off"));
    }
  }
  // Equal values with sync off are fine, and stay as they were.
  run_ranks(3, [&](Communicator& comm) {
    auto model = ll::Llama(small_llama(), 3);
    const at::Tensor before = model->rope->inv_freq.clone();
    ShardingOptions o;
    o.sync_module_states = false;
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, Policy{}), comm, o);
    RANK_CHECK(at::equal(model->rope->inv_freq, before));
  });
}

TEST_CASE("the setup fingerprint names a buffer shape mismatch", "[fsdp][buffers][reliability]") {
  for (bool sync : {true, false}) {
    CAPTURE(sync);
    std::vector<std::string> errors(3);
    std::mutex mu;
    run_ranks(3, [&](Communicator& comm) {
      const int r = comm.rank();
      auto net = BufferNet(0, r == 2 ? 4 : 5);
      ShardingOptions o;
      o.sync_module_states = sync;
      try {
        auto fsdp = fully_shard(net.ptr(), make_plan(*net, Policy{}), comm, o);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors[r] = e.what_without_backtrace();
      }
    }, std::chrono::milliseconds(20000));
    for (const auto& e : errors)
      CHECK_THAT(e, Catch::Contains("rank 2 differs from rank 0 at setup: buffer 'stats' shape "
                                    "[4] vs [5]"));
  }
}

TEST_CASE("bf16 compute keeps the fp32 inv_freq; buffer_dtype casts floating buffers only",
          "[fsdp][buffers][llama]") {
  for (int world = 1; world <= 2; ++world) {
    CAPTURE(world);
    run_ranks(world, [&](Communicator& comm) {
      auto model = ll::Llama(small_llama(), 3);
      const at::Tensor inv = model->rope->inv_freq.clone();
      ShardingOptions o;
      o.mixed_precision.param_dtype = at::kBFloat16;
      auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=DecoderLayer")),
                              comm, o);
      auto [x, y] = ll::synthetic_batch(small_llama(), 2, 1, comm.rank());
      at::Tensor loss = enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
      loss.backward();
      RANK_CHECK(model->rope->inv_freq.scalar_type() == at::kFloat);
      RANK_CHECK(at::equal(model->rope->inv_freq, inv));
      RANK_CHECK(std::isfinite(loss.item<double>()));
    });
    run_ranks(world, [&](Communicator& comm) {
      auto net = BufferNet(0);
      const auto before = buffers_of(*net);
      ShardingOptions o;
      o.mixed_precision.buffer_dtype = at::kBFloat16;
      auto fsdp = fully_shard(net.ptr(), make_plan(*net, Policy{}), comm, o);
      RANK_CHECK(net->stats.scalar_type() == at::kBFloat16);
      RANK_CHECK(at::equal(net->stats, before.at("stats").to(at::kBFloat16)));
      RANK_CHECK(net->steps.scalar_type() == at::kLong);  // integer and bool buffers keep theirs
      RANK_CHECK(at::equal(net->steps, before.at("steps")));
      RANK_CHECK(net->mask.scalar_type() == at::kBool);
      RANK_CHECK(net->scale.scalar_type() == at::kBFloat16);
    });
  }
}
