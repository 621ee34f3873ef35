// flatshard/fsdp/fingerprint.h — check at setup that every rank shards the same thing the same way.
//
// Why: ranks that disagree on the plan, the parameter shapes or dtypes, or the options issue
// collectives of different sizes or in a different order. NCCL then hangs or silently mixes
// unrelated bytes; the threads backend reports an all_gather size mismatch that names no
// parameter. Exchanging a description first turns that into one clear error on every rank.
//
// Contract
// - setup_fingerprint() describes, as ordered entries {where, what, value}, everything ranks must
//   agree on: world size, backend, the options that change collectives or what is trained
//   (strategy, reshard, mixed-precision dtypes (buffer dtype too), alignment,
//   sync_module_states, offload, load set or not), and per unit its name, kind, strategy
//   options (reshard, recompute, offload), module paths, and each parameter's name, shape, dtype
//   and device type;
//   every buffer's name, shape, dtype and device type, and — with sync_module_states off, when
//   nothing will make them equal — a hash of its values (a rank whose buffer differs then fails
//   with "setup: buffer 'rope.inv_freq' values (...) fnv1a:... vs fnv1a:...").
//   Local-only things are left out: device index, trace options, prefetch depths (they change
//   when a unit's all-gather is issued, not which or in what order), the debug sleeps, `init`
//   (a function: not comparable) and strict_plan (the plan it judges is compared).
// - check_ranks_agree() is collective (every rank must call it, before any other collective of
//   the ShardedModel). With HSDP, ShardedModel runs it over the shard group and then over the
//   replicate group, so every rank of every replica is compared (a replica with another plan
//   would otherwise all-reduce gradients of different sizes across replicas). Cost when ranks agree: one all_gather of 4 floats. When any rank differs,
//   ranks exchange their full descriptions and EVERY rank throws the same c10::Error, naming the
//   lowest differing rank and its first differing entry, e.g.
//     "fully_shard: rank 1 differs from rank 0 at unit 3 'blocks.2': param
//      'blocks.2.mlp.fc.weight' shape [256, 64] vs [128, 64] (reported by rank 0)"
// - Encoding (why floats): the Communicator moves only float32/bfloat16, and its reductions are
//   float. Bytes 0..255 and 16-bit hash pieces are integers below 2^24, exact in float32, so the
//   text travels through all_gather unchanged without widening the Communicator's dtypes.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "fsdp/options.h"
#include "wrap_policies/plan.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class Mesh;

struct FingerprintEntry {
  std::string where;  // "setup" or "unit 3 'blocks.2'"
  std::string what;   // "param 'blocks.2.mlp.fc.weight' shape"
  std::string value;  // "[256, 64]"
};

std::vector<FingerprintEntry> setup_fingerprint(const torch::nn::Module& model, const Plan& plan,
                                                const ShardingOptions& options,
                                                const Mesh& mesh);

// Throws (on every rank of the mesh) when the ranks' fingerprints differ. Collective over each
// group of `mesh`, innermost first (the shard group, then with HSDP the replicate group);
// messages name global ranks (Mesh::global_rank_at).
void check_ranks_agree(const std::vector<FingerprintEntry>& mine, const Mesh& mesh);

// The message for the first difference between `base` (rank `base_rank`) and `other` (rank
// `other_rank`); "" when they are equal. Exposed for tests.
std::string describe_difference(const std::vector<FingerprintEntry>& base, int base_rank,
                                const std::vector<FingerprintEntry>& other, int other_rank);

}  // namespace flatshard
