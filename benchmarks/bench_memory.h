// flatshard/benchmarks/bench_memory.h — does the model fit, asked before anything is allocated.
//
// Contract
// - check_memory() estimates a LOWER bound of what the runs will hold and throws UsageError
//   with the numbers when it exceeds the memory there is, so `--layers 1000000000000` is one
//   line and exit code 2, not minutes of allocation ending in std::bad_alloc or the OOM killer.
//   Being a lower bound, it never refuses a run that would fit; a run it lets through may still
//   run out (allocator caching, temporaries, other processes).
// - The estimate, P = the model's parameter count (computed in long double: no overflow):
//     state       16 B x P: fp32 weights + gradients + AdamW's two moments. `local` holds all
//                 of it on one rank; sharded runs spread it over the ranks. An fp32 host model
//                 (4 B x P, in every process) exists only with --init eager or a local run:
//                 plans are made on the meta device, and deferred runs build there.
//     activations what autograd keeps per rank: per layer 16 x batch x seq x d_model values
//                 plus 2 x batch x heads x seq^2 attention probabilities, and 2 x batch x seq x
//                 vocab logits, at the param dtype's size.
//   cpu: ranks are threads of this process: ranks x activations + (local ? ranks : 1) x state,
//        against the host's available memory (MemAvailable in /proc/meminfo; physical pages
//        when that is unreadable).
//   cuda: per GPU, activations + state (local) or state / ranks, against the device's total
//        memory; and ranks x the host model (if any, above) against the host's. With --offload
//        the least offloaded level decides: level 1 holds param-dtype shards (2 or 4 B x P /
//        ranks) on the GPU, level 2 none; the offloaded state (16 B x P over all ranks) is
//        checked against the host's memory.
//   --recompute: a layer keeps only its input (batch x seq x d_model), one layer at a time all
//   of the above.
#pragma once

#include <cstdint>
#include <optional>

#include "benchmarks/bench_options.h"

namespace flatshard {
namespace bench {

// Host memory this process may still use, in bytes; nullopt when unknown.
std::optional<int64_t> available_host_memory();

// `device_memory`: total bytes of one GPU (cuda only; nullopt = not checked). `world`: ranks.
void check_memory(const BenchOptions& options, int world, std::optional<int64_t> device_memory);

}  // namespace bench
}  // namespace flatshard
