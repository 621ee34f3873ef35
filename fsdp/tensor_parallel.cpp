#include "fsdp/tensor_parallel.h"

#include <absl/container/flat_hash_map.h>
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>

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

int64_t bytes_of(const at::Tensor& t) {
  return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
}

// Adds one collective of `t`'s bytes to a TpCounterCells' count `n` and `bytes`.
void count(std::atomic<int64_t>* n, std::atomic<int64_t>* bytes, const at::Tensor& t) {
  n->fetch_add(1, std::memory_order_relaxed);
  bytes->fetch_add(bytes_of(t), std::memory_order_relaxed);
}

// Sequence parallelism's layout: [B, T/tp, ...] on each rank, rank k holding rows
// [k*T/tp, (k+1)*T/tp) of dim 1. The communicator's collectives work on dim 0, hence the
// transposes: all-gather into [tp, B, T/tp, ...] -> [B, T, ...]; reduce-scatter from
// [B, T, ...] -> [tp, B, T/tp, ...].
at::Tensor seq_all_gather(Communicator* group, const at::Tensor& x) {
  const int tp = group->world_size();
  TORCH_CHECK(x.dim() >= 2, "sequence parallelism: expected an activation [B, T, ...], got ",
              x.sizes());
  const at::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape.insert(shape.begin(), tp);
  at::Tensor out = at::empty(shape, in.options());
  group->all_gather(in, out, group->current_stream());
  std::vector<int64_t> full = in.sizes().vec();
  full[1] *= tp;
  return out.transpose(0, 1).reshape(full);
}

at::Tensor seq_reduce_scatter(Communicator* group, const at::Tensor& y) {
  const int tp = group->world_size();
  TORCH_CHECK(y.dim() >= 2 && y.size(1) % tp == 0,
              "sequence parallelism: a rowwise module's output must be [B, T, ...] with T a ",
              "multiple of tp ", tp, "; got ", y.sizes());
  std::vector<int64_t> split = y.sizes().vec();
  split[1] /= tp;
  split.insert(split.begin() + 1, tp);  // [B, tp, T/tp, ...]
  const at::Tensor in = y.reshape(split).transpose(0, 1).contiguous();
  std::vector<int64_t> local = y.sizes().vec();
  local[1] /= tp;
  at::Tensor out = at::empty(local, y.options());
  group->reduce_scatter(in, out, ReduceOp::kSum, group->current_stream());
  return out;
}

at::Tensor seq_part(const at::Tensor& x, int tp, int rank) {
  const int64_t c = x.size(1) / tp;
  return x.narrow(1, rank * c, c).clone(at::MemoryFormat::Contiguous);  // never a view of x
}

// A colwise module's entry under sequence parallelism: all-gather forward, reduce-scatter of
// the gradient backward (Megatron's gather_from_sequence_parallel_region and its dual).
struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t group, int64_t counters) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["counters"] = counters;
    at::Tensor out = seq_all_gather(reinterpret_cast<Communicator*>(group), x);
    if (auto* c = cells_of(counters)) count(&c->forward_all_gathers, &c->forward_bytes, out);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    if (auto* c = cells_of(ctx->saved_data.at("counters").toInt()))
      count(&c->backward_reduce_scatters, &c->backward_bytes, g[0]);
    return {seq_reduce_scatter(group_of(ctx), g[0]), at::Tensor(), at::Tensor()};
  }
};

// A rowwise module's exit under sequence parallelism: reduce-scatter forward, all-gather of the
// gradient backward.
struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            int64_t group, int64_t counters) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["counters"] = counters;
    if (auto* c = cells_of(counters)) count(&c->forward_reduce_scatters, &c->forward_bytes, y);
    return seq_reduce_scatter(reinterpret_cast<Communicator*>(group), y);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    at::Tensor out = seq_all_gather(group_of(ctx), g[0]);
    if (auto* c = cells_of(ctx->saved_data.at("counters").toInt()))
      count(&c->backward_all_gathers, &c->backward_bytes, out);
    return {out, at::Tensor(), at::Tensor()};
  }
};

// The sequence region's edges (sequence_shard / sequence_gather): this rank's part forward and
// an all-gather backward, or the reverse. Counted as boundary_*.
struct ShardSequence : torch::autograd::Function<ShardSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t group, int64_t counters) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["counters"] = counters;
    auto* g = reinterpret_cast<Communicator*>(group);
    return seq_part(x, g->world_size(), g->rank());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    at::Tensor out = seq_all_gather(group_of(ctx), g[0]);
    if (auto* c = cells_of(ctx->saved_data.at("counters").toInt()))
      count(&c->boundary_all_gathers, &c->boundary_bytes, out);
    return {out, at::Tensor(), at::Tensor()};
  }
};

struct UnshardSequence : torch::autograd::Function<UnshardSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t group, int64_t counters) {
    ctx->saved_data["group"] = group;
    at::Tensor out = seq_all_gather(reinterpret_cast<Communicator*>(group), x);
    if (auto* c = cells_of(counters)) count(&c->boundary_all_gathers, &c->boundary_bytes, out);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    Communicator* group = group_of(ctx);
    return {seq_part(g[0], group->world_size(), group->rank()), at::Tensor(), at::Tensor()};
  }
};

// Loss parallelism (TensorParallel::vocab_parallel_cross_entropy): logits [N, V/tp], targets
// [N]. Megatron's _VocabParallelCrossEntropy: the max, the sum of exp and the target's logit
// all-reduced over tp (one fp32 value per token each); backward is local.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t group, int64_t counters,
                            int64_t vocab_start) {
    auto* g = reinterpret_cast<Communicator*>(group);
    auto* c = cells_of(counters);
    auto reduce = [&](at::Tensor t, ReduceOp op) {
      t = t.contiguous();
      g->all_reduce(t, op, g->current_stream());
      if (c != nullptr) count(&c->loss_all_reduces, &c->loss_bytes, t);
      return t;
    };
    const at::Tensor x = logits.to(at::kFloat);
    const int64_t local = x.size(1);
    const at::Tensor max = reduce(std::get<0>(x.max(/*dim=*/1)), ReduceOp::kMax);
    const at::Tensor shifted = x - max.unsqueeze(1);
    const at::Tensor e = shifted.exp();
    const at::Tensor sum = reduce(e.sum(1), ReduceOp::kSum);
    const at::Tensor valid = targets.ne(-100);
    const at::Tensor shifted_t = targets - vocab_start;
    const at::Tensor mine = shifted_t.ge(0).logical_and(shifted_t.lt(local)).logical_and(valid);
    const at::Tensor idx = shifted_t.clamp(0, local - 1).unsqueeze(1);
    const at::Tensor target_logit =
        reduce(shifted.gather(1, idx).squeeze(1) * mine.to(at::kFloat), ReduceOp::kSum);
    const at::Tensor weight = valid.to(at::kFloat) / valid.sum().to(at::kFloat);
    ctx->save_for_backward({e / sum.unsqueeze(1), idx, mine, weight});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return ((sum.log() - target_logit) * weight).sum();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax on this slice
    grad.scatter_add_(1, saved[1], -saved[2].to(at::kFloat).unsqueeze(1));
    grad.mul_(saved[3].unsqueeze(1) * g[0]);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data.at("dtype").toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The sequence-parallel TensorParallel of `root`, or nullptr (none, tp 1, option off).
const TensorParallel* sequence_parallel_of(const torch::nn::Module& root) {
  const TensorParallel* tp = find_tensor_parallel(&root);
  if (tp == nullptr || tp->tp_size() == 1 || !tp->plan().sequence_parallel) return nullptr;
  return tp;
}


// The placement of a parameter of a split module (a rowwise bias is replicated).
// A vocab embedding's weight [V, d] is split along dim 0 like a colwise weight: the same layout
// (checkpoints, loaders and save_hf need no placement of their own).
TpPlacement placement_of(TpStyle style, int parts, bool is_bias) {
  if (style == TpStyle::kRowwise && is_bias) return {};
  if (style == TpStyle::kVocab) return {TpStyle::kColwise, 1};
  return {style, style == TpStyle::kColwise ? parts : 1};
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

std::string to_string(const TpPlacement& p) {
  if (p.style == TpStyle::kColwise && p.parts > 1) return "colwise/" + std::to_string(p.parts);
  return to_string(p.style);
}

std::optional<TpPlacement> parse_tp_placement(const std::string& text) {
  for (TpStyle s : {TpStyle::kReplicate, TpStyle::kColwise, TpStyle::kRowwise})
    if (text == to_string(s)) return TpPlacement{s, 1};
  const std::string col = std::string(to_string(TpStyle::kColwise)) + "/";
  if (text.size() <= col.size() || text.size() > col.size() + 4 || text.compare(0, col.size(), col) != 0)
    return std::nullopt;
  int parts = 0;
  for (size_t i = col.size(); i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return std::nullopt;
    parts = parts * 10 + (text[i] - '0');
  }
  if (parts < 2 || text[col.size()] == '0') return std::nullopt;
  return TpPlacement{TpStyle::kColwise, parts};
}

std::string tp_split_error(const std::vector<int64_t>& shape, const TpPlacement& p, int tp) {
  std::ostringstream os;
  if (tp < 1) {
    os << "tp size " << tp << " is not positive";
  } else if (p.style == TpStyle::kColwise) {
    if (shape.empty() || shape.size() > 2 || p.parts < 1 || shape[0] % (int64_t{p.parts} * tp) != 0)
      os << "a " << to_string(p) << " value is 1-D or 2-D with dim 0 a multiple of "
         << p.parts << " x tp " << tp << "; it has shape " << c10::IntArrayRef(shape);
  } else if (p.style == TpStyle::kRowwise) {
    if (shape.size() != 2 || shape[1] % tp != 0)
      os << "a rowwise value is 2-D with dim 1 a multiple of tp " << tp << "; it has shape "
         << c10::IntArrayRef(shape);
  }
  return os.str();
}

std::vector<int64_t> tp_full_shape(std::vector<int64_t> local, const TpPlacement& p, int tp) {
  if (p.style == TpStyle::kColwise && !local.empty()) local[0] *= tp;
  if (p.style == TpStyle::kRowwise && local.size() == 2) local[1] *= tp;
  return local;
}

at::Tensor tp_slice(const at::Tensor& full, const TpPlacement& p, int tp, int rank) {
  if (p.style == TpStyle::kReplicate || tp == 1) return full;
  if (p.style == TpStyle::kRowwise) {
    const int64_t c = full.size(1) / tp;
    return full.narrow(1, rank * c, c).contiguous();
  }
  const int64_t out = full.size(0), block = out / p.parts, c = block / tp;
  std::vector<int64_t> shape = full.sizes().vec();
  shape[0] = block;
  shape.insert(shape.begin(), p.parts);
  std::vector<int64_t> local = full.sizes().vec();
  local[0] = out / tp;
  return full.reshape(shape).narrow(1, rank * c, c).reshape(local).contiguous();
}

at::Tensor tp_unslice(const at::Tensor& tp_major, const std::vector<int64_t>& full_shape,
                      const TpPlacement& p, int tp) {
  if (p.style == TpStyle::kReplicate || tp == 1) return tp_major.reshape(full_shape).contiguous();
  std::vector<int64_t> local = full_shape;
  if (p.style == TpStyle::kRowwise) {
    local[1] /= tp;
    local.insert(local.begin(), tp);  // [tp, out, in/tp] -> [out, tp, in/tp]
    return tp_major.reshape(local).transpose(0, 1).reshape(full_shape).contiguous();
  }
  // Colwise: [tp, parts, block/tp, rest...] -> [parts, tp, block/tp, rest...].
  const int64_t c = full_shape[0] / p.parts / tp;
  std::vector<int64_t> shape{tp, p.parts, c};
  shape.insert(shape.end(), full_shape.begin() + 1, full_shape.end());
  return tp_major.reshape(shape).transpose(0, 1).reshape(full_shape).contiguous();
}

namespace detail {

TpEntry find_tp(const torch::nn::Module* m) {
  if (g_count.load(std::memory_order_acquire) == 0) return {};
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_modules.find(m);
  return it == g_modules.end() ? TpEntry{} : it->second;
}

at::Tensor tp_enter_colwise(const TpEntry& e, const at::Tensor& x) {
  if (e.sequence) {
    TORCH_CHECK(x.dim() >= 3, "sequence parallelism: module '", printable_escape(*e.path),
                "' (colwise) got an input of shape ", x.sizes(), "; it needs [B, T/tp, ...] "
                "(gathered along the sequence, dim 1): do not flatten it to [B*T, ...] before the "
                "call (takes_sequence_shards(), fsdp/tensor_parallel.h)");
    return GatherSequence::apply(x, as_int(e.group), as_int(e.counters));
  }
  return CopyToTp::apply(x, as_int(e.group), as_int(e.counters));
}

at::Tensor tp_exit_rowwise(const TpEntry& e, const torch::nn::Module* m, const at::Tensor& y) {
  // The replicated bias was added on every rank: take it out before the sum, add it once after
  // (its gradient is then the output's, as unsplit).
  // Keep the dict: find() points into it (a temporary's pointer dangled: a use-after-free that
  // crashed tests/tensor_parallel_test.cpp about every other run).
  const auto params = m->named_parameters(/*recurse=*/false);
  const at::Tensor* bias = params.find("bias");
  auto reduce = [&](const at::Tensor& t) {
    if (!e.sequence) return ReduceFromTp::apply(t, as_int(e.group), as_int(e.counters));
    TORCH_CHECK(t.dim() >= 3, "sequence parallelism: module '", printable_escape(*e.path),
                "' (rowwise) returned an output of shape ", t.sizes(), "; it needs [B, T, ...] "
                "(reduce-scattered along the sequence, dim 1): do not flatten its input to "
                "[B*T, ...] (takes_sequence_shards(), fsdp/tensor_parallel.h)");
    return ReduceScatterSequence::apply(t, as_int(e.group), as_int(e.counters));
  };
  if (bias == nullptr || !bias->defined()) return reduce(y);
  // Under sequence parallelism the bias is added to this rank's part of the sequence only: its
  // gradient is partial, all-reduced over tp by the hook parallelize() put on it.
  return reduce(y - *bias) + *bias;
}

// Note [Replicated kv heads]
// Grouped-query attention with G kv heads, G < tp (tp a multiple of G): a kv head cannot be
// split, so k and v stay whole on every tp rank (Megatron's and torchtitan's replication) and
// tp rank r uses head group r * G / tp, the one its local query heads read. Each rank's
// gradient of that group comes from its own query heads only: a partial sum. Here the exit
// keeps the whole output y in the graph behind CopyToTp (f on the output, not the input):
// backward, the output gradient (zero outside this rank's group) is all-reduced over tp, so
// every rank holds the full dL/dy and the weight gradient (y's Linear) and input gradient are
// the unsharded ones, equal on every tp rank, like any replicated parameter's (no f on the
// input: its gradient is already whole). Costs one all-reduce of tokens x out per module per
// step (TensorParallel::counters(), explain's TpCollectives); the parameters' placement is
// kReplicate (checkpoints, clip_grad_norm_, slice_loader treat them as whole).
at::Tensor tp_exit_replicated(const TpEntry& e, const at::Tensor& y) {
  const at::Tensor whole = CopyToTp::apply(y, as_int(e.group), as_int(e.counters));
  const int64_t width = y.size(-1) / e.groups;
  const int64_t group = static_cast<int64_t>(e.tp_rank) * e.groups / e.tp_size;
  return whole.narrow(-1, group * width, width);
}

VocabIds tp_enter_vocab(const TpEntry& e, const at::Tensor& ids) {
  TORCH_CHECK(at::isIntegralType(ids.scalar_type(), /*includeBool=*/false),
              "tensor parallelism: module '", printable_escape(*e.path),
              "' (vocab) takes integer ids; got ", ids.scalar_type());
  const int64_t begin = static_cast<int64_t>(e.tp_rank) * e.vocab_rows;
  const int64_t vocab = e.vocab_rows * e.tp_size;
  // Unsplit, an id outside the vocabulary is Embedding's error; split, it would be a zero row on
  // every rank. Checked where it costs no device sync.
  if (ids.device().is_cpu() && ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < vocab, "tensor parallelism (tp rank ", e.tp_rank, " of ",
                e.tp_size, "): module '", printable_escape(*e.path), "' (vocab) got ids in [",
                lo, ", ", hi, "] outside its vocabulary [0, ", vocab, ")");
  }
  VocabIds out;
  out.outside = ids.lt(begin).logical_or(ids.ge(begin + e.vocab_rows));
  out.local = (ids - begin).masked_fill(out.outside, 0);
  return out;
}

at::Tensor tp_exit_vocab(const TpEntry& e, const at::Tensor& outside, const at::Tensor& y) {
  TORCH_CHECK(y.dim() == outside.dim() + 1, "tensor parallelism: module '",
              printable_escape(*e.path), "' (vocab) returned ", y.sizes(), " for ids ",
              outside.sizes(), "; a vocab module is Embedding-like (ids [...] -> [..., d])");
  // masked_fill's backward zeroes those rows' gradient: row 0 is not charged for others' ids.
  const at::Tensor mine = y.masked_fill(outside.unsqueeze(-1), 0);
  return ReduceFromTp::apply(mine, as_int(e.group), as_int(e.counters));
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
    for (auto& [param, hook] : sequence_hooks_) param.remove_hook(hook);
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
  return tp_slice(full, placement(name), tp_size_, tp_rank_);
}

TpPlacement TensorParallel::placement(const std::string& name) const {
  auto it = slices_.find(name);
  if (it == slices_.end()) return {};
  return placement_of(it->second.style, it->second.parts, it->second.is_bias);
}

ParamLoader TensorParallel::slice_loader(ParamLoader full) const {
  if (tp_size_ == 1 || !full) return full;
  struct Split {
    TpPlacement p;
    std::vector<int64_t> local;
  };
  auto splits = std::make_shared<std::map<std::string, Split>>();
  for (const auto& [name, slice] : slices_) {
    const TpPlacement p = placement_of(slice.style, slice.parts, slice.is_bias);
    if (p.style != TpStyle::kReplicate) (*splits)[name] = {p, slice.local_shape};
  }
  const int tp = tp_size_, rank = tp_rank_;
  ParamLoader out;
  if (full.check)
    out.check = [check = full.check, splits, tp](const std::vector<PlannedParam>& params) {
      std::vector<PlannedParam> whole = params;
      for (PlannedParam& q : whole) {
        auto it = splits->find(q.name);
        if (it != splits->end()) q.shape = tp_full_shape(q.shape, it->second.p, tp);
      }
      check(whole);
    };
  out.read = [read = full.read, splits, tp, rank](const std::string& name, int64_t begin,
                                                  int64_t end, const at::Tensor& dst) {
    auto it = splits->find(name);
    if (it == splits->end()) return read(name, begin, end, dst);
    const TpPlacement& p = it->second.p;
    const std::vector<int64_t>& local = it->second.local;
    // Runs: local rows [r0, r1) of `row` elements each map to full elements starting at
    // `full_at(r0)`; copy the part of [begin, end) each run covers.
    auto copy_run = [&](int64_t local_lo, int64_t local_hi, int64_t full_lo) {
      const int64_t lo = std::max(begin, local_lo), hi = std::min(end, local_hi);
      if (lo >= hi) return;
      read(name, full_lo + (lo - local_lo), full_lo + (hi - local_lo), dst.narrow(0, lo - begin, hi - lo));
    };
    int64_t row = 1;
    for (size_t d = 1; d < local.size(); ++d) row *= local[d];
    if (p.style == TpStyle::kColwise) {
      const int64_t c = local[0] / p.parts, block = c * tp;  // rows per block: local, full
      for (int j = 0; j < p.parts; ++j)
        copy_run(j * c * row, (j + 1) * c * row, (j * block + rank * c) * row);
    } else {  // rowwise: local [out, in/tp] of full [out, in]
      const int64_t first = begin / row, last = (end + row - 1) / row;
      for (int64_t o = first; o < last; ++o)
        copy_run(o * row, (o + 1) * row, o * row * tp + rank * row);
    }
  };
  return out;
}

std::string TensorParallel::to_string() const {
  std::ostringstream os;
  for (const TpModule& m : modules_) {
    TpRule r;
    r.style = m.style;
    r.parts = m.parts;
    os << style_text(r) << ' ' << printable_escape(m.path);
    if (m.replicated_groups > 0)  // Note [Replicated kv heads]
      os << " (kept whole: " << m.replicated_groups << " head groups < tp " << tp_size_ << ")";
    os << '\n';
  }
  return os.str();
}

TpCounters TensorParallel::counters() const {
  TpCounters c;
  if (!counters_) return c;
  const detail::TpCounterCells& k = *counters_;
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  c.forward_all_reduces = get(k.forward_all_reduces);
  c.backward_all_reduces = get(k.backward_all_reduces);
  c.forward_all_gathers = get(k.forward_all_gathers);
  c.forward_reduce_scatters = get(k.forward_reduce_scatters);
  c.backward_all_gathers = get(k.backward_all_gathers);
  c.backward_reduce_scatters = get(k.backward_reduce_scatters);
  c.forward_bytes = get(k.forward_bytes);
  c.backward_bytes = get(k.backward_bytes);
  c.grad_all_reduces = get(k.grad_all_reduces);
  c.grad_bytes = get(k.grad_bytes);
  c.boundary_all_gathers = get(k.boundary_all_gathers);
  c.boundary_bytes = get(k.boundary_bytes);
  c.loss_all_reduces = get(k.loss_all_reduces);
  c.loss_bytes = get(k.loss_bytes);
  return c;
}

void TensorParallel::reset_counters() {
  if (!counters_) return;
  detail::TpCounterCells& k = *counters_;
  for (std::atomic<int64_t>* a :
       {&k.forward_all_reduces, &k.backward_all_reduces, &k.forward_all_gathers,
        &k.forward_reduce_scatters, &k.backward_all_gathers, &k.backward_reduce_scatters,
        &k.forward_bytes, &k.backward_bytes, &k.grad_all_reduces, &k.grad_bytes,
        &k.boundary_all_gathers, &k.boundary_bytes, &k.loss_all_reduces, &k.loss_bytes})
    a->store(0, std::memory_order_relaxed);
}

at::Tensor TensorParallel::vocab_parallel_cross_entropy(const at::Tensor& logits,
                                                        const at::Tensor& targets,
                                                        int64_t vocab) const {
  const std::string where = "loss parallelism (tp rank " + std::to_string(tp_rank_) + " of " +
                            std::to_string(tp_size_) + ")";
  TORCH_CHECK(logits.dim() >= 1 &&
                  targets.numel() * std::max<int64_t>(logits.size(-1), 1) == logits.numel(),
              where, ": logits ", logits.sizes(), " do not match targets ", targets.sizes(),
              " (expected logits [..., V/tp] over the targets' shape)");
  TORCH_CHECK(vocab % tp_size_ == 0 && logits.size(-1) * tp_size_ == vocab, where,
              ": the logits have ", logits.size(-1), " classes per rank but the vocabulary is ",
              vocab, " = tp ", tp_size_, " x ", vocab / tp_size_,
              "; the tp plan must split the head colwise (e.g. colwise:path=lm_head) with a "
              "vocabulary tp divides");
  const at::Tensor flat = logits.reshape({-1, logits.size(-1)});
  const at::Tensor t = targets.reshape({-1}).to(at::kLong);
  if (tp_size_ == 1) return at::cross_entropy_loss(flat.to(at::kFloat), t);
  return VocabParallelCrossEntropy::apply(flat, t, as_int(group_), as_int(counters_.get()),
                                          static_cast<int64_t>(tp_rank_) * (vocab / tp_size_));
}

at::Tensor sequence_shard(const torch::nn::Module& root, const at::Tensor& x) {
  const TensorParallel* tp = sequence_parallel_of(root);
  if (tp == nullptr) return x;
  TORCH_CHECK(x.dim() >= 2 && x.size(1) % tp->tp_size() == 0, "sequence parallelism (tp rank ",
              tp->tp_rank(), " of ", tp->tp_size(), "): the sequence length ",
              x.dim() >= 2 ? x.size(1) : int64_t{-1}, " of activation ", x.sizes(),
              " is not a multiple of tp ", tp->tp_size(),
              "; use sequences whose length tp divides (pad them), or turn sequence_parallel off");
  return ShardSequence::apply(x, as_int(tp->group_), as_int(tp->counters_.get()));
}

at::Tensor sequence_gather(const torch::nn::Module& root, const at::Tensor& x,
                           const torch::nn::Module& next) {
  const TensorParallel* tp = sequence_parallel_of(root);
  if (tp == nullptr || detail::find_tp(&next).kind == detail::TpEntry::Kind::kColwise) return x;
  return UnshardSequence::apply(x, as_int(tp->group_), as_int(tp->counters_.get()));
}

bool takes_sequence_shards(const torch::nn::Module& m) {
  const detail::TpEntry e = detail::find_tp(&m);
  return e.kind != detail::TpEntry::Kind::kNone && e.sequence;
}

std::vector<int64_t> tp_local_shape(const TpModule& m, bool is_bias,
                                    const std::vector<int64_t>& full, int tp) {
  std::vector<int64_t> local = full;
  if (m.replicated_groups > 0) return local;  // Note [Replicated kv heads]
  if ((m.style == TpStyle::kColwise || m.style == TpStyle::kVocab) && !local.empty())
    local[0] /= tp;
  if (m.style == TpStyle::kRowwise && !is_bias && local.size() >= 2) local[1] /= tp;
  return local;
}

const TensorParallel* find_tensor_parallel(const torch::nn::Module* root) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_roots.find(root);
  return it == g_roots.end() ? nullptr : it->second;
}

std::vector<TpModule> match_tp_plan(const torch::nn::Module& model, const TpPlan& plan, int tp,
                                    const std::string& where, std::vector<TpModule>* sequence) {
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
    if (rule.style == TpStyle::kSequence && sequence != nullptr)
      sequence->push_back({item.key(), rule.style, 1, r});
    if (rule.style == TpStyle::kReplicate || rule.style == TpStyle::kSequence) continue;
    out.push_back({item.key(), rule.style, rule.parts, r});
    split.push_back(item.value());
  }
  for (size_t r = 0; r < plan.rules.size(); ++r)
    TORCH_CHECK(hits[r] > 0, where, ": tp plan rule ", r + 1, " '",
                printable_escape(style_text(plan.rules[r]) + ":" + to_spec(plan.rules[r].match)),
                "' matches no module of the model (plan '", printable_escape(plan.to_spec()),
                "'; the model's module types: ", model_types(model),
                "). Fix the rule's type or path terms, or remove it");

  bool has_sequence_rule = false;
  for (const TpRule& r : plan.rules) has_sequence_rule |= r.style == TpStyle::kSequence;
  TORCH_CHECK(!plan.sequence_parallel || has_sequence_rule, where, ": tp plan '",
              printable_escape(plan.to_spec()),
              "' has sequence_parallel but no sequence rule; name the modules that run on "
              "sequence shards (the norms), e.g. sequence:type=LayerNorm|RMSNorm");

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
    // Note [Replicated kv heads]: colwise children with fewer head groups than tp stay whole.
    for (const auto& [child, groups] : aware->tp_replicated_children(tp))
      for (size_t i = 0; i < split.size(); ++i)
        if (out[i].path == (item.key().empty() ? child : item.key() + "." + child) &&
            out[i].style == TpStyle::kColwise && out[i].parts == 1)
          out[i].replicated_groups = groups;
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
    if (tm.style == TpStyle::kVocab) {
      TORCH_CHECK(w != nullptr && w->dim() == 2 && params.size() == 1, where, ": ", what,
                  " is not Embedding-like: a vocab module holds one 2-D weight [vocab, d]; it "
                  "holds",
                  held.str(), ". Name an Embedding in the vocab rule");
      if (const auto* emb = dynamic_cast<const torch::nn::EmbeddingImpl*>(&m)) {
        TORCH_CHECK(!emb->options.padding_idx().has_value() && !emb->options.max_norm().has_value(),
                    where, ": ", what,
                    " has a padding_idx or max_norm, which a vocabulary split does not "
                    "support; leave it out of the tp plan");
      }
      TORCH_CHECK(!plan.sequence_parallel, where, ": ", what,
                  " is vocabulary-parallel, which does not combine with sequence_parallel yet "
                  "(its all-reduce would have to become a reduce-scatter along the sequence); "
                  "turn sequence_parallel off or leave '",
                  printable_escape(tm.path), "' out of the tp plan");
      TORCH_CHECK(w->size(0) % tp == 0, where, ": ", what, " has a vocabulary of ", w->size(0),
                  " rows, which tp ", tp, " cannot split evenly; pad the vocabulary to a multiple "
                  "of ", tp, " (e.g. ", (w->size(0) + tp - 1) / tp * tp,
                  ") or leave the embedding out of the tp plan");
      continue;
    }
    TORCH_CHECK(w != nullptr && w->dim() == 2 && params.size() <= (b ? 2u : 1u) &&
                    (b == nullptr || !b->defined() || (b->dim() == 1 && b->size(0) == w->size(0))),
                where, ": ", what,
                " is not Linear-like: a colwise or rowwise module holds a 2-D "
                "weight [out, in] and at most a 1-D bias [out]; it holds",
                held.str(), ". Name its Linear children in the tp plan instead");
    if (tm.replicated_groups > 0) {
      // Not combined yet: a whole module's entry would need the sequence gather as well.
      TORCH_CHECK(!plan.sequence_parallel, where, ": ", what, " has ", tm.replicated_groups,
                  " head groups, fewer than tp ", tp,
                  ", so it is kept whole (Note [Replicated kv heads]); that does not combine "
                  "with sequence_parallel yet. Use a tp that divides the kv heads, or turn "
                  "sequence_parallel off");
      TORCH_CHECK(tp % tm.replicated_groups == 0 && w->size(0) % tm.replicated_groups == 0,
                  where, ": ", what, " has ", tm.replicated_groups, " head groups in ",
                  w->size(0), " output features; replicating them over tp ", tp,
                  " needs tp a multiple of the groups and whole groups");
    } else if (tm.style == TpStyle::kColwise) {
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
  // 3. A split parameter held by another module too (tied embeddings and a colwise head) would
  // be sliced under it as well.
  std::unordered_map<const void*, size_t> split_params;
  for (size_t i = 0; i < split.size(); ++i)
    for (const auto& p : split[i]->named_parameters(/*recurse=*/false)) {
      if (!p.value().defined()) continue;
      const auto [it, fresh] = split_params.emplace(p.value().unsafeGetTensorImpl(), i);
      // Two split modules on one tensor (a tied embedding and head, vocab and colwise): it
      // would be sliced twice.
      TORCH_CHECK(fresh, where, ": modules '", printable_escape(out[it->second].path), "' (",
                  style_text(plan.rules[out[it->second].rule]), ") and '",
                  printable_escape(out[i].path), "' (", style_text(plan.rules[out[i].rule]),
                  ") share their parameter '", printable_escape(p.key()),
                  "' (tied weights); untie them or leave one out of the tp plan");
    }
  std::unordered_set<const torch::nn::Module*> split_set;
  for (const auto& m : split) split_set.insert(m.get());
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (split_set.count(item.value().get()) != 0) continue;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      auto it = p.value().defined() ? split_params.find(p.value().unsafeGetTensorImpl())
                                    : split_params.end();
      TORCH_CHECK(it == split_params.end(), where, ": module '",
                  printable_escape(out[it->second].path), "' (",
                  style_text(plan.rules[out[it->second].rule]), ") shares its parameter '",
                  printable_escape(p.key()), "' with module '", printable_escape(item.key()),
                  "' (tied weights), which would be split too; untie them or leave '",
                  printable_escape(out[it->second].path), "' out of the tp plan");
    }
  }
  return out;
}

// Note [Sequence-parallel gradients]
// Under sequence parallelism a parameter kept whole on every tp rank but used on this rank's
// part of the sequence only (a `sequence` module's: the norms; a rowwise module's bias, added
// after the reduce-scatter) gets a partial gradient; Megatron all-reduces those over tp. A
// tensor hook on the parameter does it before AccumulateGrad, so fully_shard's units (their
// GradReadyHook runs after AccumulateGrad), clip_grad_norm_ and the optimizer see the sum.
// The hooks live in the parameter's autograd meta, which fully_shard's set_data keeps.
// A recompute unit (fsdp/recompute.cpp) runs its backward through torch::autograd::grad, which
// calls the hook on the captured gradient, then hands that gradient to AccumulateGrad, which
// calls it again: the hook remembers what it returned (weak references: never keeps a gradient
// alive) and passes its own result through unchanged, so each gradient is reduced once.
struct SequenceGradHookState {
  std::mutex mu;
  // The hook's own results.
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> reduced;
};

void TensorParallel::add_sequence_grad_hooks(const torch::nn::Module& model,
                                             const std::vector<TpModule>& sequence,
                                             TensorParallel* tp) {
  std::unordered_map<std::string, const torch::nn::Module*> by_path;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    by_path.emplace(item.key(), item.value().get());
  std::unordered_set<const void*> seen;
  auto state = std::make_shared<SequenceGradHookState>();
  auto hook = [&](const std::string& name, at::Tensor p) {
    // A parameter frozen now has no gradient to reduce (register_hook refuses it).
    if (!p.defined() || !p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) return;
    Communicator* group = tp->group_;
    detail::TpCounterCells* c = tp->counters_.get();
    const unsigned key = p.register_hook([group, c, state](const at::Tensor& grad) {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        auto& seen_out = state->reduced;
        bool mine = false;
        for (size_t i = 0; i < seen_out.size();) {
          const bool hit = seen_out[i]._unsafe_get_target() == grad.unsafeGetTensorImpl() &&
                           !seen_out[i].expired();
          if (hit || seen_out[i].expired()) {
            seen_out[i] = std::move(seen_out.back());
            seen_out.pop_back();
            mine = mine || hit;
          } else {
            ++i;
          }
        }
        if (mine) return grad;  // reduced already (a recompute's captured gradient)
      }
      at::Tensor out = all_reduced(group, grad, &c->grad_all_reduces, &c->grad_bytes);
      std::lock_guard<std::mutex> lock(state->mu);
      state->reduced.emplace_back(out.getIntrusivePtr());
      return out;
    });
    tp->sequence_hooks_.emplace_back(p, key);
    tp->sequence_grad_names_.push_back(name);
  };
  for (const TpModule& m : sequence)
    for (const auto& p : by_path.at(m.path)->named_parameters(/*recurse=*/true))
      hook(m.path + "." + p.key(), p.value());
  for (const TpModule& m : tp->modules_) {
    if (m.style != TpStyle::kRowwise) continue;
    const auto params = by_path.at(m.path)->named_parameters(/*recurse=*/false);
    if (const at::Tensor* b = params.find("bias")) hook(m.path + ".bias", *b);
  }
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
  std::vector<TpModule> sequence;
  out->modules_ = match_tp_plan(*model, plan, tp, where, &sequence);
  out->group_ = mesh.tp();
  std::vector<std::shared_ptr<torch::nn::Module>> split;
  {
    std::unordered_map<std::string, std::shared_ptr<torch::nn::Module>> by_path;
    for (const auto& item : model->named_modules("", /*include_self=*/false))
      by_path.emplace(item.key(), item.value());
    for (const TpModule& tm : out->modules_) split.push_back(by_path.at(tm.path));
  }
  // (match_tp_plan checked every module; a meta model is sliced in shapes only, below.)
  // 3. Slice in place and register.
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < split.size(); ++i) {
      const TpModule& tm = out->modules_[i];
      if (tm.replicated_groups > 0) continue;  // whole (Note [Replicated kv heads])
      for (auto& p : split[i]->named_parameters(/*recurse=*/false)) {
        if (!p.value().defined()) continue;
        const bool is_bias = p.key() == "bias";
        const std::string name = tm.path + "." + p.key();
        if (tm.style == TpStyle::kRowwise && is_bias) {  // replicated
          out->slices_[name] = {tm.style, tm.parts, is_bias, p.value().sizes().vec()};
          continue;
        }
        // On meta (a model to be loaded by fully_shard): shapes only, sliced alike.
        p.value().set_data(
            tp_slice(p.value().detach(), placement_of(tm.style, tm.parts, is_bias), tp, rank));
        out->slices_[name] = {tm.style, tm.parts, is_bias, p.value().sizes().vec()};
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
      if (out->modules_[i].style == TpStyle::kVocab) {
        e.kind = detail::TpEntry::Kind::kVocab;
        e.tp_rank = rank;
        e.tp_size = tp;
        e.vocab_rows = out->slices_.at(out->modules_[i].path + ".weight").local_shape[0];
      }
      if (out->modules_[i].replicated_groups > 0) {  // Note [Replicated kv heads]
        e.kind = detail::TpEntry::Kind::kReplicatedHeads;
        e.groups = out->modules_[i].replicated_groups;
        e.tp_rank = rank;
        e.tp_size = tp;
      }
      e.group = mesh.tp();
      e.path = &out->modules_[i].path;
      e.counters = out->counters_.get();
      e.sequence = plan.sequence_parallel;
      TORCH_CHECK(g_modules.emplace(split[i].get(), e).second, where, ": module '",
                  printable_escape(out->modules_[i].path),
                  "' is already split by another parallelize()");
      out->registered_.push_back(split[i].get());
    }
    g_count.store(g_modules.size(), std::memory_order_release);
  }
  if (tp > 1 && plan.sequence_parallel)
    TensorParallel::add_sequence_grad_hooks(*model, sequence, out.get());
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    g_roots[model.get()] = out.get();
  }
  return out;
}

}  // namespace flatshard
