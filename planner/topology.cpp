// flatshard/planner/topology.cpp — see topology.h.
#include "planner/topology.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace flatshard {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_sizes(const char* what, int64_t ranks, int64_t stride, int64_t gpus_per_node) {
  TORCH_CHECK(ranks >= 1 && stride >= 1 && gpus_per_node >= 0, what, ": group size ", ranks,
              " and shard size ", stride, " must be >= 1 and gpus_per_node ", gpus_per_node,
              " >= 0 (0: no topology)");
}

// A ring's steps over n ranks (NCCL: all-gather and reduce-scatter n-1, all-reduce 2(n-1)).
int64_t ring_steps(Collective c, int64_t n) {
  return c == Collective::kAllReduce ? 2 * (n - 1) : n - 1;
}

}  // namespace

const char* to_string(Collective c) {
  switch (c) {
    case Collective::kAllGather:
      return "all-gather";
    case Collective::kReduceScatter:
      return "reduce-scatter";
    case Collective::kAllReduce:
      return "all-reduce";
  }
  return "?";
}

std::string GroupSpan::to_string() const {
  std::string s = std::to_string(ranks) + (ranks == 1 ? " rank" : " ranks") + " on " +
                  std::to_string(nodes) + (nodes == 1 ? " node" : " nodes");
  if (nodes > 1) s += " (" + std::to_string(per_node) + " per node)";
  return s;
}

GroupSpan shard_group_span(int64_t shard, int64_t gpus_per_node) {
  check_sizes("shard_group_span", shard, 1, gpus_per_node);
  const int64_t g = gpus_per_node;
  if (g == 0 || (shard <= g && g % shard == 0)) return {shard, 1, shard};
  if (shard % g == 0) return {shard, shard / g, g};
  // Straddles node boundaries: at worst one node more than it fills, one rank on some node.
  return {shard, std::min(shard, ceil_div(shard, g) + 1), 1};
}

GroupSpan replicate_group_span(int64_t replicate, int64_t shard, int64_t gpus_per_node) {
  check_sizes("replicate_group_span", replicate, shard, gpus_per_node);
  const int64_t g = gpus_per_node;
  if (g == 0 || replicate == 1) return {replicate, 1, replicate};
  if (shard % g == 0) return {replicate, replicate, 1};  // a shard group fills whole nodes
  if (g % shard == 0) {
    const int64_t q = g / shard;  // members of one replicate group on a node
    if (replicate <= q) return {replicate, 1, replicate};
    const int64_t nodes = ceil_div(replicate, q);
    return {replicate, nodes, replicate % q == 0 ? q : replicate % q};
  }
  return {replicate, std::min(replicate, ceil_div(replicate * shard, g) + 1), 1};
}

CollectiveTime collective_time(const MachineProfile& p, Collective c, const GroupSpan& g,
                               double bus_bytes) {
  double latency = 0, gbps = 0;
  switch (c) {
    case Collective::kAllGather:
      latency = p.all_gather_latency_us, gbps = p.all_gather_gbps;
      break;
    case Collective::kReduceScatter:
      latency = p.reduce_scatter_latency_us, gbps = p.reduce_scatter_gbps;
      break;
    case Collective::kAllReduce:
      latency = p.all_reduce_latency_us, gbps = p.all_reduce_gbps;
      break;
  }
  CollectiveTime t;
  t.bus_bytes = bus_bytes;
  const int64_t steps = ring_steps(c, g.ranks), reference = ring_steps(c, 2);
  if (g.nodes <= 1) {
    t.latency_us =
        latency + static_cast<double>(std::max<int64_t>(0, steps - reference)) *
                      p.intra_node_hop_latency_us;
    t.bus_gbps = gbps;
    return t;
  }
  const int64_t inter = ring_steps(c, g.nodes), intra = steps - inter;
  t.latency_us = latency +
                 static_cast<double>(std::max<int64_t>(0, intra - reference)) *
                     p.intra_node_hop_latency_us +
                 static_cast<double>(inter) * p.inter_node_hop_latency_us;
  t.bus_gbps = std::min(gbps, static_cast<double>(g.per_node) * p.inter_node_gbps);
  if (c == Collective::kAllReduce) {
    const double levels = std::ceil(std::log2(static_cast<double>(g.nodes)));
    const double tree = latency + 2 * (static_cast<double>(g.per_node - 1) *
                                           p.intra_node_hop_latency_us +
                                       levels * p.inter_node_hop_latency_us);
    if (tree < t.latency_us) {
      t.latency_us = tree;
      t.tree = true;
    }
  }
  return t;
}

}  // namespace flatshard
