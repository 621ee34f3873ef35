// flatshard/fsdp/cost_model.cpp — see cost_model.h for the model; this file walks it.
#include "fsdp/cost_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "support/format.h"

namespace flatshard {

namespace {

int64_t elem(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

// Where a unit sits in the model: the layers it holds whole, the layers it holds part of, and
// whether it runs before the layers (embeddings) or after them (final norm, lm_head).
struct UnitPlace {
  std::vector<int64_t> whole, partial;
  bool head = false;    // holds the output projection
  bool input = false;   // only input modules (embeddings)
  double position = 0;  // execution order key
};

bool layer_index(const std::string& path, const std::string& prefix, int64_t* index, bool* whole,
                 std::string* inner = nullptr) {
  if (prefix.empty() || path.rfind(prefix + ".", 0) != 0) return false;
  const std::string rest = path.substr(prefix.size() + 1);
  const size_t dot = rest.find('.');
  const std::string digits = rest.substr(0, dot);
  if (digits.empty() || digits.size() > 12 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  *index = std::stoll(digits);
  *whole = dot == std::string::npos;
  if (inner) *inner = *whole ? std::string() : rest.substr(dot + 1);
  return true;
}

// Bytes per token a recompute unit holding only the module at `inner` (its path inside a layer)
// saves less than the same module without recompute (cost_model.h, activations): a LLaMA RMSNorm
// keeps its input (d e) instead of its fp32 copy, its cast output and the statistic.
double recomputed_leaf_saving(const TransformerShape& shape, const std::string& inner) {
  for (const auto& path : shape.rms_norm_paths)
    if (inner == path) return 4.0 * static_cast<double>(shape.d_model) + 4;
  return 0;
}

// Time of one collective of `bytes` (what this rank sends, explain's convention) over `world`
// ranks: latency + bus bytes / bandwidth (machine_profile.h).
double collective_ms(double latency_us, double gbps, double bus_factor, int64_t bytes) {
  if (bytes <= 0) return 0;
  return latency_us / 1e3 + bus_factor * static_cast<double>(bytes) / (gbps * 1e6);
}

std::string ms(double v) { return format_fixed(v, v < 10 ? 2 : 1); }

}  // namespace

int64_t TransformerShape::layer_matmul_params() const {
  const int64_t d = d_model;
  if (kind == Kind::kGpt) return 12 * d * d;
  const int64_t kv = (n_kv_heads > 0 ? n_kv_heads : n_heads) * head_dim();
  return 2 * d * d + 2 * d * kv + 3 * d * mlp_hidden;
}

double TransformerShape::layer_activation_bytes_per_token(int64_t e) const {
  const double d = static_cast<double>(d_model), H = static_cast<double>(n_heads);
  if (kind == Kind::kGpt) return 17 * d * e + 2 * (2 * 4) + 4 * H;
  const int64_t kvh = n_kv_heads > 0 ? n_kv_heads : n_heads;
  const double kv = static_cast<double>(kvh * head_dim()), h = static_cast<double>(mlp_hidden);
  const double norms = 2 * (4 * d + d * e + 4);
  const double attn = kvh != n_heads ? e * (4 * d + kv + 2 * d) : e * (4 * d + 3 * kv);
  return norms + attn + 4 * H + 4 * h * e;
}

double TransformerShape::head_activation_bytes_per_token(int64_t e) const {
  return 2.0 * static_cast<double>(d_model) * e + 4.0 * static_cast<double>(vocab);
}

OffloadTerms offload_terms(const UnitExplanation& u, int level, c10::ScalarType param_dtype) {
  OffloadTerms t;
  if (level <= 0 || u.padded_numel == 0) return t;
  TORCH_CHECK(level <= 2, "offload level must be 0, 1 or 2, got ", level);
  const int64_t trainable =
      u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes;
  const int64_t grad = u.frozen ? 0 : u.master_bytes;
  t.device_bytes_saved = u.master_bytes + 2 * trainable;
  t.host_bytes = u.master_bytes + grad + 2 * trainable;
  // A sharded unit keeps its compute-dtype shard (FlatParam::resident_); a NO_SHARD one uploads
  // into its unsharded buffer, which it keeps anyway (UnitExplanation::gathered_bytes).
  const bool sharded = u.strategy != ShardingStrategy::kNoShard;
  t.resident_bytes = level == 1 && sharded ? u.shard_numel * elem(param_dtype) : 0;
  const int64_t gathers =
      u.per_step.forward_all_gathers + u.per_step.backward_all_gathers + u.per_step.all_reduces;
  t.h2d_bytes = (level == 1 ? 1 : std::max<int64_t>(1, gathers)) * u.master_bytes;
  t.d2h_bytes = grad;
  t.cpu_optimizer_params = trainable / 4;
  return t;
}

CostPrediction predict_cost(const Explanation& e, const TransformerShape& shape, const Workload& w,
                            const MachineProfile& prof, int offload_level) {
  TORCH_CHECK(w.batch >= 1 && w.seq >= 1, "predict_cost: batch and seq must be >= 1, got batch ",
              w.batch, " seq ", w.seq);
  TORCH_CHECK(shape.vocab > 0 && shape.d_model > 0 && shape.n_heads > 0 && shape.n_layers > 0 &&
                  shape.d_model % shape.n_heads == 0 &&
                  (shape.kind == TransformerShape::Kind::kGpt || shape.mlp_hidden > 0),
              "predict_cost: shape needs positive vocab, d_model, n_heads (dividing d_model), "
              "n_layers and (LLaMA) mlp_hidden; got vocab ",
              shape.vocab, " d_model ", shape.d_model, " n_heads ", shape.n_heads, " n_layers ",
              shape.n_layers, " mlp_hidden ", shape.mlp_hidden);
  TORCH_CHECK(offload_level >= 0 && offload_level <= 2,
              "predict_cost: offload level must be 0, 1 or 2, got ", offload_level);
  TORCH_CHECK(prof.copy_rate_beside_compute > 0 && prof.copy_rate_beside_compute <= 1,
              "predict_cost: copy_rate_beside_compute must be in (0, 1], got ",
              prof.copy_rate_beside_compute);
  const auto& mp = e.options.mixed_precision;
  const int64_t ec = elem(mp.param_dtype);
  const int64_t er = elem(mp.reduce_dtype.value_or(mp.param_dtype));
  const int n = static_cast<int>(e.units.size());
  const int64_t L = shape.n_layers;
  const double tokens = static_cast<double>(w.tokens());
  const int W = e.world_size, R = e.replicate_size;

  // --- where each unit sits -----------------------------------------------------------------
  std::vector<UnitPlace> place(n);
  std::vector<double> leaf_saving(L, 0);  // bytes per token, recomputed leaves (see the header)
  for (int k = 0; k < n; ++k) {
    const auto& u = e.units[k];
    UnitPlace& p = place[k];
    bool any_layer = false, only_input = !u.modules.empty();
    for (const auto& m : u.modules) {
      int64_t i = 0;
      bool whole = false;
      std::string inner;
      if (layer_index(m, shape.layer_prefix, &i, &whole, &inner) && i < L) {
        (whole ? p.whole : p.partial).push_back(i);
        if (!whole && u.recompute) leaf_saving[i] += recomputed_leaf_saving(shape, inner);
        any_layer = true;
        only_input = false;
        continue;
      }
      if (m == "lm_head" || m.rfind("lm_head.", 0) == 0) p.head = true;
      const bool is_input = m == "wte" || m == "wpe" || m == "embed_tokens" || m == "rope";
      if (!is_input) only_input = false;
    }
    p.input = only_input && !any_layer;
    if (u.is_root) {
      p.position = -2;
    } else if (any_layer) {
      double lo = 1e18;
      for (auto i : p.whole) lo = std::min(lo, static_cast<double>(i));
      for (auto i : p.partial) lo = std::min(lo, static_cast<double>(i) + 0.5);
      p.position = lo;
    } else {
      p.position = p.input ? -1 : static_cast<double>(L);
    }
  }
  bool head_owned = false;
  for (int k = 0; k < n; ++k) head_owned = head_owned || (place[k].head && !e.units[k].is_root);
  std::vector<int> order(n);
  for (int k = 0; k < n; ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return place[a].position < place[b].position; });
  std::vector<int> pos_of(n);
  for (int q = 0; q < n; ++q) pos_of[order[q]] = q;

  // Layers: which unit position frees them in backward (their first unit in execution order;
  // the root, position 0, when no other unit touches them) and whether they are recomputed.
  std::vector<int> anchor(L, 0);
  std::vector<bool> recomputed(L, false);
  std::vector<int> layer_units(L, 0);
  for (int q = n - 1; q >= 0; --q) {
    const int k = order[q];
    for (auto i : place[k].whole) {
      anchor[i] = q;
      if (e.units[k].recompute) recomputed[i] = true;
      ++layer_units[i];
    }
    for (auto i : place[k].partial) {
      anchor[i] = q;
      ++layer_units[i];
    }
  }
  const double scale = prof.activation_scale;
  const double layer_full = tokens * shape.layer_activation_bytes_per_token(ec) * scale;
  const double layer_input = tokens * static_cast<double>(shape.d_model * ec) * scale;
  const double head_saved = tokens * shape.head_activation_bytes_per_token(ec) * scale;
  const double V = static_cast<double>(shape.vocab);
  const double loss_forward_extra = tokens * V * (ec + (ec != 4 ? 4 : 0)) * scale;
  const double loss_backward_extra = tokens * V * 8 * scale;
  const int64_t inner =
      shape.kind == TransformerShape::Kind::kGpt ? 4 * shape.d_model : 2 * shape.mlp_hidden;
  const double layer_backward_work =
      tokens * static_cast<double>(ec * (2 * shape.d_model + 2 * inner)) * scale;
  auto saved = [&](int64_t i) {
    return recomputed[i] ? layer_input : layer_full - tokens * leaf_saving[i] * scale;
  };

  // --- persistent state -----------------------------------------------------------------------
  CostPrediction p;
  std::vector<OffloadTerms> off(n);
  std::vector<int> level(n, 0);
  std::vector<int64_t> master_grad(n, 0);
  int64_t persistent = 0;
  for (int k = 0; k < n; ++k) {
    const auto& u = e.units[k];
    // The unit's level as explain resolved it (fsdp/resolve.h), at least `offload_level`.
    level[k] = std::max(u.offload, u.padded_numel > 0 ? offload_level : 0);
    if (u.strategy == ShardingStrategy::kNoShard) level[k] = std::min(level[k], 1);  // resolve.h
    off[k] = offload_terms(u, level[k], mp.param_dtype);
    const int64_t trainable =
        u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes;
    persistent +=
        u.master_bytes + 2 * trainable - off[k].device_bytes_saved + off[k].resident_bytes;
    if (u.strategy == ShardingStrategy::kNoShard) {
      // The unsharded buffer; offloaded (even fp32, which otherwise computes on the master
      // itself) it is a device copy of the host master.
      persistent += level[k] > 0 ? u.padded_numel * ec : u.gathered_bytes;
      p.replicated_bytes += 2 * u.master_bytes + 2 * trainable;
    }
    master_grad[k] = (u.frozen || level[k] > 0) ? 0 : u.master_bytes;
    p.host_bytes += off[k].host_bytes;
  }
  p.persistent_bytes = persistent;

  // --- the walk -------------------------------------------------------------------------------
  auto transient = [&](int k) {
    return e.units[k].strategy == ShardingStrategy::kNoShard ? int64_t{0}
                                                             : e.units[k].gathered_bytes;
  };
  auto kept = [&](int k) {
    return e.units[k].strategy != ShardingStrategy::kNoShard && !e.units[k].reshard_after_forward;
  };
  const int fp = e.options.forward_prefetch, bp = e.options.backward_prefetch;
  double best = -1;
  auto consider = [&](double act, double grads, double trans, const std::string& at) {
    const double total = act + grads + trans;
    if (total > best) {
      best = total;
      p.activation_bytes = static_cast<int64_t>(act);
      p.gradient_bytes = static_cast<int64_t>(grads);
      p.transient_bytes = static_cast<int64_t>(trans);
      p.peak_at = at;
    }
  };
  // One rank and no replicas: no collective runs and no flat gradient exists (Note [One-rank
  // reduction]: each gradient goes straight into the master gradient), nothing is staged.
  const bool one_rank = W * R == 1;
  const double staging = one_rank ? 0.0 : prof.collective_staging;
  // An offloaded unit keeps the general path at one rank too (its gradient goes to the host).
  auto flat_grad = [&](int k) {
    return one_rank && level[k] == 0 ? 0.0 : static_cast<double>(e.units[k].grad_buffer_bytes);
  };
  // Forward.
  double act = 0;
  // Offloaded: the fp32 master comes up to a device buffer before its cast (level 1 at the
  // first gather of the step, level 2 at every gather).
  auto upload = [&](int k) { return level[k] > 0 ? 4.0 * e.units[k].shard_numel : 0.0; };
  // The upload's device buffer is a temporary of the gather's issue (upload_to_device(): freed
  // when the copy and cast are queued, reused in stream order), so one is alive at a time, at
  // the pre-forward / pre-backward that issues the gather, beside no compute working set (on the
  // GPU, 1B GPT at 1 seq, offload 2 per two layers: counting it beside the backward of the unit
  // that prefetched over-predicted the peak by 23%).
  for (int q = 0; q < n; ++q) {
    const int k = order[q];
    // Gathers this pre-forward issues: all of the first 1 + fp units at the first, then the one
    // fp ahead (fp = 0: its own).
    double up = 0;
    if (q == 0 || fp == 0) {
      for (int j = q; j <= std::min(n - 1, q + fp); ++j) up = std::max(up, upload(order[j]));
    } else if (q + fp <= n - 1) {
      up = upload(order[q + fp]);
    }
    double g = static_cast<double>(transient(k)) * (1 + staging) + up;
    for (int j = 0; j < q; ++j)
      if (kept(order[j])) g += transient(order[j]);
    for (int j = q + 1; j <= std::min(n - 1, q + fp); ++j)
      g += transient(order[j]);  // prefetched (kept or not: not yet counted)
    consider(act, 0, g, "forward of " + e.units[k].name);
    // Layers whose first unit is this one are saved from here on.
    for (int64_t i = 0; i < L; ++i)
      if (anchor[i] == q) act += saved(i);
  }
  double kept_all = 0;
  for (int k = 0; k < n; ++k)
    if (kept(k)) kept_all += transient(k);
  consider(act + head_saved + loss_forward_extra, 0, kept_all, "loss forward");
  // The root's pre-backward is the step's first (its hook sits on the loss): from the loss's
  // backward on, the root's flat gradient exists (FlatParam::prepare_grad, the general path)
  // and the first bp units of backward are gathered (Runtime::on_first_pre_backward). (CPU
  // ranks, world 1, offload 1, recompute per block: without them 67.4 MiB under, the root's
  // and one block's size.)
  auto prefetched_first = [&](int skip) {  // the first bp units of backward, less `skip`
    double bytes = 0;
    for (int q = n - 1; q >= std::max(1, n - bp); --q)
      if (!kept(order[q]) && order[q] != skip) bytes += transient(order[q]);
    return bytes;
  };
  consider(act + head_saved + loss_backward_extra, 0,
           kept_all + flat_grad(order[0]) + prefetched_first(-1), "loss backward");
  {
    // The output projection's backward: the logits' gradient (compute dtype, and the fp32 one
    // it was cast from) beside its saved input, the head unit gathered and the flat gradients
    // of the head unit and the root (its first gradient arrives here).
    int head = 0;
    for (int k = 0; k < n; ++k)
      if (place[k].head && !e.units[k].is_root) head = k;
    if (!head_owned) head = order[0];
    double g = kept_all + flat_grad(head);
    if (!kept(head)) g += transient(head) * (1 + staging);
    if (head != order[0]) g += flat_grad(order[0]);
    g += prefetched_first(head);  // the head's own buffer is counted above
    const double a =
        act + tokens * (2.0 * shape.d_model * ec + V * (ec + (ec != 4 ? 4 : 0))) * scale;
    consider(a, 0, g, "backward of the output projection");
  }
  // The head's parameter gradients (compute dtype) wait for their unit's reduction, as every
  // gradient does (FlatParam::accept_grad); when the root holds the head, that reduction is the
  // step's last, so they are held through every layer's backward.
  const double head_pending = head_owned ? 0.0 : V * static_cast<double>(shape.d_model) * ec;
  // Backward, reverse execution order, the root last.
  double grads = 0;
  int previous = -1;
  for (int q = n - 1; q >= 0; --q) {
    const int k = order[q];
    double g = static_cast<double>(transient(k)) + head_pending;
    // A backward gather's staging lives only while the collective runs, before (a prefetch: long
    // before) this unit's backward compute: it and the compute's working set are never alive
    // together (CPU ranks, world 2 and 4: their sum over-counted per-layer plans by about one
    // layer's gradient work, and hid the head gradient above). It is counted where the gather is
    // issued ("backward gather at", below), not beside the compute: taking the larger of the two
    // at the compute put a unit's staging beside its own flat gradient, which does not exist
    // yet there (CPU ranks, two layers per unit, worlds 2-4: 3.0-6.6% over, now 0.2-1.7%).
    double stage = 0;  // this unit's own staging, for the recompute rule below
    if (e.units[k].per_step.backward_all_gathers) stage = staging * transient(k);
    for (int j = 0; j < q; ++j)
      if (kept(order[j]) || j >= q - bp) g += transient(order[j]);
    if (q != 0) g += flat_grad(order[0]);
    if (previous >= 0) g += flat_grad(previous);
    // The largest of f over the units whose gathers this pre-backward issues: all of the first
    // bp at the start of backward, then the one bp ahead; bp = 0: its own. Before this unit's
    // gradient exists.
    auto over_issued = [&](auto&& f) {
      double most = 0;
      if (bp == 0) {
        most = f(k);
      } else if (q == n - 1) {
        for (int j = q; j >= std::max(0, q - bp); --j) most = std::max(most, f(order[j]));
      } else if (q - bp >= 0) {
        most = f(order[q - bp]);
      }
      return most;
    };
    // A level-2 unit gathered for backward uploads its master again.
    const double up = over_issued([&](int j) {
      return level[j] == 2 && !kept(j) && e.units[j].per_step.backward_all_gathers ? upload(j)
                                                                                     : 0.0;
    });
    // Each gather's staging, alive while its collective runs.
    const double sg = over_issued([&](int j) {
      return !kept(j) && e.units[j].per_step.backward_all_gathers ? staging * transient(j) : 0.0;
    });
    g += flat_grad(k);
    // Activations: layers freed later (anchor < q) saved; layers anchored here being consumed:
    // full (recomputed ones rebuilt whole).
    double a = 0;
    bool touches_layer = false;
    for (int64_t i = 0; i < L; ++i) {
      if (anchor[i] < q) a += saved(i);
      if (anchor[i] == q) {
        a += layer_full;
        touches_layer = true;
      }
    }
    // The head's log-softmax output is gone after the loss's backward; its inputs remain.
    if (place[k].head && !e.units[k].is_root) a += tokens * 2.0 * shape.d_model * ec * scale;
    const double work =
        touches_layer || !place[k].partial.empty() || !place[k].whole.empty()
            ? layer_backward_work
            : 0.0;
    // A recompute unit keeps the staging in both points, here and at its reduction: measured so
    // (CPU ranks, world 2 and 4: per-leaf recompute 5-7% under without it), not explained —
    // the recompute forward's own scratch beside the rebuilt layer is not modelled apart.
    const double extra = e.units[k].recompute ? stage + work : work;
    if (up > 0 || sg > 0)
      consider(a, grads, g - flat_grad(k) + std::max(up, sg),
               "backward gather at " + e.units[k].name);
    // (Its master gradient does not exist yet: zero_grad leaves none, and the reduction
    // allocates it. Counted here, the one-unit plans were 6-8% over on the GPU.)
    consider(a, grads, g + extra, "backward of " + e.units[k].name);
    // Its reduction (FlatParam::reduce_grad's general path): the flat gradient, the parameters'
    // own gradients (compute dtype, held until the reduction's event), the reduced shard (an
    // all-reduce works in place), the master gradient, allocated here; offloaded, also the
    // reduced shard's fp32 copy until it reaches the host. One rank (Note [One-rank reduction]):
    // the parameters' own gradients beside the fresh master gradient they are copied into. The
    // held gradients and the reduced shard were once this model's "staging" of the threads
    // backend, where the gap to the counting allocator was exactly these two at world 2 and 4;
    // on the GPU (1B GPT, one unit, offload 1, 1 seq, world 1) the walk without them said
    // 8.8 GiB where 12.3 were measured.
    double after = a;  // this unit's layers are done
    for (int64_t i = 0; i < L; ++i)
      if (anchor[i] == q) after -= layer_full;
    const auto& uk = e.units[k];
    const bool general = !(one_rank && level[k] == 0);
    // (The root's own reduction: its held gradients include the head's.)
    const double own_grads =
        general || !uk.frozen
            ? static_cast<double>(uk.padded_numel) * ec - (q == 0 ? head_pending : 0.0)
            : 0.0;
    const bool reduced_shard = general && uk.strategy != ShardingStrategy::kNoShard;
    const double held = own_grads +
                        (reduced_shard ? static_cast<double>(er) * uk.shard_numel : 0.0) +
                        (level[k] > 0 ? 4.0 * uk.shard_numel : 0.0);
    consider(after, grads + master_grad[k], g + (e.units[k].recompute ? stage : 0.0) + held,
             "reduction of " + e.units[k].name);
    grads += master_grad[k];
    previous = k;
  }
  const double peak = (persistent + best) * (1 + prof.allocator_slack);
  p.peak_bytes = static_cast<int64_t>(std::llround(peak));

  // --- time -----------------------------------------------------------------------------------
  const double rate = prof.compute_tflops * 1e9;  // FLOP per ms
  const double attn_flops_layer = 12.0 * shape.d_model * static_cast<double>(w.seq) * tokens;
  const double layer_flops = 6.0 * tokens * shape.layer_matmul_params() + attn_flops_layer;
  const double head_flops = 6.0 * tokens * static_cast<double>(shape.vocab * shape.d_model);
  std::vector<double> fwd_ms(n, 0), bwd_ms(n, 0);
  for (int k = 0; k < n; ++k) {
    const auto& u = e.units[k];
    double f = 0, rc = 0;
    for (auto i : place[k].whole) {
      (void)i;
      f += layer_flops;
      if (u.recompute) rc += layer_flops / 3;
    }
    for (auto i : place[k].partial) {
      const double share = layer_flops / std::max(1, layer_units[i]);
      f += share;
      if (u.recompute) rc += share / 3;  // a recomputed leaf runs its own forward again
    }
    if (place[k].head || (u.is_root && !head_owned)) f += head_flops;
    if (u.is_root)  // layers no other unit touches (model granularity)
      for (int64_t i = 0; i < L; ++i)
        if (layer_units[i] == 0) f += layer_flops;
    fwd_ms[k] = f / 3 / rate;
    bwd_ms[k] = (2 * f / 3 + rc) / rate;
    p.compute_ms += (f + rc) / rate;
    p.recompute_ms += rc / rate;
  }
  // Per-parameter passes and collectives.
  const double mem_rate = prof.memory_gbps * 1e6;  // bytes per ms
  std::vector<double> ag_ms(n, 0), red_ms(n, 0);
  const double ag_bus = W > 1 ? static_cast<double>(W - 1) : 0;  // x shard bytes
  const double rs_bus = W > 1 ? static_cast<double>(W - 1) / W : 0;
  for (int k = 0; k < n; ++k) {
    const auto& u = e.units[k];
    const auto& c = u.per_step;
    const int64_t gathers = c.forward_all_gathers + c.backward_all_gathers;
    if (ec != 4) p.passes_ms += gathers * static_cast<double>((4 + ec) * u.shard_numel) / mem_rate;
    if (er != 4 && (c.reduce_scatters || c.all_reduces))
      p.passes_ms += static_cast<double>((er + 4) * u.shard_numel) / mem_rate;
    const int64_t trainable =
        u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes;
    if (level[k] == 0)
      p.optimizer_ms += prof.optimizer_bytes_per_param * (trainable / 4) / mem_rate;
    if (W == 1 && R == 1) {  // world-1 collectives are device copies
      p.passes_ms += gathers * 2.0 * u.all_gather_bytes / mem_rate;
      continue;
    }
    if (W > 1 && c.forward_all_gathers + c.backward_all_gathers > 0)
      ag_ms[k] = collective_ms(prof.all_gather_latency_us, prof.all_gather_gbps, ag_bus,
                               u.all_gather_bytes);
    double r = 0;
    if (c.reduce_scatters && W > 1)
      r += collective_ms(prof.reduce_scatter_latency_us, prof.reduce_scatter_gbps, rs_bus,
                         u.reduce_bytes);
    if (c.all_reduces && W > 1)
      r += collective_ms(prof.all_reduce_latency_us, prof.all_reduce_gbps, 2 * rs_bus,
                         u.reduce_bytes);
    if (R > 1 && c.replicate_bytes > 0)
      r += collective_ms(prof.all_reduce_latency_us, prof.all_reduce_gbps, 2.0 * (R - 1) / R,
                         c.replicate_bytes);
    red_ms[k] = r;
    p.comm_ms += gathers * ag_ms[k] + r;
  }
  // Offload copies (cost_model.h): uploads before gathers, downloads after reductions.
  std::vector<double> up_fwd(n, 0), up_bwd(n, 0), down(n, 0);
  double copy_ms = 0, cpu_opt_ms = 0;
  for (int k = 0; k < n; ++k) {
    const auto& c = e.units[k].per_step;
    const double h2d = off[k].h2d_bytes / (prof.h2d_gbps * 1e6);
    if (level[k] == 2 && c.backward_all_gathers > 0) {
      const double per = h2d / static_cast<double>(std::max<int64_t>(
                                   1, c.forward_all_gathers + c.backward_all_gathers));
      up_bwd[k] = per * static_cast<double>(c.backward_all_gathers);
      up_fwd[k] = h2d - up_bwd[k];
    } else {
      up_fwd[k] = h2d;
    }
    down[k] = off[k].d2h_bytes / (prof.d2h_gbps * 1e6);
    copy_ms += h2d + down[k];
    cpu_opt_ms += off[k].cpu_optimizer_params / prof.cpu_optimizer_params_per_s * 1e3;
  }
  // The pipeline: forward gathers on their own stream, issued `fp` units ahead (at that unit's
  // pre-forward); backward in reverse order, gathers issued `bp` units ahead, reductions after
  // each unit on the reduce stream; the step waits for the last reduction. A copy runs at
  // copy_rate_beside_compute of its rate while compute runs beside it (cost_model.h). Returns
  // the exposed gather time and the reduction tail.
  const double beside = prof.copy_rate_beside_compute;
  auto walk = [&](bool copies, double* exposed_gathers, double* tail) {
    // The compute spans so far, in time order (one compute stream: disjoint).
    std::vector<std::pair<double, double>> spans;
    auto computes = [&](double begin, double ms) {
      if (ms > 0) spans.emplace_back(begin, begin + ms);
      return begin + ms;
    };
    // When a copy of `work` ms at its full rate, started at t, ends: slowed inside the compute
    // spans known so far; after the last one nothing computes (the compute waits for this copy,
    // or the backward is over).
    auto copy_end = [&](double t, double work) {
      if (work <= 0) return t;
      auto it = std::upper_bound(spans.begin(), spans.end(), t,
                                 [](double v, const std::pair<double, double>& s) {
                                   return v < s.second;
                                 });
      for (; it != spans.end(); ++it) {
        if (it->first > t) {  // idle compute before this span: the full rate
          if (it->first - t >= work) return t + work;
          work -= it->first - t;
          t = it->first;
        }
        const double can = (it->second - t) * beside;
        if (can >= work) return t + work / beside;
        work -= can;
        t = it->second;
      }
      return t + work;
    };
    std::vector<double> start(n, 0);
    double compute_t = 0, comm_t = 0, exposed = 0;
    for (int q = 0; q < n; ++q) {
      const int k = order[q];
      const double issue =
          q - fp >= 0 && fp > 0 ? start[order[q - fp]] : (fp > 0 ? 0 : compute_t);
      double ready = compute_t;
      const double gather = e.units[k].per_step.forward_all_gathers ? ag_ms[k] : 0.0;
      const double up = copies ? up_fwd[k] : 0.0;
      if (gather + up > 0) {  // the upload, then the gather
        comm_t = copy_end(std::max(comm_t, issue), up) + gather;
        ready = std::max(ready, comm_t);
      }
      exposed += ready - compute_t;
      start[k] = ready;
      compute_t = computes(ready, fwd_ms[k]);
    }
    const double backward_begin = compute_t;
    std::vector<double> bstart(n, 0), bend(n, 0);
    for (int q = n - 1; q >= 0; --q) {
      const int k = order[q];
      const int ahead = q + bp;
      const double issue =
          bp > 0 && ahead <= n - 1 && ahead != q ? bstart[order[ahead]] : compute_t;
      double ready = compute_t;
      const double gather = e.units[k].per_step.backward_all_gathers ? ag_ms[k] : 0.0;
      const double up = copies ? up_bwd[k] : 0.0;
      if (gather + up > 0) {
        // The first bp units of backward are prefetched when backward begins.
        const double s0 = std::max(comm_t, bp > 0 && ahead > n - 1 ? backward_begin : issue);
        comm_t = copy_end(s0, up) + gather;
        ready = std::max(ready, comm_t);
      }
      exposed += ready - compute_t;
      bstart[k] = ready;
      compute_t = computes(ready, bwd_ms[k]);
      bend[k] = compute_t;
    }
    // The reductions (the compute never waits for them), each after its unit's backward; the
    // download follows the unit's reduction.
    double red_t = backward_begin;
    for (int q = n - 1; q >= 0; --q) {
      const int k = order[q];
      const double down_ms = copies ? down[k] : 0.0;
      if (red_ms[k] + down_ms > 0)
        red_t = copy_end(std::max(red_t, bend[k]) + red_ms[k], down_ms);
    }
    *exposed_gathers = exposed;
    *tail = std::max(0.0, red_t - compute_t);
  };
  double tail = 0;
  walk(false, &p.exposed_all_gather_ms, &tail);
  p.exposed_comm_ms = p.exposed_all_gather_ms + tail;
  double copy_exposed = 0;
  if (prof.comm_overlap == 0) {  // synchronous collectives: nothing hides
    double gathers = 0;
    for (int k = 0; k < n; ++k)
      gathers += ag_ms[k] * (e.units[k].per_step.forward_all_gathers +
                             e.units[k].per_step.backward_all_gathers);
    p.exposed_all_gather_ms = gathers;
    p.exposed_comm_ms = p.comm_ms;
    copy_exposed = std::max(0.0, copy_ms - p.compute_ms);
  } else if (copy_ms > 0) {
    double g = 0, t = 0;
    walk(true, &g, &t);
    copy_exposed = std::max(0.0, g + t - p.exposed_comm_ms);
  }
  p.cpu_optimizer_ms = cpu_opt_ms;
  p.offload_ms = cpu_opt_ms + copy_exposed;

  // Host: per step, per unit; recompute runs a unit's forward hooks again and re-issues the
  // forward of the layers it holds whole (their forward share of the per-layer host time).
  const double per_layer_host = prof.host_ms_per_step / prof.host_reference_layers;
  const double unit_host = prof.host_us_per_unit_forward + prof.host_us_per_unit_backward;
  const double forward_share = unit_host > 0 ? prof.host_us_per_unit_forward / unit_host : 0.0;
  double recompute_host = 0;
  for (int k = 0; k < n; ++k) {
    if (!e.units[k].recompute) continue;
    recompute_host += prof.host_us_per_unit_forward / 1e3 +
                      forward_share * per_layer_host * static_cast<double>(place[k].whole.size());
  }
  p.host_ms = per_layer_host * static_cast<double>(L) + n * unit_host / 1e3 + recompute_host;
  p.gpu_ms = p.compute_ms + p.passes_ms + p.optimizer_ms + p.exposed_comm_ms + p.offload_ms;
  p.host_bound = p.host_ms > p.gpu_ms;
  const double norm = prof.host_overlap_norm;  // machine_profile.h: imperfect overlap
  const double hi = std::max(p.gpu_ms, p.host_ms), lo = std::min(p.gpu_ms, p.host_ms);
  p.step_ms = hi > 0 ? hi * std::pow(1 + std::pow(lo / hi, norm), 1 / norm) : 0;
  return p;
}

std::string CostPrediction::to_string() const {
  std::ostringstream os;
  os << "predicted peak per rank " << format_bytes(peak_bytes) << " at " << peak_at
     << ": persistent " << format_bytes(persistent_bytes) << " (fp32 masters + AdamW"
     << (replicated_bytes ? " + NO_SHARD copies" : "") << "), activations "
     << format_bytes(activation_bytes) << ", master gradients " << format_bytes(gradient_bytes)
     << ", gathered/flat-gradient/working " << format_bytes(transient_bytes);
  if (host_bytes) os << "; offloaded to host " << format_bytes(host_bytes);
  os << "\npredicted step " << ms(step_ms) << " ms" << (host_bound ? " (host-bound)" : "")
     << ": compute " << ms(compute_ms) << " (recompute " << ms(recompute_ms)
     << "), parameter passes " << ms(passes_ms) << ", optimizer " << ms(optimizer_ms)
     << ", exposed communication " << ms(exposed_comm_ms) << " of " << ms(comm_ms) << ", offload "
     << ms(offload_ms) << "; host " << ms(host_ms) << "\n";
  return os.str();
}

}  // namespace flatshard
