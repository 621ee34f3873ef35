// flatshard/profiling/kernel_profile.cpp — see kernel_profile.h for the contract.
#include "profiling/kernel_profile.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <utility>

namespace flatshard {
namespace profiling {

namespace {

bool contains_any(const std::string& s, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (s.find(k) != std::string::npos) return true;
  return false;
}

// Total length of the union of [begin, end) intervals.
double union_ns(std::vector<std::pair<uint64_t, uint64_t>> iv) {
  std::sort(iv.begin(), iv.end());
  double total = 0;
  uint64_t cur_b = 0, cur_e = 0;
  bool open = false;
  for (const auto& [b, e] : iv) {
    if (!open || b > cur_e) {
      if (open) total += static_cast<double>(cur_e - cur_b);
      cur_b = b;
      cur_e = e;
      open = true;
    } else {
      cur_e = std::max(cur_e, e);
    }
  }
  if (open) total += static_cast<double>(cur_e - cur_b);
  return total;
}

std::vector<KernelGroup> sorted_groups(const std::map<std::string, KernelGroup>& m, int steps,
                                       size_t limit) {
  std::vector<KernelGroup> v;
  for (const auto& [name, g] : m) v.push_back(g);
  std::sort(v.begin(), v.end(), [](const KernelGroup& a, const KernelGroup& b) {
    return a.ms != b.ms ? a.ms > b.ms : a.name < b.name;
  });
  if (v.size() > limit) v.resize(limit);
  for (auto& g : v) {
    g.ms /= steps;
    g.count /= steps;
  }
  return v;
}

}  // namespace

std::string kernel_category(const std::string& name) {
  std::string s = name;
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (contains_any(s, {"nccl"})) return "nccl";
  if (contains_any(s, {"flash", "fmha", "attention", "attn", "sdpa"})) return "attention";
  if (contains_any(s, {"gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul"})) return "gemm";
  if (contains_any(s, {"adam", "multi_tensor", "foreach"})) return "optimizer";
  if (contains_any(s, {"norm", "reduce", "softmax", "nll", "cross_entropy", "sum"}))
    return "norm/reduce";
  if (contains_any(s, {"memcpy", "memset"})) return "memcpy/memset";
  if (contains_any(s, {"elementwise", "copy", "vectorized", "unrolled", "fill", "cat", "index"}))
    return "elementwise";
  return "other";
}

KernelProfile summarize_kernels(const std::vector<KernelRecord>& records, int steps,
                                size_t top_n) {
  TORCH_CHECK(steps >= 1, "summarize_kernels: steps must be >= 1, got ", steps);
  KernelProfile p;
  p.steps = steps;
  if (records.empty()) return p;
  std::vector<std::pair<uint64_t, uint64_t>> all, comm, compute;
  std::map<std::string, KernelGroup> by_cat, by_name;
  std::map<int64_t, std::vector<std::pair<uint64_t, uint64_t>>> by_stream;
  uint64_t first = records.front().start_ns, last = records.front().end_ns;
  for (const auto& r : records) {
    TORCH_CHECK(r.end_ns >= r.start_ns, "summarize_kernels: '", r.name, "' ends (", r.end_ns,
                ") before it starts (", r.start_ns, ")");
    const std::string cat = kernel_category(r.name);
    const double ns = static_cast<double>(r.end_ns - r.start_ns);
    all.emplace_back(r.start_ns, r.end_ns);
    by_stream[r.stream].emplace_back(r.start_ns, r.end_ns);
    (cat == "nccl" ? comm : compute).emplace_back(r.start_ns, r.end_ns);
    for (auto [g, name] : {std::pair{&by_cat[cat], &cat}, std::pair{&by_name[r.name], &r.name}}) {
      g->name = *name;
      g->count += 1;
      g->ms += ns * 1e-6;
    }
    first = std::min(first, r.start_ns);
    last = std::max(last, r.end_ns);
  }
  const double per = 1e-6 / steps;
  p.span_ms = static_cast<double>(last - first) * per;
  p.busy_ms = union_ns(all) * per;
  p.comm_ms = union_ns(comm) * per;
  p.compute_ms = union_ns(compute) * per;
  // |A ∩ B| = |A| + |B| - |A ∪ B|
  p.overlap_ms = std::max(0.0, p.comm_ms + p.compute_ms - p.busy_ms);
  p.categories = sorted_groups(by_cat, steps, by_cat.size());
  p.kernels = sorted_groups(by_name, steps, top_n);
  for (const auto& [stream, iv] : by_stream)
    p.streams.push_back(KernelGroup{"stream " + std::to_string(stream),
                                    static_cast<double>(iv.size()) / steps, union_ns(iv) * per});
  std::sort(p.streams.begin(), p.streams.end(),
            [](const KernelGroup& a, const KernelGroup& b) { return a.ms > b.ms; });
  return p;
}

void start_kernel_profile() {
  namespace pi = torch::profiler::impl;
  const pi::ProfilerConfig config(pi::ProfilerState::KINETO);
  const std::set<pi::ActivityType> activities{pi::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}

std::vector<KernelRecord> stop_kernel_profile() {
  auto result = torch::autograd::profiler::disableProfiler();
  TORCH_CHECK(result, "flatshard-bench: the PyTorch profiler returned no result");
  std::vector<KernelRecord> out;
  // libkineto::ActivityType: GPU_MEMCPY = 3, GPU_MEMSET = 4, CONCURRENT_KERNEL = 5.
  for (const auto& e : result->events()) {
    const uint8_t t = e.activityType();
    if (t < 3 || t > 5) continue;
    out.push_back(KernelRecord{e.name(), e.deviceResourceId(), e.startNs(), e.endNs()});
  }
  return out;
}

}  // namespace profiling
}  // namespace flatshard
