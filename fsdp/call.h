// flatshard/fsdp/call.h — the one line where a parent calls a (possibly sharded) child module.
//
//   x = flatshard::call(blocks_[i], x);      // instead of  x = blocks_[i]->forward(x);
//
// LibTorch modules have no forward hooks and `forward` is not virtual, so a sharded unit must be
// entered through this call: it gathers the unit's parameters before the module runs, frees them
// after (per the unit's strategy), and arms the backward hooks on the outputs. For a module that
// is not (the first module of) a unit it is a plain forward call plus one hash lookup. Models
// written this way run unchanged when not sharded at all.
//
// Outside its unit's call a sharded parameter holds no values (Note [Guarded sharded
// parameters], flat_param/flat_param.h): calling a sharded unit's forward directly (a
// forgotten flatshard::call), reading a parameter between steps (p.sum(), p.item(), printing,
// copying it), or after the ShardedModel is destroyed throws a c10::Error at the first data
// access, on CPU and CUDA alike:
//   flatshard: parameter 'blocks.0.norm.weight' of unit 'blocks.0' (rank 1) was read while the
//   unit is sharded: ... Enter the module through flatshard::call(module, args...) or
//   flatshard::enter(module, fn) instead of calling its forward() directly; between steps read
//   parameters with ShardedModel::gather_full_params(). ...
// A unit's parameters are readable from its entry (its first member call in a forward, or its
// pre-backward) until it reshards; a unit only prefetched (gathered ahead of its call) stays
// guarded. Limits: metadata (sizes, dtype, device, requires_grad) and views (t(), narrow) never
// throw, only data does; a view taken while the unit was gathered, kept and read after it
// resharded, reads the freed buffer (ATen: "setStorage: ... out of bounds for storage of size
// 0" for view ops; kernels get a null pointer) — don't keep views of parameters across calls.
// NO_SHARD units are always gathered and never guarded. Parameters of a destroyed ShardedModel
// stay guarded: gather them (gather_full_params(), a full checkpoint) before destroying it. A
// backward through a graph built before the ShardedModel was destroyed throws naming the unit.
//
// Eval: under NoGradGuard every unit reshards after its forward. A forward in grad mode keeps
// what a backward needs (the root, SHARD_GRAD_OP units) until its outputs' autograd graph is
// gone; without a backward, dropping the outputs reshards everything (Note [Forward without
// backward], fsdp/runtime.cpp).
//
// Recompute units (activation checkpointing, Note [Recompute] in fsdp/recompute.h): in grad
// mode call() runs the member's forward without saving activations and recomputes it in
// backward; tensor arguments are at::Tensor or std::vector<at::Tensor>, other arguments are
// copied. enter() on a recompute unit in grad mode throws.
//
// Supported return types of `forward`: at::Tensor, std::vector<at::Tensor>, std::tuple of tensors
// (non-tensor elements pass through). Thread rule: a model is driven by one thread at a time.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/recompute.h"
#include "fsdp/tp_entry.h"
#include "fsdp/unit_entry.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class Runtime;
class Unit;

namespace detail {

// UnitEntry and find_unit: fsdp/unit_entry.h.
// Before the member module runs: the runtime unshards the unit (or waits for the prefetched
// all-gather).
void pre_forward(const UnitEntry& e, const torch::nn::Module* m);
// After it ran: the runtime attaches the pre-backward hook to `outputs` (replacing them with
// identity views whose backward unshards the unit) and reshards if this was the unit's last
// member call.
void post_forward(const UnitEntry& e, const torch::nn::Module* m, std::vector<at::Tensor>& outputs);

// Mixed precision: a floating-point tensor argument of a unit's forward is cast to the unit's
// compute dtype (FSDP's cast_forward_inputs); other arguments pass through untouched.
at::Tensor cast_input(const UnitEntry& e, const at::Tensor& t);
template <class T>
decltype(auto) cast_arg(const UnitEntry& unit, T&& v) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return cast_input(unit, v);
  } else {
    return std::forward<T>(v);
  }
}

template <class M>
const torch::nn::Module* module_of(const M& m) {
  if constexpr (std::is_pointer_v<M>) {
    return m;
  } else {
    return m.get();  // std::shared_ptr<Impl> or torch::nn::ModuleHolder<Impl>
  }
}

template <class T>
struct OutputAdapter {  // non-tensor outputs: no backward hook possible
  static void collect(T&, std::vector<at::Tensor>&) {}
  static void restore(T&, std::vector<at::Tensor>&, size_t&) {}
};
template <>
struct OutputAdapter<at::Tensor> {
  static void collect(at::Tensor& t, std::vector<at::Tensor>& v) { v.push_back(t); }
  static void restore(at::Tensor& t, std::vector<at::Tensor>& v, size_t& i) { t = v[i++]; }
};
template <>
struct OutputAdapter<std::vector<at::Tensor>> {
  static void collect(std::vector<at::Tensor>& ts, std::vector<at::Tensor>& v) {
    v.insert(v.end(), ts.begin(), ts.end());
  }
  static void restore(std::vector<at::Tensor>& ts, std::vector<at::Tensor>& v, size_t& i) {
    for (auto& t : ts) t = v[i++];
  }
};
template <class... Ts>
struct OutputAdapter<std::tuple<Ts...>> {
  static void collect(std::tuple<Ts...>& tup, std::vector<at::Tensor>& v) {
    std::apply([&](auto&... e) { (OutputAdapter<std::decay_t<decltype(e)>>::collect(e, v), ...); },
               tup);
  }
  static void restore(std::tuple<Ts...>& tup, std::vector<at::Tensor>& v, size_t& i) {
    std::apply(
        [&](auto&... e) { (OutputAdapter<std::decay_t<decltype(e)>>::restore(e, v, i), ...); }, tup);
  }
};

}  // namespace detail

namespace detail {
template <class Fn>
auto run_unit(const UnitEntry& unit, const torch::nn::Module* m, Fn&& fn) {
  pre_forward(unit, m);
  auto out = fn();
  using Out = decltype(out);
  std::vector<at::Tensor> tensors;
  OutputAdapter<Out>::collect(out, tensors);
  post_forward(unit, m, tensors);
  size_t i = 0;
  OutputAdapter<Out>::restore(out, tensors, i);
  return out;
}
}  // namespace detail

namespace detail {
// Tensor arguments of a recomputed call (Note [Recompute]): taken out of the stored copy of the
// arguments (the autograd node saves them, nothing else holds them) and put back, detached, for
// the recompute. Other argument types are stored by value.
template <class T>
struct ArgAdapter {
  static void take(T&, std::vector<at::Tensor>&) {}
  static void put(T&, const std::vector<at::Tensor>&, size_t&) {}
};
template <>
struct ArgAdapter<at::Tensor> {
  static void take(at::Tensor& t, std::vector<at::Tensor>& v) { v.push_back(std::move(t)); }
  static void put(at::Tensor& t, const std::vector<at::Tensor>& v, size_t& i) { t = v[i++]; }
};
template <>
struct ArgAdapter<std::vector<at::Tensor>> {
  static void take(std::vector<at::Tensor>& ts, std::vector<at::Tensor>& v) {
    for (auto& t : ts) v.push_back(std::move(t));
  }
  static void put(std::vector<at::Tensor>& ts, const std::vector<at::Tensor>& v, size_t& i) {
    for (auto& t : ts) t = v[i++];
  }
};

// `post` runs on the forward's output inside the unit's call (and again in the recompute):
// Identity, or a rowwise module's tensor-parallel exit, which reads the module's bias.
template <class Post, class M, class... Args>
auto call_recomputed(const UnitEntry& unit, const torch::nn::Module* m, const Post& post,
                     M& module, Args&&... args) {
  using Stored = std::tuple<std::decay_t<Args>...>;
  Stored stored(cast_arg(unit, std::forward<Args>(args))...);
  std::vector<at::Tensor> inputs;
  std::apply([&](auto&... a) { (ArgAdapter<std::decay_t<decltype(a)>>::take(a, inputs), ...); },
             stored);
  // A copy of the handle: the node may run after the caller's handle is gone.
  auto forward = [handle = std::decay_t<M>(module), stored = std::move(stored),
                  post](const std::vector<at::Tensor>& tensors) {
    Stored a = stored;
    size_t i = 0;
    std::apply(
        [&](auto&... x) { (ArgAdapter<std::decay_t<decltype(x)>>::put(x, tensors, i), ...); }, a);
    std::decay_t<M> h = handle;  // a non-const handle: forward() is not const
    return post(std::apply([&](auto&... x) { return h->forward(x...); }, a));
  };
  using Out = decltype(forward(inputs));
  pre_forward(unit, m);
  RngStates rng = save_rng_states(unit);
  Out out = [&] {
    at::NoGradGuard no_grad;
    return forward(inputs);
  }();
  std::vector<at::Tensor> tensors;
  OutputAdapter<Out>::collect(out, tensors);
  RecomputeFn flat = [forward](const std::vector<at::Tensor>& ts) {
    Out o = forward(ts);
    std::vector<at::Tensor> v;
    OutputAdapter<Out>::collect(o, v);
    return v;
  };
  tensors = attach_recompute(unit, m, std::move(inputs), std::move(tensors), std::move(flat),
                             std::move(rng));
  post_forward(unit, m, tensors);
  size_t i = 0;
  OutputAdapter<Out>::restore(out, tensors, i);
  return out;
}
}  // namespace detail

// Runs fn() as a unit-aware call of `module`: the unit (if `module` is one) is gathered before
// and its outputs hooked after. Use it to enter a unit through a method other than forward,
// e.g. the root:  auto loss = flatshard::enter(model, [&] { return model->loss(x, y); });
// (fn's inputs are not cast for mixed precision: cast them yourself if they are floating point.)
template <class M, class Fn>
auto enter(M& module, Fn&& fn) {
  const torch::nn::Module* m = detail::module_of(module);
  const detail::UnitEntry unit = detail::find_unit(m);
  if (unit.unit == nullptr) return fn();
  if (detail::recompute_active(unit)) detail::reject_enter_recompute(unit);
  return detail::run_unit(unit, m, std::forward<Fn>(fn));
}

namespace detail {
struct Identity {
  template <class T>
  std::decay_t<T> operator()(T&& t) const {
    return std::forward<T>(t);
  }
};

// A rowwise module's exit (fsdp/tp_entry.h), as a `post` of call_unit.
struct RowwiseExit {
  TpEntry tp;
  const torch::nn::Module* m;
  at::Tensor operator()(const at::Tensor& y) const { return tp_exit_rowwise(tp, m, y); }
};
// A colwise module kept whole (Note [Replicated kv heads]): its head group's exit.
struct ReplicatedExit {
  TpEntry tp;
  at::Tensor operator()(const at::Tensor& y) const { return tp_exit_replicated(tp, y); }
};

// A vocabulary-parallel embedding's exit: masks the rows of ids outside this rank's range and
// all-reduces (fsdp/tp_entry.h).
struct VocabExit {
  TpEntry tp;
  at::Tensor outside;
  at::Tensor operator()(const at::Tensor& y) const { return tp_exit_vocab(tp, outside, y); }
};

// module->forward(args...) then post(output), both inside the unit's call when `m` is a unit
// member (its parameters are gathered for both).
template <class Post, class M, class... Args>
auto call_unit(const torch::nn::Module* m, const Post& post, M& module, Args&&... args) {
  const UnitEntry unit = find_unit(m);
  if (unit.unit == nullptr) return post(module->forward(std::forward<Args>(args)...));
  if (recompute_active(unit))
    return call_recomputed(unit, m, post, module, std::forward<Args>(args)...);
  return run_unit(unit, m, [&] {
    return post(module->forward(cast_arg(unit, std::forward<Args>(args))...));
  });
}

template <class... Args>
struct OneTensorArg : std::false_type {};
template <class A>
struct OneTensorArg<A> : std::is_same<std::decay_t<A>, at::Tensor> {};

// A module the TP plan splits (fsdp/tensor_parallel.h): colwise enters through f, rowwise
// leaves through g (fsdp/tp_entry.h), a vocab embedding looks up its rows and leaves through g,
// around the unit-aware call.
template <class M, class... Args>
auto call_tp(const TpEntry& tp, const torch::nn::Module* m, M& module, Args&&... args) {
  using Out = decltype(call_unit(m, Identity{}, module, std::forward<Args>(args)...));
  if constexpr (OneTensorArg<Args...>::value && std::is_same_v<Out, at::Tensor>) {
    if (tp.kind == TpEntry::Kind::kColwise)
      return call_unit(m, Identity{}, module, tp_enter_colwise(tp, args...));
    if (tp.kind == TpEntry::Kind::kVocab) {
      VocabIds ids = tp_enter_vocab(tp, args...);
      return call_unit(m, VocabExit{tp, std::move(ids.outside)}, module, std::move(ids.local));
    }
    if (tp.kind == TpEntry::Kind::kReplicatedHeads)
      return call_unit(m, ReplicatedExit{tp}, module, std::forward<Args>(args)...);
    // Inside the unit's call: the exit reads the bias, which a per-leaf unit frees after it.
    return call_unit(m, RowwiseExit{tp, m}, module, std::forward<Args>(args)...);
  } else {
    tp_bad_signature(tp);
    return call_unit(m, Identity{}, module, std::forward<Args>(args)...);  // not reached
  }
}
}  // namespace detail

// Calls module->forward(args...) as a unit-aware call. `module` may be a ModuleHolder
// (torch::nn::Linear, TORCH_MODULE types), a std::shared_ptr<Impl> or a raw Impl pointer.
// With mixed precision, floating-point tensor arguments are cast to the compute dtype.
// A module a TP plan splits (fsdp/tensor_parallel.h) gets its tensor-parallel collectives here.
template <class M, class... Args>
auto call(M& module, Args&&... args) {
  const torch::nn::Module* m = detail::module_of(module);
  const detail::TpEntry tp = detail::find_tp(m);
  if (tp.kind != detail::TpEntry::Kind::kNone)
    return detail::call_tp(tp, m, module, std::forward<Args>(args)...);
  return detail::call_unit(m, detail::Identity{}, module, std::forward<Args>(args)...);
}

}  // namespace flatshard
