#include "fsdp/call.h"

#include <absl/container/flat_hash_map.h>

#include <atomic>
#include <mutex>
#include <shared_mutex>

#include "fsdp/runtime.h"
#include "fsdp/unit.h"

namespace flatshard {
namespace detail {

namespace {
// Ranks-as-threads tests drive several models from several threads, so the registry is shared
// and locked; `g_count` keeps the unsharded case (no live ShardedModel) lock-free. This lookup
// runs on every flatshard::call (hundreds per step for per-leaf plans): an open-addressing
// absl::flat_hash_map keeps it to one cache line probe.
std::shared_mutex g_mu;
absl::flat_hash_map<const torch::nn::Module*, UnitEntry> g_units;
std::atomic<size_t> g_count{0};
}  // namespace

void register_member(const torch::nn::Module* module, Runtime* runtime, Unit* unit,
                     const std::string& path) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  auto [it, inserted] = g_units.emplace(module, UnitEntry{runtime, unit});
  TORCH_CHECK(inserted, "flatshard: module '", path, "' is already a member of unit '",
              it->second.unit->name(), "'; cannot add it to unit '", unit->name(),
              "' (was fully_shard applied twice to the same model?)");
  g_count.store(g_units.size(), std::memory_order_release);
}

void unregister_member(const torch::nn::Module* module) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  g_units.erase(module);
  g_count.store(g_units.size(), std::memory_order_release);
}

UnitEntry find_unit(const torch::nn::Module* m) {
  if (g_count.load(std::memory_order_acquire) == 0) return {};
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_units.find(m);
  return it == g_units.end() ? UnitEntry{} : it->second;
}

void pre_forward(const UnitEntry& e, const torch::nn::Module* m) {
  e.runtime->pre_forward(*e.unit, m);
}

at::Tensor cast_input(const UnitEntry& e, const at::Tensor& t) {
  const at::ScalarType dt = e.unit->flat().config().param_dtype;
  if (!t.defined() || !at::isFloatingType(t.scalar_type())) return t;
  return e.runtime->wrap_input(*e.unit, t.scalar_type() == dt ? t : t.to(dt));
}

void post_forward(const UnitEntry& e, const torch::nn::Module* m,
                  std::vector<at::Tensor>& outputs) {
  e.runtime->post_forward(*e.unit, m, outputs);
}

}  // namespace detail
}  // namespace flatshard
