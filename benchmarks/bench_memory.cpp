// flatshard/benchmarks/bench_memory.cpp — see bench_memory.h for the contract.
#include "benchmarks/bench_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "benchmarks/bench_granularity.h"

namespace flatshard {
namespace bench {

namespace {

// "1.5 GiB", also for sizes far beyond int64 (support/format.h's format_bytes takes int64_t).
std::string bytes_text(long double b) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  int u = 0;
  while (b >= 1024 && u < 8) b /= 1024, ++u;
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0Lf %s" : "%.4Lg %s", b, units[u]);
  return buf;
}

bool has_local(const BenchOptions& o) {
  for (const auto& g : split_granularities(o.policies))
    if (g == "local") return true;
  return false;
}

long double activations(const BenchOptions& o) {
  const models::ModelConfig& c = o.model;
  const long double T = c.seq_len(), tokens = static_cast<long double>(o.batch) * T;
  const long double per_layer =
      16 * tokens * c.d_model() + 2 * static_cast<long double>(o.batch) * c.n_heads() * T * T;
  // --recompute (and no local run, which never recomputes): a layer keeps only its input, and
  // one layer at a time holds its activations during its recompute.
  const bool recomputed = o.recompute && !has_local(o);
  const long double layers = recomputed ? c.n_layers() * tokens * c.d_model() + per_layer
                                        : c.n_layers() * per_layer;
  const long double values = layers + 2 * tokens * c.vocab();
  return values *
         static_cast<long double>(c10::elementSize(o.sharding.mixed_precision.param_dtype));
}

}  // namespace

std::optional<int64_t> available_host_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  long long kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return static_cast<int64_t>(kib) * 1024;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<int64_t>(pages) * page;
  return std::nullopt;
}

void check_memory(const BenchOptions& o, int world, std::optional<int64_t> device_memory) {
  const long double p = o.model.num_parameters_bound();
  const bool local = has_local(o);
  // An fp32 host model per rank, built before sharding: eager init, or a local run (plans are
  // made on the meta device and deferred runs build there too: no host copy).
  const long double state = 16 * p, act = activations(o);
  const long double planning = (local || !o.deferred_init) ? 4 * p : 0;
  const int ranks = std::max(world, 1);
  auto refuse = [&](const std::string& where, long double need, const std::string& breakdown,
                    long double have, const std::string& source) {
    std::ostringstream os;
    os << "the model does not fit: " << o.model.to_string() << " has "
       << static_cast<double>(p) << " parameters and needs at least " << bytes_text(need)
       << " of " << where << " (" << breakdown << ") but " << bytes_text(have) << " is "
       << source << "; use a smaller model (--layers, --d-model, --vocab, --seq, --batch)";
    throw UsageError(os.str());
  };
  const std::optional<int64_t> host = available_host_memory();
  if (o.device == DeviceKind::kCpu) {
    const long double need = std::max(planning, ranks * act + (local ? ranks : 1) * state);
    if (host && need > *host)
      refuse("host memory",
             need, std::to_string(ranks) + " rank thread(s) x " + bytes_text(act) +
                       " activations + " + (local ? std::to_string(ranks) + " x " : "") +
                       bytes_text(state) + " fp32 weights, gradients and AdamW state",
             *host, "available (MemAvailable, /proc/meminfo)");
    return;
  }
  // Note [CPU offload]: the least offloaded run decides the device's share; level 1 keeps the
  // compute-dtype shard there, level 2 nothing between gathers.
  const int level = local ? 0 : *std::min_element(o.offload_levels.begin(), o.offload_levels.end());
  const long double param_bytes =
      static_cast<long double>(c10::elementSize(o.sharding.mixed_precision.param_dtype));
  const long double device_state =
      local ? state : level == 0 ? state / ranks : level == 1 ? param_bytes * p / ranks : 0;
  const long double per_gpu = act + device_state;
  if (device_memory && per_gpu > *device_memory)
    refuse("memory per GPU", per_gpu,
           bytes_text(act) + " activations + " + bytes_text(device_state) +
               (level == 0 ? " fp32 weights, gradients and AdamW state"
                           : " compute-dtype shards (offload " + std::to_string(level) + ")") +
               (local ? " (local: unsharded)" : ""),
           *device_memory, "the GPU's total memory");
  if (host && level > 0 && state > *host)
    refuse("host memory", state,
           bytes_text(state) + " fp32 weights, gradients and AdamW state offloaded by all ranks",
           *host, "available (MemAvailable, /proc/meminfo)");
  if (host && ranks * planning > *host)
    refuse("host memory", ranks * planning,
           std::to_string(ranks) + " process(es) x " + bytes_text(planning) +
               " fp32 host model (eager init or local run)",
           *host, "available (MemAvailable, /proc/meminfo)");
}

}  // namespace bench
}  // namespace flatshard
