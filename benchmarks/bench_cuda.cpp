// flatshard/benchmarks/bench_cuda.cpp — see bench_cuda.h for the contract.
#include "benchmarks/bench_cuda.h"

#include <algorithm>

namespace flatshard {
namespace bench {

RunResult run_on_cuda(const RunConfig& config, const Granularity& granularity,
                      Communicator& comm, const DeviceHooks& hooks, const ProgressFn& progress) {
  hooks.synchronize();
  const int64_t baseline = hooks.memory_current ? hooks.memory_current() : 0;
  RunResult r;
  if (granularity.local) {
    if (comm.rank() == 0) r = train_rank(config, granularity, nullptr, hooks, progress);
    comm.barrier();
  } else {
    r = train_rank(config, granularity, &comm, hooks, progress);
  }
  r.peak_memory_bytes = std::max<int64_t>(0, r.peak_memory_bytes - baseline);
  r.setup_peak_memory_bytes = std::max<int64_t>(0, r.setup_peak_memory_bytes - baseline);
  return r;
}

}  // namespace bench
}  // namespace flatshard
