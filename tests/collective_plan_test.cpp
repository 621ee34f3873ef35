// flat_param/collective_plan.h: the plan each configuration gets (sharded, NO_SHARD, one rank,
// HSDP, offload 1 and 2), the bytes each plan says it sends against closed forms, and on CPU
// thread ranks (worlds 1, 2, 3 and an HSDP 2 x 2 mesh) every plan's results against references
// the plans did not compute: a reduction's master gradient is the mean of the ranks' full
// gradients sliced to the shard, a gather's full buffer the concatenation of the group's masters
// cast to the compute dtype. Gradients are small integers times the world size, so every mean
// is exact in any summation order and the comparisons are bitwise.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <mutex>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "flat_param/collective_plan.h"
#include "flat_param/flat_param.h"
#include "flat_param/offload_state.h"
#include "rank_require.h"

using namespace flatshard;

namespace {

// Align 4: offsets {0, 16, 24, 28, 48}, 59 used -> padded to a multiple of 4 * world: 60 over
// 1 and 3 ranks, 64 over 2 (tests/flat_param_test.cpp).
const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {7}, {1}, {2, 3, 3}, {11}};
constexpr size_t kNoGrad = 2;  // the parameter that never gets a gradient

std::vector<at::Tensor> make_params(at::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(11);
  std::vector<at::Tensor> ps;
  for (const auto& s : kShapes) ps.push_back(at::randn(s, gen).to(dtype).requires_grad_(true));
  return ps;
}

std::vector<ParamRef> refs(const std::vector<at::Tensor>& ps) {
  std::vector<ParamRef> r;
  for (size_t i = 0; i < ps.size(); ++i) r.push_back({"p" + std::to_string(i), ps[i]});
  return r;
}

// A communicator that has a size and a rank and no collectives: enough for the factories and
// for building a FlatParam without sync_module_states.
class SizeOnlyComm final : public Communicator {
 public:
  explicit SizeOnlyComm(int world) : world_(world) {}
  int rank() const override { return 0; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "size-only"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void all_gather(const at::Tensor&, const at::Tensor&, c10::Stream) override { fail(); }
  void reduce_scatter(const at::Tensor&, const at::Tensor&, ReduceOp, c10::Stream) override {
    fail();
  }
  void all_reduce(const at::Tensor&, ReduceOp, c10::Stream, Lane) override { fail(); }
  void broadcast(const at::Tensor&, int, c10::Stream) override { fail(); }
  void barrier() override { fail(); }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(1); }

 private:
  static void fail() { TORCH_CHECK(false, "SizeOnlyComm has no collectives"); }
  int world_;
};

struct Strategy {
  const char* label;
  bool sharded;
  int offload;
  bool kept = false;  // Note [Kept compute shard] (below fp32 only: it means nothing at fp32)
};
const std::vector<Strategy> kStrategies = {{"sharded", true, 0},
                                           {"sharded kept", true, 0, true},
                                           {"NO_SHARD", false, 0},
                                           {"sharded offload1", true, 1},
                                           {"sharded offload2", true, 2},
                                           {"NO_SHARD offload1", false, 1}};

FlatParamConfig config_of(const Strategy& s, at::ScalarType param, at::ScalarType reduce) {
  FlatParamConfig cfg;
  cfg.sharded = s.sharded;
  cfg.offload = s.offload;
  cfg.param_dtype = param;
  cfg.reduce_dtype = reduce;
  cfg.align = 4;
  cfg.keep_compute_shard = s.kept && param != at::kFloat;
  return cfg;
}

// Global rank r's gradient of parameter i: world * (j % 5 + (r + 1) * (i + 1)), j the element.
at::Tensor rank_grad(const at::Tensor& p, size_t i, int r, int world, at::ScalarType dtype) {
  return at::arange(p.numel(), at::kFloat)
      .remainder_(5)
      .add_((r + 1.0) * (i + 1.0))
      .mul_(world)
      .to(dtype)
      .view(p.sizes());
}

// The mean over `world` ranks of rank_grad, as the padded flat vector (padding and the
// parameter without gradient zero), in double, from the closed form: sum over r of
// (j % 5 + (r + 1) * (i + 1)).
at::Tensor reference_mean(const FlatLayout& l, int world) {
  auto e = at::zeros({l.padded_numel}, at::kDouble);
  for (size_t i = 0; i < l.numels.size(); ++i) {
    if (i == kNoGrad) continue;
    const double ranks = world * (world + 1) / 2.0;  // sum of (r + 1)
    e.narrow(0, l.offsets[i], l.numels[i])
        .copy_(
            at::arange(l.numels[i], at::kDouble).remainder_(5).mul_(world).add_(ranks * (i + 1.0)));
  }
  return e;
}

at::Tensor my_part(const at::Tensor& full, const FlatLayout& l, bool sharded, int rank) {
  return sharded ? full.narrow(0, l.shard_begin(rank), l.shard_numel) : full;
}

// Offloaded units: the staged reduction added to the master gradient (the host has waited).
void finish_host_grad(FlatParam& fp) {
  if (HostGrad* h = fp.reduce_plan().host_grad()) h->finish(fp.master());
}

// One backward's gradients of global rank `r` delivered as AccumulateGrad does, reduced.
void backward_and_reduce(FlatParam& fp, std::vector<at::Tensor>& ps, Communicator& comm, int r,
                         int world, bool defer) {
  fp.set_defer_grad_copies(defer);
  // What Unit::pre_backward does.
  if (!(defer && !fp.reduce_plan().needs_flat_grad())) fp.prepare_grad();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (i == kNoGrad) continue;
    ps[i].mutable_grad() = rank_grad(ps[i], i, r, world, fp.config().param_dtype);
    fp.accept_grad(i);
  }
  fp.reduce_grad(comm.current_stream());
}

// A reduction and a second one that accumulates, against the reference; `r` global rank,
// `world` all ranks (shard x replicate), `shard_rank` the rank in the layout's group.
void check_reductions(FlatParam& fp, std::vector<at::Tensor>& ps, Communicator& comm, int r,
                      int world, int shard_rank, bool defer) {
  const FlatLayout& l = fp.layout();
  const at::Tensor expect =
      my_part(reference_mean(l, world), l, fp.config().sharded, shard_rank).to(at::kFloat);
  backward_and_reduce(fp, ps, comm, r, world, defer);
  finish_host_grad(fp);  // offload: the host has "waited" (CPU ranks: copies are done)
  RANK_REQUIRE(fp.master().grad().defined());
  RANK_REQUIRE(fp.master().grad().scalar_type() == at::kFloat);
  RANK_REQUIRE(at::equal(fp.master().grad(), expect));
  for (const auto& p : ps) RANK_REQUIRE_FALSE(p.grad().defined());
  // A second backward accumulates into the master gradient; offloaded, the staged copy is
  // added by HostGrad::finish().
  backward_and_reduce(fp, ps, comm, r, world, defer);
  if (fp.config().offload > 0) RANK_REQUIRE(at::equal(fp.master().grad(), expect));
  finish_host_grad(fp);
  RANK_REQUIRE(at::equal(fp.master().grad(), expect * 2));
}

// Writes every rank's master in place (an optimizer step: the version changes), publishes it
// in `masters[r]`, waits for the group, gathers, and checks full() against the concatenation
// of the group's masters [first, first + n) (NO_SHARD: this rank's own master).
void check_gather(FlatParam& fp, Communicator& group, int r, int first, int n, float step,
                  std::vector<at::Tensor>& masters, std::mutex& mu) {
  {
    at::NoGradGuard no_grad;
    fp.master().add_(step * (r + 1));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    masters[r] = fp.master().detach().clone();
  }
  group.barrier();
  std::vector<at::Tensor> parts;
  if (fp.config().sharded) {
    for (int k = first; k < first + n; ++k) parts.push_back(masters[k]);
  } else {
    parts.push_back(masters[r]);
  }
  const at::Tensor expect = at::cat(parts).to(fp.config().param_dtype);
  for (int twice = 0; twice < 2; ++twice) {  // again without a change: level 1 reuses its shard
    fp.unshard(group.current_stream());
    RANK_REQUIRE(at::equal(fp.full(), expect));
    fp.reshard();
  }
  group.barrier();  // nobody overwrites masters[] while a peer still reads it
}

}  // namespace

TEST_CASE("the factories choose the plan from the config and the communicators",
          "[flat_param][collective_plan]") {
  struct Case {
    bool sharded;
    int offload;
    int world, replicas;
    at::ScalarType param, reduce;
    const char* gather;
    const char* reduction;
  };
  const auto f32 = at::kFloat, bf16 = at::kBFloat16;
  const std::vector<Case> cases = {
      {true, 0, 2, 0, f32, f32, "AllGather", "ReduceScatter"},
      {true, 0, 1, 0, f32, f32, "AllGather", "OneRankReduce"},
      {true, 0, 1, 0, bf16, bf16, "AllGather", "OneRankReduce"},
      {true, 0, 1, 0, bf16, f32, "AllGather", "OneRankReduce"},
      // A reduce dtype that rounds is the requested behaviour: the general path.
      {true, 0, 1, 0, f32, bf16, "AllGather", "ReduceScatter"},
      {false, 0, 2, 0, f32, f32, "ReplicatedRecast", "AllReduce"},
      {false, 0, 1, 0, bf16, bf16, "ReplicatedRecast", "OneRankReduce"},
      {true, 0, 2, 2, f32, f32, "AllGather", "ReplicateAllReduce(ReduceScatter)"},
      {true, 0, 1, 2, f32, f32, "AllGather", "ReplicateAllReduce(ReduceScatter)"},
      {false, 0, 2, 2, f32, f32, "ReplicatedRecast", "ReplicateAllReduce(AllReduce)"},
      {true, 0, 2, 1, f32, f32, "AllGather", "ReduceScatter"},  // one replica: no HSDP
      {true, 1, 2, 0, bf16, f32, "ResidentAllGather", "HostGradDelivery(ReduceScatter)"},
      {true, 1, 1, 0, f32, f32, "ResidentAllGather", "HostGradDelivery(ReduceScatter)"},
      {true, 2, 2, 0, bf16, f32, "UploadAllGather", "HostGradDelivery(ReduceScatter)"},
      {false, 1, 2, 0, f32, f32, "ReplicatedUpload", "HostGradDelivery(AllReduce)"},
      {false, 2, 1, 0, bf16, f32, "ReplicatedUpload", "HostGradDelivery(AllReduce)"},
      {true, 1, 2, 2, bf16, f32, "ResidentAllGather",
       "HostGradDelivery(ReplicateAllReduce(ReduceScatter))"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.sharded, c.offload, c.world, c.replicas, c.param, c.reduce);
    SizeOnlyComm comm(c.world), rep(std::max(c.replicas, 1));
    Communicator* replicate = c.replicas > 0 ? &rep : nullptr;
    FlatParamConfig cfg = config_of({"", c.sharded, c.offload}, c.param, c.reduce);
    cfg.sync_module_states = false;  // SizeOnlyComm has no broadcast
    const FlatLayout layout = FlatLayout::make(kShapes, c.sharded ? c.world : 1, cfg.align);
    // The buffers FlatParam would hand the gather plan: the fp32 master, full() in param dtype.
    const at::Tensor master =
        at::zeros({c.sharded ? layout.shard_numel : layout.padded_numel}, at::kFloat);
    const at::Tensor full = at::empty({layout.padded_numel}, c.param);
    auto gather = make_gather_plan("blk", cfg, layout, comm, GatherArgs{master, full, {}, {}});
    auto reduce = make_reduce_plan("blk", cfg, layout, Mesh(comm, replicate));
    CHECK(gather->name() == c.gather);
    CHECK(reduce->name() == c.reduction);
    CHECK(reduce->needs_flat_grad() == (std::string(c.reduction) != "OneRankReduce"));
    // FlatParam asks the same factories, once.
    auto ps = make_params(at::kFloat);
    FlatParam fp("blk", refs(ps), Mesh(comm, replicate), cfg);
    CHECK(fp.gather_plan().name() == c.gather);
    CHECK(fp.reduce_plan().name() == c.reduction);
    CHECK(fp.reduce_plan().needs_flat_grad() == reduce->needs_flat_grad());
    // The optional parts exist only where the unit uses them (STYLE.md 17): the offload copy
    // and the host gradient when offloaded, the step copy for a NO_SHARD recast below fp32.
    CHECK((fp.gather_plan().extras().offload != nullptr) == (c.offload > 0));
    CHECK((fp.reduce_plan().host_grad() != nullptr) == (c.offload > 0));
    CHECK((fp.gather_plan().extras().step != nullptr) ==
          (std::string(c.gather) == "ReplicatedRecast" && c.param != at::kFloat));
  }
  SizeOnlyComm comm(2);
  FlatParamConfig bad;
  bad.offload = 3;
  const FlatLayout layout = FlatLayout::make(kShapes, 2, bad.align);
  CHECK_THROWS_WITH(
      make_gather_plan("blk", bad, layout, comm, GatherArgs{}),
      Catch::Contains("unit 'blk'") && Catch::Contains("offload level must be 0, 1 or 2, got 3"));
  CHECK_THROWS_WITH(make_reduce_plan("blk", bad, layout, comm),
                    Catch::Contains("offload level must be 0, 1 or 2, got 3"));
}

TEST_CASE("Kept compute shard: the sharded gather all-gathers the kept shard, recast only when "
          "the master moved since it was written", "[flat_param][collective_plan]") {
  // Note [Kept compute shard] (flat_param/collective_plan.h).
  const Strategy kept{"sharded kept", true, 0, true};
  {
    SizeOnlyComm comm(2);
    FlatParamConfig cfg = config_of(kept, at::kBFloat16, at::kFloat);
    cfg.sync_module_states = false;
    auto ps = make_params(at::kFloat);
    FlatParam fp("blk", refs(ps), comm, cfg);
    CHECK(fp.gather_plan().name() == "KeptShardAllGather");
    REQUIRE(fp.gather_plan().extras().step != nullptr);
    CHECK(fp.gather_plan().extras().offload == nullptr);
    // The kept shard is the master's element count in bf16: 64 / 2 ranks * 2 B.
    CHECK(fp.gather_plan().extras().step->tensor().numel() == fp.master().numel());
    CHECK(fp.gather_plan().extras().step->tensor().scalar_type() == at::kBFloat16);
    CHECK(kept_shard_bytes(cfg, fp.layout()) == 32 * 2);
    CHECK(fp.gather_plan().bytes() == 32 * 2);  // the wire is unchanged
    // Where it means nothing the rule refuses it (fsdp/resolve.cpp never sets it there).
    for (auto bad : {std::make_pair(false, 0), std::make_pair(true, 1)}) {
      FlatParamConfig b = cfg;
      b.sharded = bad.first;
      b.offload = bad.second;
      CHECK_THROWS_WITH(b.validate("blk"), Catch::Contains("keep_compute_shard") &&
                                               Catch::Contains("unit 'blk'"));
    }
    FlatParamConfig f32 = cfg;
    f32.param_dtype = at::kFloat;
    CHECK_THROWS_WITH(f32.validate("blk"), Catch::Contains("keep_compute_shard"));
  }
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    run_ranks(world, [&](Communicator& c) {
      auto ps = make_params(at::kFloat);
      FlatParam fp("unit", refs(ps), c, config_of(kept, at::kBFloat16, at::kFloat));
      StepCopy* step = fp.gather_plan().extras().step;
      RANK_REQUIRE(step != nullptr);
      // A step wrote the copy (here: a value the master's cast is not) and marked it: the
      // gather sends it as it is, from every rank.
      const at::Tensor sentinel = at::full({fp.master().numel()}, 3.5 + c.rank(), at::kBFloat16);
      step->tensor().copy_(sentinel);
      step->mark_current();
      fp.unshard(c.current_stream());
      const FlatLayout& l = fp.layout();
      for (int k = 0; k < world; ++k)
        RANK_REQUIRE(at::equal(fp.full().narrow(0, l.shard_begin(k), l.shard_numel),
                               at::full({l.shard_numel}, 3.5 + k, at::kBFloat16)));
      fp.reshard();
      c.barrier();
      // The master moves without a step writing the copy: the next gather recasts it.
      {
        at::NoGradGuard no_grad;
        fp.master().add_(1.0);
      }
      RANK_REQUIRE_FALSE(step->current());
      fp.unshard(c.current_stream());
      RANK_REQUIRE(step->current());
      RANK_REQUIRE(at::equal(step->tensor(), fp.master().detach().to(at::kBFloat16)));
      RANK_REQUIRE(at::equal(fp.full().narrow(0, l.shard_begin(c.rank()), l.shard_numel),
                             fp.master().detach().to(at::kBFloat16)));
      fp.reshard();
    });
  }
}

TEST_CASE("each plan's byte counts are the closed forms", "[flat_param][collective_plan]") {
  // kShapes at align 4: 59 elements used, padded to 60 over 3 ranks (shard 20) and over 1.
  const auto f32 = at::kFloat, bf16 = at::kBFloat16;
  struct Case {
    bool sharded;
    int offload;
    int world, replicas;
    at::ScalarType param, reduce;
    int64_t gather, reduction, replicate, resident;
  };
  const std::vector<Case> cases = {
      // shard_numel * 2 (bf16), padded_numel * 4 (fp32)
      {true, 0, 3, 0, bf16, f32, 20 * 2, 60 * 4, 0, 0},
      {true, 0, 3, 0, f32, bf16, 20 * 4, 60 * 2, 0, 0},
      // HSDP: the shard's all-reduce across replicas, in the reduce dtype
      {true, 0, 3, 2, bf16, f32, 20 * 2, 60 * 4, 20 * 4, 0},
      // NO_SHARD: no gather; the whole buffer all-reduced (and across replicas)
      {false, 0, 3, 0, bf16, f32, 0, 60 * 4, 0, 0},
      {false, 0, 3, 2, bf16, bf16, 0, 60 * 2, 60 * 2, 0},
      // one rank: counted as the general path would send (the unit's counters, as before)
      {true, 0, 1, 0, bf16, bf16, 60 * 2, 60 * 2, 0, 0},
      // offload 1 holds the compute-dtype shard on the device; 2 holds nothing
      {true, 1, 3, 0, bf16, f32, 20 * 2, 60 * 4, 0, 20 * 2},
      {true, 2, 3, 0, bf16, f32, 20 * 2, 60 * 4, 0, 0},
      {false, 1, 3, 0, bf16, f32, 0, 60 * 4, 0, 0},
  };
  for (const Case& c : cases) {
    CAPTURE(c.sharded, c.offload, c.world, c.replicas, c.param, c.reduce);
    SizeOnlyComm comm(c.world), rep(std::max(c.replicas, 1));
    Communicator* replicate = c.replicas > 0 ? &rep : nullptr;
    FlatParamConfig cfg = config_of({"", c.sharded, c.offload}, c.param, c.reduce);
    cfg.sync_module_states = false;
    auto ps = make_params(at::kFloat);
    FlatParam fp("blk", refs(ps), Mesh(comm, replicate), cfg);
    REQUIRE(fp.layout().padded_numel == 60);
    CHECK(fp.gather_plan().bytes() == c.gather);
    CHECK(fp.reduce_plan().bytes() == c.reduction);
    CHECK(fp.reduce_plan().replicate_bytes() == c.replicate);
    // What the unit keeps on the device between gathers is the offload copy's.
    const OffloadCopy* copy = fp.gather_plan().extras().offload;
    CHECK((copy ? copy->resident_bytes() : 0) == c.resident);
  }
}

TEST_CASE("every reduce plan gives the mean of the ranks' gradients, sliced to the shard",
          "[flat_param][collective_plan]") {
  const auto f32 = at::kFloat, bf16 = at::kBFloat16;
  const std::vector<std::pair<at::ScalarType, at::ScalarType>> dtypes = {
      {f32, f32}, {bf16, f32}, {bf16, bf16}};
  for (const Strategy& s : kStrategies)
    for (auto [param, reduce] : dtypes)
      for (bool defer : {false, true}) {
        const FlatParamConfig cfg = config_of(s, param, reduce);
        for (int world : {1, 2, 3}) {
          CAPTURE(s.label, param, reduce, defer, world);
          std::string plan;
          std::mutex mu;
          run_ranks(world, [&](Communicator& c) {
            auto ps = make_params(f32);
            FlatParam fp("unit", refs(ps), c, cfg);
            if (c.rank() == 0) {
              std::lock_guard<std::mutex> lock(mu);
              plan = fp.reduce_plan().name();
            }
            fp.unshard(c.current_stream());
            check_reductions(fp, ps, c, c.rank(), world, c.rank(), defer);
          });
          // Worlds 1 to 3 went through the one-rank reduction and the general paths.
          // (Every dtype pair here rounds nothing: reduce == param or fp32.)
          if (world == 1 && s.offload == 0) CHECK(plan == "OneRankReduce");
          if (world > 1) CHECK(plan.find("OneRankReduce") == std::string::npos);
        }
        // HSDP: 2 replicas of 2-rank shard groups; the mean is over all 4 ranks.
        CAPTURE(s.label, param, reduce, defer, "HSDP 2x2");
        run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
          auto ps = make_params(f32);
          FlatParam fp("unit", refs(ps), Mesh(shard, &rep), cfg);
          RANK_REQUIRE(fp.hybrid());
          RANK_REQUIRE(fp.reduce_plan().name().find("ReplicateAllReduce(") != std::string::npos);
          fp.unshard(shard.current_stream());
          const int r = rep.rank() * 2 + shard.rank();
          check_reductions(fp, ps, shard, r, 4, shard.rank(), defer);
        });
      }
}

TEST_CASE("every gather plan fills full() with the group's masters, cast to the compute dtype",
          "[flat_param][collective_plan]") {
  for (const Strategy& s : kStrategies)
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      const FlatParamConfig cfg = config_of(s, dtype, at::kFloat);
      for (int world : {1, 2, 3}) {
        CAPTURE(s.label, dtype, world);
        std::vector<at::Tensor> masters(world);
        std::mutex mu;
        run_ranks(world, [&](Communicator& c) {
          auto ps = make_params(at::kFloat);
          FlatParam fp("unit", refs(ps), c, cfg);
          // Twice: the second write must reach full() too (offload: the version changed).
          check_gather(fp, c, c.rank(), 0, world, 1.0f, masters, mu);
          check_gather(fp, c, c.rank(), 0, world, 0.5f, masters, mu);
        });
      }
      CAPTURE(s.label, dtype, "HSDP 2x2");
      std::vector<at::Tensor> masters(4);
      std::mutex mu;
      run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
        auto ps = make_params(at::kFloat);
        FlatParam fp("unit", refs(ps), Mesh(shard, &rep), cfg);
        const int r = rep.rank() * 2 + shard.rank();
        // The gather stays inside the shard group: its two masters.
        check_gather(fp, shard, r, rep.rank() * 2, 2, 1.0f, masters, mu);
      });
    }
}

TEST_CASE("plans work on the buffers they are given, without a FlatParam",
          "[flat_param][collective_plan]") {
  // The seam alone: a sharded bf16 gather and an fp32 reduce-scatter over 3 ranks on tensors
  // the test made, against the same closed forms.
  run_ranks(3, [](Communicator& c) {
    FlatParamConfig cfg;
    cfg.param_dtype = at::kBFloat16;
    cfg.align = 4;
    const FlatLayout l = FlatLayout::make(kShapes, 3, cfg.align);
    auto reduce = make_reduce_plan("seam", cfg, l, c);

    // Rank k's master: k * 100 + its element index.
    const at::Tensor master = at::arange(l.shard_numel, at::kFloat).add_(100.0 * c.rank());
    const at::Tensor full = at::empty({l.padded_numel}, at::kBFloat16);
    auto gather = make_gather_plan("seam", cfg, l, c, GatherArgs{master, full, {}, {}});
    gather->gather(c.current_stream());
    std::vector<at::Tensor> parts;
    for (int k = 0; k < 3; ++k)
      parts.push_back(at::arange(l.shard_numel, at::kFloat).add_(100.0 * k));
    RANK_REQUIRE(at::equal(full, at::cat(parts).to(at::kBFloat16)));

    // Rank k's flat gradient: 3 * (j % 5 + k + 1) everywhere (padding included: the plan
    // reduces what it is given); the mean over k = 0, 1, 2 is 3 * (j % 5) + 6.
    const at::Tensor flat = at::arange(l.padded_numel, at::kFloat)
                                .remainder_(5)
                                .add_(c.rank() + 1.0)
                                .mul_(3)
                                .to(at::kBFloat16);
    const at::Tensor mean = at::arange(l.padded_numel, at::kFloat).remainder_(5).mul_(3).add_(6.0);
    at::Tensor master_param = at::zeros({l.shard_numel}).requires_grad_(true);
    std::vector<std::pair<int64_t, int64_t>> padding;
    std::vector<bool> written(kShapes.size(), true);
    std::vector<at::Tensor> pending(kShapes.size());
    const BackwardGrads grads{l, padding, flat, written, pending, master_param};
    for (int pass = 1; pass <= 2; ++pass) {  // set, then add
      ReduceResult r = reduce->reduce(flat, c.current_stream());
      RANK_REQUIRE(r.sent.scalar_type() == at::kFloat);  // reduce dtype fp32: a cast copy
      master_param.mutable_grad() =
          reduce->accumulate_master_grad(r, grads, master_param.grad());
      RANK_REQUIRE(at::equal(master_param.grad(),
                             mean.narrow(0, l.shard_begin(c.rank()), l.shard_numel) * pass));
    }
  });
}
