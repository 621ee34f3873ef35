// flatshard/flat_param/gathered_scale.cpp — see gathered_scale.h for the contract.
#include "flat_param/gathered_scale.h"

#include <absl/container/flat_hash_map.h>

#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <utility>

#include "flat_param/collective_plan.h"  // GatherPlan::extras(): flat_param.h only declares it
#include "flat_param/flat_param.h"

namespace flatshard {

namespace {
// Shared by the rank threads of a CPU run, hence locked; `g_count` keeps models without an fp8
// unit lock-free (fsdp/call.cpp's registry does the same).
std::shared_mutex g_mu;
absl::flat_hash_map<const c10::TensorImpl*, std::pair<const FlatParam*, size_t>> g_params;
std::atomic<size_t> g_count{0};
}  // namespace

at::Tensor gathered_fp8_scale(const at::Tensor& param) {
  if (!param.defined() || g_count.load(std::memory_order_acquire) == 0) return {};
  std::shared_lock<std::shared_mutex> lock(g_mu);
  const auto it = g_params.find(param.unsafeGetTensorImpl());
  if (it == g_params.end()) return {};
  const auto& [flat, i] = it->second;
  if (is_guarded_param(param) || !flat->is_unsharded()) return {};
  const at::Tensor* scales = flat->gather_plan().extras().fp8_scales;
  if (scales == nullptr || !scales->defined()) return {};
  return scales->narrow(0, static_cast<int64_t>(i), 1);
}

namespace detail {

void register_fp8_params(const FlatParam& flat) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  for (size_t i = 0; i < flat.params().size(); ++i)
    g_params[flat.params()[i].param.unsafeGetTensorImpl()] = {&flat, i};
  g_count.store(g_params.size(), std::memory_order_release);
}

void unregister_fp8_params(const FlatParam& flat) noexcept {
  try {  // a lock or an erase that throws leaves a stale entry, which only a lookup of a
         // destroyed model's parameter could find; nothing to do about it in a destructor
    std::unique_lock<std::shared_mutex> lock(g_mu);
    for (const ParamRef& p : flat.params()) {
      const auto it = g_params.find(p.param.unsafeGetTensorImpl());
      if (it != g_params.end() && it->second.first == &flat) g_params.erase(it);
    }
    g_count.store(g_params.size(), std::memory_order_release);
  } catch (...) {
  }
}

}  // namespace detail
}  // namespace flatshard
