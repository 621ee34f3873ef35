// flatshard/planner/topology.h — where a process group's ranks sit on the nodes of a cluster, and
// what one collective over that group costs (the cost model's collective term, cost_model.h).
//
//   GroupSpan shard = shard_group_span(/*shard=*/8, /*gpus_per_node=*/8);        // 1 node x 8
//   GroupSpan rep = replicate_group_span(/*replicate=*/16, /*shard=*/8, 8);      // 16 nodes x 1
//   double ms = collective_ms(profile, Collective::kAllReduce, rep, bus_bytes);
//
// Contract
// - Ranks are numbered node by node (rank / gpus_per_node is the node, as torchrun and the mesh
//   number them). A shard group is `shard` consecutive ranks; a replicate group is `replicate`
//   ranks `shard` apart (DeviceMesh (replicate, shard), FSDP2's HSDP layout). gpus_per_node 0:
//   no topology (a profile without it), every group inside one node.
// - GroupSpan{ranks, nodes, per_node}: per_node is the fewest ranks of the group on one of its
//   nodes (the node whose NICs carry the ring's inter-node hops). A group that neither fits
//   whole nodes nor divides one (shard 12 on nodes of 8) is taken at its worst: every node it
//   touches holds one of its ranks as far as bandwidth goes (per_node 1) and it spans one node
//   more than it fills.
// - collective_ms(): latency + bus bytes / bus bandwidth, bus bytes as nccl-tests define them
//   (the caller passes them: all-gather and reduce-scatter (n-1)/n x the full buffer, all-reduce
//   2(n-1)/n). Rings as NCCL runs them (src/graph/tuning.cc's model):
//     steps      all-gather and reduce-scatter n-1, all-reduce 2(n-1); of them nodes-1
//                (all-reduce 2(nodes-1)) cross the network, the rest NVLink.
//     latency    the profile's fixed cost of the collective (*_latency_us, measured at 2 ranks
//                in one node: it holds that ring's own steps) + each further NVLink step x
//                intra_node_hop_latency_us + each network step x inter_node_hop_latency_us.
//     bandwidth  inside one node the collective's own bus bandwidth (*_gbps); across nodes
//                the slowest link bounds it: min(*_gbps, per_node x inter_node_gbps) — each of
//                a node's per_node rings leaves the node through its own NIC (rail-aligned).
//   All-reduce across nodes: the faster of that ring and NCCL's tree (same bandwidth, latency
//   2 x ((per_node - 1) intra + ceil(log2 nodes) inter) hops), as NCCL picks the faster.
//   One node with both hop latencies 0 is exactly the profile's per-collective formula.
// - Sizes < 1 or gpus_per_node < 0 are errors naming the values.
#pragma once

#include <cstdint>
#include <string>

#include "planner/machine_profile.h"

namespace flatshard {

enum class Collective { kAllGather, kReduceScatter, kAllReduce };
const char* to_string(Collective c);

struct GroupSpan {
  int64_t ranks = 1;     // ranks in the group
  int64_t nodes = 1;     // nodes it spans
  int64_t per_node = 1;  // the fewest of its ranks on one node (see the contract)
  std::string to_string() const;  // "8 ranks on 1 node", "16 ranks on 16 nodes (1 per node)"
};

// `shard` consecutive ranks.
GroupSpan shard_group_span(int64_t shard, int64_t gpus_per_node);
// `replicate` ranks, `shard` apart.
GroupSpan replicate_group_span(int64_t replicate, int64_t shard, int64_t gpus_per_node);

// The parts of one collective's time (see the contract); ms() their sum.
struct CollectiveTime {
  double latency_us = 0;  // fixed cost + hops
  double bus_gbps = 0;    // the bus bandwidth it runs at
  double bus_bytes = 0;
  bool tree = false;      // all-reduce across nodes: the tree was the faster
  double ms() const { return bus_bytes > 0 ? latency_us / 1e3 + bus_bytes / (bus_gbps * 1e6) : 0; }
};
CollectiveTime collective_time(const MachineProfile& p, Collective c, const GroupSpan& g,
                               double bus_bytes);
inline double collective_ms(const MachineProfile& p, Collective c, const GroupSpan& g,
                            double bus_bytes) {
  return collective_time(p, c, g, bus_bytes).ms();
}

}  // namespace flatshard
