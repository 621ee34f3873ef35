// FusedAdamW (optim/fused_adamw.h) against torch::optim::AdamW: the same parameters, gradients
// and options give the same parameters and state after several steps, including parameter
// groups with their own options, a parameter without a gradient in some steps, and a flat
// master shard of a sharded model. Tolerance: both compute the same formula in fp32 in a
// different order of operations (rtol 1e-5, atol 1e-7 after 6 steps).
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <map>

#include "collectives/thread_communicator.h"
#include "optim/fused_adamw.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "tiny_net.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;

namespace {

std::vector<at::Tensor> make_params(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> ps;
  for (int64_t n : {7, 64, 1000, 3})
    ps.push_back(at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true));
  return ps;
}

void set_grads(std::vector<at::Tensor>& ps, int step) {
  for (size_t i = 0; i < ps.size(); ++i) {
    // Parameter 3 gets no gradient on odd steps: AdamW skips it (no decay, no count).
    if (i == 3 && step % 2 == 1) {
      ps[i].mutable_grad() = at::Tensor();
      continue;
    }
    auto g = at::sin(at::arange(ps[i].numel(), at::kFloat) * 0.37 + step + i) * (1.0 + i);
    ps[i].mutable_grad() = g;
  }
}

// One of two identical models a comparison trains side by side: TinyNet(5, 9, 3) sharded by
// `policy` under `o`, with a FusedAdamW over its masters or, with `groups`, two groups over the
// shard views (biases without decay at another learning rate); attached when `attach`.
struct TinySide {
  flatshard_test::TinyNet net{nullptr};
  std::unique_ptr<ShardedModel> fsdp;
  std::shared_ptr<FusedAdamW> opt;
  std::vector<double> losses;
};

TinySide make_tiny_side(Communicator& comm, const char* policy, const ShardingOptions& o,
                        bool groups, bool attach) {
  TinySide s;
  s.net = flatshard_test::TinyNet(5, 9, 3);
  flatshard_test::init_params(*s.net, 11);
  s.fsdp = fully_shard(s.net.ptr(), make_plan(*s.net, parse_policy(policy)), comm, o);
  const auto opts = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  if (groups) {
    std::vector<at::Tensor> decay, plain;
    for (auto& [name, p] : s.fsdp->named_parameters())
      (name.find("bias") == std::string::npos ? decay : plain).push_back(p);
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(decay);
    g.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(
                              torch::optim::AdamWOptions(3e-2).weight_decay(0)));
    s.opt = std::make_shared<FusedAdamW>(g, opts);
  } else {
    s.opt = std::make_shared<FusedAdamW>(s.fsdp->parameters(), opts);
  }
  if (attach) s.fsdp->attach_optimizer(s.opt);
  return s;
}

// zero_grad, forward on `x`, backward of the mean square; records the loss.
void tiny_backward(TinySide& s, const at::Tensor& x) {
  s.opt->zero_grad();
  at::Tensor loss = enter(s.net, [&] { return s.net->forward(x); }).to(at::kFloat).pow(2).mean();
  loss.backward();
  s.losses.push_back(loss.item<double>());
}

}  // namespace

TEST_CASE("FusedAdamW matches torch::optim::AdamW", "[fsdp][optim]") {
  auto a = make_params(1), b = make_params(1);
  auto opts = torch::optim::AdamWOptions(3e-2).weight_decay(0.1).betas({0.8, 0.95}).eps(1e-6);
  // Two groups: the second with its own learning rate and no decay.
  std::vector<torch::optim::OptimizerParamGroup> ga, gb;
  ga.emplace_back(std::vector<at::Tensor>{a[0], a[1]});
  ga.emplace_back(std::vector<at::Tensor>{a[2], a[3]},
                  std::make_unique<torch::optim::AdamWOptions>(
                      torch::optim::AdamWOptions(1e-2).weight_decay(0).betas({0.8, 0.95}).eps(1e-6)));
  gb.emplace_back(std::vector<at::Tensor>{b[0], b[1]});
  gb.emplace_back(std::vector<at::Tensor>{b[2], b[3]},
                  std::make_unique<torch::optim::AdamWOptions>(
                      torch::optim::AdamWOptions(1e-2).weight_decay(0).betas({0.8, 0.95}).eps(1e-6)));
  torch::optim::AdamW ref(ga, opts);
  FusedAdamW fused(gb, opts);
  for (int step = 0; step < 6; ++step) {
    set_grads(a, step);
    set_grads(b, step);
    ref.step();
    fused.step();
  }
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i, (a[i] - b[i]).abs().max().item<double>());
    CHECK(at::allclose(a[i], b[i], 1e-5, 1e-7));
    // The state is AdamW's, so checkpoints and state_dict users see no difference.
    auto& sa = static_cast<torch::optim::AdamWParamState&>(*ref.state().at(a[i].unsafeGetTensorImpl()));
    auto* sb = dynamic_cast<torch::optim::AdamWParamState*>(
        fused.state().at(b[i].unsafeGetTensorImpl()).get());
    REQUIRE(sb != nullptr);
    CHECK(sb->step() == sa.step());
    CHECK(at::allclose(sb->exp_avg_sq(), sa.exp_avg_sq(), 1e-5, 1e-9));
  }
  // The parameter without a gradient on odd steps was updated 3 times out of 6.
  CHECK(static_cast<torch::optim::AdamWParamState&>(*fused.state().at(b[3].unsafeGetTensorImpl()))
            .step() == 3);
}

TEST_CASE("FusedAdamW on a sharded model's flat master shards", "[fsdp][optim]") {
  run_ranks(2, [](Communicator& comm) {
    auto make = [&] {
      auto net = flatshard_test::TinyNet(5, 9, 2);
      flatshard_test::init_params(*net, 7);
      return net;
    };
    auto ref_net = make(), net = make();
    auto fa = fully_shard(ref_net.ptr(), make_plan(*ref_net, parse_policy("type=TinyBlock")), comm);
    auto fb = fully_shard(net.ptr(), make_plan(*net, parse_policy("type=TinyBlock")), comm);
    torch::optim::AdamW ref(fa->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    FusedAdamW fused(fb->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int step = 0; step < 4; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + comm.rank());
      auto x = at::randn({4, 5}, gen);
      ref.zero_grad();
      fused.zero_grad();
      enter(ref_net, [&] { return ref_net->forward(x); }).pow(2).mean().backward();
      enter(net, [&] { return net->forward(x); }).pow(2).mean().backward();
      ref.step();
      fused.step();
    }
    const auto pa = fa->gather_full_params(), pb = fb->gather_full_params();
    TORCH_CHECK(pa.size() == pb.size() && !pa.empty(), "parameter lists differ");
    for (size_t i = 0; i < pa.size(); ++i)
      TORCH_CHECK(at::allclose(pa[i].second, pb[i].second, 1e-5, 1e-7), "rank ", comm.rank(),
                  ": ", pa[i].first, " differs by ",
                  (pa[i].second - pb[i].second).abs().max().item<double>());
  });
}

TEST_CASE("Low-precision moments: bf16 AdamW moments are fp32 AdamW with the moments rounded to "
          "bf16 after each step, bit for bit", "[optim]") {
  // Note [Low-precision moments] (optim/fused_adamw.h). The reference is ATen's fused AdamW on
  // fp32 moments that the test itself rounds to bf16 after every step. Sizes straddle the CPU
  // step's 4 Mi-element block; one parameter gets no gradient on odd steps; two groups; a bf16
  // gradient (Note [Low-precision master gradient]) for one tensor; then a state round trip
  // through fp32 (what a checkpoint load gives back) continues identically.
  auto make = [] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    std::vector<at::Tensor> ps;
    for (int64_t n : std::vector<int64_t>{4194304 + 9, 1000, 7, 64})
      ps.push_back(at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true));
    return ps;
  };
  auto ps = make(), ref = make();
  const auto o = torch::optim::AdamWOptions(3e-2).weight_decay(0.1).betas({0.8, 0.95}).eps(1e-6);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{ps[0], ps[1]});
  groups.emplace_back(std::vector<at::Tensor>{ps[2], ps[3]},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-2).weight_decay(0).betas({0.8, 0.95})));
  FusedAdamW opt(std::move(groups), o);
  CHECK_THROWS_WITH(opt.set_moments_dtype(at::kHalf), Catch::Contains("bfloat16"));
  opt.set_moments_dtype(at::kBFloat16);
  std::vector<at::Tensor> m(ref.size()), v(ref.size());
  std::vector<int64_t> counts(ref.size(), 0);
  for (size_t i = 0; i < ref.size(); ++i) {
    m[i] = at::zeros({ref[i].numel()}, at::kBFloat16);
    v[i] = at::zeros({ref[i].numel()}, at::kBFloat16);
  }
  auto reference_step = [&](int step) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < ref.size(); ++i) {
      if (!ref[i].grad().defined()) continue;
      const bool second = i >= 2;
      const double lr = second ? 1e-2 : 3e-2, wd = second ? 0.0 : 0.1, eps = second ? 1e-8 : 1e-6;
      at::Tensor mf = m[i].to(at::kFloat), vf = v[i].to(at::kFloat);
      const at::Tensor st = at::full({}, static_cast<double>(++counts[i]), at::kFloat);
      at::_fused_adamw_({ref[i].detach()}, {ref[i].grad().to(at::kFloat)}, {mf}, {vf}, {}, {st},
                        lr, 0.8, 0.95, wd, eps, false, false);
      m[i] = mf.to(at::kBFloat16);
      v[i] = vf.to(at::kBFloat16);
    }
    (void)step;
  };
  auto compare = [&](int step) {
    for (size_t i = 0; i < ps.size(); ++i) {
      CAPTURE(step, i);
      REQUIRE(at::equal(ps[i], ref[i]));
      auto& st = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(ps[i].unsafeGetTensorImpl()));
      // A tensor not stepped since the fp32 round trip keeps that state until its next step.
      if (ps[i].grad().defined()) REQUIRE(st.exp_avg().scalar_type() == at::kBFloat16);
      REQUIRE(at::equal(st.exp_avg().to(at::kBFloat16), m[i]));
      REQUIRE(at::equal(st.exp_avg_sq().to(at::kBFloat16), v[i]));
    }
  };
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < ps.size(); ++i) {
      if (i == 3 && step % 2 == 1) {
        ps[i].mutable_grad() = at::Tensor();
        ref[i].mutable_grad() = at::Tensor();
        continue;
      }
      at::Tensor g = at::sin(at::arange(ps[i].numel(), at::kFloat) * 0.37 + step + i) * (1.0 + i);
      if (i == 1) g = g.to(at::kBFloat16);
      ps[i].mutable_grad() = g;
      ref[i].mutable_grad() = g;
    }
    if (step == 3) {  // the state as a checkpoint load leaves it: fp32 tensors of equal value
      for (auto& p : ps) {
        auto& st = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
        st.exp_avg(st.exp_avg().to(at::kFloat));
        st.exp_avg_sq(st.exp_avg_sq().to(at::kFloat));
      }
    }
    opt.step();
    reference_step(step);
    compare(step);
  }
  // Not the fp32 moments' result: the rounding is real (so the comparison above can fail).
  auto fp32 = make();
  FusedAdamW plain(fp32, o);
  for (int step = 0; step < 2; ++step) {
    for (auto& p : fp32)
      p.mutable_grad() = at::sin(at::arange(p.numel(), at::kFloat) * 0.37 + step) * 2.0;
    plain.step();
  }
  auto& st0 = static_cast<torch::optim::AdamWParamState&>(*plain.state().at(fp32[0].unsafeGetTensorImpl()));
  CHECK(st0.exp_avg().scalar_type() == at::kFloat);
  CHECK_FALSE(at::equal(st0.exp_avg(), st0.exp_avg().to(at::kBFloat16).to(at::kFloat)));
}

TEST_CASE("FusedAdamW bumps the version counters of what it writes", "[optim]") {
  // ATen's _fused_adamw_ writes in place without bumping versions; version-based checks (the
  // StepGuard's "did the optimizer change any master?") must still see the step. Empty tensors
  // (shard views a rank holds nothing of) are in the list too.
  auto ps = make_params(3);
  ps.push_back(at::zeros({0}, at::kFloat).requires_grad_(true));
  set_grads(ps, 0);
  ps.back().mutable_grad() = at::zeros({0}, at::kFloat);
  FusedAdamW opt(ps, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  std::vector<int64_t> before;
  for (auto& p : ps) before.push_back(static_cast<int64_t>(p._version()));
  opt.step();
  for (size_t i = 0; i < ps.size(); ++i) {
    CAPTURE(i);
    REQUIRE(static_cast<int64_t>(ps[i]._version()) > before[i]);
  }
}

TEST_CASE("FusedAdamW's captured step with bf16 gradients and a bf16 copy is bitwise the fused "
          "step on the upcast gradients", "[fsdp][optim]") {
  // Note [Host compute copy]: the CPU step runs per 4 Mi-element block (upcast the block's
  // gradient, step it, cast it into the copy). Sizes straddle the block (2 blocks + 4101, one
  // block exactly) and vector boundaries; two groups with their own options; a tensor without
  // a gradient in the captured step.
  auto make = [] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    std::vector<at::Tensor> ps;
    for (int64_t n : std::vector<int64_t>{8392709, 4194304, 131077, 17, 0, 4099})
      ps.push_back(at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true));
    return ps;
  };
  auto groups = [](const std::vector<at::Tensor>& ps) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{ps[0], ps[1], ps[2]});
    g.emplace_back(std::vector<at::Tensor>{ps[3], ps[4], ps[5]},
                   std::make_unique<torch::optim::AdamWOptions>(
                       torch::optim::AdamWOptions(1e-2).weight_decay(0).betas({0.8, 0.95})));
    return g;
  };
  auto ref_p = make(), mix_p = make();
  const auto opts = torch::optim::AdamWOptions(3e-2).weight_decay(0.1).eps(1e-6);
  FusedAdamW ref(groups(ref_p), opts), mix(groups(mix_p), opts);
  std::vector<at::Tensor> copies;
  for (const auto& p : mix_p) copies.push_back(at::full({p.numel()}, 7.0, at::kBFloat16));
  std::vector<FusedAdamW::Located> located;
  for (size_t i = 0; i < mix_p.size(); ++i) located.push_back({i < 3 ? size_t{0} : size_t{1}, mix_p[i]});
  for (int step = 0; step < 3; ++step) {
    std::vector<at::Tensor> bf16(mix_p.size());
    for (size_t i = 0; i < mix_p.size(); ++i) {
      const bool none = i == 5 && step == 1;  // no gradient this step: not stepped
      bf16[i] = none ? at::Tensor()
                     : (at::sin(at::arange(mix_p[i].numel(), at::kFloat) * 0.91 + step) * (1 + i))
                           .to(at::kBFloat16);
      ref_p[i].mutable_grad() = none ? at::Tensor() : bf16[i].to(at::kFloat);
    }
    ref.step();
    auto index = [&](const at::Tensor& p) {
      for (size_t i = 0; i < mix_p.size(); ++i)
        if (mix_p[i].is_same(p)) return i;
      return mix_p.size();
    };
    mix.run_step(mix.capture_located(
        located, [&](const at::Tensor& p) { return bf16[index(p)]; },
        [&](const at::Tensor& p) { return copies[index(p)]; }));
  }
  for (size_t i = 0; i < mix_p.size(); ++i) {
    CAPTURE(i);
    CHECK(at::equal(ref_p[i], mix_p[i]));
    CHECK(at::equal(copies[i], ref_p[i].detach().to(at::kBFloat16)));
    auto& sa = static_cast<torch::optim::AdamWParamState&>(*ref.state().at(ref_p[i].unsafeGetTensorImpl()));
    auto& sb = static_cast<torch::optim::AdamWParamState&>(*mix.state().at(mix_p[i].unsafeGetTensorImpl()));
    CHECK(sb.step() == sa.step());
    CHECK(at::equal(sb.exp_avg(), sa.exp_avg()));
    CHECK(at::equal(sb.exp_avg_sq(), sa.exp_avg_sq()));
  }
  // The copy is stepped values, not a copy of the start: it moved from its fill.
  CHECK_FALSE(at::equal(copies[0], at::full({copies[0].numel()}, 7.0, at::kBFloat16)));
  // A gradient wider than its parameter is refused, naming both.
  CHECK_THROWS_WITH(mix.capture_located(located, [&](const at::Tensor& p) {
                      return at::zeros({p.numel()}, at::kDouble);
                    }),
                    Catch::Contains("Double"));
}

TEST_CASE("Compute copy in the step: an attached FusedAdamW writes NO_SHARD bf16 units' copies, "
          "bit for bit what the gather's recast writes", "[fsdp][optim]") {
  // Note [Compute copy in the step] (optim/fused_adamw.h). Two identical models train alike, one
  // with the optimizer attached (its step writes the blocks' bf16 full() buffers, which the
  // next forward then uses without a recast), one without (the forward recasts). Losses and
  // masters must be equal bit for bit; right after each step, the attached model's NO_SHARD
  // parameters must already hold the cast of their updated masters, which the other model's
  // cannot yet (so the check can fail). Variants: parameter groups over the shard views, and a
  // master written in place after the step (the copies are then stale: the gather recasts).
  for (int world : {1, 2})
    for (bool groups : {false, true})
      for (bool write_after : {false, true}) {
        CAPTURE(world, groups, write_after);
        run_ranks(world, [&](Communicator& comm) {
          ShardingOptions o;
          o.mixed_precision.param_dtype = at::kBFloat16;
          o.mixed_precision.reduce_dtype = at::kFloat;
          using Side = TinySide;
          auto make = [&](bool attach) {
            return make_tiny_side(comm, "noshard:type=TinyBlock", o, groups, attach);
          };
          Side a = make(true), b = make(false);
          int copies = 0;
          for (const auto& u : a.fsdp->units()) copies += u.step_copy ? 1 : 0;
          TORCH_CHECK(copies == 3, "rank ", comm.rank(), ": ", copies, " units keep a step copy");
          // Whether every NO_SHARD parameter of `s` holds the bf16 cast of its master now.
          auto copies_current = [](Side& s) {
            const auto full = s.fsdp->gather_full_params();
            std::map<std::string, at::Tensor> by_name(full.begin(), full.end());
            bool all = true;
            for (const auto& item : s.net->named_parameters())
              if (item.key().rfind("blocks.", 0) == 0)
                all = all && at::equal(item.value().detach(),
                                       by_name.at(item.key()).to(at::kBFloat16));
            return all;
          };
          for (int step = 0; step < 4; ++step) {
            auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + comm.rank());
            const auto x = at::randn({4, 5}, gen).to(at::kBFloat16);
            for (Side* s : {&a, &b}) {
              tiny_backward(*s, x);
              s->opt->step();
            }
            if (write_after) {
              for (Side* s : {&a, &b}) {
                at::NoGradGuard no_grad;
                for (auto& p : s->fsdp->parameters()) p.mul_(0.999);
              }
            } else {
              TORCH_CHECK(copies_current(a), "rank ", comm.rank(), " step ", step,
                          ": the attached step did not write the copies");
              TORCH_CHECK(!copies_current(b), "rank ", comm.rank(), " step ", step,
                          ": the unattached model's copies are already current");
            }
          }
          TORCH_CHECK(a.losses == b.losses, "rank ", comm.rank(), ": losses differ, first ",
                      a.losses[0], " vs ", b.losses[0], ", last ", a.losses.back(), " vs ",
                      b.losses.back());
          const auto pa = a.fsdp->gather_full_params(), pb = b.fsdp->gather_full_params();
          for (size_t i = 0; i < pa.size(); ++i)
            TORCH_CHECK(at::equal(pa[i].second, pb[i].second), "rank ", comm.rank(), ": ",
                        pa[i].first, " differs by ",
                        (pa[i].second - pb[i].second).abs().max().item<double>());
        });
      }
}

TEST_CASE("Kept compute shard: sharded bf16 units whose attached step writes their kept shard "
          "train bit for bit as the gather's cast", "[fsdp][optim]") {
  // Note [Kept compute shard] (flat_param/collective_plan.h). Model a keeps each sharded unit's
  // bf16 shard and has the optimizer attached (the step writes the shards; the gathers cast
  // nothing); model b is the plain sharded path (every gather casts the master). Losses and
  // masters must be equal bit for bit. Variants: parameter groups over the shard views, and a
  // master written in place after the step (the kept shards are then stale: the gather recasts).
  for (int world : {1, 2, 3})
    for (bool groups : {false, true})
      for (bool write_after : {false, true}) {
        CAPTURE(world, groups, write_after);
        run_ranks(world, [&](Communicator& comm) {
          ShardingOptions o;
          o.mixed_precision.param_dtype = at::kBFloat16;
          o.mixed_precision.reduce_dtype = at::kFloat;
          ShardingOptions kept = o;
          kept.keep_compute_shard = true;
          TinySide a = make_tiny_side(comm, "type=TinyBlock", kept, groups, true);
          TinySide b = make_tiny_side(comm, "type=TinyBlock", o, groups, false);
          for (const auto& u : a.fsdp->units())
            TORCH_CHECK(u.step_copy, "rank ", comm.rank(), ": unit ", u.name, " keeps no shard");
          for (const auto& u : b.fsdp->units())
            TORCH_CHECK(!u.step_copy, "rank ", comm.rank(), ": unit ", u.name, " keeps a copy");
          for (int step = 0; step < 4; ++step) {
            auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + comm.rank());
            const auto x = at::randn({4, 5}, gen).to(at::kBFloat16);
            for (TinySide* s : {&a, &b}) {
              tiny_backward(*s, x);
              s->opt->step();
            }
            if (write_after) {
              for (TinySide* s : {&a, &b}) {
                at::NoGradGuard no_grad;
                for (auto& p : s->fsdp->parameters()) p.mul_(0.999);
              }
            }
          }
          TORCH_CHECK(a.losses == b.losses, "rank ", comm.rank(), ": losses differ, first ",
                      a.losses[0], " vs ", b.losses[0], ", last ", a.losses.back(), " vs ",
                      b.losses.back());
          const auto pa = a.fsdp->gather_full_params(), pb = b.fsdp->gather_full_params();
          TORCH_CHECK(pa.size() == pb.size() && !pa.empty(), "rank ", comm.rank());
          for (size_t i = 0; i < pa.size(); ++i)
            TORCH_CHECK(at::equal(pa[i].second, pb[i].second), "rank ", comm.rank(), ": ",
                        pa[i].first, " differs by ",
                        (pa[i].second - pb[i].second).abs().max().item<double>());
        });
      }
}

TEST_CASE("FusedAdamW::set_compute_copies rejects a pair that does not match", "[optim]") {
  auto ps = make_params(5);
  FusedAdamW opt(ps, torch::optim::AdamWOptions(1e-2));
  auto set = [&](const at::Tensor& copy) {
    FusedAdamW::ComputeCopies c;
    c.tensors.emplace_back(ps[1], copy);
    c.current = [] { return true; };
    c.written = [] {};
    opt.set_compute_copies({c});
  };
  CHECK_THROWS_WITH(set(at::zeros({63}, at::kBFloat16)), Catch::Contains("63 of BFloat16"));
  CHECK_THROWS_WITH(set(at::zeros({64}, at::kFloat)), Catch::Contains("narrower floating"));
  CHECK_NOTHROW(set(at::zeros({64}, at::kBFloat16)));
  // Written in the step: the copy holds the cast of the updated parameter.
  at::Tensor copy = at::zeros({64}, at::kHalf);
  set(copy);
  set_grads(ps, 0);
  opt.step();
  CHECK(at::equal(copy, ps[1].detach().to(at::kHalf)));
}

TEST_CASE("Low-precision master gradient: bf16 master gradients train bit for bit as their fp32 "
          "upcasts; clipping rounds once in bf16", "[fsdp][optim]") {
  // Note [Low-precision master gradient] (flat_param/collective_plan.h). Two identical models,
  // bf16 compute and reduction, one with keep_low_precision_grads. After every backward the
  // kept model's gradients must be bf16 and equal to the other's fp32 ones (which are exact
  // upcasts of bf16 values); without clipping, losses and masters stay equal bit for bit
  // (FusedAdamW reads the bf16 gradient and upcasts exactly). With clipping, both compute the
  // same fp32 norm, and the kept gradient is the fp32 clipped gradient rounded to bf16 once.
  // Variants: one rank (the one-rank path's copy) and two (the reduce-scatter's output kept),
  // sharded and NO_SHARD blocks (whose step also writes the compute copy), parameter groups
  // over the shard views.
  for (int world : {1, 2})
    for (const char* policy : {"type=TinyBlock", "noshard:type=TinyBlock"})
      for (bool groups : {false, true})
        for (bool clip : {false, true}) {
          CAPTURE(world, policy, groups, clip);
          run_ranks(world, [&](Communicator& comm) {
            using Side = TinySide;
            auto make = [&](bool keep) {
              ShardingOptions o;
              o.mixed_precision.param_dtype = at::kBFloat16;
              o.mixed_precision.keep_low_precision_grads = keep;
              // Note [Compute copy in the step]: NO_SHARD blocks' copies written in the step.
              return make_tiny_side(comm, policy, o, groups,
                                    std::string(policy).rfind("noshard", 0) == 0);
            };
            Side a = make(true), b = make(false);
            for (int step = 0; step < 4; ++step) {
              auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + comm.rank());
              const auto x = at::randn({4, 5}, gen).to(at::kBFloat16);
              double norms[2] = {0, 0};
              for (Side* s : {&a, &b}) tiny_backward(*s, x);
              const auto ga = a.fsdp->parameters(), gb = b.fsdp->parameters();
              TORCH_CHECK(ga.size() == gb.size() && !ga.empty(), "rank ", comm.rank());
              for (size_t i = 0; i < ga.size(); ++i) {
                const at::Tensor &x1 = ga[i].grad(), &x2 = gb[i].grad();
                TORCH_CHECK(x1.defined() && x2.defined(), "rank ", comm.rank(), " param ", i);
                TORCH_CHECK(x1.scalar_type() == at::kBFloat16 && x2.scalar_type() == at::kFloat,
                            "rank ", comm.rank(), " param ", i, ": gradients of ",
                            x1.scalar_type(), " and ", x2.scalar_type());
                TORCH_CHECK(at::equal(x1.to(at::kFloat), x2), "rank ", comm.rank(), " step ",
                            step, " param ", i, ": the kept gradient is not the upcast one's");
              }
              if (clip) {
                int k = 0;
                for (Side* s : {&a, &b}) norms[k++] = s->fsdp->clip_grad_norm_(1e-3);
                TORCH_CHECK(norms[0] == norms[1] && norms[0] > 1e-3, "rank ", comm.rank(),
                            ": norms ", norms[0], " and ", norms[1]);
                for (size_t i = 0; i < ga.size(); ++i)
                  TORCH_CHECK(at::equal(ga[i].grad(), gb[i].grad().to(at::kBFloat16)), "rank ",
                              comm.rank(), " step ", step, " param ", i,
                              ": the clipped bf16 gradient is not the fp32 one rounded");
                // From here the two models' gradients differ by that rounding; step each with
                // the same gradient (b's rounded) so the optimizer is still compared.
                at::NoGradGuard no_grad;
                for (size_t i = 0; i < gb.size(); ++i)
                  gb[i].mutable_grad().copy_(ga[i].grad().to(at::kFloat));
              }
              for (Side* s : {&a, &b}) s->opt->step();
            }
            TORCH_CHECK(a.losses == b.losses, "rank ", comm.rank(), ": losses differ, first ",
                        a.losses[0], " vs ", b.losses[0], ", last ", a.losses.back(), " vs ",
                        b.losses.back());
            const auto pa = a.fsdp->gather_full_params(), pb = b.fsdp->gather_full_params();
            for (size_t i = 0; i < pa.size(); ++i)
              TORCH_CHECK(at::equal(pa[i].second, pb[i].second), "rank ", comm.rank(), ": ",
                          pa[i].first, " differs by ",
                          (pa[i].second - pb[i].second).abs().max().item<double>());
            // The full gradients come back in the kept dtype.
            const auto fa = a.fsdp->gather_full_grads();
            TORCH_CHECK(!fa.empty() && fa[0].second.scalar_type() == at::kBFloat16, "rank ",
                        comm.rank());
          });
        }
}

TEST_CASE("Low-precision master gradient: refused with offload, and by the gradient scaler, "
          "with messages", "[fsdp][optim]") {
  run_ranks(1, [&](Communicator& comm) {
    ShardingOptions o;
    o.mixed_precision.param_dtype = at::kBFloat16;
    o.mixed_precision.keep_low_precision_grads = true;
    o.offload = 1;
    auto net = flatshard_test::TinyNet(5, 9, 3);
    try {
      auto fsdp = fully_shard(net.ptr(), make_plan(*net, parse_policy("type=TinyBlock")), comm, o);
      TORCH_CHECK(false, "offload with keep_low_precision_grads was accepted");
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK(what.find("keep_low_precision_grads cannot be combined with offload") !=
                      std::string::npos,
                  "unexpected message: ", what);
    }
    o.offload = 0;
    o.mixed_precision.param_dtype = at::kHalf;
    auto net2 = flatshard_test::TinyNet(5, 9, 3);
    auto fsdp = fully_shard(net2.ptr(), make_plan(*net2, parse_policy("type=TinyBlock")), comm, o);
    auto opt = std::make_shared<FusedAdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    ShardedGradScaler scaler(*fsdp);
    const auto x = at::ones({4, 5}, at::kHalf);
    at::Tensor loss = enter(net2, [&] { return net2->forward(x); }).to(at::kFloat).pow(2).mean();
    scaler.scale(loss).backward();
    try {
      scaler.unscale_(*opt);
      TORCH_CHECK(false, "the scaler unscaled fp16 master gradients");
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK(what.find("keep_low_precision_grads off") != std::string::npos,
                  "unexpected message: ", what);
    }
  });
}
