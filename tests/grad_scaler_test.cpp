// fp16 compute over fp32 masters with flatshard::ShardedGradScaler (fsdp/grad_scaler.h), against
// an unsharded fp16 reference written here: the same TinyNet, an fp32 master copy the optimizer
// steps, an fp16 compute copy refreshed from it every step, the loss scaled, each rank's fp16
// gradient averaged as an fp16 reduction does (exact mean, rounded to fp16), upcast, unscaled
// with plain ops, checked for inf/NaN, and torch.amp.GradScaler's skip / backoff / growth rules.
//
// Why bitwise: every rank's fp16 forward and backward are the reference's ops on the same fp16
// values; the threads backend's average is the fp32 sum in rank order divided by the world,
// rounded to the reduce dtype (fp16) — what the reference computes; unscaling multiplies by a
// power of two; AdamW then sees the same fp32 gradients. So losses, scales, skipped steps and
// parameters are compared exactly, at worlds 1, 2 and 3.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/crc32.h"
#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "fsdp/grad_scaler.h"
#include "parity_util.h"
#include "rank_require.h"
#include "support/json.h"
#include "temp_dir.h"
#include "tiny_net.h"

using namespace flatshard;
using namespace flatshard_test;
using Catch::Matchers::Contains;

namespace {

constexpr int64_t kIn = 5, kD = 8, kLayers = 2, kBatch = 4;
constexpr double kLr = 1e-2, kWeightDecay = 0.1;

TinyNet make_net() {
  auto net = TinyNet(kIn, kD, kLayers);
  init_params(*net, 7);
  return net;
}

Plan net_plan(torch::nn::Module& m) { return manual_plan(m, {{"blocks.0"}, {"blocks.1"}}); }

ShardingOptions fp16_options() {
  ShardingOptions o;
  o.mixed_precision.param_dtype = at::kHalf;  // reduce dtype: the default, i.e. fp16 too
  return o;
}

// Rank `rank`'s batch of `step`; the targets are scaled so gradients are large enough for a
// few loss scales to overflow fp16.
std::pair<at::Tensor, at::Tensor> batch(int rank, int step) {
  auto gen = at::detail::createCPUGenerator(1000 * step + rank + 1);
  at::Tensor x = at::randn({kBatch, kIn}, gen);
  at::Tensor y = at::randn({kBatch, 3}, gen) * 4;
  return {x, y};
}

torch::optim::AdamWOptions adamw() {
  return torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay);
}

struct Spec {
  int world = 1;
  int steps = 12;
  GradScalerOptions scaler;
  // +inf written into one element of `inject_rank`'s master gradient after the backward of
  // `inject_step` (a rank-local overflow: only the all-reduce tells the other ranks).
  int inject_step = -1, inject_rank = -1;
  // Sharded side: the optimizer over named_parameters()' per-parameter shard views (Note
  // [Original-parameter views]) instead of the per-unit master shards.
  bool views = false;
};

// What a run saw, per step, and the final parameters.
struct Trace {
  std::vector<double> losses;  // mean over ranks of the unscaled losses
  std::vector<double> scales;  // S used in the step (before update())
  std::vector<int> stepped;    // 1: the optimizer stepped, 0: skipped
  std::map<std::string, at::Tensor> params;
};

// --- the unsharded fp16 reference --------------------------------------------------------------
Trace reference_steps(const Spec& s) {
  at::NoGradGuard outer_no_grad;  // re-enabled around forward/backward below
  TinyNet master = make_net();    // fp32 master weights: what the optimizer steps
  TinyNet compute = make_net();   // the fp16 compute copy
  compute->to(at::kHalf);
  std::vector<at::Tensor> mp = master->parameters(), cp = compute->parameters();
  torch::optim::AdamW opt(mp, adamw());
  float scale = static_cast<float>(s.scaler.init_scale);
  int64_t tracker = 0;
  Trace t;
  for (int step = 0; step < s.steps; ++step) {
    for (size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i]);  // fp32 -> fp16
    std::vector<at::Tensor> sum(mp.size());
    double loss_sum = 0;
    for (int r = 0; r < s.world; ++r) {
      for (auto& p : cp) p.mutable_grad() = at::Tensor();
      auto [x, y] = batch(r, step);
      at::AutoGradMode grad_on(true);
      at::Tensor loss = at::mse_loss(compute->forward(x.to(at::kHalf)).to(at::kFloat), y);
      loss_sum += loss.item<double>();
      (loss * static_cast<double>(scale)).backward();
      for (size_t i = 0; i < cp.size(); ++i) {
        const at::Tensor g = cp[i].grad().to(at::kFloat);
        sum[i] = sum[i].defined() ? sum[i] + g : g;
      }
    }
    t.losses.push_back(loss_sum / s.world);
    // The fp16 average over ranks (rounded to fp16 once), upcast to the fp32 master gradient.
    for (size_t i = 0; i < mp.size(); ++i)
      mp[i].mutable_grad() = (sum[i] / s.world).to(at::kHalf).to(at::kFloat);
    if (step == s.inject_step) mp[0].mutable_grad().view({-1})[0] = INFINITY;
    // Unscale by 1/S (double, rounded to fp32) and look for inf/NaN.
    const float inv = static_cast<float>(1.0 / static_cast<double>(scale));
    bool found_inf = false;
    for (auto& p : mp) {
      p.mutable_grad().mul_(inv);
      found_inf = found_inf || !at::isfinite(p.grad()).all().item<bool>();
    }
    t.scales.push_back(scale);
    t.stepped.push_back(found_inf ? 0 : 1);
    if (!found_inf) opt.step();
    opt.zero_grad();
    // torch.amp.GradScaler's update.
    if (found_inf) {
      scale = static_cast<float>(scale * s.scaler.backoff_factor);
      tracker = 0;
    } else if (++tracker == s.scaler.growth_interval) {
      const float grown = static_cast<float>(scale * s.scaler.growth_factor);
      if (std::isfinite(grown)) scale = grown;
      tracker = 0;
    }
  }
  for (auto& p : master->named_parameters()) t.params[p.key()] = p.value().detach().clone();
  return t;
}

// On a rank thread of its own, for the ranks' thread count (run_ranks: one intra-op thread):
// CPU LayerNorm's fp16 weight and bias gradients are reduced over the batch per thread, so
// another thread count rounds them differently (seen: one fp16 ulp at step 0).
Trace run_reference(const Spec& s) {
  Trace t;
  run_ranks(1, [&](Communicator&) { t = reference_steps(s); });
  return t;
}

// --- the sharded run ----------------------------------------------------------------------------
// One rank's steps [from, to) with the scaler; `before` runs before step `from` (a load),
// `after_step` after each step (a save).
struct RankHooks {
  std::function<void(ShardedModel&, torch::optim::AdamW&, ShardedGradScaler&)> before;
  std::function<void(int step, ShardedModel&, torch::optim::AdamW&, ShardedGradScaler&)> after_step;
};

void inject_inf(ShardedModel& fsdp) {
  at::NoGradGuard no_grad;
  for (auto& p : fsdp.parameters())
    if (p.grad().defined() && p.grad().numel() > 0) {
      p.mutable_grad().view({-1})[0] = INFINITY;
      return;
    }
  TORCH_CHECK(false, "no master gradient to write an inf into");
}

struct RankTrace {
  std::vector<double> losses, scales;
  std::vector<int> stepped;
};

RankTrace train_rank(const Spec& s, Communicator& comm, int from, int to, const RankHooks& hooks,
                     std::map<std::string, at::Tensor>* params_out) {
  TinyNet net = make_net();
  auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
  for (size_t u = 0; u < fsdp->num_units(); ++u)
    RANK_REQUIRE(fsdp->unit(u).flat().config().reduce_dtype == at::kHalf);
  std::vector<at::Tensor> params;
  if (s.views) {
    for (auto& [name, p] : fsdp->named_parameters()) params.push_back(p);
  } else {
    params = fsdp->parameters();
  }
  torch::optim::AdamW opt(params, adamw());
  ShardedGradScaler scaler(*fsdp, s.scaler);
  if (hooks.before) hooks.before(*fsdp, opt, scaler);
  RankTrace t;
  for (int step = from; step < to; ++step) {
    opt.zero_grad();
    auto [x, y] = batch(comm.rank(), step);
    at::Tensor loss = at::mse_loss(flatshard::call(net, x).to(at::kFloat), y);
    t.losses.push_back(loss.item<double>());
    scaler.scale(loss).backward();
    if (step == s.inject_step && comm.rank() == s.inject_rank) inject_inf(*fsdp);
    t.scales.push_back(scaler.get_scale());
    t.stepped.push_back(scaler.step(opt) ? 1 : 0);
    scaler.update();
    if (hooks.after_step) hooks.after_step(step, *fsdp, opt, scaler);
  }
  if (params_out) {
    auto full = fsdp->gather_full_params();
    if (comm.rank() == 0)
      for (auto& [k, v] : full) (*params_out)[k] = v;
  }
  return t;
}

// Every rank's trace must be the same (scales, skipped steps); returns rank 0's, losses averaged.
Trace run_sharded(const Spec& s, int from, int to, const RankHooks& hooks = {}) {
  std::vector<RankTrace> per_rank(s.world);
  Trace out;
  std::mutex mu;
  run_ranks(s.world, [&](Communicator& comm) {
    std::map<std::string, at::Tensor> params;
    RankTrace t = train_rank(s, comm, from, to, hooks, &params);
    std::lock_guard<std::mutex> lock(mu);
    per_rank[comm.rank()] = t;
    if (comm.rank() == 0) out.params = params;
  });
  for (int r = 1; r < s.world; ++r) {
    CAPTURE(r);
    REQUIRE(per_rank[r].stepped == per_rank[0].stepped);  // every rank skipped alike
    REQUIRE(per_rank[r].scales == per_rank[0].scales);
  }
  out.scales = per_rank[0].scales;
  out.stepped = per_rank[0].stepped;
  for (size_t i = 0; i < per_rank[0].losses.size(); ++i) {
    double sum = 0;
    for (int r = 0; r < s.world; ++r) sum += per_rank[r].losses[i];
    out.losses.push_back(sum / s.world);
  }
  return out;
}

std::string first_param_difference(const std::map<std::string, at::Tensor>& want,
                                   const std::map<std::string, at::Tensor>& got) {
  if (want.size() != got.size()) return "parameter counts differ";
  for (const auto& [k, v] : want) {
    auto it = got.find(k);
    if (it == got.end()) return "missing " + k;
    if (!at::equal(v, it->second))
      return k + " differs by " + std::to_string((v - it->second).abs().max().item<double>());
  }
  return "";
}

void require_same(const Trace& ref, const Trace& got) {
  CAPTURE(ref.scales, got.scales, ref.stepped, got.stepped, ref.losses, got.losses);
  REQUIRE(got.scales == ref.scales);
  REQUIRE(got.stepped == ref.stepped);
  REQUIRE(got.losses == ref.losses);  // bitwise (see the top of the file)
  if (!ref.params.empty()) REQUIRE(first_param_difference(ref.params, got.params) == "");
}

int count(const std::vector<int>& v, int x) {
  return static_cast<int>(std::count(v.begin(), v.end(), x));
}

// The default 2^16 overflows fp16 on this model (its targets are large); 2^13 does not: the
// first steps back off, then the scale grows after every 3 clean steps until it overflows again.
GradScalerOptions overflowing() {
  GradScalerOptions o;
  o.init_scale = 1 << 16;
  o.growth_interval = 3;
  return o;
}

}  // namespace

TEST_CASE("grad scaler: fp16 training matches the unsharded fp16 reference bit for bit",
          "[grad_scaler][parity]") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    Spec s;
    s.world = world;
    s.scaler = overflowing();
    const Trace ref = run_reference(s);
    CAPTURE(ref.scales, ref.stepped);
    // The run exercises every rule: overflow skips with backoff, clean steps, growth.
    REQUIRE(count(ref.stepped, 0) >= 2);
    REQUIRE(count(ref.stepped, 1) >= 6);
    bool grew = false;
    for (size_t i = 1; i < ref.scales.size(); ++i) grew = grew || ref.scales[i] > ref.scales[i - 1];
    REQUIRE(grew);
    require_same(ref, run_sharded(s, 0, s.steps));
    if (world == 2) {  // the optimizer on per-parameter views: the scaler unscales those
      s.views = true;
      require_same(ref, run_sharded(s, 0, s.steps));
    }
  }
}

TEST_CASE("grad scaler: an inf on one rank only makes every rank skip", "[grad_scaler]") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    Spec s;
    s.world = world;
    s.steps = 6;
    s.scaler.init_scale = 256;  // no overflow of its own
    s.inject_step = 2;
    s.inject_rank = world - 1;
    const Trace ref = run_reference(s);
    REQUIRE(ref.stepped == std::vector<int>{1, 1, 0, 1, 1, 1});
    const Trace got = run_sharded(s, 0, s.steps);  // checks every rank skipped step 2
    require_same(ref, got);
    REQUIRE(got.scales[3] == 128);  // backed off once
  }
}

TEST_CASE("grad scaler: HSDP agrees over the shard and the replicate group",
          "[grad_scaler][hsdp]") {
  // 2 replicas x 2 shards; the inf is on global rank 1 (replica 0, shard 1: its shard group
  // learns of it from the shard all-reduce, the other replica from the replicate one) or on
  // global rank 2 (replica 1, shard 0).
  for (int global_inject : {1, 2}) {
    std::vector<std::vector<int>> stepped(4);
    std::vector<std::vector<double>> scales(4);
    std::mutex mu;
    run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& replicate) {
      TinyNet net = make_net();
      auto fsdp =
          fully_shard(net.ptr(), net_plan(*net), ShardingMesh(shard, &replicate), fp16_options());
      torch::optim::AdamW opt(fsdp->parameters(), adamw());
      GradScalerOptions so;
      so.init_scale = 256;
      ShardedGradScaler scaler(*fsdp, so);
      const int global = fsdp->mesh().global_rank();
      std::vector<int> my_stepped;
      std::vector<double> my_scales;
      for (int step = 0; step < 4; ++step) {
        opt.zero_grad();
        auto [x, y] = batch(global, step);
        at::Tensor loss = at::mse_loss(flatshard::call(net, x).to(at::kFloat), y);
        scaler.scale(loss).backward();
        if (step == 1 && global == global_inject) inject_inf(*fsdp);
        my_stepped.push_back(scaler.step(opt) ? 1 : 0);
        scaler.update();
        my_scales.push_back(scaler.get_scale());
      }
      std::lock_guard<std::mutex> lock(mu);
      stepped[global] = my_stepped;
      scales[global] = my_scales;
    });
    CAPTURE(global_inject);
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      CHECK(stepped[r] == std::vector<int>{1, 0, 1, 1});
      CHECK(scales[r] == std::vector<double>{256, 128, 128, 128});
    }
  }
}

TEST_CASE("grad scaler: a checkpoint carries the scaler state and training continues identically",
          "[grad_scaler][checkpoint]") {
  TempDir tmp;
  const std::string dir = tmp / "ckpt";
  Spec s;
  s.world = 2;
  s.scaler = overflowing();
  const int kSave = 5;  // saved after step kSave - 1, i.e. before step kSave
  GradScalerState saved;
  RankHooks save_hooks;
  save_hooks.after_step = [&](int step, ShardedModel& fsdp, torch::optim::AdamW& opt,
                              ShardedGradScaler& scaler) {
    if (step != kSave - 1) return;
    CheckpointOptions co;
    co.grad_scaler = &scaler;
    save_checkpoint(fsdp, &opt, dir, co);
    if (fsdp.comm().rank() == 0) saved = scaler.state_dict();
  };
  const Trace whole = run_sharded(s, 0, s.steps, save_hooks);
  REQUIRE(read_manifest(dir).grad_scaler.has_value());
  CHECK(read_manifest(dir).grad_scaler->scale == saved.scale);
  CHECK(read_manifest(dir).grad_scaler->growth_tracker == saved.growth_tracker);
  CHECK(read_manifest(dir).grad_scaler->growth_interval == 3);
  // The saved scale is not the initial one (the run had backed off / grown by then).
  REQUIRE(saved.scale != s.scaler.init_scale);

  // Resume: a scaler with the default options takes the saved scale, tracker and constants.
  Spec resumed = s;
  resumed.scaler = GradScalerOptions{};
  RankHooks load_hooks;
  load_hooks.before = [&](ShardedModel& fsdp, torch::optim::AdamW& opt, ShardedGradScaler& scaler) {
    LoadOptions lo;
    lo.grad_scaler = &scaler;
    load_checkpoint(fsdp, &opt, dir, lo);
    RANK_CHECK(scaler.get_scale() == saved.scale);
    RANK_CHECK(scaler.growth_tracker() == saved.growth_tracker);
    RANK_CHECK(scaler.state_dict().growth_interval == 3);
  };
  const Trace rest = run_sharded(resumed, kSave, s.steps, load_hooks);
  Trace tail;
  tail.losses.assign(whole.losses.begin() + kSave, whole.losses.end());
  tail.scales.assign(whole.scales.begin() + kSave, whole.scales.end());
  tail.stepped.assign(whole.stepped.begin() + kSave, whole.stepped.end());
  tail.params = whole.params;
  require_same(tail, rest);
}

TEST_CASE(
    "grad scaler: a checkpoint without scaler state is an error for an enabled scaler, "
    "ignored by a disabled one",
    "[grad_scaler][checkpoint]") {
  TempDir tmp;
  {
    const std::string plain = tmp / "plain";
    run_ranks(1, [&](Communicator& comm) {
      TinyNet net = make_net();
      auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
      torch::optim::AdamW opt(fsdp->parameters(), adamw());
      GradScalerOptions off;
      off.enabled = false;
      ShardedGradScaler disabled(*fsdp, off);
      CheckpointOptions co;
      co.grad_scaler = &disabled;  // a disabled scaler saves nothing
      save_checkpoint(*fsdp, &opt, plain, co);
      LoadOptions lo;
      lo.grad_scaler = &disabled;
      load_checkpoint(*fsdp, &opt, plain, lo);  // ignored
      ShardedGradScaler enabled(*fsdp);
      lo.grad_scaler = &enabled;
      RANK_REQUIRE_THROWS_WITH(
          load_checkpoint(*fsdp, &opt, plain, lo),
          Contains("saved without grad scaler state") && Contains("65536") && Contains("rank 0"));
      CHECK(enabled.get_scale() == 65536);
    });
    REQUIRE_FALSE(read_manifest(plain).grad_scaler.has_value());
  }
}

TEST_CASE("grad scaler: untrusted checkpoint values are checked", "[grad_scaler][checkpoint]") {
  TempDir tmp;
  const std::string dir = tmp / "ckpt";
  run_ranks(1, [&](Communicator& comm) {
    TinyNet net = make_net();
    auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
    torch::optim::AdamW opt(fsdp->parameters(), adamw());
    ShardedGradScaler scaler(*fsdp);
    CheckpointOptions co;
    co.grad_scaler = &scaler;
    save_checkpoint(*fsdp, &opt, dir, co);
  });
  const std::string manifest = dir + "/manifest.json";
  const std::string original = read_bytes(manifest);
  // Rewrites one grad_scaler field's JSON text and the manifest's CRC, as a tamperer would.
  auto tamper = [&](const std::string& field, const std::string& text) {
    json::Json doc = json::parse(original, manifest);
    doc.erase("manifest_crc32");
    const std::string placeholder = "987654321012345";
    doc["grad_scaler"][field] = std::stoll(placeholder);  // replaced by `text` below
    std::string body = doc.dump(1);
    body = body.substr(0, body.size() - 2);  // without "\n}"
    body.replace(body.find(placeholder), placeholder.size(), text);
    write_bytes(manifest, body + ",\n\"manifest_crc32\": \"" +
                              crc32_hex(crc32(body.data(), body.size())) + "\"\n}\n");
  };
  auto load_error = [&]() {
    std::string message;
    try {
      run_ranks(1, [&](Communicator& comm) {
        TinyNet net = make_net();
        auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
        torch::optim::AdamW opt(fsdp->parameters(), adamw());
        ShardedGradScaler scaler(*fsdp);
        LoadOptions lo;
        lo.grad_scaler = &scaler;
        load_checkpoint(*fsdp, &opt, dir, lo);
      });
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    return message;
  };
  tamper("scale", "65536");
  REQUIRE(load_error() == "");  // the tampering itself is harmless
  struct Case {
    std::string field, text, says;
  };
  for (const Case& c : std::vector<Case>{
           {"scale", "0", "becomes inf or NaN), got 0"},
           {"scale", "-65536", "becomes inf or NaN), got -65536"},
           {"scale", "1e39", "becomes inf or NaN), got 1e+39"},
           // Note [Loss scale range]: subnormal fp32 scales, whose reciprocal overflows fp32.
           {"scale", "1e-40",
            "scale must be a normal positive fp32 value in [1.17549e-38, 3.40282e+38]"},
           {"scale", "1e-40", "becomes inf or NaN), got 1e-40"},
           {"scale", "1e-45", "becomes inf or NaN), got 1e-45"},
           {"scale", "1e999", "number overflow parsing '1e999'"},
           {"scale", "\"inf\"", "/grad_scaler/scale"},
           {"growth_factor", "1", "growth_factor must be in (1, 2^16 = 65536], got 1"},
           {"growth_factor", "1e300", "growth_factor must be in (1, 2^16 = 65536], got 1e+300"},
           {"backoff_factor", "1.5", "backoff_factor must be in [2^-16 = 1.52588e-05, 1), got 1.5"},
           {"backoff_factor", "1e-300",
            "backoff_factor must be in [2^-16 = 1.52588e-05, 1), got 1e-300"},
           {"growth_interval", "0", "growth_interval must be in [1, 2^31 - 1], got 0"},
           {"growth_tracker", "2000",
            "growth_tracker must be in [0, growth_interval = 2000), got 2000"},
           {"growth_tracker", "1.5", "/grad_scaler/growth_tracker"},
       }) {
    CAPTURE(c.field, c.text);
    tamper(c.field, c.text);
    const std::string err = load_error();
    CAPTURE(err);
    CHECK_THAT(err, Contains(c.says) && Contains("manifest.json") && Contains("rank 0"));
  }
}

TEST_CASE("grad scaler: a run of skipped steps is not mistaken for an optimizer doing nothing",
          "[grad_scaler]") {
  // fsdp/step_guard.h warns after 10 reduced backward passes with no master changed (an
  // optimizer on the wrong tensors). Skipped steps leave the masters as they were, but the
  // usual loop clears the gradients before the next forward, which the guard reads as "no
  // step was meant": 12 skips in a row give no warning.
  struct Collector : c10::WarningHandler {
    void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
    std::vector<std::string> messages;
  };
  run_ranks(1, [&](Communicator& comm) {
    TinyNet net = make_net();
    auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
    torch::optim::AdamW opt(fsdp->parameters(), adamw());
    GradScalerOptions so;
    so.init_scale = 1e38;  // ~2^126: fp16 gradients overflow for the next ~100 steps
    ShardedGradScaler scaler(*fsdp, so);
    Collector warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    int skipped = 0;
    for (int step = 0; step < 12; ++step) {
      opt.zero_grad();
      auto [x, y] = batch(comm.rank(), step);
      scaler.scale(at::mse_loss(flatshard::call(net, x).to(at::kFloat), y)).backward();
      if (!scaler.step(opt)) ++skipped;
      scaler.update();
    }
    REQUIRE(skipped == 12);
    for (const auto& m : warnings.messages)
      CHECK(m.find("backward passes in a row") == std::string::npos);
  });
}

TEST_CASE("grad scaler: misuse is a clear error naming the call and the rank",
          "[grad_scaler][misuse]") {
  run_ranks(2, [&](Communicator& comm) {
    TinyNet net = make_net();
    auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
    torch::optim::AdamW opt(fsdp->parameters(), adamw());
    GradScalerOptions so;
    so.init_scale = 256;  // no overflow on this model
    ShardedGradScaler scaler(*fsdp, so);
    const std::string rank = "(rank " + std::to_string(comm.rank()) + ")";
    auto backward = [&] {
      opt.zero_grad();
      auto [x, y] = batch(comm.rank(), 0);
      scaler.scale(at::mse_loss(flatshard::call(net, x).to(at::kFloat), y)).backward();
    };
    RANK_REQUIRE_THROWS_WITH(scaler.update(),
                             Contains("no inf checks were recorded since the last update()") &&
                                 Contains("ShardedGradScaler::update " + rank));
    backward();
    scaler.unscale_(opt);
    RANK_REQUIRE_THROWS_WITH(
        scaler.unscale_(opt),
        Contains("unscale_() has already been called on this optimizer since the last update()") &&
            Contains(rank));
    RANK_REQUIRE_THROWS_WITH(scaler.load_state_dict(scaler.state_dict()),
                             Contains("inside a step") && Contains(rank));
    // (Collectives stay outside the RANK_ macros: they hold one lock for all rank threads.)
    bool stepped = scaler.step(opt);  // unscaled once, not twice: the step goes ahead
    RANK_CHECK(stepped);
    RANK_REQUIRE_THROWS_WITH(
        scaler.step(opt),
        Contains("step() has already been called since the last update()") && Contains(rank));
    RANK_REQUIRE_THROWS_WITH(scaler.unscale_(opt),
                             Contains("unscale_() is being called after step()") && Contains(rank));
    scaler.update();  // the scaler is usable after each error
    RANK_CHECK(scaler.get_scale() == 256);
    RANK_CHECK(scaler.growth_tracker() == 1);
    backward();
    stepped = scaler.step(opt);
    RANK_CHECK(stepped);
    scaler.update();

    RANK_REQUIRE_THROWS_WITH(scaler.scale(at::ones({1}, at::kLong)),
                             Contains("the loss must be a floating-point tensor, got Long"));
    GradScalerState bad = scaler.state_dict();
    bad.scale = std::numeric_limits<double>::quiet_NaN();
    RANK_REQUIRE_THROWS_WITH(
        scaler.load_state_dict(bad),
        Contains("scale must be a normal positive fp32 value") && Contains("got nan") &&
            Contains(rank));
    RANK_CHECK(scaler.get_scale() == 256);  // unchanged by the refused state

    // A local fault inside unscale_ (rank 1's optimizer holds an fp16 gradient) fails every
    // rank at the same point, naming rank 1: no rank is left waiting in the all-reduce.
    at::Tensor p = at::zeros({3}, comm.rank() == 1 ? at::kHalf : at::kFloat).requires_grad_();
    p.mutable_grad() = at::ones_like(p);
    torch::optim::AdamW odd({p}, adamw());
    std::string error;
    try {
      scaler.unscale_(odd);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    RANK_REQUIRE_THAT(error,
                      Contains("rank 1") && Contains("Half") && Contains("dense fp32 gradients"));
  });
}

TEST_CASE("grad scaler: invalid options name the field and the value", "[grad_scaler][misuse]") {
  {
    run_ranks(1, [&](Communicator& comm) {
      TinyNet net = make_net();
      auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
      auto with = [](auto set) {
        GradScalerOptions o;
        set(o);
        return o;
      };
      RANK_REQUIRE_THROWS_WITH(ShardedGradScaler(*fsdp, with([](auto& o) { o.init_scale = 0; })),
                               Contains("init_scale must be a normal positive fp32 value") &&
                                   Contains("got 0") && Contains("(rank 0)"));
      RANK_REQUIRE_THROWS_WITH(
          ShardedGradScaler(*fsdp, with([](auto& o) { o.init_scale = INFINITY; })),
          Contains("init_scale must be a normal positive fp32 value") && Contains("got inf"));
      RANK_REQUIRE_THROWS_WITH(ShardedGradScaler(*fsdp, with([](auto& o) { o.growth_factor = 1; })),
                               Contains("growth_factor must be in (1, 2^16 = 65536], got 1"));
      RANK_REQUIRE_THROWS_WITH(
          ShardedGradScaler(*fsdp, with([](auto& o) { o.backoff_factor = 0; })),
          Contains("backoff_factor must be in [2^-16 = 1.52588e-05, 1), got 0"));
      RANK_REQUIRE_THROWS_WITH(
          ShardedGradScaler(*fsdp, with([](auto& o) { o.growth_interval = 0; })),
          Contains("growth_interval must be in [1, 2^31 - 1], got 0"));
      // Note [Loss scale range]: a subnormal init_scale (1/S = inf in fp32) and factors that
      // move S by more than 2^16 in one update.
      RANK_REQUIRE_THROWS_WITH(
          ShardedGradScaler(*fsdp, with([](auto& o) { o.init_scale = 1e-40; })),
          Contains("GradScalerOptions.init_scale must be a normal positive fp32 value in "
                   "[1.17549e-38, 3.40282e+38]") &&
              Contains("got 1e-40"));
      RANK_REQUIRE_THROWS_WITH(
          ShardedGradScaler(*fsdp, with([](auto& o) { o.backoff_factor = 1e-300; })),
          Contains("backoff_factor must be in [2^-16 = 1.52588e-05, 1), got 1e-300"));
      RANK_REQUIRE_THROWS_WITH(
          ShardedGradScaler(*fsdp, with([](auto& o) { o.growth_factor = 1e300; })),
          Contains("growth_factor must be in (1, 2^16 = 65536], got 1e+300"));
      // The bounds themselves are valid.
      ShardedGradScaler(*fsdp, with([](auto& o) {
        o.init_scale = std::numeric_limits<float>::min();
        o.backoff_factor = 1.0 / 65536;
        o.growth_factor = 65536;
      }));
    });
  }
}

TEST_CASE("grad scaler: disabled, it is a pass-through", "[grad_scaler]") {
  run_ranks(2, [&](Communicator& comm) {
    TinyNet net = make_net();
    auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
    torch::optim::AdamW opt(fsdp->parameters(), adamw());
    GradScalerOptions off;
    off.enabled = false;
    ShardedGradScaler scaler(*fsdp, off);
    auto [x, y] = batch(comm.rank(), 0);
    at::Tensor loss = at::mse_loss(flatshard::call(net, x).to(at::kFloat), y);
    RANK_CHECK(scaler.scale(loss).is_same(loss));
    RANK_CHECK(scaler.get_scale() == 1.0);
    loss.backward();
    const int64_t before = fsdp->parameters()[0]._version();
    scaler.unscale_(opt);  // nothing, no collective
    const bool stepped = scaler.step(opt);
    RANK_CHECK(stepped);
    RANK_CHECK(fsdp->parameters()[0]._version() != before);  // stepped
    scaler.update();
    scaler.update();  // no step state to check when disabled
  });
}

TEST_CASE(
    "grad scaler: backing off stops at the smallest normal fp32 scale, and a gradient that "
    "overflows only once unscaled skips the step",
    "[grad_scaler]") {
  // Note [Loss scale range] (fsdp/grad_scaler.cpp). Gradients set by hand on a lone parameter:
  // the scaler's all-reduce and rules are the same for any optimizer.
  constexpr float kMin = std::numeric_limits<float>::min();  // 2^-126
  run_ranks(2, [&](Communicator& comm) {
    TinyNet net = make_net();
    auto fsdp = fully_shard(net.ptr(), net_plan(*net), comm, fp16_options());
    at::Tensor p = at::zeros({3}).requires_grad_();
    torch::optim::AdamW opt({p}, adamw());
    // One step with gradient `grad` on rank `on` (1 elsewhere); whether it stepped.
    auto step = [&](ShardedGradScaler& scaler, float grad, int on) {
      p.mutable_grad() = at::full({3}, comm.rank() == on ? grad : 1.0f);
      const bool stepped = scaler.step(opt);
      scaler.update();
      return stepped;
    };

    // S = 2^-10: 1e36 is finite, but 1e36 / S = 1.024e39 is inf in fp32. The kernel's check
    // reads the gradient before it is unscaled; the step must still be skipped on every rank
    // and the parameter stay finite.
    GradScalerOptions so;
    so.init_scale = std::ldexp(1.0, -10);
    ShardedGradScaler small(*fsdp, so);
    bool stepped = step(small, 1e36f, 1);
    RANK_CHECK(!stepped);
    RANK_CHECK(small.get_scale() == std::ldexp(1.0, -11));  // backed off
    RANK_CHECK(at::isfinite(p).all().item<bool>());
    RANK_CHECK(at::equal(p, at::zeros({3})));  // not stepped
    // A gradient that stays finite once unscaled steps as usual.
    stepped = step(small, 1e30f, 1);
    RANK_CHECK(stepped);
    RANK_CHECK(at::isfinite(p).all().item<bool>());

    // 2^-120 backed off by 2^-16 would be 2^-136, a subnormal whose reciprocal is inf in fp32:
    // held at 2^-126 instead, and again on the next overflow.
    so = GradScalerOptions{};
    so.init_scale = std::ldexp(1.0, -120);
    so.backoff_factor = 1.0 / 65536;
    ShardedGradScaler held(*fsdp, so);
    stepped = step(held, INFINITY, 1);
    RANK_CHECK(!stepped);
    RANK_CHECK(held.get_scale() == kMin);
    stepped = step(held, NAN, 0);
    RANK_CHECK(!stepped);
    RANK_CHECK(held.get_scale() == kMin);
    held.state_dict().check("the held scale");  // and a checkpoint of it loads
  });
}
