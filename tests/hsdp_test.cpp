// HSDP (hybrid sharding) on CPU, ranks as threads in a replicate x shard grid:
// - the rank layout and the shard-group size from each launcher's environment;
// - run_ranks_2d's groups and failure propagation;
// - parity: 4 ranks as 2x2, 1x4 and 4x1 train the reference GPT like one unsharded rank over
//   the union of the 4 batches (step-0 gradients, losses, final parameters; per-layer and
//   per-leaf plans with NO_SHARD units in the mix; one run with no_sync accumulation and
//   clipping), every replica ends bit-identical, and the counters are exact: one replicate
//   all-reduce per sharded unit per step when R > 1, none when R == 1;
// - checkpoints: replicate rank 0's shard group writes, every rank loads.
// Tolerances are gpt_parity_test's (fp32; only summation order differs: averaging over the
// shard group then over replicas instead of over all ranks at once).
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <atomic>

#include "checkpoint/checkpoint.h"
#include "collectives/sharding_mesh.h"
#include "collectives/thread_mesh.h"
#include "gpt_parity_spec.h"
#include "models/gpt.h"
#include "temp_dir.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
using namespace flatshard_test;
namespace g = flatshard::gpt;

namespace {

LaunchEnv parse(const std::map<std::string, std::string>& vars) {
  return LaunchEnv::from_lookup([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

g::GPTConfig cfg() { return parity_gpt_config(); }

ParitySpec gpt_spec(const std::string& policy_spec) { return gpt_parity_spec(4, policy_spec); }

struct HsdpRun {
  ParityRun run;                                         // global rank 0's view
  std::vector<std::map<std::string, at::Tensor>> replica_params;  // shard rank 0 of each replica
  std::vector<std::map<std::string, at::Tensor>> replica_grads;   // step-0 grads, same ranks
  std::vector<UnitInfo> units;
};

// run_sharded() of parity_util.h on an R x S mesh; rank r = i * S + j trains on batch r.
HsdpRun run_hsdp(const ParitySpec& s, int R, int S) {
  REQUIRE(R * S == s.world);
  HsdpRun out;
  out.run.losses.assign(s.steps, 0.0);
  out.replica_params.resize(R);
  out.replica_grads.resize(R);
  std::mutex mu;
  run_ranks_2d(R, S, [&](Communicator& shard, Communicator& replicate) {
    const int rank = replicate.rank() * S + shard.rank();
    auto model = s.make_model();
    auto fsdp = fully_shard(model, s.plan(*model), ShardingMesh(shard, &replicate), s.options);
    RankRun r = train_sharded_rank(s, model, *fsdp, rank);
    std::lock_guard<std::mutex> lock(mu);
    for (int step = 0; step < s.steps; ++step) out.run.losses[step] += r.losses[step] / s.world;
    if (shard.rank() == 0) {
      for (auto& kv : r.grads0) out.replica_grads[replicate.rank()][kv.first] = kv.second;
      for (auto& kv : r.params) out.replica_params[replicate.rank()][kv.first] = kv.second;
    }
    if (rank == 0) {
      out.run.last_step_counters = r.last_step_counters;
      out.units = fsdp->units();
    }
  });
  out.run.params = out.replica_params[0];
  out.run.grads = out.replica_grads[0];
  return out;
}


// Replicas must not drift: every rank applies the same averaged gradient to the same values.
void require_replicas_identical(const HsdpRun& h) {
  for (size_t i = 1; i < h.replica_params.size(); ++i)
    for (auto& kv : h.replica_params[0]) {
      CAPTURE(i, kv.first);
      REQUIRE(at::equal(h.replica_params[i].at(kv.first), kv.second));
      REQUIRE(at::equal(h.replica_grads[i].at(kv.first), h.replica_grads[0].at(kv.first)));
    }
}

// One reduce-scatter per sharded unit, one all-reduce per NO_SHARD unit and, with replicas,
// one replicate all-reduce per sharded unit; bytes from the unit sizes (fp32 reduction).
void require_exact_counters(const HsdpRun& h, int R) {
  const auto& c = h.run.last_step_counters;
  REQUIRE(c.per_unit.size() == h.units.size());
  int64_t sharded = 0;
  for (size_t u = 0; u < h.units.size(); ++u) {
    const UnitInfo& info = h.units[u];
    CAPTURE(info.name);
    if (info.padded_numel == 0) continue;
    const bool noshard = info.strategy == ShardingStrategy::kNoShard;
    sharded += !noshard;
    CHECK(c.per_unit[u].reduce_scatters == (noshard ? 0 : 1));
    CHECK(c.per_unit[u].all_reduces == (noshard ? 1 : 0));
    CHECK(c.per_unit[u].replicate_all_reduces == (!noshard && R > 1 ? 1 : 0));
    const int64_t rep_elems = noshard ? info.padded_numel : info.shard_numel;
    CHECK(c.per_unit[u].replicate_bytes == (R > 1 ? rep_elems * 4 : 0));
  }
  REQUIRE(sharded >= 2);
  CHECK(c.total.replicate_all_reduces == (R > 1 ? sharded : 0));
}

const char* kMix = "noshard:path=lm_head|wpe|blocks.1*;";

}  // namespace

TEST_CASE("HSDP layout: rank r = i*S + j", "[hsdp][layout]") {
  auto l = HsdpLayout::make(8, 4);
  CHECK((l.replicate == 2 && l.shard == 4 && l.world_size() == 8));
  CHECK((l.shard_group(6) == 1 && l.shard_rank(6) == 2 && l.global_rank(1, 2) == 6));
  CHECK_THROWS_WITH(HsdpLayout::make(8, 3), Catch::Contains("shard-group size 3 must divide the world size 8"));
  CHECK_THROWS_WITH(HsdpLayout::make(4, 0), Catch::Contains("must divide"));
}

TEST_CASE("HSDP shard-group size from each launcher's ranks per node", "[hsdp][launch_env]") {
  const std::map<std::string, std::string> addr = {{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}};
  auto with = [&](std::map<std::string, std::string> v) {
    v.insert(addr.begin(), addr.end());
    return parse(v);
  };
  // torchrun --nnodes 2 --nproc-per-node 4
  auto t = with({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
  CHECK(hsdp_shard_size(t) == 4);
  CHECK(hsdp_shard_size(t, 2) == 2);  // explicit wins
  CHECK_THROWS_WITH(hsdp_shard_size(t, 3), Catch::Contains("3 must divide the world size 8"));
  // srun -N 2 --ntasks-per-node 4
  auto s = with({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
                 {"SLURM_NTASKS_PER_NODE", "4"}});
  CHECK((s.launcher == LaunchEnv::Launcher::kSlurm && hsdp_shard_size(s) == 4));
  // srun -n 8 -N 2 without --ntasks-per-node: SLURM_TASKS_PER_NODE only.
  auto s2 = with({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
                  {"SLURM_TASKS_PER_NODE", "4(x2)"}});
  CHECK(s2.local_world_size == 4);
  CHECK(with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"},
              {"SLURM_TASKS_PER_NODE", "4,4"}}).local_world_size == 4);
  auto uneven = with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"},
                      {"SLURM_TASKS_PER_NODE", "4,3"}});
  CHECK(uneven.local_world_size == -1);
  CHECK_THROWS_WITH(hsdp_shard_size(uneven), Catch::Contains("SLURM_NTASKS_PER_NODE") &&
                                                 Catch::Contains("pass the shard-group size"));
  CHECK(hsdp_shard_size(uneven, 7) == 7);
  CHECK(with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"},
              {"SLURM_TASKS_PER_NODE", "4(y2)"}}).local_world_size == -1);
  // mpirun -np 8 --map-by ppr:4:node
  auto m = with({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  CHECK((m.launcher == LaunchEnv::Launcher::kOpenMpi && hsdp_shard_size(m) == 4));
  auto m2 = with({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}});
  CHECK_THROWS_WITH(hsdp_shard_size(m2), Catch::Contains("OMPI_COMM_WORLD_LOCAL_SIZE is unset") &&
                                             Catch::Contains("rank 3"));
}

TEST_CASE("run_ranks_2d: shard groups are row blocks, replicate groups columns", "[hsdp][threads]") {
  for (auto [R, S] : std::vector<std::pair<int, int>>{{2, 2}, {1, 4}, {4, 1}, {2, 3}}) {
    CAPTURE(R, S);
    std::atomic<int> ran{0};
    run_ranks_2d(R, S, [&, R = R, S = S](Communicator& shard, Communicator& rep) {
      // Catch2 assertions are not thread-safe: check inside ranks with TORCH_CHECK.
      TORCH_CHECK(shard.world_size() == S && rep.world_size() == R, "group sizes");
      const int rank = rep.rank() * S + shard.rank();
      at::Tensor me = at::full({1}, static_cast<float>(rank));
      at::Tensor row = at::empty({S}), col = at::empty({R});
      shard.all_gather(me, row, shard.current_stream());
      rep.all_gather(me, col, rep.current_stream());
      for (int j = 0; j < S; ++j)
        TORCH_CHECK(row[j].item<float>() == rep.rank() * S + j, "rank ", rank, ": shard slot ", j,
                    " holds ", row[j].item<float>());
      for (int i = 0; i < R; ++i)
        TORCH_CHECK(col[i].item<float>() == i * S + shard.rank(), "rank ", rank,
                    ": replicate slot ", i, " holds ", col[i].item<float>());
      ++ran;
    });
    CHECK(ran == R * S);
  }
}

TEST_CASE("run_ranks_2d: a failing rank releases ranks waiting in other groups", "[hsdp][threads]") {
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(run_ranks_2d(2, 2,
                                 [](Communicator& shard, Communicator& rep) {
                                   if (rep.rank() == 1 && shard.rank() == 1)
                                     throw std::runtime_error("boom");
                                   at::Tensor t = at::ones({3});
                                   rep.all_reduce(t, ReduceOp::kSum, rep.current_stream());
                                   shard.all_reduce(t, ReduceOp::kSum, shard.current_stream());
                                 }),
                    Catch::Contains("rank 3: boom"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));  // not the 60 s timeout
}

TEST_CASE("HSDP GPT training matches unsharded training (2x2, 1x4, 4x1)", "[hsdp][parity]") {
  const ParityRun ref = run_reference(gpt_spec(""));
  for (const char* plan : {"type=Block", "type=Linear|LayerNorm|Embedding"})
    for (auto [R, S] : std::vector<std::pair<int, int>>{{2, 2}, {1, 4}, {4, 1}}) {
      CAPTURE(plan, R, S);
      auto h = run_hsdp(gpt_spec(std::string(kMix) + plan), R, S);
      require_parity(ref, h.run);
      require_replicas_identical(h);
      require_exact_counters(h, R);
    }
}

TEST_CASE("HSDP with no_sync accumulation and clipping matches", "[hsdp][parity]") {
  auto s = gpt_spec(std::string(kMix) + "type=Block");
  s.micro_batches = 2;
  s.no_sync_accumulation = true;
  s.clip = 0.05;  // below the gradient norm, so clipping scales: a double-counted norm shows
  auto h = run_hsdp(s, 2, 2);
  require_parity(run_reference(s), h.run);
  require_replicas_identical(h);
  require_exact_counters(h, 2);
}

TEST_CASE("HSDP with bf16 master gradients trains as with fp32 ones, bit for bit",
          "[hsdp][parity][bf16]") {
  // Note [Low-precision master gradient] (flat_param/collective_plan.h) through the replicate
  // all-reduce: on a 2x2 mesh, bf16 compute and reduction, the kept bf16 gradients are the
  // fp32 path's values (exact upcasts), and both torch's AdamW (a bf16 .grad on an fp32
  // parameter promotes exactly) and FusedAdamW step to the same bits.
  for (bool fused : {false, true}) {
    CAPTURE(fused);
    auto s = gpt_spec(std::string(kMix) + "type=Block");
    s.options.mixed_precision.param_dtype = at::kBFloat16;
    s.fused_adamw = fused;
    const auto fp32 = run_hsdp(s, 2, 2);
    s.options.mixed_precision.keep_low_precision_grads = true;
    const auto kept = run_hsdp(s, 2, 2);
    REQUIRE(kept.run.losses == fp32.run.losses);
    for (auto& kv : fp32.run.grads) {
      CAPTURE(kv.first);
      REQUIRE(kept.run.grads.at(kv.first).scalar_type() == at::kBFloat16);
      REQUIRE(at::equal(kept.run.grads.at(kv.first).to(at::kFloat), kv.second));
    }
    for (auto& kv : fp32.run.params) {
      CAPTURE(kv.first);
      REQUIRE(at::equal(kept.run.params.at(kv.first), kv.second));
    }
    require_replicas_identical(kept);
  }
}

TEST_CASE("HSDP checkpoint: replicate rank 0's group writes, every rank loads", "[hsdp][checkpoint]") {
  TempDir tmp;
  const std::string dir = tmp / "ckpt";
  auto s = gpt_spec(std::string(kMix) + "type=Block");
  std::map<std::string, at::Tensor> saved;
  std::vector<std::map<std::string, at::Tensor>> loaded(2);  // per replica
  std::mutex mu;
  run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
    const int rank = rep.rank() * 2 + shard.rank();
    auto model = s.make_model();
    auto fsdp = fully_shard(model, s.plan(*model), ShardingMesh(shard, &rep), s.options);
    torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      s.loss(model, rank, step, 0).backward();
      opt.step();
    }
    save_checkpoint(*fsdp, &opt, dir);
    auto full = fsdp->gather_full_params();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& kv : full) saved[kv.first] = kv.second;
    }
    // A fresh model with other initial values (no sync from a common seed would hide a
    // rank that did not load).
    auto model2 = std::static_pointer_cast<torch::nn::Module>(g::GPT(cfg(), 100 + rank).ptr());
    ShardingOptions o;
    o.sync_module_states = false;
    auto fsdp2 = fully_shard(model2, s.plan(*model2), ShardingMesh(shard, &rep), o);
    torch::optim::AdamW opt2(fsdp2->parameters(), torch::optim::AdamWOptions(1e-2));
    load_checkpoint(*fsdp2, &opt2, dir);
    auto back = fsdp2->gather_full_params();
    std::lock_guard<std::mutex> lock(mu);
    if (shard.rank() == 0)  // one rank per replica: each must have loaded the same values
      for (auto& kv : back) loaded[rep.rank()][kv.first] = kv.second;
  });
  REQUIRE(!saved.empty());
  for (auto& kv : saved)
    for (int i = 0; i < 2; ++i) {
      CAPTURE(kv.first, i);
      REQUIRE(at::equal(loaded[i].at(kv.first), kv.second));
    }
  // S = 2 shard files: one group wrote, at its own world size.
  struct stat st {};
  CHECK(::stat((dir + "/shard-00000-of-00002.safetensors").c_str(), &st) == 0);
  CHECK(::stat((dir + "/shard-00001-of-00002.safetensors").c_str(), &st) == 0);
  CHECK(read_manifest(dir).world_size == 2);
}

TEST_CASE("HSDP sync_module_states: every rank starts from global rank 0's values", "[hsdp]") {
  // Each rank builds its model from another seed; the broadcast within the shard group and then
  // across replicas must leave all four holding rank 0's initial values.
  auto s = gpt_spec(std::string(kMix) + "type=Block");
  std::map<std::string, at::Tensor> want;
  {
    auto m0 = g::GPT(cfg(), 100);
    for (auto& p : m0->named_parameters()) want[p.key()] = p.value().detach().clone();
  }
  std::vector<std::map<std::string, at::Tensor>> got(4);
  std::mutex mu;
  run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
    const int rank = rep.rank() * 2 + shard.rank();
    auto model = std::static_pointer_cast<torch::nn::Module>(g::GPT(cfg(), 100 + rank).ptr());
    auto fsdp = fully_shard(model, s.plan(*model), ShardingMesh(shard, &rep));
    auto full = fsdp->gather_full_params();
    std::lock_guard<std::mutex> lock(mu);
    for (auto& kv : full) got[rank][kv.first] = kv.second;
  });
  for (int r = 0; r < 4; ++r)
    for (auto& kv : want) {
      CAPTURE(r, kv.first);
      REQUIRE(at::equal(got[r].at(kv.first), kv.second));
    }
}

TEST_CASE("HSDP: a replica with another plan fails at setup on every rank, naming global ranks",
          "[hsdp][reliability][fingerprint]") {
  // 2x2: the shard groups {0,1} and {2,3} each agree within themselves, so only the check across
  // replicas can see that replica 1 groups the blocks differently (its replicate all-reduces
  // would have other sizes).
  std::vector<std::string> errors(4);
  std::mutex mu;
  run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& rep) {
    const int rank = rep.rank() * 2 + shard.rank();
    auto spec = gpt_spec(rep.rank() == 0 ? "type=Block" : "every=2,type=Block");
    auto model = spec.make_model();
    try {
      auto fsdp = fully_shard(model, spec.plan(*model), ShardingMesh(shard, &rep), spec.options);
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r, errors[r]);
    // Replicate group {0, 2} compares global rank 2 with 0; {1, 3} compares 3 with 1.
    const std::string pair = r % 2 == 0 ? "rank 2 differs from rank 0" : "rank 3 differs from rank 1";
    CHECK_THAT(errors[r], Catch::Contains(pair + " at setup: plan units 3 vs 4"));
    CHECK_THAT(errors[r], Catch::Contains("reported by rank " + std::to_string(r)));
  }
}
