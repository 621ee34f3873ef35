// FlatParam: flatten -> shard -> all-gather -> views is bit-exact for odd sizes and world sizes
// 1..4; padding never leaks into values or gradients; one reduce-scatter averages gradients;
// deferred gradient copies (done by reduce_grad) give the same sums as immediate ones.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <algorithm>

#include "collectives/thread_communicator.h"
#include "flat_param/flat_param.h"
#include "rank_require.h"

using namespace flatshard;

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {7}, {1}, {2, 3, 3}, {11}};

std::vector<at::Tensor> make_params(int64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<at::Tensor> ps;
  for (const auto& s : kShapes) ps.push_back(at::randn(s, gen).requires_grad_(true));
  return ps;
}

std::vector<ParamRef> refs(const std::vector<at::Tensor>& ps) {
  std::vector<ParamRef> r;
  for (size_t i = 0; i < ps.size(); ++i) r.push_back({"p" + std::to_string(i), ps[i]});
  return r;
}

}  // namespace

TEST_CASE("FlatLayout aligns every parameter and pads to world * align", "[flat_param]") {
  auto l = FlatLayout::make(kShapes, 3, 4);
  REQUIRE(l.offsets == std::vector<int64_t>{0, 16, 24, 28, 48});
  REQUIRE(l.used_numel == 15 + 7 + 1 + 18 + 11);
  REQUIRE(l.padded_numel == 60);  // 48 + 11 = 59 -> multiple of 12
  REQUIRE(l.shard_numel == 20);
  auto one = FlatLayout::make({{5}}, 1, 1);
  REQUIRE(one.padded_numel == 5);
  auto empty = FlatLayout::make({}, 4, 8);
  REQUIRE(empty.padded_numel == 0);
  REQUIRE(empty.shard_numel == 0);
}

TEST_CASE("flatten, shard, all-gather and views are bit-exact", "[flat_param]") {
  for (int world = 1; world <= 4; ++world)
    for (int64_t align : {1, 8})
      for (auto dtype : {at::kFloat, at::kBFloat16}) {
        CAPTURE(world, align, dtype);
        run_ranks(world, [&](Communicator& c) {
          auto ps = make_params(7);  // identical on every rank
          std::vector<at::Tensor> orig;
          for (auto& p : ps) orig.push_back(p.detach().clone());
          FlatParamConfig cfg;
          cfg.align = align;
          cfg.param_dtype = dtype;
          FlatParam fp("unit", refs(ps), c, cfg);
          const auto& l = fp.layout();
          RANK_REQUIRE(l.padded_numel % (world * align) == 0);
          RANK_REQUIRE(fp.master().numel() == l.shard_numel);
          RANK_REQUIRE(fp.master().scalar_type() == at::kFloat);
          RANK_REQUIRE(fp.master().requires_grad());
          RANK_REQUIRE_FALSE(fp.is_unsharded());  // storage freed after setup
          // The master shard is this rank's slice of the padded concatenation (padding zero).
          auto expect = at::zeros({l.padded_numel});
          for (size_t i = 0; i < orig.size(); ++i)
            expect.narrow(0, l.offsets[i], l.numels[i]).copy_(orig[i].reshape({-1}));
          RANK_REQUIRE(at::equal(fp.master().detach(),
                                 expect.narrow(0, l.shard_begin(c.rank()), l.shard_numel)));

          fp.unshard(c.current_stream());
          RANK_REQUIRE(fp.is_unsharded());
          for (size_t i = 0; i < ps.size(); ++i) {
            RANK_REQUIRE(ps[i].scalar_type() == dtype);
            RANK_REQUIRE(ps[i].sizes() == orig[i].sizes());
            RANK_REQUIRE(at::equal(ps[i].detach(), orig[i].to(dtype)));
            RANK_REQUIRE(ps[i].is_leaf());
          }
          RANK_REQUIRE(at::equal(fp.full(), expect.to(dtype)));  // padding gathered as zeros

          fp.reshard();
          RANK_REQUIRE_FALSE(fp.is_unsharded());
          fp.unshard(c.current_stream());  // and again: the views survive the free
          for (size_t i = 0; i < ps.size(); ++i)
            RANK_REQUIRE(at::equal(ps[i].detach(), orig[i].to(dtype)));
        });
      }
}

TEST_CASE("one reduce-scatter averages flat gradients; padding stays zero", "[flat_param]") {
  for (int world = 1; world <= 4; ++world)
    for (bool sharded : {true, false}) {
      CAPTURE(world, sharded);
      run_ranks(world, [&](Communicator& c) {
        auto ps = make_params(3);
        FlatParamConfig cfg;
        cfg.sharded = sharded;
        FlatParam fp("unit", refs(ps), c, cfg);
        const auto& l = fp.layout();
        fp.unshard(c.current_stream());
        fp.prepare_grad();
        // Rank r's gradient of parameter i, element j: (r + 1) * (i + 1) + j, delivered as
        // AccumulateGrad does: a fresh .grad the first time, in place into .grad afterwards.
        auto add_grads = [&] {
          for (size_t i = 0; i < ps.size(); ++i) {
            auto g = at::arange(ps[i].numel(), at::kFloat).add_((c.rank() + 1.0) * (i + 1.0));
            at::Tensor& pg = ps[i].mutable_grad();
            if (pg.defined()) {
              pg.add_(g.view(ps[i].sizes()));
            } else {
              pg = g.view(ps[i].sizes());
            }
            fp.accept_grad(i);
          }
        };
        const double mean_r1 = (world + 1) / 2.0;  // mean over ranks of (r + 1)
        auto expect = at::zeros({l.padded_numel});  // padding stays zero
        for (size_t i = 0; i < ps.size(); ++i)
          expect.narrow(0, l.offsets[i], l.numels[i])
              .copy_(at::arange(l.numels[i], at::kFloat).add_(mean_r1 * (i + 1.0)));
        at::Tensor mine = sharded ? expect.narrow(0, l.shard_begin(c.rank()), l.shard_numel) : expect;
        add_grads();
        // The parameters' .grad are now views of the flat gradient.
        RANK_REQUIRE(fp.full_grad().narrow(0, l.offsets[1], 1).item<float>() ==
                     (c.rank() + 1.0f) * 2);
        RANK_REQUIRE(ps[1].grad().data_ptr() ==
                     fp.full_grad().narrow(0, l.offsets[1], 1).data_ptr());
        // A second backward before the reduction (accumulation without sync) adds in place.
        add_grads();
        RANK_REQUIRE(fp.full_grad().narrow(0, l.offsets[1], 1).item<float>() ==
                     (c.rank() + 1.0f) * 4);
        fp.reduce_grad(c.current_stream());
        RANK_REQUIRE_FALSE(ps[0].grad().defined());  // cleared after the reduction
        RANK_REQUIRE(at::allclose(fp.master().grad(), mine * 2, 1e-6, 1e-6));
        fp.master().mutable_grad() = at::Tensor();
        // One backward, one reduction.
        fp.prepare_grad();
        add_grads();
        fp.reduce_grad(c.current_stream());
        RANK_REQUIRE(fp.master().grad().sizes() == mine.sizes());
        RANK_REQUIRE(at::allclose(fp.master().grad(), mine, 1e-6, 1e-6));
        // A second backward's reduction accumulates into the master gradient.
        fp.prepare_grad();
        add_grads();
        fp.reduce_grad(c.current_stream());
        RANK_REQUIRE(at::allclose(fp.master().grad(), mine * 2, 1e-6, 1e-6));
      });
    }
}

TEST_CASE("flat parameters refuse mixed dtypes and devices with a clear error", "[flat_param]") {
  run_ranks(1, [](Communicator& c) {
    std::vector<ParamRef> ps = {{"a", at::ones({2}).requires_grad_(true)},
                                {"b", at::ones({2}, at::kDouble).requires_grad_(true)}};
    RANK_REQUIRE_THROWS_WITH(FlatParam("blk", ps, c, FlatParamConfig{}),
                             Catch::Contains("unit 'blk'") && Catch::Contains("'a' is Float") &&
                                 Catch::Contains("'b' is Double"));
    std::vector<ParamRef> ints = {{"i", at::ones({2}, at::kLong)}};
    RANK_REQUIRE_THROWS_WITH(FlatParam("blk", ints, c, FlatParamConfig{}),
                             Catch::Contains("floating-point parameters only"));
  });
}

TEST_CASE("debug padding poison: gathered padding is NaN, values and gradients unaffected",
          "[flat_param]") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    run_ranks(world, [&](Communicator& c) {
      auto ps = make_params(5);
      std::vector<at::Tensor> orig;
      for (auto& p : ps) orig.push_back(p.detach().clone());
      FlatParamConfig cfg;
      cfg.poison_padding = true;
      FlatParam fp("unit", refs(ps), c, cfg);
      const auto& l = fp.layout();
      fp.unshard(c.current_stream());
      // Every element outside a parameter's range is NaN; every parameter is intact.
      auto is_param = at::zeros({l.padded_numel}, at::kBool);
      for (size_t i = 0; i < ps.size(); ++i) {
        is_param.narrow(0, l.offsets[i], l.numels[i]).fill_(true);
        RANK_REQUIRE(at::equal(ps[i].detach(), orig[i]));
      }
      RANK_REQUIRE(l.padding() > 0);
      RANK_REQUIRE(fp.full().masked_select(is_param.logical_not()).isnan().all().item<bool>());
      RANK_REQUIRE_FALSE(fp.full().masked_select(is_param).isnan().any().item<bool>());
      // Gradients live in their own buffer: the reduced master gradient has no NaN.
      fp.prepare_grad();
      // The fresh flat gradient is NaN; parameter 0 gets no gradient: reduce_grad() must zero
      // it and the padding, and overwrite the rest.
      RANK_REQUIRE(fp.full_grad().isnan().all().item<bool>());
      for (size_t i = 1; i < ps.size(); ++i) {
        ps[i].mutable_grad() = at::ones_like(ps[i]);
        fp.accept_grad(i);
      }
      fp.reduce_grad(c.current_stream());
      RANK_REQUIRE_FALSE(fp.master().grad().isnan().any().item<bool>());
      auto expect = at::zeros({l.padded_numel});
      for (size_t i = 1; i < ps.size(); ++i) expect.narrow(0, l.offsets[i], l.numels[i]).fill_(1.0);
      RANK_REQUIRE(
          at::equal(fp.master().grad(), expect.narrow(0, l.shard_begin(c.rank()), l.shard_numel)));
    });
  }
}

namespace {

// Closed-form gradients for the deferred-copy tests. Rank r's gradient of parameter i, element
// j: a = (r + 1) * (i + 1) + j and b = 10 * (r + 1) - j, so their mean over ranks is
// m * (i + 1) + j and 10 * m - j with m = (world + 1) / 2. Small integers: exact in bf16.
at::Tensor grad_a(const at::Tensor& p, int rank, size_t i) {
  return at::arange(p.numel(), at::kFloat)
      .add_((rank + 1.0) * (i + 1.0))
      .to(p.scalar_type())
      .view(p.sizes());
}
at::Tensor grad_b(const at::Tensor& p, int rank) {
  return at::arange(p.numel(), at::kFloat)
      .neg_()
      .add_(10.0 * (rank + 1.0))
      .to(p.scalar_type())
      .view(p.sizes());
}
// The padded flat vector whose parameter i holds ka * mean(a) + kb * mean(b) (padding zero).
at::Tensor expected_mean(const FlatLayout& l, int world, const std::vector<double>& ka,
                         const std::vector<double>& kb) {
  const double m = (world + 1) / 2.0;
  auto e = at::zeros({l.padded_numel});
  for (size_t i = 0; i < l.numels.size(); ++i) {
    auto j = at::arange(l.numels[i], at::kFloat);
    e.narrow(0, l.offsets[i], l.numels[i])
        .copy_((j + m * (i + 1.0)) * ka[i] + (j.neg() + 10.0 * m) * kb[i]);
  }
  return e;
}
at::Tensor my_part(const at::Tensor& full, const FlatLayout& l, bool sharded, int rank) {
  return sharded ? full.narrow(0, l.shard_begin(rank), l.shard_numel) : full;
}
bool region_is_nan(const FlatParam& fp, size_t i) {
  const auto& l = fp.layout();
  return fp.full_grad().narrow(0, l.offsets[i], l.numels[i]).isnan().all().item<bool>();
}
bool is_flat_view(const FlatParam& fp, const at::Tensor& g, size_t i) {
  return g.data_ptr() == fp.full_grad().narrow(0, fp.layout().offsets[i], 1).data_ptr();
}

}  // namespace

TEST_CASE("deferred gradient copies: accept_grad leaves the flat gradient to reduce_grad",
          "[flat_param]") {
  for (int world : {1, 2, 3})
    for (bool sharded : {true, false})
      for (auto dtype : {at::kFloat, at::kBFloat16}) {
        CAPTURE(world, sharded, dtype);
        run_ranks(world, [&](Communicator& c) {
          auto ps = make_params(3);
          FlatParamConfig cfg;
          cfg.sharded = sharded;
          cfg.param_dtype = dtype;
          cfg.poison_padding = true;  // a region nobody wrote yet reads NaN
          FlatParam fp("unit", refs(ps), c, cfg);
          const auto& l = fp.layout();
          const size_t n = ps.size();
          fp.unshard(c.current_stream());
          fp.set_defer_grad_copies(true);
          fp.prepare_grad();
          // Parameter 0 gets no gradient; the others a fresh one (AccumulateGrad keeps it), then
          // an in-place addition into that same tensor (AccumulateGrad's usual accumulation).
          std::vector<at::Tensor> given(n);
          for (size_t i = 1; i < n; ++i) {
            given[i] = grad_a(ps[i], c.rank(), i);
            ps[i].mutable_grad() = given[i];
            fp.accept_grad(i);
            ps[i].mutable_grad().add_(grad_a(ps[i], c.rank(), i));
            fp.accept_grad(i);
          }
          // Nothing copied yet: the flat gradient is still all NaN, .grad the original tensor.
          RANK_REQUIRE(fp.full_grad().isnan().all().item<bool>());
          for (size_t i = 1; i < n; ++i) {
            RANK_REQUIRE(ps[i].grad().is_same(given[i]));
            RANK_REQUIRE(at::equal(given[i], grad_a(ps[i], c.rank(), i) * 2));
          }
          auto in_use = fp.reduce_grad(c.current_stream());
          std::vector<double> ka(n, 2.0), kb(n, 0.0);
          ka[0] = 0.0;
          auto expect = my_part(expected_mean(l, world, ka, kb), l, sharded, c.rank());
          RANK_REQUIRE(fp.master().grad().scalar_type() == at::kFloat);
          RANK_REQUIRE(at::allclose(fp.master().grad(), expect, 1e-6, 1e-6));
          for (size_t i = 0; i < n; ++i) RANK_REQUIRE_FALSE(ps[i].grad().defined());
          // The reduce stream read the gradients: they are among the buffers to keep alive.
          // (No CAPTURE here: Catch2's message stream is not thread-safe; rank_require.h.)
          for (size_t i = 1; i < n; ++i)
            RANK_REQUIRE(std::any_of(in_use.begin(), in_use.end(),
                                     [&](const at::Tensor& t) { return t.is_same(given[i]); }));

          // drop_grad() forgets pending gradients: a pass that is dropped leaves nothing behind
          // for the next reduction (here parameter 0, which gets no gradient next time).
          fp.master().mutable_grad() = at::Tensor();
          fp.prepare_grad();
          for (size_t i = 0; i < n; ++i) {
            ps[i].mutable_grad() = grad_b(ps[i], c.rank());
            fp.accept_grad(i);
          }
          fp.drop_grad();
          for (size_t i = 0; i < n; ++i) RANK_REQUIRE_FALSE(ps[i].grad().defined());
          fp.prepare_grad();
          for (size_t i = 1; i < n; ++i) {
            ps[i].mutable_grad() = grad_a(ps[i], c.rank(), i);
            fp.accept_grad(i);
          }
          fp.reduce_grad(c.current_stream());
          ka.assign(n, 1.0);
          ka[0] = 0.0;
          expect = my_part(expected_mean(l, world, ka, kb), l, sharded, c.rank());
          RANK_REQUIRE(at::allclose(fp.master().grad(), expect, 1e-6, 1e-6));
        });
      }
}

TEST_CASE("deferred gradient copies: an out-of-place accumulation replaces the pending gradient",
          "[flat_param]") {
  for (int world : {1, 2, 3})
    for (bool sharded : {true, false}) {
      CAPTURE(world, sharded);
      run_ranks(world, [&](Communicator& c) {
        auto ps = make_params(4);
        FlatParamConfig cfg;
        cfg.sharded = sharded;
        cfg.poison_padding = true;
        FlatParam fp("unit", refs(ps), c, cfg);
        const auto& l = fp.layout();
        const size_t n = ps.size();
        fp.unshard(c.current_stream());
        fp.set_defer_grad_copies(true);
        fp.prepare_grad();
        for (size_t i = 0; i < n; ++i) {
          ps[i].mutable_grad() = grad_a(ps[i], c.rank(), i);
          fp.accept_grad(i);
          // AccumulateGrad out of place: .grad = .grad + new, a new tensor holding both.
          at::Tensor sum = ps[i].grad() + grad_b(ps[i], c.rank());
          ps[i].mutable_grad() = sum;
          fp.accept_grad(i);
          RANK_REQUIRE(ps[i].grad().is_same(sum));
          RANK_REQUIRE(region_is_nan(fp, i));
        }
        fp.reduce_grad(c.current_stream());
        // a + b once each: neither the replaced tensor alone nor both tensors added.
        auto expect = my_part(expected_mean(l, world, std::vector<double>(n, 1.0),
                                            std::vector<double>(n, 1.0)),
                              l, sharded, c.rank());
        RANK_REQUIRE(at::allclose(fp.master().grad(), expect, 1e-6, 1e-6));
      });
    }
}

TEST_CASE("accumulation without sync, then a deferred synced pass: the flat gradient is the sum",
          "[flat_param]") {
  for (int world : {1, 2, 3})
    for (bool sharded : {true, false}) {
      CAPTURE(world, sharded);
      run_ranks(world, [&](Communicator& c) {
        auto ps = make_params(5);
        FlatParamConfig cfg;
        cfg.sharded = sharded;
        cfg.poison_padding = true;
        FlatParam fp("unit", refs(ps), c, cfg);
        const auto& l = fp.layout();
        const size_t n = ps.size();
        RANK_REQUIRE(n >= 5);
        fp.unshard(c.current_stream());
        // Pass 1, no sync: parameters 1.. get a, copied at once; .grad becomes the flat view.
        fp.set_defer_grad_copies(false);
        fp.prepare_grad();
        const void* flat_ptr = fp.full_grad().data_ptr();
        for (size_t i = 1; i < n; ++i) {
          ps[i].mutable_grad() = grad_a(ps[i], c.rank(), i);
          fp.accept_grad(i);
          RANK_REQUIRE(is_flat_view(fp, ps[i].grad(), i));
          RANK_REQUIRE_FALSE(region_is_nan(fp, i));
        }
        RANK_REQUIRE(region_is_nan(fp, 0));
        // Pass 2, synced (deferring): the buffer is kept (prepare_grad is a no-op).
        fp.set_defer_grad_copies(true);
        fp.prepare_grad();
        RANK_REQUIRE(fp.full_grad().data_ptr() == flat_ptr);
        // Parameter 0: its first gradient, b, stays pending.
        at::Tensor b0 = grad_b(ps[0], c.rank());
        ps[0].mutable_grad() = b0;
        fp.accept_grad(0);
        RANK_REQUIRE(ps[0].grad().is_same(b0));
        RANK_REQUIRE(region_is_nan(fp, 0));
        // Parameter 1: out-of-place accumulation (as with create_graph): .grad = view + b, a new
        // tensor that already includes a. Pending; the flat gradient must end as a + b, not
        // 2a + b (Note [Replaced gradient]).
        at::Tensor b1 = ps[1].grad() + grad_b(ps[1], c.rank());
        ps[1].mutable_grad() = b1;
        fp.accept_grad(1);
        RANK_REQUIRE(ps[1].grad().is_same(b1));
        // Parameter 2: .grad reset between passes (a discarded), then a fresh b: b alone.
        ps[2].mutable_grad() = at::Tensor();
        ps[2].mutable_grad() = grad_b(ps[2], c.rank());
        fp.accept_grad(2);
        // Parameters 3..n-2: AccumulateGrad adds b in place into the view.
        for (size_t i = 3; i + 1 < n; ++i) {
          ps[i].mutable_grad().add_(grad_b(ps[i], c.rank()));
          fp.accept_grad(i);
          RANK_REQUIRE(is_flat_view(fp, ps[i].grad(), i));
        }
        // Parameter n-1: no gradient in pass 2.
        fp.reduce_grad(c.current_stream());
        std::vector<double> ka(n, 1.0), kb(n, 1.0);
        ka[0] = 0.0;
        ka[2] = 0.0;
        kb[n - 1] = 0.0;
        auto expect = my_part(expected_mean(l, world, ka, kb), l, sharded, c.rank());
        RANK_REQUIRE(at::allclose(fp.master().grad(), expect, 1e-6, 1e-6));
      });
    }
}

TEST_CASE("deferred gradient copies: accept_grad without deferral takes over a pending gradient",
          "[flat_param]") {
  run_ranks(2, [&](Communicator& c) {
    auto ps = make_params(6);
    FlatParamConfig cfg;
    cfg.poison_padding = true;
    FlatParam fp("unit", refs(ps), c, cfg);
    const auto& l = fp.layout();
    const size_t n = ps.size();
    fp.unshard(c.current_stream());
    fp.set_defer_grad_copies(true);
    fp.prepare_grad();
    for (size_t i = 0; i < n; ++i) {
      ps[i].mutable_grad() = grad_a(ps[i], c.rank(), i);
      fp.accept_grad(i);
    }
    // Deferral off before the reduction: the next accept_grad copies .grad (which holds the
    // pending gradient plus b, added in place) and drops the pending reference, so the
    // reduction must not add it a second time.
    fp.set_defer_grad_copies(false);
    for (size_t i = 0; i < n; ++i) {
      ps[i].mutable_grad().add_(grad_b(ps[i], c.rank()));
      fp.accept_grad(i);
      RANK_REQUIRE(is_flat_view(fp, ps[i].grad(), i));
      RANK_REQUIRE_FALSE(region_is_nan(fp, i));
    }
    fp.reduce_grad(c.current_stream());
    auto expect = my_part(expected_mean(l, 2, std::vector<double>(n, 1.0),
                                        std::vector<double>(n, 1.0)),
                          l, true, c.rank());
    RANK_REQUIRE(at::allclose(fp.master().grad(), expect, 1e-6, 1e-6));
  });
}

TEST_CASE("without deferral, a replaced .grad is the whole gradient: out of place a + b, reset b",
          "[flat_param]") {
  run_ranks(2, [&](Communicator& c) {
    auto ps = make_params(3);
    FlatParamConfig cfg;
    cfg.poison_padding = true;
    FlatParam fp("unit", refs(ps), c, cfg);
    const auto& l = fp.layout();
    const size_t n = ps.size();
    RANK_REQUIRE(n >= 3);
    fp.unshard(c.current_stream());
    fp.set_defer_grad_copies(false);
    fp.prepare_grad();
    for (size_t i = 0; i < ps.size(); ++i) {  // pass 1: a, copied; .grad becomes the view
      ps[i].mutable_grad() = grad_a(ps[i], c.rank(), i);
      fp.accept_grad(i);
    }
    // Pass 2: parameter 0 accumulates out of place (includes a), parameter 1 was reset (a
    // discarded), the others accumulate in place.
    ps[0].mutable_grad() = ps[0].grad() + grad_b(ps[0], c.rank());
    ps[1].mutable_grad() = grad_b(ps[1], c.rank());
    for (size_t i = 2; i < n; ++i) ps[i].mutable_grad().add_(grad_b(ps[i], c.rank()));
    for (size_t i = 0; i < n; ++i) {
      fp.accept_grad(i);
      RANK_REQUIRE(is_flat_view(fp, ps[i].grad(), i));
    }
    fp.reduce_grad(c.current_stream());
    std::vector<double> ka(n, 1.0), kb(n, 1.0);
    ka[1] = 0.0;
    auto expect = my_part(expected_mean(l, 2, ka, kb), l, true, c.rank());
    RANK_REQUIRE(at::allclose(fp.master().grad(), expect, 1e-6, 1e-6));
  });
}
