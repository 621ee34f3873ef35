#include "fsdp/tensor_parallel.h"

#include <absl/container/flat_hash_map.h>
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>

#include "collectives/communicator.h"
#include "fsdp/tp_entry.h"
#include "support/input_file.h"
#include "wrap_policies/match.h"

namespace flatshard {

namespace {

// Ranks as threads parallelize several models at once: the registry is shared and locked;
// g_count keeps flatshard::call lock-free when no model is parallelized.
std::shared_mutex g_mu;
absl::flat_hash_map<const torch::nn::Module*, detail::TpEntry> g_modules;
std::unordered_map<const torch::nn::Module*, const TensorParallel*> g_roots;
std::atomic<size_t> g_count{0};

Communicator* group_of(const torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<Communicator*>(ctx->saved_data.at("group").toInt());
}

// `count`/`bytes`: the TpCounterCells fields this all-reduce adds to (TensorParallel::counters()).
at::Tensor all_reduced(Communicator* group, const at::Tensor& t, std::atomic<int64_t>* count,
                       std::atomic<int64_t>* bytes) {
  at::Tensor out = t.clone(at::MemoryFormat::Contiguous);
  group->all_reduce(out, ReduceOp::kSum, group->current_stream());
  if (count != nullptr) {
    count->fetch_add(1, std::memory_order_relaxed);
    bytes->fetch_add(static_cast<int64_t>(out.numel()) * static_cast<int64_t>(out.element_size()),
                     std::memory_order_relaxed);
  }
  return out;
}

detail::TpCounterCells* cells_of(int64_t counters) {
  return reinterpret_cast<detail::TpCounterCells*>(static_cast<intptr_t>(counters));
}

// Megatron's f: identity forward, all-reduce of the gradient backward.
struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t group, int64_t counters) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["counters"] = counters;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    detail::TpCounterCells* c = cells_of(ctx->saved_data.at("counters").toInt());
    return {all_reduced(group_of(ctx), g[0], c ? &c->backward_all_reduces : nullptr,
                        c ? &c->backward_bytes : nullptr),
            at::Tensor(), at::Tensor()};
  }
};

// Megatron's g: all-reduce forward, identity backward.
struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& y,
                            int64_t group, int64_t counters) {
    detail::TpCounterCells* c = cells_of(counters);
    return all_reduced(reinterpret_cast<Communicator*>(group), y,
                       c ? &c->forward_all_reduces : nullptr, c ? &c->forward_bytes : nullptr);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list g) {
    return {g[0], at::Tensor(), at::Tensor()};
  }
};

int64_t as_int(const void* c) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(c)); }

// The slice of `full` a tp rank keeps (the one home of the layout, parallelize and local_slice).
at::Tensor slice_of(const at::Tensor& full, TpStyle style, int parts, bool is_bias, int tp,
                    int rank) {
  if (style == TpStyle::kRowwise) {
    if (is_bias) return full;
    const int64_t c = full.size(1) / tp;
    return full.narrow(1, rank * c, c).contiguous();
  }
  const int64_t out = full.size(0), block = out / parts, c = block / tp;
  std::vector<int64_t> shape = full.sizes().vec();
  shape[0] = block;
  shape.insert(shape.begin(), parts);
  std::vector<int64_t> local = full.sizes().vec();
  local[0] = out / tp;
  return full.reshape(shape).narrow(1, rank * c, c).reshape(local).contiguous();
}

std::string model_types(const torch::nn::Module& root) {
  std::vector<std::string> seen;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    const std::string t = policy_type_name(item.value()->name());
    if (std::find(seen.begin(), seen.end(), t) == seen.end()) seen.push_back(t);
  }
  std::string out;
  for (const auto& t : seen) out += (out.empty() ? "" : ", ") + t;
  return printable_escape(out);
}

}  // namespace

namespace detail {

TpEntry find_tp(const torch::nn::Module* m) {
  if (g_count.load(std::memory_order_acquire) == 0) return {};
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_modules.find(m);
  return it == g_modules.end() ? TpEntry{} : it->second;
}

at::Tensor tp_enter_colwise(const TpEntry& e, const at::Tensor& x) {
  return CopyToTp::apply(x, as_int(e.group), as_int(e.counters));
}

at::Tensor tp_exit_rowwise(const TpEntry& e, const torch::nn::Module* m, const at::Tensor& y) {
  // The replicated bias was added on every rank: take it out before the sum, add it once after
  // (its gradient is then the output's, as unsplit).
  const at::Tensor* bias = m->named_parameters(/*recurse=*/false).find("bias");
  if (bias == nullptr || !bias->defined())
    return ReduceFromTp::apply(y, as_int(e.group), as_int(e.counters));
  return ReduceFromTp::apply(y - *bias, as_int(e.group), as_int(e.counters)) + *bias;
}

void tp_bad_signature(const TpEntry& e) {
  TORCH_CHECK(false, "tensor parallelism: module '", printable_escape(*e.path),
              "' is split by the tp plan but its forward is not one Tensor in, one Tensor out; "
              "colwise and rowwise modules must be Linear-like (name another module in the plan)");
}

}  // namespace detail

TensorParallel::~TensorParallel() {
  // Only erases the entries this object added. Locking may throw (std::system_error): then
  // they stay registered, which a destructor cannot report; swallowed (CONTRIBUTING.md 5).
  try {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    for (const torch::nn::Module* m : registered_) g_modules.erase(m);
    auto it = g_roots.find(root_);
    if (it != g_roots.end() && it->second == this) g_roots.erase(it);
    g_count.store(g_modules.size(), std::memory_order_release);
  } catch (...) {
  }
}

bool TensorParallel::is_split(const at::Tensor& param) const {
  return split_.count(param.unsafeGetTensorImpl()) != 0;
}

at::Tensor TensorParallel::local_slice(const std::string& name, const at::Tensor& full) const {
  auto it = slices_.find(name);
  if (it == slices_.end()) return full;
  return slice_of(full, it->second.style, it->second.parts, it->second.is_bias, tp_size_, tp_rank_);
}

std::string TensorParallel::to_string() const {
  std::ostringstream os;
  for (const TpModule& m : modules_) {
    TpRule r;
    r.style = m.style;
    r.parts = m.parts;
    os << style_text(r) << ' ' << printable_escape(m.path) << '\n';
  }
  return os.str();
}

TpCounters TensorParallel::counters() const {
  TpCounters c;
  if (!counters_) return c;
  c.forward_all_reduces = counters_->forward_all_reduces.load(std::memory_order_relaxed);
  c.backward_all_reduces = counters_->backward_all_reduces.load(std::memory_order_relaxed);
  c.forward_bytes = counters_->forward_bytes.load(std::memory_order_relaxed);
  c.backward_bytes = counters_->backward_bytes.load(std::memory_order_relaxed);
  return c;
}

void TensorParallel::reset_counters() {
  if (!counters_) return;
  counters_->forward_all_reduces = 0;
  counters_->backward_all_reduces = 0;
  counters_->forward_bytes = 0;
  counters_->backward_bytes = 0;
}

std::vector<int64_t> tp_local_shape(const TpModule& m, bool is_bias,
                                    const std::vector<int64_t>& full, int tp) {
  std::vector<int64_t> local = full;
  if (m.style == TpStyle::kColwise && !local.empty()) local[0] /= tp;
  if (m.style == TpStyle::kRowwise && !is_bias && local.size() >= 2) local[1] /= tp;
  return local;
}

const TensorParallel* find_tensor_parallel(const torch::nn::Module* root) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_roots.find(root);
  return it == g_roots.end() ? nullptr : it->second;
}

std::vector<TpModule> match_tp_plan(const torch::nn::Module& model, const TpPlan& plan, int tp,
                                    const std::string& where) {
  std::vector<TpModule> out;
  // 1. Match.
  const Policy policy = plan.match_policy();
  PolicyMatcher matcher(policy);
  TORCH_CHECK(!matcher.needs_size(), where, ": tp plan '", printable_escape(plan.to_spec()),
              "' has a size>= term; a tp plan chooses modules by type or path only");
  std::vector<int> hits(plan.rules.size(), 0);
  std::vector<std::shared_ptr<torch::nn::Module>> split;
  std::unordered_set<const torch::nn::Module*> seen;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (!seen.insert(item.value().get()).second) continue;  // a module under a second path
    const int r = matcher.first_match(match_subject(model, item.key(), *item.value()));
    if (r < 0) continue;
    ++hits[r];
    const TpRule& rule = plan.rules[r];
    if (rule.style == TpStyle::kReplicate) continue;
    out.push_back({item.key(), rule.style, rule.parts, r});
    split.push_back(item.value());
  }
  for (size_t r = 0; r < plan.rules.size(); ++r)
    TORCH_CHECK(hits[r] > 0, where, ": tp plan rule ", r + 1, " '",
                printable_escape(style_text(plan.rules[r]) + ":" + to_spec(plan.rules[r].match)),
                "' matches no module of the model (plan '", printable_escape(plan.to_spec()),
                "'; the model's module types: ", model_types(model),
                "). Fix the rule's type or path terms, or remove it");

  // 2. The parents' own checks (heads), then Linear-like modules and sizes tp divides.
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const auto* aware = dynamic_cast<const TensorParallelModule*>(item.value().get());
    if (aware == nullptr) continue;
    bool has_split_child = false;
    for (const auto& child : item.value()->named_children())
      for (const auto& s : split) has_split_child = has_split_child || s == child.value();
    if (!has_split_child) continue;
    try {
      aware->check_tensor_parallel(item.key(), tp);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, where, ": ", e.what_without_backtrace());
    }
  }

  for (size_t i = 0; i < split.size(); ++i) {
    const TpModule& tm = out[i];
    const torch::nn::Module& m = *split[i];
    const std::string what = "module '" + printable_escape(tm.path) + "' (" +
                             printable_escape(policy_type_name(m.name())) + ", " +
                             style_text(plan.rules[tm.rule]) + ")";
    const auto params = m.named_parameters(/*recurse=*/false);
    const at::Tensor* w = params.find("weight");
    const at::Tensor* b = params.find("bias");
    std::ostringstream held;
    for (const auto& p : params) held << ' ' << printable_escape(p.key()) << p.value().sizes();
    TORCH_CHECK(w != nullptr && w->dim() == 2 && params.size() <= (b ? 2u : 1u) &&
                    (b == nullptr || !b->defined() || (b->dim() == 1 && b->size(0) == w->size(0))),
                where, ": ", what,
                " is not Linear-like: a colwise or rowwise module holds a 2-D "
                "weight [out, in] and at most a 1-D bias [out]; it holds",
                held.str(), ". Name its Linear children in the tp plan instead");
    if (tm.style == TpStyle::kColwise) {
      const int64_t o = w->size(0);
      TORCH_CHECK(o % (static_cast<int64_t>(tm.parts) * tp) == 0, where, ": ", what, " has ", o,
                  " output features", tm.parts > 1 ? " in " + std::to_string(tm.parts) + " blocks" : "",
                  ", which tp ", tp, " cannot split evenly (", o, " must be a multiple of ",
                  static_cast<int64_t>(tm.parts) * tp, ")");
    } else {
      TORCH_CHECK(w->size(1) % tp == 0, where, ": ", what, " has ", w->size(1),
                  " input features, which tp ", tp, " cannot split evenly");
    }
  }
  return out;
}

std::unique_ptr<TensorParallel> parallelize(const std::shared_ptr<torch::nn::Module>& model,
                                            const TpPlan& plan, const Mesh& mesh) {
  TORCH_CHECK(model != nullptr, "parallelize: model is null");
  mesh.check();
  const int tp = mesh.size(MeshDim::kTp), rank = mesh.coord(MeshDim::kTp);
  const std::string where = "parallelize (" + mesh.describe_rank() + ")";
  TORCH_CHECK(find_tensor_parallel(model.get()) == nullptr, where,
              ": the model is already parallelized; keep the first TensorParallel");
  std::unique_ptr<TensorParallel> out(new TensorParallel());
  out->root_ = model.get();
  out->plan_ = plan;
  out->tp_size_ = tp;
  out->tp_rank_ = rank;
  out->counters_ = std::make_unique<detail::TpCounterCells>();

  // 1-2. Match and check (nothing changed yet).
  out->modules_ = match_tp_plan(*model, plan, tp, where);
  std::vector<std::shared_ptr<torch::nn::Module>> split;
  {
    std::unordered_map<std::string, std::shared_ptr<torch::nn::Module>> by_path;
    for (const auto& item : model->named_modules("", /*include_self=*/false))
      by_path.emplace(item.key(), item.value());
    for (const TpModule& tm : out->modules_) split.push_back(by_path.at(tm.path));
  }
  for (size_t i = 0; i < split.size(); ++i) {
    const at::Tensor* w = split[i]->named_parameters(/*recurse=*/false).find("weight");
    TORCH_CHECK(!w->is_meta(), where, ": module '", printable_escape(out->modules_[i].path),
                "'s weight is on meta; parallelize a model with values (deferred init under "
                "tensor parallelism is not supported yet)");
  }
  // 3. Slice in place and register.
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < split.size(); ++i) {
      const TpModule& tm = out->modules_[i];
      for (auto& p : split[i]->named_parameters(/*recurse=*/false)) {
        if (!p.value().defined()) continue;
        const bool is_bias = p.key() == "bias";
        const std::string name = tm.path + "." + p.key();
        out->slices_[name] = {tm.style, tm.parts, is_bias};
        if (tm.style == TpStyle::kRowwise && is_bias) continue;  // replicated
        p.value().set_data(slice_of(p.value().detach(), tm.style, tm.parts, is_bias, tp, rank));
        out->split_.insert(p.value().unsafeGetTensorImpl());
      }
    }
  }
  if (tp > 1) {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    for (size_t i = 0; i < split.size(); ++i) {
      detail::TpEntry e;
      e.kind = out->modules_[i].style == TpStyle::kColwise ? detail::TpEntry::Kind::kColwise
                                                           : detail::TpEntry::Kind::kRowwise;
      e.group = mesh.tp();
      e.path = &out->modules_[i].path;
      e.counters = out->counters_.get();
      TORCH_CHECK(g_modules.emplace(split[i].get(), e).second, where, ": module '",
                  printable_escape(out->modules_[i].path),
                  "' is already split by another parallelize()");
      out->registered_.push_back(split[i].get());
    }
    g_count.store(g_modules.size(), std::memory_order_release);
  }
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    g_roots[model.get()] = out.get();
  }
  return out;
}

}  // namespace flatshard
