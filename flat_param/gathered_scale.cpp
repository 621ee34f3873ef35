// flatshard/flat_param/gathered_scale.cpp — see gathered_scale.h for the contract.
#include "flat_param/gathered_scale.h"

#include <absl/container/flat_hash_map.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace flatshard {

namespace {
struct Entry {
  const void* owner;
  size_t index;
  std::shared_ptr<const detail::Fp8ScaleLookup> scale_of;
};
// Shared by the rank threads of a CPU run, hence locked; `g_count` keeps models without an fp8
// unit lock-free (fsdp/call.cpp's registry does the same).
std::shared_mutex g_mu;
absl::flat_hash_map<const c10::TensorImpl*, Entry> g_params;
std::atomic<size_t> g_count{0};
}  // namespace

at::Tensor gathered_fp8_scale(const at::Tensor& param) {
  if (!param.defined() || g_count.load(std::memory_order_acquire) == 0) return {};
  std::shared_lock<std::shared_mutex> lock(g_mu);
  const auto it = g_params.find(param.unsafeGetTensorImpl());
  if (it == g_params.end()) return {};
  return (*it->second.scale_of)(param, it->second.index);
}

namespace detail {

void register_fp8_params(const void* owner, const std::vector<const c10::TensorImpl*>& params,
                         Fp8ScaleLookup scale_of) {
  auto shared = std::make_shared<const Fp8ScaleLookup>(std::move(scale_of));
  std::unique_lock<std::shared_mutex> lock(g_mu);
  for (size_t i = 0; i < params.size(); ++i) g_params[params[i]] = Entry{owner, i, shared};
  g_count.store(g_params.size(), std::memory_order_release);
}

void unregister_fp8_params(const void* owner) noexcept {
  try {  // a lock that throws leaves stale entries, which only a lookup of a destroyed model's
         // parameter could find; nothing to do about it in a destructor
    std::unique_lock<std::shared_mutex> lock(g_mu);
    for (auto it = g_params.begin(); it != g_params.end();) {
      if (it->second.owner == owner) {
        g_params.erase(it++);  // absl's erase(iterator) invalidates only `it`
      } else {
        ++it;
      }
    }
    g_count.store(g_params.size(), std::memory_order_release);
  } catch (...) {
  }
}

}  // namespace detail
}  // namespace flatshard
