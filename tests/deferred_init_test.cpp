// Deferred initialization (fsdp/deferred_init.h, Note [Deferred initialization]): a model built
// on the meta device and initialised by fully_shard unit by unit, against the reference the
// parity tests already trust — the same model built eagerly with the same seed.
//   * values: gather_full_params() of the deferred model equals the eager model's parameters
//     bit for bit, at world 1..4, per-layer and per-leaf plans, both families (tied too);
//   * training: the first steps' losses equal the eager sharded path's exactly;
//   * memory: the setup peak (counting CPU allocator) stays within shards + one unit's flat
//     buffers, and an eager setup of the same model exceeds that bound (the test can fail);
//   * errors: every rank throws a c10::Error naming the tensor, the unit and the rank.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/sharding_mesh.h"
#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "fsdp/call.h"
#include "fsdp/deferred_init.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "models/family.h"
#include "models/model_init.h"
#include "profiling/counting_allocator.h"
#include "rank_require.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
// The reference families by descriptor (models/family.h).
using Family = const models::Family*;
const Family kGpt = &models::family("gpt"), kLlama = &models::family("llama");
using models::ModelConfig;

namespace {

ModelConfig tiny(Family f, int64_t layers = 2, bool tied = false) {
  ModelConfig c = ModelConfig::preset(*f, "tiny");
  c.n_layers() = layers;
  c.tie_embeddings() = tied;
  return c;
}

std::shared_ptr<torch::nn::Module> build_meta(const ModelConfig& c, uint64_t seed) {
  MetaInit meta;
  return c.build(seed);
}

Policy policy(Family f, const std::string& granularity) {
  const auto& m = f->modules();
  return parse_policy("type=" + (granularity == "layer" ? m.layer_type : m.leaf_types));
}

std::map<std::string, at::Tensor> eager_params(const ModelConfig& c, uint64_t seed) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : c.build(seed)->named_parameters()) out[p.key()] = p.value().detach();
  return out;
}

// Sharded on `world` thread ranks, built on meta (deferred) or eagerly; rank 0's gathered
// parameters and every rank's mean loss per step.
struct Sharded {
  std::map<std::string, at::Tensor> params;
  std::vector<double> losses;
};

Sharded run_sharded(const ModelConfig& c, uint64_t seed, int world, const std::string& granularity,
                    bool deferred, int steps, ShardingOptions options = {}) {
  Sharded out;
  out.losses.assign(static_cast<size_t>(steps), 0.0);
  std::vector<std::vector<double>> per_rank(static_cast<size_t>(world));
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    auto model = deferred ? build_meta(c, seed) : c.build(seed);
    auto fsdp = fully_shard(model, policy(&c.family(), granularity), comm, options);
    auto gathered = fsdp->gather_full_params();
    torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      const auto batch = c.synthetic_batch(2, 5, comm.rank(), s);
      at::Tensor loss =
          enter(model, [&] { return c.loss(*model, batch.first, batch.second); });
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
    std::lock_guard<std::mutex> lock(mu);
    per_rank[static_cast<size_t>(comm.rank())] = losses;
    if (comm.rank() == 0)
      for (auto& [name, t] : gathered) out.params[name] = t;
  });
  // Summed in rank order, not in the order threads finish: the comparisons are exact.
  for (const auto& losses : per_rank)
    for (int s = 0; s < steps; ++s) out.losses[static_cast<size_t>(s)] += losses[s] / world;
  return out;
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("the models initialise each tensor alone, in any order, as construction does",
          "[deferred]") {
  for (Family f : {kGpt, kLlama}) {
    for (bool tied : {false, true}) {
      CAPTURE(f->name(), tied);
      const ModelConfig c = tiny(f, 2, tied);
      const auto eager = eager_params(c, 11);
      auto meta = build_meta(c, 11);
      const auto* self = dynamic_cast<const InitializesItself*>(meta.get());
      REQUIRE(self != nullptr);
      auto named = meta->named_parameters();
      std::vector<std::string> names = named.keys();
      std::reverse(names.begin(), names.end());  // not registration order
      for (const auto& name : names) {
        CAPTURE(name);
        at::Tensor v = at::empty(named[name].sizes());
        self->init_tensor(name, v);
        CHECK(at::equal(v, eager.at(name)));
        // Another dtype and a non-contiguous target get the same draw.
        if (v.dim() == 2) {
          at::Tensor t = at::empty({v.size(1), v.size(0)}).t();
          self->init_tensor(name, t);
          CHECK(at::equal(t, eager.at(name)));
          at::Tensor d = at::empty(v.sizes(), at::kDouble);
          self->init_tensor(name, d);
          CHECK(at::equal(d, eager.at(name).to(at::kDouble)));
        }
      }
      for (const auto& b : meta->named_buffers()) {
        at::Tensor v = at::empty(b.value().sizes(), b.value().scalar_type());
        self->init_tensor(b.key(), v);
        CHECK(at::equal(v, c.build(11)->named_buffers()[b.key()]));
      }
      CHECK(contains(message_of([&] { self->init_tensor("no.such.weight", at::empty({1})); }),
                     "no parameter"));
      CHECK(contains(message_of([&] { self->init_tensor(names.back(), at::empty({1, 2, 3})); }),
                     "got values of shape"));
    }
  }
  // Per-tensor seeds: another seed changes every drawn tensor.
  const auto a = eager_params(tiny(kGpt), 1), b = eager_params(tiny(kGpt), 2);
  CHECK_FALSE(at::equal(a.at("blocks.0.attn.qkv.weight"), b.at("blocks.0.attn.qkv.weight")));
  CHECK(models::tensor_seed(0, "a") != models::tensor_seed(0, "b"));
  CHECK(models::tensor_seed(0, "a") == models::tensor_seed(0, "a"));
}

TEST_CASE("normal_init: chunked draws independent of thread count, layout and device path",
          "[deferred]") {
  const int threads = at::get_num_threads();
  const int64_t n = 2 * models::kDrawChunk + 12345;  // three chunks, a short last one
  auto draw = [&](int t) {
    at::set_num_threads(t);
    at::Tensor v = at::empty({n});
    models::normal_init(v, 0.5, 3, "big.weight");
    return v;
  };
  const at::Tensor one = draw(1), two = draw(2);
  at::set_num_threads(threads);
  CHECK(at::equal(one, two));
  // Chunks differ from each other (their own seeds), and the values look normal.
  CHECK_FALSE(at::equal(one.narrow(0, 0, 1000), one.narrow(0, models::kDrawChunk, 1000)));
  CHECK(std::abs(one.std().item<double>() - 0.5) < 0.01);
  // Non-contiguous and double targets take the CPU fp32 draw and copy it.
  at::Tensor t = at::empty({n, 3}).select(1, 1);  // stride 3
  REQUIRE_FALSE(t.is_contiguous());
  models::normal_init(t, 0.5, 3, "big.weight");
  CHECK(at::equal(t, one));
  at::Tensor d = at::empty({n}, at::kDouble);
  models::normal_init(d, 0.5, 3, "big.weight");
  CHECK(at::equal(d, one.to(at::kDouble)));
}

TEST_CASE("deferred init equals the eager model bit for bit at world 1..4; training agrees",
          "[deferred][parity]") {
  for (Family f : {kGpt, kLlama}) {
    for (const std::string granularity : {"layer", "leaf"}) {
      for (int world = 1; world <= 4; ++world) {
        CAPTURE(f->name(), granularity, world);
        const ModelConfig c = tiny(f, 3);
        const auto eager = eager_params(c, 7);
        const Sharded deferred = run_sharded(c, 7, world, granularity, true, 2);
        REQUIRE(deferred.params.size() == eager.size());
        for (const auto& [name, t] : eager) {
          CAPTURE(name);
          CHECK(at::equal(deferred.params.at(name), t));
        }
        const Sharded reference = run_sharded(c, 7, world, granularity, false, 2);
        CHECK(deferred.losses == reference.losses);
      }
    }
  }
}

TEST_CASE("deferred init: tied embeddings, bf16 compute, sync_module_states off, HSDP-free",
          "[deferred][parity]") {
  for (Family f : {kGpt, kLlama}) {
    CAPTURE(f->name());
    const ModelConfig c = tiny(f, 2, /*tied=*/true);
    const auto eager = eager_params(c, 3);
    ShardingOptions bf16;
    bf16.mixed_precision.param_dtype = at::kBFloat16;
    ShardingOptions no_sync;
    no_sync.sync_module_states = false;
    for (const ShardingOptions& o : {bf16, no_sync}) {
      const Sharded deferred = run_sharded(c, 3, 3, "layer", true, 2, o);
      for (const auto& [name, t] : eager) {
        CAPTURE(name);
        CHECK(at::equal(deferred.params.at(name), t));
      }
      CHECK(deferred.losses == run_sharded(c, 3, 3, "layer", false, 2, o).losses);
    }
  }
}

// Peak bytes of building + sharding on `world` thread ranks (the counting allocator is process
// wide: all ranks together), and the bound of the Note for that many ranks: every rank's master
// shards (together: the padded model) + per rank one unit's fp32 flat buffer and its compute
// buffer, for the largest unit, + slack for the small things (fingerprint, agree flags, hooks).
struct SetupMemory {
  int64_t peak = 0, bound = 0;
  int64_t after = 0, shards = 0;  // live once every rank is set up; its master shards' bytes
};

SetupMemory setup_memory(const ModelConfig& c, int world, bool deferred,
                         const ShardingOptions& options) {
  auto& mem = profiling::CountingCpuAllocator::install();
  SetupMemory out;
  int64_t padded_total = 0, largest = 0;
  std::mutex mu;
  const int64_t before = mem.current_bytes();
  mem.reset_peak();
  run_ranks(world, [&](Communicator& comm) {
    auto model = deferred ? build_meta(c, 5) : c.build(5);
    auto fsdp = fully_shard(model, policy(&c.family(), "layer"), comm, options);
    comm.barrier();
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out.peak = mem.peak_bytes() - before;
      out.after = mem.current_bytes() - before;
      for (const auto& u : fsdp->units()) {
        padded_total += u.padded_numel;
        largest = std::max(largest, u.padded_numel);
      }
    }
    comm.barrier();  // every rank's model and shards stay alive until rank 0 has read
  });
  out.shards = 4 * padded_total;
  const int64_t compute = c10::elementSize(options.mixed_precision.param_dtype);
  out.bound = 4 * padded_total + world * largest * (4 + compute) + world * (64 << 10);
  return out;
}

TEST_CASE("setup memory: shards plus one unit at a time; eager setup exceeds the bound",
          "[deferred][memory]") {
  ShardingOptions fp32;  // sync_module_states on: the threads backend's broadcast stages one
                         // copy of the unit per receiving rank, which fits the fp32 bound
  ShardingOptions bf16;
  bf16.mixed_precision.param_dtype = at::kBFloat16;
  bf16.sync_module_states = false;  // deterministic init: no broadcast needed, strict bound
  for (Family f : {kGpt, kLlama}) {
    for (const ShardingOptions& o : {fp32, bf16}) {
      const ModelConfig c = tiny(f, 8);  // several layers, so the whole model is well above
      const int world = 2;
      const SetupMemory deferred = setup_memory(c, world, true, o);
      const SetupMemory eager = setup_memory(c, world, false, o);
      CAPTURE(f->name(), o.mixed_precision.param_dtype, deferred.peak, eager.peak,
              deferred.bound);
      CHECK(deferred.peak > 0);
      CHECK(deferred.peak <= deferred.bound);
      CHECK(eager.peak > deferred.bound);
      // Nothing keeps a unit's fp32 flat buffer (or the materialised values) alive after
      // setup: what is live is the master shards plus small things, as after an eager setup.
      CAPTURE(deferred.after, deferred.shards, eager.after);
      CHECK(deferred.after <= deferred.shards + world * (64 << 10));
      CHECK(deferred.after <= eager.after + (16 << 10));
    }
  }
}

namespace {

// Two Linear layers without an init of their own, built on meta.
std::shared_ptr<torch::nn::Module> plain_meta_net() {
  MetaInit meta;
  auto net = std::make_shared<torch::nn::Module>("Net");
  net->register_module("a", torch::nn::Linear(4, 4));
  net->register_module("b", torch::nn::Linear(4, 2));
  return net;
}

std::string shard_error(int world, const std::function<std::shared_ptr<torch::nn::Module>()>& make,
                        const ShardingOptions& options) {
  return message_of([&] {
    run_ranks(world, [&](Communicator& comm) {
      auto net = make();
      auto fsdp = fully_shard(net, parse_policy("type=Linear"), comm, options);
    });
  });
}

}  // namespace

TEST_CASE("deferred init errors name the tensor, the unit and the rank, on every rank",
          "[deferred][errors]") {
  SECTION("a meta parameter nothing can initialise") {
    const std::string e = shard_error(2, plain_meta_net, {});
    CAPTURE(e);
    CHECK(contains(e, "parameter 'a.weight' is on the meta device and nothing can initialise"));
    CHECK(contains(e, "ShardingOptions::init"));
  }
  SECTION("a model partly on meta") {
    auto partly = [] {
      auto net = std::make_shared<torch::nn::Module>("Net");
      {
        MetaInit meta;
        net->register_module("a", torch::nn::Linear(4, 4));
      }
      net->register_module("b", torch::nn::Linear(4, 2));
      return net;
    };
    const std::string e = shard_error(2, partly, {});
    CAPTURE(e);
    CHECK(contains(e, "parameter 'a.weight' is on meta (it holds no values) but parameter "
                      "'b.weight' is on cpu (rank "));
    CHECK(contains(e, "flatshard::MetaInit"));
  }
  SECTION("an init that throws on one rank: every rank fails, naming it") {
    std::mutex mu;
    std::vector<std::string> errors(3);
    run_ranks(3, [&](Communicator& comm) {
      ShardingOptions o;
      const int rank = comm.rank();
      o.init = [rank](const std::string& name, const at::Tensor& v) {
        if (rank == 1 && name == "b.weight") throw std::runtime_error("no file for b");
        v.fill_(0.5);
      };
      auto net = plain_meta_net();
      const std::string e =
          message_of([&] { auto fsdp = fully_shard(net, parse_policy("type=Linear"), comm, o); });
      std::lock_guard<std::mutex> lock(mu);
      errors[static_cast<size_t>(rank)] = e;
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(contains(e, "initialising unit 'b'"));
      CHECK(contains(e, "rank"));
      CHECK(contains(e, "init of 'b.weight' threw: no file for b"));
    }
    CHECK(contains(errors[1], "failed on rank 1"));
    CHECK(contains(errors[0], "failed on rank(s) 1"));
  }
  SECTION("an init that changes a shape or replaces the storage") {
    for (const bool reshape : {true, false}) {
      CAPTURE(reshape);
      std::shared_ptr<torch::nn::Module> net;
      ShardingOptions o;
      o.init = [&net, reshape](const std::string& name, const at::Tensor& v) {
        at::Tensor p = net->named_parameters()[name];
        p.set_data(reshape ? at::zeros({3}) : at::zeros(v.sizes()));
      };
      const std::string e = shard_error(1, [&] { return net = plain_meta_net(); }, o);
      CAPTURE(e);
      CHECK(contains(e, "parameter 'a.weight' of unit 'a' (rank "));
      CHECK(contains(e, reshape ? "changed it from [4, 4]" : "replaced its storage"));
    }
  }
  SECTION("an init that resizes the tensor it is given") {
    for (const int64_t n : {1, 1000}) {  // a view of less, or a reallocated flat buffer
      ShardingOptions o;
      o.init = [n](const std::string&, const at::Tensor& v) { v.resize_({n}); };
      const std::string e = shard_error(2, plain_meta_net, o);
      CAPTURE(e);
      CHECK(contains(e, "initialising unit 'a'"));
      CHECK(contains(e, "init of 'a.weight': it resized the tensor it was given from [4, 4] to [" +
                            std::to_string(n) + "]"));
    }
  }
  SECTION("a user init fills every tensor") {
    ShardingOptions o;
    o.init = [](const std::string& name, const at::Tensor& v) {
      v.fill_(name.back() == 's' ? 0.0 : 0.25);  // biases 0, weights 0.25
    };
    run_ranks(2, [&](Communicator& comm) {
      auto net = plain_meta_net();
      auto fsdp = fully_shard(net, parse_policy("type=Linear"), comm, o);
      std::vector<std::string> wrong;  // named here: CAPTURE is not safe on rank threads
      for (const auto& [name, t] : fsdp->gather_full_params())
        if (!t.device().is_cpu() ||
            !at::equal(t, at::full_like(t, name.back() == 's' ? 0.0 : 0.25)))
          wrong.push_back(name);
      RANK_CHECK(wrong == std::vector<std::string>{});
    });
  }
}

TEST_CASE("deferred init under HSDP: values as eager; an init failing on one rank fails all",
          "[deferred][hsdp]") {
  const ModelConfig c = tiny(kLlama, 2);
  const auto eager = eager_params(c, 9);
  for (const bool fail : {false, true}) {
    CAPTURE(fail);
    std::mutex mu;
    std::vector<std::string> errors;
    run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& replicate) {
      const int rank = replicate.rank() * 2 + shard.rank();
      ShardingOptions o;
      auto model = build_meta(c, 9);
      const auto* self = dynamic_cast<const InitializesItself*>(model.get());
      if (fail) {
        o.init = [self, rank](const std::string& name, const at::Tensor& v) {
          if (rank == 3 && name == "layers.1.mlp.up.weight") throw std::runtime_error("bad");
          self->init_tensor(name, v);
        };
      }
      std::string e = message_of([&] {
        auto fsdp = fully_shard(model, policy(&c.family(), "layer"), ShardingMesh(shard, &replicate),
                                o);
        auto gathered = fsdp->gather_full_params();
        for (auto& [name, t] : gathered) {
          // Thrown on the rank's thread, rethrown by run_ranks (no Catch2 macro on rank threads).
          TORCH_CHECK(at::equal(t, eager.at(name)), "shard rank ", shard.rank(), ": ", name,
                      " differs from the eager model's");
        }
      });
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e);
    });
    REQUIRE(errors.size() == 4);
    for (const auto& e : errors) {
      CAPTURE(e);
      if (!fail) {
        CHECK(e.empty());
      } else {
        CHECK(contains(e, "initialising unit 'layers.1'"));
        CHECK(contains(e, "init of 'layers.1.mlp.up.weight' threw: bad"));
      }
    }
  }
}
