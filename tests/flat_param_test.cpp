// FlatParam: flatten -> shard -> all-gather -> views is bit-exact for odd sizes and world sizes
// 1..4; padding never leaks into values or gradients; one reduce-scatter averages gradients.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

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
