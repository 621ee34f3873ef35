// The cluster topology of the machine profile and the collective costs over groups that span
// nodes (planner/topology.h, planner/machine_profile.h, planner/cost_model.h; issue 52), label
// advisor.
//
// Independent references: closed forms written out here from the contract's ring model (NCCL's
// steps, the slowest link's bandwidth), the rank layout counted by brute force (rank / gpus per
// node), and the named profiles' own JSON files read by the test.
#include <catch2/catch.hpp>

#include <chrono>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fsdp/meta_init.h"
#include "planner/advisor.h"
#include "temp_dir.h"
#include "tool_run.h"
#include "models/family.h"
#include "planner/cost_model.h"
#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "planner/topology.h"
#include "wrap_policies/plan.h"
#include "wrap_policies/spec.h"
#include "wrap_policies/tp_plan.h"

using namespace flatshard;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// A profile with round numbers for the closed forms.
MachineProfile cluster_profile() {
  MachineProfile p;
  p.source = "test";
  p.all_gather_latency_us = 20;
  p.reduce_scatter_latency_us = 21;
  p.all_reduce_latency_us = 23;
  p.all_gather_gbps = 268;
  p.reduce_scatter_gbps = 260;
  p.all_reduce_gbps = 328;
  p.intra_node_hop_latency_us = 3.4;
  p.inter_node_hop_latency_us = 9.6;
  p.inter_node_gbps = 50;
  p.gpus_per_node = 8;
  return p;
}

// Brute force: over every group of the layout, the nodes it touches and the fewest of its
// ranks on one node; the worst group (most nodes, then fewest per node).
GroupSpan counted(int64_t world, int64_t shard, bool replicate_group, int64_t g) {
  GroupSpan worst{0, 0, 1 << 30};
  const int64_t replicas = world / shard;
  const int64_t groups = replicate_group ? shard : replicas;
  for (int64_t j = 0; j < groups; ++j) {
    std::map<int64_t, int64_t> per;
    const int64_t n = replicate_group ? replicas : shard;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t rank = replicate_group ? j + i * shard : j * shard + i;
      ++per[rank / g];
    }
    int64_t fewest = 1 << 30;
    for (const auto& [node, count] : per) fewest = std::min(fewest, count);
    const int64_t nodes = static_cast<int64_t>(per.size());
    if (nodes > worst.nodes || (nodes == worst.nodes && fewest < worst.per_node))
      worst = {n, nodes, fewest};
  }
  return worst;
}

}  // namespace

TEST_CASE("topology: group spans against the rank layout counted rank by rank",
          "[advisor][cluster]") {
  for (int64_t g : {1, 2, 4, 8}) {
    for (int64_t world : {8, 16, 64, 128}) {
      for (int64_t shard = 1; shard <= world; ++shard) {
        if (world % shard) continue;
        // Aligned layouts (the shard group fills nodes or divides one): exact.
        if (!(shard % g == 0 || g % shard == 0)) continue;
        CAPTURE(g, world, shard);
        const GroupSpan s = shard_group_span(shard, g), cs = counted(world, shard, false, g);
        CHECK(s.ranks == cs.ranks);
        CHECK(s.nodes == cs.nodes);
        CHECK(s.per_node == cs.per_node);
        const GroupSpan r = replicate_group_span(world / shard, shard, g),
                        cr = counted(world, shard, true, g);
        CHECK(r.ranks == cr.ranks);
        CHECK(r.nodes == cr.nodes);
        CHECK(r.per_node == cr.per_node);
      }
    }
  }
  // Misaligned: taken at least as bad as the worst group (more nodes, fewer per node).
  const GroupSpan m = shard_group_span(12, 8), cm = counted(48, 12, false, 8);
  CHECK(m.nodes >= cm.nodes);
  CHECK(m.per_node <= cm.per_node);
  // No topology: one node.
  CHECK(shard_group_span(64, 0).nodes == 1);
  CHECK(replicate_group_span(16, 8, 0).nodes == 1);
  CHECK(replicate_group_span(16, 8, 8).to_string() == "16 ranks on 16 nodes (1 per node)");
  CHECK(error_of([] { shard_group_span(0, 8); }).find("group size 0") != std::string::npos);
  CHECK(error_of([] { replicate_group_span(2, 8, -1); }).find("gpus_per_node -1") !=
        std::string::npos);
}

TEST_CASE("topology: collective times against closed forms inside a node, across nodes, and "
          "with no topology", "[advisor][cluster]") {
  const MachineProfile p = cluster_profile();
  const double bytes = 64e6;  // bus bytes
  // Inside one node (8 ranks): the collective's own bandwidth; the NVLink steps beyond the
  // 2-rank ring's: all-gather 7 - 1, all-reduce 14 - 2.
  const GroupSpan node{8, 1, 8};
  CHECK(collective_ms(p, Collective::kAllGather, node, bytes) ==
        Approx((20 + 6 * 3.4) / 1e3 + bytes / 268e6).epsilon(1e-12));
  CHECK(collective_ms(p, Collective::kReduceScatter, node, bytes) ==
        Approx((21 + 6 * 3.4) / 1e3 + bytes / 260e6).epsilon(1e-12));
  CHECK(collective_ms(p, Collective::kAllReduce, node, bytes) ==
        Approx((23 + 12 * 3.4) / 1e3 + bytes / 328e6).epsilon(1e-12));
  // 2 ranks in a node: exactly the profile's per-collective formula.
  CHECK(collective_ms(p, Collective::kAllGather, {2, 1, 2}, bytes) ==
        Approx(20 / 1e3 + bytes / 268e6).epsilon(1e-12));

  // 64 ranks on 8 nodes, 8 per node: 63 steps, 7 over the network; bandwidth min(268, 8 x 50).
  const GroupSpan wide{64, 8, 8};
  const CollectiveTime ag = collective_time(p, Collective::kAllGather, wide, bytes);
  CHECK(ag.latency_us == Approx(20 + (56 - 1) * 3.4 + 7 * 9.6).epsilon(1e-12));
  CHECK(ag.bus_gbps == 268);
  // 4 per node: the NICs bound it, 4 x 50 = 200 GB/s.
  CHECK(collective_time(p, Collective::kAllGather, {64, 16, 4}, bytes).bus_gbps == 200);
  // One rank per node (HSDP's replicate group): one NIC, 50 GB/s; the all-reduce's ring has
  // 2 x 15 network steps, the tree 2 x ceil(log2 16) = 8: the tree is faster.
  const GroupSpan rep{16, 16, 1};
  const CollectiveTime ar = collective_time(p, Collective::kAllReduce, rep, bytes);
  CHECK(ar.tree);
  CHECK(ar.latency_us == Approx(23 + 2 * (0 * 3.4 + 4 * 9.6)).epsilon(1e-12));
  CHECK(ar.bus_gbps == 50);
  CHECK(ar.ms() == Approx((23 + 8 * 9.6) / 1e3 + bytes / 50e6).epsilon(1e-12));
  // Two nodes: ring 2 network steps = 23 + 19.2, tree 2 x 1 = the same: the ring is kept.
  const CollectiveTime two = collective_time(p, Collective::kAllReduce, {2, 2, 1}, bytes);
  CHECK(two.latency_us == Approx(23 + 2 * 9.6).epsilon(1e-12));

  // No topology: every group in one node, the old per-collective formula at every size
  // (hop latencies 0, as in the defaults).
  MachineProfile flat = MachineProfile::defaults();
  CHECK(flat.gpus_per_node == 0);
  CHECK(flat.intra_node_hop_latency_us == 0);
  const GroupSpan any = shard_group_span(1024, 0);
  CHECK(collective_ms(flat, Collective::kAllGather, any, bytes) ==
        flat.all_gather_latency_us / 1e3 + bytes / (flat.all_gather_gbps * 1e6));
  CHECK(collective_ms(flat, Collective::kAllGather, any, 0) == 0);
}

TEST_CASE("cost model: HSDP's intra-node gathers and cross-node all-reduce are costed on their "
          "own links", "[advisor][cluster]") {
  auto cfg = models::ModelConfig::preset("gpt", "small");
  std::shared_ptr<torch::nn::Module> model;
  {
    MetaInit meta;
    model = cfg.build(0);
  }
  const auto shape = cfg.transformer_shape();
  const Workload w{1, cfg.seq_len()};
  ShardingOptions o;
  o.mixed_precision.param_dtype = at::kBFloat16;
  o.forward_prefetch = o.backward_prefetch = 1;
  const Plan plan = make_plan(*model, parse_policy("type=Block"));
  const int shard = 8, replicas = 16;  // 128 GPUs on 16 nodes of 8
  const Explanation e = explain(*model, plan, MeshShape(shard, replicas), o);
  MachineProfile p = cluster_profile();

  // comm_ms from explain's bytes and the closed forms: all-gathers and reduce-scatters over the
  // node (8 ranks, 1 node: NVLink), the replicate all-reduce over 16 nodes, one rank each.
  auto comm = [&](const MachineProfile& prof, double inter_gbps_bound, bool topology) {
    double total = 0;
    for (const auto& u : e.units) {
      const auto& c = u.per_step;
      const double ag = (prof.all_gather_latency_us + 6 * prof.intra_node_hop_latency_us) / 1e3 +
                        7.0 * u.all_gather_bytes / (prof.all_gather_gbps * 1e6);
      total += (c.forward_all_gathers + c.backward_all_gathers) * ag;
      if (c.reduce_scatters)
        total += (prof.reduce_scatter_latency_us + 6 * prof.intra_node_hop_latency_us) / 1e3 +
                 7.0 / 8 * u.reduce_bytes / (prof.reduce_scatter_gbps * 1e6);
      if (c.replicate_bytes > 0) {
        const double bus = 2.0 * 15 / 16 * c.replicate_bytes;
        total += topology
                     ? (prof.all_reduce_latency_us + 8 * prof.inter_node_hop_latency_us) / 1e3 +
                           bus / (inter_gbps_bound * 1e6)
                     : (prof.all_reduce_latency_us + 28 * prof.intra_node_hop_latency_us) / 1e3 +
                           bus / (prof.all_reduce_gbps * 1e6);
      }
    }
    return total;
  };
  const CostPrediction hsdp = predict_cost(e, shape, w, p);
  CHECK(hsdp.comm_ms == Approx(comm(p, 50, true)).epsilon(1e-9));
  // The same mesh without topology: the replicate all-reduce at NVLink's speed (what the
  // profile without nodes said), so less communication than on the cluster.
  MachineProfile one_node = p;
  one_node.gpus_per_node = 0;
  one_node.intra_node_hop_latency_us = 0;  // as a profile from before the topology keys
  const CostPrediction flat = predict_cost(e, shape, w, one_node);
  CHECK(flat.comm_ms == Approx(comm(one_node, 0, false)).epsilon(1e-9));
  CHECK(flat.comm_ms < hsdp.comm_ms);

  // FULL_SHARD over all 128 GPUs: every all-gather is a 128-rank ring over 16 nodes: 127 steps,
  // 15 of them over the network; at this model's small shards the latency dominates and HSDP
  // moves less over its slowest links.
  const Explanation fs = explain(*model, plan, MeshShape(shard * replicas, 1), o);
  const CostPrediction full = predict_cost(fs, shape, w, p);
  double gathers = 0;
  for (const auto& u : fs.units)
    gathers += (u.per_step.forward_all_gathers + u.per_step.backward_all_gathers) *
               ((20 + (112 - 1) * 3.4 + 15 * 9.6) / 1e3 +
                127.0 * u.all_gather_bytes / (268 * 1e6));
  double reductions = 0;
  for (const auto& u : fs.units)
    if (u.per_step.reduce_scatters)
      reductions += (21 + (112 - 1) * 3.4 + 15 * 9.6) / 1e3 +
                    127.0 / 128 * u.reduce_bytes / (260 * 1e6);
  CHECK(full.comm_ms == Approx(gathers + reductions).epsilon(1e-9));
  CHECK(full.comm_ms > hsdp.comm_ms);

  // Every rank inside one node (3 of 8 GPUs: a misaligned shard group, but only one): costed
  // as one node, exactly as without the topology.
  const Explanation three = explain(*model, plan, MeshShape(3, 1), o);
  MachineProfile eight = p, none = p;
  none.gpus_per_node = 0;
  CHECK(predict_cost(three, shape, w, eight).comm_ms == predict_cost(three, shape, w, none).comm_ms);

  // Throughput: tokens and model FLOPs of the step (the family's closed form, recompute left
  // out), MFU against the peak.
  CHECK(hsdp.tokens == w.tokens());
  CHECK(hsdp.model_flops == Approx(cfg.flops_per_token() * w.tokens()).epsilon(1e-9));
  CHECK(hsdp.tokens_per_s() == Approx(w.tokens() * 1e3 / hsdp.step_ms));
  CHECK(hsdp.mfu(989) == Approx(hsdp.model_flops / (hsdp.step_ms / 1e3) / 989e12));
  CHECK(hsdp.mfu(0) == 0);
}

TEST_CASE("machine profile: topology keys, sources, named profiles; old profiles still load",
          "[advisor][cluster][profile]") {
  const std::string head = R"({"format": "flatshard-machine-profile", "version": 1, )";
  // A profile from before the topology keys: no nodes, defaults elsewhere.
  const MachineProfile old = parse_profile(head + R"("all_gather_gbps": 100})", "old.json");
  CHECK(old.gpus_per_node == 0);
  CHECK(old.sources.empty());
  const MachineProfile t = parse_profile(
      head + R"("gpus_per_node": 8, "inter_node_gbps": 25, "inter_node_hop_latency_us": 5,
                "intra_node_hop_latency_us": 1, "peak_tflops": 312, "device_memory_gb": 80,
                "sources": {"inter_node_gbps": "spec: 200 Gb/s", "peak_tflops": "spec: x"}})",
      "t.json");
  CHECK(t.gpus_per_node == 8);
  CHECK(t.inter_node_gbps == 25);
  CHECK(t.sources.at("inter_node_gbps") == "spec: 200 Gb/s");
  // Round trip, sources included.
  CHECK(parse_profile(t.to_json(), "again").to_json() == t.to_json());
  struct Bad {
    std::string text, says;
  };
  const std::vector<Bad> bad = {
      {head + R"("gpus_per_node": 2.5})", "'gpus_per_node' must be a whole number of GPUs"},
      {head + R"("gpus_per_node": -8})", "'gpus_per_node' must be >= 0"},
      {head + R"("gpus_per_node": 1e7})", "'gpus_per_node' must be >= 0 and at most 1e+06"},
      {head + R"("inter_node_gbps": 0})", "'inter_node_gbps' must be > 0"},
      {head + R"("inter_node_hop_latency_us": 1e9})", "'inter_node_hop_latency_us' must be"},
      {head + R"("sources": {"nope": "spec: x"}})", "'nope' is not a numeric key"},
      {head + R"("sources": {"peak_tflops": "from a blog"}})", "must start with \"spec:\""},
      {head + R"("sources": {"peak_tflops": 3}})", "expected a string"},
      {head + R"("sources": [1]})", "expected an object"},
  };
  for (const auto& b : bad) {
    CAPTURE(b.text);
    const std::string err = error_of([&] { parse_profile(b.text, "bad.json"); });
    CAPTURE(err);
    CHECK(err.find(b.says) != std::string::npos);
    CHECK(err.find("bad.json") != std::string::npos);
  }

  // The named profiles: compiled in, every numeric key stated, each with its source.
  const auto names = named_profiles();
  CHECK(names == std::vector<std::string>{"a100-ib200", "h100-ib400", "h200-ib400"});
  const std::set<std::string> keys = [] {
    std::set<std::string> k;
    const std::string json = MachineProfile::defaults().to_json();
    for (size_t at = json.find("\n  \""); at != std::string::npos; at = json.find("\n  \"", at + 1))
      k.insert(json.substr(at + 4, json.find('"', at + 4) - at - 4));
    for (const char* meta : {"format", "version", "source"}) k.erase(meta);
    return k;
  }();
  CHECK(keys.size() == 28);
  for (const auto& n : names) {
    CAPTURE(n);
    const MachineProfile p = load_profile_named(n);
    CHECK(p.gpus_per_node == 8);
    CHECK(p.peak_tflops > 0);
    CHECK(p.device_memory_gb > 0);
    for (const auto& k : keys) {
      CAPTURE(k);
      REQUIRE(p.sources.count(k) == 1);
    }
  }
  const MachineProfile h100 = load_profile_named("h100-ib400");
  CHECK(h100.inter_node_gbps == 50);  // 400 Gb/s
  CHECK(h100.peak_tflops == 989);
  CHECK(h100.sources.at("inter_node_gbps").rfind("spec:", 0) == 0);
  CHECK(h100.sources.at("compute_tflops").rfind("estimate:", 0) == 0);  // measured on H200
  CHECK(load_profile_named("a100-ib200").inter_node_gbps == 25);  // 200 Gb/s
  const std::string unknown = error_of([] { load_profile_named("h100-ib800"); });
  CAPTURE(unknown);
  CHECK(unknown.find("neither a named profile (a100-ib200, h100-ib400, h200-ib400)") !=
        std::string::npos);
}

TEST_CASE("advisor: HSDP shard sizes searched over a cluster's meshes", "[advisor][cluster]") {
  CHECK(cluster_shard_sizes(64, 8) == std::vector<int>{1, 2, 4, 8, 16, 32, 64});
  // 48 GPUs on nodes of 8: 3, 6 and 12 straddle nodes; 24 and 48 fill whole nodes.
  CHECK(cluster_shard_sizes(48, 8) == std::vector<int>{1, 2, 4, 8, 16, 24, 48});
  CHECK(cluster_shard_sizes(6, 0) == std::vector<int>{1, 2, 3, 6});

  auto cfg = models::ModelConfig::preset("gpt", "small");
  std::shared_ptr<torch::nn::Module> model;
  {
    MetaInit meta;
    model = cfg.build(0);
  }
  AdvisorOptions a;
  a.memory_limit_bytes = int64_t{8} << 30;
  a.workload = {1, cfg.seq_len()};
  a.shape = cfg.transformer_shape();
  a.profile = cluster_profile();
  a.prefetch_depths = {1};
  a.shard_sizes = cluster_shard_sizes(32, 8);
  const Advice advice = suggest(*model, 32, 1, ShardingOptions{}, a);
  std::set<std::pair<int, int>> meshes;
  for (const auto& c : advice.candidates) {
    meshes.insert({c.shard, c.replicate});
    CHECK(c.shard * c.replicate == 32);
    CHECK(c.command_line().find("--world " + std::to_string(c.shard) + " --replicate " +
                                std::to_string(c.replicate)) != std::string::npos);
  }
  CHECK(meshes.size() == 6);  // 1, 2, 4, 8, 16, 32
  // Each candidate is exactly predict_cost at its own mesh.
  const Candidate& best = advice.best();
  ShardingOptions o;
  o.forward_prefetch = o.backward_prefetch = best.prefetch;
  const Explanation e = explain(*model, make_plan(*model, parse_policy(best.spec)),
                                MeshShape(best.shard, best.replicate), o);
  CHECK(predict_cost(e, a.shape, a.workload, a.profile).step_ms == best.cost.step_ms);
  const std::string table = advice.to_string();
  CHECK(table.find(" mesh ") != std::string::npos);
  CHECK(table.find("tok/s/GPU") != std::string::npos);
  a.shard_sizes = {3};
  CHECK(error_of([&] { suggest(*model, 32, 1, ShardingOptions{}, a); })
            .find("shard size 3 does not divide the 32 ranks") != std::string::npos);
}

TEST_CASE("cost model and advisor: tensor parallelism's all-reduces on the tp group's links",
          "[advisor][cluster][tp]") {
  auto cfg = models::ModelConfig::preset("gpt", "small");  // d 256, 8 heads, 4 layers, seq 256
  std::shared_ptr<torch::nn::Module> model;
  {
    MetaInit meta;
    model = cfg.build(0);
  }
  const auto shape = cfg.transformer_shape();
  const TpPlan tp_plan = parse_tp_plan(cfg.family().modules().tp_plan);
  const Workload w{2, cfg.seq_len()};
  ShardingOptions o;
  o.mixed_precision.param_dtype = at::kBFloat16;
  const Plan plan = make_plan(*model, parse_policy("type=Block"));
  const MachineProfile p = cluster_profile();
  const Explanation e1 = explain(*model, plan, MeshShape(8, 1), o);
  const Explanation e2 = explain(*model, plan, MeshShape(4, 1, 2), o, std::nullopt, {}, tp_plan);
  const CostPrediction p1 = predict_cost(e1, shape, w, p), p2 = predict_cost(e2, shape, w, p);

  // Per GPT layer 2 forward + 2 backward all-reduces of tokens x d_model bf16 over the tp
  // group: 2 consecutive ranks in one node, so the profile's own all-reduce (its fixed latency
  // holds a 2-rank ring's steps), bus bytes 2 (T-1)/T x the buffer.
  const double L = 4, d = 256, tokens = static_cast<double>(w.tokens());
  const double one = 23.0 / 1e3 + 2.0 * 1 / 2 * tokens * d * 2 / (328 * 1e6);
  CHECK(p1.tp_comm_ms == 0);
  CHECK(p2.tp_comm_ms == Approx(4 * L * one).epsilon(1e-9));
  // All of it exposed, on top of the sharding's own exposed communication.
  CHECK(p2.exposed_comm_ms - p2.tp_comm_ms >= 0);
  CHECK(p2.comm_ms >= p2.tp_comm_ms);
  // Compute: the layers' matmuls and attention split over tp; the head whole on each rank.
  const double rate = p.compute_tflops * 1e9;
  const double layer = 6.0 * tokens * shape.layer_matmul_params +
                       shape.attention_flops_per_token_per_position * cfg.seq_len() * tokens;
  const double head = 6.0 * tokens * shape.vocab * shape.d_model;
  CHECK(p1.compute_ms == Approx((L * layer + head) / rate).epsilon(1e-9));
  CHECK(p2.compute_ms == Approx((L * layer / 2 + head) / rate).epsilon(1e-9));
  CHECK(p2.tokens == tokens / 2);  // each GPU's share of its tp group's batch
  // Persistent bytes: explain's TP-local masters (the split layers' parameters / tp).
  CHECK(p2.persistent_bytes < predict_cost(explain(*model, plan, MeshShape(4, 1), o), shape, w, p)
                                  .persistent_bytes);

  // The advisor: tp 1 and tp 2 (and 4) on 8 ranks; 3 divides no 8 ranks: skipped, said why.
  AdvisorOptions a;
  a.memory_limit_bytes = int64_t{8} << 30;
  a.workload = w;
  a.shape = shape;
  a.profile = p;
  a.prefetch_depths = {1};
  a.tp_sizes = {2, 3, 4};
  a.tp_plan = tp_plan;
  const Advice advice = suggest(*model, 8, 1, o, a);
  std::set<int> tps;
  for (const auto& c : advice.candidates) {
    CAPTURE(c.label, c.tp);
    tps.insert(c.tp);
    CHECK(c.shard * c.replicate * c.tp == 8);
    CHECK((c.command_line().find("--tp ") != std::string::npos) == (c.tp > 1));
  }
  CHECK(tps == std::set<int>{1, 2, 4});
  REQUIRE(advice.tp_skipped.size() == 1);
  CHECK_THAT(advice.tp_skipped[0], Catch::Contains("tp 3: does not divide the 8 ranks"));
  // Each candidate is predict_cost at its own mesh and tp; ranked by time per token per GPU.
  for (const auto& c : advice.candidates) {
    if (c.tp == 1 || c.label != "layer") continue;
    ShardingOptions oc = o;
    oc.forward_prefetch = oc.backward_prefetch = c.prefetch;
    const Explanation ec = explain(*model, make_plan(*model, parse_policy(c.spec)),
                                   MeshShape(c.shard, c.replicate, c.tp), oc, std::nullopt, {},
                                   tp_plan);
    CHECK(predict_cost(ec, shape, w, p).step_ms == c.cost.step_ms);
  }
  for (size_t i = 2; i < advice.candidates.size(); ++i) {
    const Candidate &x = advice.candidates[i - 1], &y = advice.candidates[i];
    if (x.fits && y.fits)
      CHECK(x.cost.step_ms / x.cost.tokens <= y.cost.step_ms / y.cost.tokens);
  }
  const std::string table = advice.to_string();
  CHECK(table.find(" tp ") != std::string::npos);
  CHECK(table.find("skipped tp 3") != std::string::npos);
  a.tp_plan = {};
  CHECK(error_of([&] { suggest(*model, 8, 1, o, a); }).find("without a tp_plan") !=
        std::string::npos);
}

#ifdef FLATSHARD_EXPLAIN_EXE
TEST_CASE("flatshard-explain: --gpus-per-node, --nodes, --profile by name, tokens/s and MFU",
          "[advisor][cluster][cli]") {
  flatshard_test::TempDir dir;
  auto run = [&](const std::vector<std::string>& args) {
    return flatshard_test::run_tool(dir.path(), FLATSHARD_EXPLAIN_EXE, args);
  };
  // Issue 52's command: the cluster search with the H100 profile's 80 GB as the budget.
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run({"--preset", "1b", "--world", "64", "--gpus-per-node", "8", "--profile",
                      "h100-ib400", "--batch", "2", "--suggest"});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CAPTURE(r.out, r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("memory limit: the profile's device memory, 80 GB") != std::string::npos);
  CHECK(r.out.find("tokens/s per GPU, MFU ") != std::string::npos);
  CHECK(r.out.find("cluster: 64 GPUs on 8 node(s) of 8") != std::string::npos);
  CHECK(r.out.find("16x4") != std::string::npos);  // an HSDP mesh of the search
  CHECK(seconds < 10);  // ~0.3 s of CPU; generous for loaded CI cores

  // --nodes sets --world; the throughput lines with --batch.
  const auto n = run({"--preset", "small", "--nodes", "2", "--gpus-per-node", "4", "--profile",
                      "h100-ib400", "--batch", "1"});
  CAPTURE(n.out, n.err);
  CHECK(n.exit_code == 0);
  CHECK(n.out.find("cluster: 8 GPUs on 2 node(s) of 4; shard group 8 ranks on 2 nodes") !=
        std::string::npos);
  CHECK(n.out.find("throughput: tokens_per_s_per_gpu=") != std::string::npos);

  struct Bad {
    std::vector<std::string> args;
    int code;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {{"--preset", "small"}, 2, "--world is required (or --nodes with --gpus-per-node)"},
      {{"--preset", "small", "--nodes", "2"}, 2, "needs --gpus-per-node"},
      {{"--preset", "small", "--nodes", "2", "--gpus-per-node", "8", "--world", "8"}, 2,
       "16 GPUs is not --world 8 x --replicate 1"},
      {{"--preset", "small", "--nodes", "4000000000", "--gpus-per-node", "8"}, 2,
       "more ranks than an int holds"},
      {{"--preset", "small", "--world", "12", "--gpus-per-node", "8", "--batch", "1"}, 1,
       "12 GPUs do not fill whole nodes of 8"},
      {{"--preset", "small", "--world", "2", "--profile", "h100-ib800", "--batch", "1"}, 1,
       "neither a named profile (a100-ib200, h100-ib400, h200-ib400)"},
  };
  for (const auto& b : bad) {
    const auto o = run(b.args);
    CAPTURE(b.args, o.out, o.err);
    CHECK(o.exit_code == b.code);
    CHECK(o.err.find(b.says) != std::string::npos);
  }
}
#endif

TEST_CASE("h200-ib400 predicts the measured 2x H200 collectives within 10% from 16 MiB to 1 GiB",
          "[advisor][cluster][honesty]") {
  // benchmarks/history.md "Collectives (2x H200)", flatshard run 3 (us per call); size is
  // nccl-tests' total payload: bus bytes = size x (n-1)/n (all-gather, reduce-scatter) or
  // 2 (n-1)/n (all-reduce), n = 2.
  struct Row {
    Collective c;
    double mib, measured_us;
  };
  const std::vector<Row> rows = {
      {Collective::kAllGather, 1, 13.93},       {Collective::kAllGather, 4, 26.34},
      {Collective::kAllGather, 16, 54.27},      {Collective::kAllGather, 64, 156.90},
      {Collective::kAllGather, 256, 552.05},    {Collective::kAllGather, 1024, 2005.45},
      {Collective::kReduceScatter, 1, 12.95},   {Collective::kReduceScatter, 4, 23.93},
      {Collective::kReduceScatter, 16, 51.71},  {Collective::kReduceScatter, 64, 160.74},
      {Collective::kReduceScatter, 256, 567.53}, {Collective::kReduceScatter, 1024, 2001.46},
      {Collective::kAllReduce, 1, 13.72},       {Collective::kAllReduce, 4, 33.76},
      {Collective::kAllReduce, 16, 74.41},      {Collective::kAllReduce, 64, 251.20},
      {Collective::kAllReduce, 256, 898.55},    {Collective::kAllReduce, 1024, 3275.86},
  };
  const MachineProfile p = load_profile_named("h200-ib400");
  const GroupSpan two = shard_group_span(2, static_cast<int64_t>(p.gpus_per_node));
  for (const auto& r : rows) {
    const double size = r.mib * (1 << 20);
    const double bus = r.c == Collective::kAllReduce ? size : size / 2;
    const double predicted_us = 1e3 * collective_ms(p, r.c, two, bus);
    const double error = (predicted_us - r.measured_us) / r.measured_us;
    CAPTURE(to_string(r.c), r.mib, r.measured_us, predicted_us, error);
    if (r.mib >= 16) {  // a layer unit's collectives (the 1B GPT's: ~100 MiB)
      CHECK(std::abs(error) <= 0.10);
    } else if (r.mib >= 4) {
      CHECK(std::abs(error) <= 0.20);  // reduce-scatter +16%: one line cannot fit every size
    } else {
      // 1 MiB: the fixed cost (fitted at 4-16 MiB) over-states the smallest calls (~+60%).
      CHECK(predicted_us > r.measured_us);
    }
  }
}
