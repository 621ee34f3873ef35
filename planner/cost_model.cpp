// flatshard/planner/cost_model.cpp — see cost_model.h for the model; this file walks it.
#include "planner/cost_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "flat_param/flat_param_config.h"
#include "planner/topology.h"
#include "support/format.h"
#include "support/input_file.h"

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
// saves less than the same module without recompute (TransformerShape::recomputed_leaf_savings).
double recomputed_leaf_saving(const TransformerShape& shape, const std::string& inner) {
  for (const auto& [path, bytes] : shape.recomputed_leaf_savings)
    if (inner == path) return bytes;
  return 0;
}

// Whether module path `m` is one of `roots` or below one of them.
bool under_any(const std::string& m, const std::vector<std::string>& roots) {
  for (const auto& r : roots)
    if (m == r || (m.size() > r.size() && m.compare(0, r.size(), r) == 0 && m[r.size()] == '.'))
      return true;
  return false;
}

std::string ms(double v) { return format_fixed(v, v < 10 ? 2 : 1); }

}  // namespace

OffloadTerms offload_terms(const UnitExplanation& u, int level, c10::ScalarType param_dtype) {
  OffloadTerms t;
  if (level <= 0 || u.padded_numel == 0) return t;
  check_offload_level(level, "offload_terms");
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

namespace {

// predict_cost in named phases over one explained plan: place the units in the model, the
// persistent state, the memory walk (forward, loss, backward), the time walk (compute, passes
// and collectives, offload copies, the stream pipeline, host). Each phase reads what the earlier
// ones derived; nothing is shared beyond one prediction.
class CostWalk {
 public:
  CostWalk(const Explanation& e, const TransformerShape& shape, const Workload& w,
           const MachineProfile& prof, int offload_level)
      : explained_(e),
        shape_(shape),
        prof_(prof),
        offload_level_(offload_level),
        compute_elem_(elem(e.options.mixed_precision.param_dtype)),
        reduce_elem_(elem(e.options.mixed_precision.reduce_dtype.value_or(
            e.options.mixed_precision.param_dtype))),
        n_(static_cast<int>(e.units.size())),
        layers_(shape.n_layers),
        seq_(static_cast<double>(w.seq)),
        tokens_(static_cast<double>(w.tokens())),
        shard_size_(e.mesh.shard()),
        replicas_(e.mesh.replicate()),
        tp_(e.mesh.tp()),
        forward_prefetch_(e.options.forward_prefetch),
        backward_prefetch_(e.options.backward_prefetch),
        // One rank and no replicas: no collective runs and no flat gradient exists (Note
        // [One-rank reduction]: each gradient goes straight into the master gradient), nothing
        // is staged.
        one_rank_(shard_size_ * replicas_ == 1),
        staging_(one_rank_ ? 0.0 : prof.collective_staging) {}

  CostPrediction run() {
    place_units();
    persistent_state();
    memory_walk();
    time_walk();
    return p_;
  }

 private:
  // --- phase 1: where each unit sits --------------------------------------------------------
  void place_units();
  // --- phase 2: masters, AdamW state, NO_SHARD copies, offload residents ----------------------
  void persistent_state();
  // --- phase 3: the memory walk ---------------------------------------------------------------
  void memory_walk();
  double walk_forward();  // returns the activations saved at the end of forward
  void walk_loss(double act);
  void walk_backward();
  // --- phase 4: the time walk -----------------------------------------------------------------
  void time_walk();
  void unit_compute();
  void passes_and_collectives();
  void offload_copies();
  void pipeline(bool copies, double* exposed_gathers, double* tail) const;
  void host_time();

  // Walk helpers.
  double transient(int k) const {
    return explained_.units[k].strategy == ShardingStrategy::kNoShard
               ? 0.0
               : static_cast<double>(explained_.units[k].gathered_bytes);
  }
  bool kept(int k) const {
    return explained_.units[k].strategy != ShardingStrategy::kNoShard &&
           !explained_.units[k].reshard_after_forward;
  }
  // An offloaded unit keeps the general path at one rank too (its gradient goes to the host).
  double flat_grad(int k) const {
    return one_rank_ && level_[k] == 0 ? 0.0
                                       : static_cast<double>(explained_.units[k].grad_buffer_bytes);
  }
  // Offloaded: the fp32 master comes up to a device buffer before its cast (level 1 at the
  // first gather of the step, level 2 at every gather).
  double upload(int k) const { return level_[k] > 0 ? 4.0 * explained_.units[k].shard_numel : 0.0; }
  double saved(int64_t i) const {
    return recomputed_[i] ? layer_input_ : layer_full_ - tokens_ * leaf_saving_[i] * scale();
  }
  double scale() const { return prof_.activation_scale; }
  double per_token(const PerToken& t) const { return tokens_ * t.bytes(compute_elem_) * scale(); }
  // The first bp units of backward (gathered when backward begins), less `skip`.
  double prefetched_first(int skip) const {
    double bytes = 0;
    for (int q = n_ - 1; q >= std::max(1, n_ - backward_prefetch_); --q)
      if (!kept(order_[q]) && order_[q] != skip) bytes += transient(order_[q]);
    return bytes;
  }
  void consider(double act, double grads, double trans, const std::string& at) {
    const double total = act + grads + trans;
    if (total > best_) {
      best_ = total;
      p_.activation_bytes = static_cast<int64_t>(act);
      p_.gradient_bytes = static_cast<int64_t>(grads);
      p_.transient_bytes = static_cast<int64_t>(trans);
      p_.peak_at = at;
    }
  }

  const Explanation& explained_;
  const TransformerShape& shape_;
  const MachineProfile& prof_;
  const int offload_level_;
  const int64_t compute_elem_, reduce_elem_;  // element sizes: compute dtype, reduce dtype
  const int n_;
  const int64_t layers_;
  const double seq_, tokens_;
  const int shard_size_, replicas_, tp_, forward_prefetch_, backward_prefetch_;
  const bool one_rank_;
  const double staging_;

  CostPrediction p_;
  // Phase 1.
  std::vector<UnitPlace> place_;
  std::vector<double> leaf_saving_;  // bytes per token, recomputed leaves (see the header)
  bool head_owned_ = false;          // a unit other than the root holds the head
  std::vector<int> order_;           // unit indices in execution order
  // Layers: which unit position frees them in backward (their first unit in execution order;
  // the root, position 0, when no other unit touches them), whether they are recomputed, and
  // how many units hold a part of them.
  std::vector<int> anchor_;
  std::vector<bool> recomputed_;
  std::vector<int> layer_units_;
  // Per unit position q: the layers anchored there, and over those layers saved(i) summed
  // (phase 1's end), so the walks are linear in units + layers, not their product.
  std::vector<std::vector<int64_t>> anchored_at_;
  std::vector<double> saved_at_;
  // kept_before_[q]: the gathered bytes of the kept units at positions < q.
  std::vector<double> kept_before_;
  double layer_full_ = 0, layer_input_ = 0, head_saved_ = 0, layer_backward_work_ = 0;
  // Phase 2.
  std::vector<OffloadTerms> off_;
  std::vector<int> level_;
  std::vector<int64_t> master_grad_;
  int64_t persistent_ = 0;
  // Phase 3.
  double best_ = -1;
  // Phase 4.
  std::vector<double> fwd_ms_, bwd_ms_, ag_ms_, red_ms_, up_fwd_, up_bwd_, down_;
  double copy_ms_ = 0, cpu_opt_ms_ = 0;
};

void CostWalk::place_units() {
  place_.assign(n_, UnitPlace{});
  leaf_saving_.assign(layers_, 0);
  for (int k = 0; k < n_; ++k) {
    const auto& u = explained_.units[k];
    UnitPlace& p = place_[k];
    bool any_layer = false, only_input = !u.modules.empty();
    for (const auto& m : u.modules) {
      int64_t i = 0;
      bool whole = false;
      std::string inner;
      if (layer_index(m, shape_.layer_prefix, &i, &whole, &inner) && i < layers_) {
        (whole ? p.whole : p.partial).push_back(i);
        if (!whole && u.recompute) leaf_saving_[i] += recomputed_leaf_saving(shape_, inner);
        any_layer = true;
        only_input = false;
        continue;
      }
      if (under_any(m, shape_.head_modules)) p.head = true;
      if (!under_any(m, shape_.input_modules)) only_input = false;
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
      p.position = p.input ? -1 : static_cast<double>(layers_);
    }
  }
  for (int k = 0; k < n_; ++k)
    head_owned_ = head_owned_ || (place_[k].head && !explained_.units[k].is_root);
  order_.resize(n_);
  for (int k = 0; k < n_; ++k) order_[k] = k;
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int a, int b) { return place_[a].position < place_[b].position; });

  anchor_.assign(layers_, 0);
  recomputed_.assign(layers_, false);
  layer_units_.assign(layers_, 0);
  for (int q = n_ - 1; q >= 0; --q) {
    const int k = order_[q];
    for (auto i : place_[k].whole) {
      anchor_[i] = q;
      if (explained_.units[k].recompute) recomputed_[i] = true;
      ++layer_units_[i];
    }
    for (auto i : place_[k].partial) {
      anchor_[i] = q;
      ++layer_units_[i];
    }
  }
  layer_full_ = per_token(shape_.layer_activations);
  layer_input_ = per_token(shape_.recompute_keeps);
  head_saved_ = per_token(shape_.head_activations);
  layer_backward_work_ = per_token(shape_.layer_backward_work);
  anchored_at_.assign(n_, {});
  saved_at_.assign(n_, 0.0);
  for (int64_t i = 0; i < layers_; ++i) {
    anchored_at_[anchor_[i]].push_back(i);
    saved_at_[anchor_[i]] += saved(i);
  }
  kept_before_.assign(n_ + 1, 0.0);
  for (int q = 0; q < n_; ++q)
    kept_before_[q + 1] = kept_before_[q] + (kept(order_[q]) ? transient(order_[q]) : 0.0);
}

void CostWalk::persistent_state() {
  off_.resize(n_);
  level_.assign(n_, 0);
  master_grad_.assign(n_, 0);
  const auto param_dtype = explained_.options.mixed_precision.param_dtype;
  for (int k = 0; k < n_; ++k) {
    const auto& u = explained_.units[k];
    // The unit's level as explain resolved it (fsdp/resolve.h), at least `offload_level`.
    level_[k] = std::max(u.offload, u.padded_numel > 0 ? offload_level_ : 0);
    if (u.strategy == ShardingStrategy::kNoShard) level_[k] = std::min(level_[k], 1);  // resolve.h
    off_[k] = offload_terms(u, level_[k], param_dtype);
    const int64_t trainable =
        u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes;
    // Offloaded: the level's resident shard; else Note [Kept compute shard]'s, if kept.
    persistent_ += u.master_bytes + 2 * trainable - off_[k].device_bytes_saved +
                   (level_[k] > 0 ? off_[k].resident_bytes : u.resident_bytes);
    if (u.strategy == ShardingStrategy::kNoShard) {
      // The unsharded buffer; offloaded (even fp32, which otherwise computes on the master
      // itself) it is a device copy of the host master.
      persistent_ += level_[k] > 0 ? u.padded_numel * compute_elem_ : u.gathered_bytes;
      p_.replicated_bytes += u.master_bytes + u.master_grad_bytes + 2 * trainable;
    }
    master_grad_[k] = level_[k] > 0 ? 0 : u.master_grad_bytes;
    p_.host_bytes += off_[k].host_bytes;
  }
  p_.persistent_bytes = persistent_;
}

void CostWalk::memory_walk() {
  const double act = walk_forward();
  walk_loss(act);
  walk_backward();
  const double peak = (persistent_ + best_) * (1 + prof_.allocator_slack);
  // llround of a value beyond int64 is undefined: refuse (a profile within its bounds and a
  // model explain accepts stay far below).
  TORCH_CHECK(std::isfinite(peak) && peak >= 0 && peak < 9e18,
              "predict_cost: the predicted peak of ", peak,
              " bytes is not a finite byte count "
              "(allocator_slack ",
              prof_.allocator_slack, ", activation_scale ", prof_.activation_scale, ")");
  p_.peak_bytes = static_cast<int64_t>(std::llround(peak));
}

double CostWalk::walk_forward() {
  double act = 0;
  // The upload's device buffer is a temporary of the gather's issue (upload_to_device(): freed
  // when the copy and cast are queued, reused in stream order), so one is alive at a time, at
  // the pre-forward / pre-backward that issues the gather, beside no compute working set (on the
  // GPU, 1B GPT at 1 seq, offload 2 per two layers: counting it beside the backward of the unit
  // that prefetched over-predicted the peak by 23%).
  for (int q = 0; q < n_; ++q) {
    const int k = order_[q];
    // Gathers this pre-forward issues: all of the first 1 + fp units at the first, then the one
    // fp ahead (fp = 0: its own).
    double up = 0;
    if (q == 0 || forward_prefetch_ == 0) {
      for (int j = q; j <= std::min(n_ - 1, q + forward_prefetch_); ++j)
        up = std::max(up, upload(order_[j]));
    } else if (q + forward_prefetch_ <= n_ - 1) {
      up = upload(order_[q + forward_prefetch_]);
    }
    double g = transient(k) * (1 + staging_) + up + kept_before_[q];
    for (int j = q + 1; j <= std::min(n_ - 1, q + forward_prefetch_); ++j)
      g += transient(order_[j]);  // prefetched (kept or not: not yet counted)
    consider(act, 0, g, "forward of " + explained_.units[k].name);
    // Layers whose first unit is this one are saved from here on.
    act += saved_at_[q];
  }
  return act;
}

void CostWalk::walk_loss(double act) {
  const double V = static_cast<double>(shape_.vocab);
  const double loss_forward_extra =
      tokens_ * V * (compute_elem_ + (compute_elem_ != 4 ? 4 : 0)) * scale();
  const double loss_backward_extra = tokens_ * V * 8 * scale();
  const double kept_all = kept_before_[n_];
  consider(act + head_saved_ + loss_forward_extra, 0, kept_all, "loss forward");
  // The root's pre-backward is the step's first (its hook sits on the loss): from the loss's
  // backward on, the root's flat gradient exists (FlatParam::prepare_grad, the general path)
  // and the first bp units of backward are gathered (Runtime::on_first_pre_backward). (CPU
  // ranks, world 1, offload 1, recompute per block: without them 67.4 MiB under, the root's
  // and one block's size.)
  consider(act + head_saved_ + loss_backward_extra, 0,
           kept_all + flat_grad(order_[0]) + prefetched_first(-1), "loss backward");
  // The output projection's backward: the logits' gradient (compute dtype, and the fp32 one
  // it was cast from) beside its saved input, the head unit gathered and the flat gradients
  // of the head unit and the root (its first gradient arrives here).
  int head = 0;
  for (int k = 0; k < n_; ++k)
    if (place_[k].head && !explained_.units[k].is_root) head = k;
  if (!head_owned_) head = order_[0];
  double g = kept_all + flat_grad(head);
  if (!kept(head)) g += transient(head) * (1 + staging_);
  if (head != order_[0]) g += flat_grad(order_[0]);
  g += prefetched_first(head);  // the head's own buffer is counted above
  const double a = act + tokens_ *
                             (2.0 * shape_.d_model * compute_elem_ +
                              V * (compute_elem_ + (compute_elem_ != 4 ? 4 : 0))) *
                             scale();
  consider(a, 0, g, "backward of the output projection");
}

void CostWalk::walk_backward() {
  // The head's parameter gradients (compute dtype) wait for their unit's reduction, as every
  // gradient does (FlatParam::accept_grad); when the root holds the head, that reduction is the
  // step's last, so they are held through every layer's backward.
  const double head_pending =
      head_owned_ ? 0.0 : static_cast<double>(shape_.vocab) * shape_.d_model * compute_elem_;
  // Backward, reverse execution order, the root last. saved_before[q]: the activations of the
  // layers anchored before position q (freed later), summed once.
  std::vector<double> saved_before(n_ + 1, 0.0);
  for (int q = 0; q < n_; ++q) saved_before[q + 1] = saved_before[q] + saved_at_[q];
  double grads = 0;
  int previous = -1;
  for (int q = n_ - 1; q >= 0; --q) {
    const int k = order_[q];
    double g = transient(k) + head_pending;
    // A backward gather's staging lives only while the collective runs, before (a prefetch: long
    // before) this unit's backward compute: it and the compute's working set are never alive
    // together (CPU ranks, world 2 and 4: their sum over-counted per-layer plans by about one
    // layer's gradient work, and hid the head gradient above). It is counted where the gather is
    // issued ("backward gather at", below), not beside the compute: taking the larger of the two
    // at the compute put a unit's staging beside its own flat gradient, which does not exist
    // yet there (CPU ranks, two layers per unit, worlds 2-4: 3.0-6.6% over, now 0.2-1.7%).
    double stage = 0;  // this unit's own staging, for the recompute rule below
    if (explained_.units[k].per_step.backward_all_gathers) stage = staging_ * transient(k);
    g += kept_before_[q];  // kept units before this one, and the bp ones just before it
    for (int j = std::max(0, q - backward_prefetch_); j < q; ++j)
      if (!kept(order_[j])) g += transient(order_[j]);
    if (q != 0) g += flat_grad(order_[0]);
    if (previous >= 0) g += flat_grad(previous);
    // The largest of f over the units whose gathers this pre-backward issues: all of the first
    // bp at the start of backward, then the one bp ahead; bp = 0: its own. Before this unit's
    // gradient exists.
    auto over_issued = [&](auto&& f) {
      double most = 0;
      if (backward_prefetch_ == 0) {
        most = f(k);
      } else if (q == n_ - 1) {
        for (int j = q; j >= std::max(0, q - backward_prefetch_); --j)
          most = std::max(most, f(order_[j]));
      } else if (q - backward_prefetch_ >= 0) {
        most = f(order_[q - backward_prefetch_]);
      }
      return most;
    };
    // A level-2 unit gathered for backward uploads its master again.
    const double up = over_issued([&](int j) {
      return level_[j] == 2 && !kept(j) && explained_.units[j].per_step.backward_all_gathers
                 ? upload(j)
                 : 0.0;
    });
    // Each gather's staging, alive while its collective runs.
    const double sg = over_issued([&](int j) {
      return !kept(j) && explained_.units[j].per_step.backward_all_gathers ? staging_ * transient(j)
                                                                           : 0.0;
    });
    g += flat_grad(k);
    // Activations: layers freed later (anchor < q) saved; layers anchored here being consumed:
    // full (recomputed ones rebuilt whole).
    const double here = static_cast<double>(anchored_at_[q].size()) * layer_full_;
    double a = saved_before[q] + here;
    const bool touches_layer = !anchored_at_[q].empty();
    // The head's log-softmax output is gone after the loss's backward; its inputs remain.
    if (place_[k].head && !explained_.units[k].is_root)
      a += tokens_ * 2.0 * shape_.d_model * compute_elem_ * scale();
    const double work = touches_layer || !place_[k].partial.empty() || !place_[k].whole.empty()
                            ? layer_backward_work_
                            : 0.0;
    // A recompute unit keeps the staging in both points, here and at its reduction: measured so
    // (CPU ranks, world 2 and 4: per-leaf recompute 5-7% under without it), not explained —
    // the recompute forward's own scratch beside the rebuilt layer is not modelled apart.
    const double extra = explained_.units[k].recompute ? stage + work : work;
    if (up > 0 || sg > 0)
      consider(a, grads, g - flat_grad(k) + std::max(up, sg),
               "backward gather at " + explained_.units[k].name);
    // (Its master gradient does not exist yet: zero_grad leaves none, and the reduction
    // allocates it. Counted here, the one-unit plans were 6-8% over on the GPU.)
    consider(a, grads, g + extra, "backward of " + explained_.units[k].name);
    // Its reduction (FlatParam::reduce_grad's general path): the flat gradient, the parameters'
    // own gradients (compute dtype, held until the reduction's event), the reduced shard (an
    // all-reduce works in place), the master gradient, allocated here; offloaded, also the
    // reduced shard's fp32 copy until it reaches the host. One rank (Note [One-rank reduction]):
    // the parameters' own gradients beside the fresh master gradient they are copied into. The
    // held gradients and the reduced shard were once this model's "staging" of the threads
    // backend, where the gap to the counting allocator was exactly these two at world 2 and 4;
    // on the GPU (1B GPT, one unit, offload 1, 1 seq, world 1) the walk without them said
    // 8.8 GiB where 12.3 were measured.
    double after = a - here;  // this unit's layers are done
    const auto& uk = explained_.units[k];
    const bool general = !(one_rank_ && level_[k] == 0);
    // (The root's own reduction: its held gradients include the head's.)
    const double own_grads =
        general || !uk.frozen
            ? static_cast<double>(uk.padded_numel) * compute_elem_ - (q == 0 ? head_pending : 0.0)
            : 0.0;
    const bool reduced_shard = general && uk.strategy != ShardingStrategy::kNoShard;
    const double held = own_grads +
                        (reduced_shard ? static_cast<double>(reduce_elem_) * uk.shard_numel : 0.0) +
                        (level_[k] > 0 ? 4.0 * uk.shard_numel : 0.0);
    consider(after, grads + master_grad_[k],
             g + (explained_.units[k].recompute ? stage : 0.0) + held,
             "reduction of " + explained_.units[k].name);
    grads += master_grad_[k];
    previous = k;
  }
}

void CostWalk::time_walk() {
  unit_compute();
  passes_and_collectives();
  offload_copies();
  double tail = 0;
  pipeline(false, &p_.exposed_all_gather_ms, &tail);
  p_.exposed_comm_ms = p_.exposed_all_gather_ms + tail;
  // The TP all-reduces run on the compute stream between a layer's matmuls: nothing hides them.
  p_.comm_ms += p_.tp_comm_ms;
  p_.exposed_comm_ms += p_.tp_comm_ms;
  // Note [Offload step in backward] (fsdp/offload_step.h): each offloaded unit's CPU step runs
  // beside the backward of the units after it, once its gradient is on the host; at level 1
  // its upload follows its step there instead of riding the next forward's gathers. The CPU
  // steps (one after another on one worker) and the last unit's upload show where they outlast
  // the backward left after the first reduction.
  // Note [Delayed offload step]: delayed, each unit's step has from its reduction to the same
  // point of the next step: the whole next forward and backward hide it.
  const bool delayed = explained_.options.offload_step == OffloadStep::kDelayed;
  const bool step_in_backward =
      explained_.options.offload_step != OffloadStep::kAfterBackward && cpu_opt_ms_ > 0;
  double cpu_exposed = cpu_opt_ms_;
  if (step_in_backward) {
    double window = 0, last_upload = 0;
    for (int q = 0; q < n_; ++q) {
      const int k = order_[q];
      if (delayed)
        window += fwd_ms_[k] + bwd_ms_[k];
      else if (q + 1 < n_)
        window += bwd_ms_[k];  // all but the first unit to reduce
      if (level_[k] == 1) {
        if (last_upload == 0) last_upload = up_fwd_[k];  // the first in forward steps last
        up_fwd_[k] = 0;
      }
    }
    cpu_exposed = std::max(0.0, cpu_opt_ms_ + last_upload - window);
  }
  double copy_exposed = 0;
  if (prof_.comm_overlap == 0) {  // synchronous collectives: nothing hides
    double gathers = 0;
    for (int k = 0; k < n_; ++k)
      gathers += ag_ms_[k] * (explained_.units[k].per_step.forward_all_gathers +
                              explained_.units[k].per_step.backward_all_gathers);
    p_.exposed_all_gather_ms = gathers;
    p_.exposed_comm_ms = p_.comm_ms;  // the TP all-reduces included (above)
    copy_exposed = std::max(0.0, copy_ms_ - p_.compute_ms);
  } else if (copy_ms_ > 0) {
    double g = 0, t = 0;
    pipeline(true, &g, &t);
    copy_exposed = std::max(0.0, g + t - p_.exposed_comm_ms);
  }
  p_.cpu_optimizer_ms = cpu_opt_ms_;
  p_.offload_ms = cpu_exposed + copy_exposed;
  host_time();
  p_.gpu_ms = p_.compute_ms + p_.passes_ms + p_.optimizer_ms + p_.exposed_comm_ms + p_.offload_ms;
  p_.host_bound = p_.host_ms > p_.gpu_ms;
  const double norm = prof_.host_overlap_norm;  // machine_profile.h: imperfect overlap
  const double hi = std::max(p_.gpu_ms, p_.host_ms), lo = std::min(p_.gpu_ms, p_.host_ms);
  p_.step_ms = hi > 0 ? hi * std::pow(1 + std::pow(lo / hi, norm), 1 / norm) : 0;
}

void CostWalk::unit_compute() {
  // Tensor parallelism: a tp group's ranks share its tokens (each GPU's share: 1 / tp) and
  // split every layer's matmuls and attention heads; the head stays whole on each rank.
  p_.tokens = tokens_ / tp_;
  const double rate = prof_.compute_tflops * 1e9;  // FLOP per ms
  const double attn_flops_layer = shape_.attention_flops_per_token_per_position * seq_ * tokens_;
  const double layer_flops =
      (6.0 * tokens_ * static_cast<double>(shape_.layer_matmul_params) + attn_flops_layer) / tp_;
  const double head_flops = 6.0 * tokens_ * static_cast<double>(shape_.vocab * shape_.d_model);
  fwd_ms_.assign(n_, 0);
  bwd_ms_.assign(n_, 0);
  for (int k = 0; k < n_; ++k) {
    const auto& u = explained_.units[k];
    double f = 0, rc = 0;
    for (size_t w = 0; w < place_[k].whole.size(); ++w) {
      f += layer_flops;
      if (u.recompute) rc += layer_flops / 3;
    }
    for (auto i : place_[k].partial) {
      const double share = layer_flops / std::max(1, layer_units_[i]);
      f += share;
      if (u.recompute) rc += share / 3;  // a recomputed leaf runs its own forward again
    }
    if (place_[k].head || (u.is_root && !head_owned_)) f += head_flops;
    if (u.is_root)  // layers no other unit touches (model granularity)
      for (int64_t i = 0; i < layers_; ++i)
        if (layer_units_[i] == 0) f += layer_flops;
    p_.model_flops += f;
    fwd_ms_[k] = f / 3 / rate;
    bwd_ms_[k] = (2 * f / 3 + rc) / rate;
    p_.compute_ms += (f + rc) / rate;
    p_.recompute_ms += rc / rate;
  }
}

void CostWalk::passes_and_collectives() {
  const double mem_rate = prof_.memory_gbps * 1e6;  // bytes per ms
  ag_ms_.assign(n_, 0);
  red_ms_.assign(n_, 0);
  const double ag_bus =
      shard_size_ > 1 ? static_cast<double>(shard_size_ - 1) : 0;  // x shard bytes
  const double rs_bus = shard_size_ > 1 ? static_cast<double>(shard_size_ - 1) / shard_size_ : 0;
  // Each group's own links (planner/topology.h): the shard group's all-gathers and
  // reductions, the replicate group's all-reduce.
  // All ranks inside one node (W x R <= gpus per node): every group is, aligned or not.
  const auto per_node = static_cast<int64_t>(prof_.gpus_per_node);
  // Tensor parallelism is the innermost dimension (collectives/mesh.h): a tp group is tp
  // consecutive ranks, a shard group shard_size_ ranks tp apart, replicas shard x tp apart.
  const int64_t nodes =
      static_cast<int64_t>(shard_size_) * replicas_ * tp_ <= per_node ? 0 : per_node;
  const GroupSpan shard = tp_ > 1 ? replicate_group_span(shard_size_, tp_, nodes)
                                  : shard_group_span(shard_size_, nodes);
  const GroupSpan replicate =
      replicate_group_span(replicas_, static_cast<int64_t>(shard_size_) * tp_, nodes);
  auto cost = [&](Collective c, const GroupSpan& g, double bus, int64_t bytes) {
    return bytes > 0 ? collective_ms(prof_, c, g, bus * static_cast<double>(bytes)) : 0.0;
  };
  // The TP all-reduces (explain's TpCollectives, per unit): each one of its share of the
  // tensors' bytes (tokens x numel per token x the compute dtype's size), over the tp group.
  if (tp_ > 1) {
    const GroupSpan tp = shard_group_span(tp_, nodes);
    const double bus = 2.0 * (tp_ - 1) / tp_;
    auto all_reduces = [&](int64_t count, int64_t numel_per_token) {
      if (count <= 0) return 0.0;
      const double bytes = tokens_ * static_cast<double>(numel_per_token * compute_elem_);
      return static_cast<double>(count) *
             collective_ms(prof_, Collective::kAllReduce, tp, bus * bytes / count);
    };
    for (const auto& u : explained_.units)
      p_.tp_comm_ms += all_reduces(u.tp.forward_all_reduces, u.tp.forward_numel_per_token) +
                       all_reduces(u.tp.backward_all_reduces, u.tp.backward_numel_per_token);
  }
  for (int k = 0; k < n_; ++k) {
    const auto& u = explained_.units[k];
    const auto& c = u.per_step;
    const int64_t gathers = c.forward_all_gathers + c.backward_all_gathers;
    if (compute_elem_ != 4)
      p_.passes_ms += gathers * static_cast<double>((4 + compute_elem_) * u.shard_numel) / mem_rate;
    if (reduce_elem_ != 4 && (c.reduce_scatters || c.all_reduces))
      p_.passes_ms += static_cast<double>((reduce_elem_ + 4) * u.shard_numel) / mem_rate;
    const int64_t trainable =
        u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes;
    if (level_[k] == 0)
      p_.optimizer_ms += prof_.optimizer_bytes_per_param * (trainable / 4) / mem_rate;
    if (shard_size_ == 1 && replicas_ == 1) {  // world-1 collectives are device copies
      p_.passes_ms += gathers * 2.0 * u.all_gather_bytes / mem_rate;
      continue;
    }
    if (shard_size_ > 1 && c.forward_all_gathers + c.backward_all_gathers > 0)
      ag_ms_[k] = cost(Collective::kAllGather, shard, ag_bus, u.all_gather_bytes);
    double r = 0;
    if (c.reduce_scatters && shard_size_ > 1)
      r += cost(Collective::kReduceScatter, shard, rs_bus, u.reduce_bytes);
    if (c.all_reduces && shard_size_ > 1)
      r += cost(Collective::kAllReduce, shard, 2 * rs_bus, u.reduce_bytes);
    if (replicas_ > 1 && c.replicate_bytes > 0)
      r += cost(Collective::kAllReduce, replicate, 2.0 * (replicas_ - 1) / replicas_,
                c.replicate_bytes);
    red_ms_[k] = r;
    p_.comm_ms += gathers * ag_ms_[k] + r;
  }
}

// Offload copies (cost_model.h): uploads before gathers, downloads after reductions.
void CostWalk::offload_copies() {
  up_fwd_.assign(n_, 0);
  up_bwd_.assign(n_, 0);
  down_.assign(n_, 0);
  for (int k = 0; k < n_; ++k) {
    const auto& c = explained_.units[k].per_step;
    const double h2d = off_[k].h2d_bytes / (prof_.h2d_gbps * 1e6);
    if (level_[k] == 2 && c.backward_all_gathers > 0) {
      const double per = h2d / static_cast<double>(std::max<int64_t>(
                                   1, c.forward_all_gathers + c.backward_all_gathers));
      up_bwd_[k] = per * static_cast<double>(c.backward_all_gathers);
      up_fwd_[k] = h2d - up_bwd_[k];
    } else {
      up_fwd_[k] = h2d;
    }
    down_[k] = off_[k].d2h_bytes / (prof_.d2h_gbps * 1e6);
    copy_ms_ += h2d + down_[k];
    cpu_opt_ms_ += off_[k].cpu_optimizer_params / prof_.cpu_optimizer_params_per_s * 1e3;
  }
}

// The pipeline: forward gathers on their own stream, issued `fp` units ahead (at that unit's
// pre-forward); backward in reverse order, gathers issued `bp` units ahead, reductions after
// each unit on the reduce stream; the step waits for the last reduction. A copy runs at
// copy_rate_beside_compute of its rate while compute runs beside it (cost_model.h). Returns
// the exposed gather time and the reduction tail.
void CostWalk::pipeline(bool copies, double* exposed_gathers, double* tail) const {
  const double beside = prof_.copy_rate_beside_compute;
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
    auto it =
        std::upper_bound(spans.begin(), spans.end(), t,
                         [](double v, const std::pair<double, double>& s) { return v < s.second; });
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
  std::vector<double> start(n_, 0);
  double compute_t = 0, comm_t = 0, exposed = 0;
  for (int q = 0; q < n_; ++q) {
    const int k = order_[q];
    const double issue = q - forward_prefetch_ >= 0 && forward_prefetch_ > 0
                             ? start[order_[q - forward_prefetch_]]
                             : (forward_prefetch_ > 0 ? 0 : compute_t);
    double ready = compute_t;
    const double gather = explained_.units[k].per_step.forward_all_gathers ? ag_ms_[k] : 0.0;
    const double up = copies ? up_fwd_[k] : 0.0;
    if (gather + up > 0) {  // the upload, then the gather
      comm_t = copy_end(std::max(comm_t, issue), up) + gather;
      ready = std::max(ready, comm_t);
    }
    exposed += ready - compute_t;
    start[k] = ready;
    compute_t = computes(ready, fwd_ms_[k]);
  }
  const double backward_begin = compute_t;
  std::vector<double> bstart(n_, 0), bend(n_, 0);
  for (int q = n_ - 1; q >= 0; --q) {
    const int k = order_[q];
    const int ahead = q + backward_prefetch_;
    const double issue =
        backward_prefetch_ > 0 && ahead <= n_ - 1 && ahead != q ? bstart[order_[ahead]] : compute_t;
    double ready = compute_t;
    const double gather = explained_.units[k].per_step.backward_all_gathers ? ag_ms_[k] : 0.0;
    const double up = copies ? up_bwd_[k] : 0.0;
    if (gather + up > 0) {
      // The first bp units of backward are prefetched when backward begins.
      const double s0 =
          std::max(comm_t, backward_prefetch_ > 0 && ahead > n_ - 1 ? backward_begin : issue);
      comm_t = copy_end(s0, up) + gather;
      ready = std::max(ready, comm_t);
    }
    exposed += ready - compute_t;
    bstart[k] = ready;
    compute_t = computes(ready, bwd_ms_[k]);
    bend[k] = compute_t;
  }
  // The reductions (the compute never waits for them), each after its unit's backward; the
  // download follows the unit's reduction.
  double red_t = backward_begin;
  for (int q = n_ - 1; q >= 0; --q) {
    const int k = order_[q];
    const double down_ms = copies ? down_[k] : 0.0;
    if (red_ms_[k] + down_ms > 0) red_t = copy_end(std::max(red_t, bend[k]) + red_ms_[k], down_ms);
  }
  *exposed_gathers = exposed;
  *tail = std::max(0.0, red_t - compute_t);
}

// Host: per step, per unit; recompute runs a unit's forward hooks again and re-issues the
// forward of the layers it holds whole (their forward share of the per-layer host time).
void CostWalk::host_time() {
  const double per_layer_host = prof_.host_ms_per_step / prof_.host_reference_layers;
  const double unit_host = prof_.host_us_per_unit_forward + prof_.host_us_per_unit_backward;
  const double forward_share = unit_host > 0 ? prof_.host_us_per_unit_forward / unit_host : 0.0;
  double recompute_host = 0;
  for (int k = 0; k < n_; ++k) {
    if (!explained_.units[k].recompute) continue;
    recompute_host += prof_.host_us_per_unit_forward / 1e3 +
                      forward_share * per_layer_host * static_cast<double>(place_[k].whole.size());
  }
  p_.host_ms =
      per_layer_host * static_cast<double>(layers_) + n_ * unit_host / 1e3 + recompute_host;
}

}  // namespace

CostPrediction predict_cost(const Explanation& e, const TransformerShape& shape, const Workload& w,
                            const MachineProfile& prof, int offload_level) {
  TORCH_CHECK(w.batch >= 1 && w.seq >= 1, "predict_cost: batch and seq must be >= 1, got batch ",
              w.batch, " seq ", w.seq);
  shape.validate();
  check_offload_level(offload_level, "predict_cost");
  TORCH_CHECK(prof.copy_rate_beside_compute > 0 && prof.copy_rate_beside_compute <= 1,
              "predict_cost: copy_rate_beside_compute must be in (0, 1], got ",
              prof.copy_rate_beside_compute);
  const CostPrediction p = CostWalk(e, shape, w, prof, offload_level).run();
  // Every time finite and non-negative: a profile outside its bounds (machine_profile.h; code
  // can build one) must be an error, not an "inf ms" or 60-digit prediction.
  const std::pair<const char*, double> times[] = {
      {"compute_ms", p.compute_ms},
      {"passes_ms", p.passes_ms},
      {"optimizer_ms", p.optimizer_ms},
      {"comm_ms", p.comm_ms},
      {"exposed_comm_ms", p.exposed_comm_ms},
      {"tp_comm_ms", p.tp_comm_ms},
      {"exposed_all_gather_ms", p.exposed_all_gather_ms},
      {"host_ms", p.host_ms},
      {"offload_ms", p.offload_ms},
      {"recompute_ms", p.recompute_ms},
      {"gpu_ms", p.gpu_ms},
      {"step_ms", p.step_ms},
      {"cpu_optimizer_ms", p.cpu_optimizer_ms}};
  constexpr double kMaxMs = 1e18;  // ~3e7 years: beyond it a number of digits, not a time
  for (const auto& [name, v] : times)
    TORCH_CHECK(std::isfinite(v) && v >= 0 && v <= kMaxMs, "predict_cost: predicted ", name, " = ",
                v, " ms is not a finite time of at most ", kMaxMs, " ms; the machine profile (",
                printable_escape(prof.source),
                ") holds a value outside its bounds (planner/machine_profile.h: check_profile)");
  return p;
}

double CostPrediction::tokens_per_s() const { return step_ms > 0 ? tokens * 1e3 / step_ms : 0; }

double CostPrediction::mfu(double peak_tflops) const {
  return peak_tflops > 0 && step_ms > 0 ? model_flops / (step_ms * 1e9) / peak_tflops : 0;
}

std::string CostPrediction::throughput(const MachineProfile& profile) const {
  std::ostringstream os;
  os << "predicted throughput: " << format_fixed(tokens_per_s(), 0) << " tokens/s per GPU, ";
  if (profile.peak_tflops > 0)
    os << "MFU " << format_fixed(100 * mfu(profile.peak_tflops), 1) << "% of "
       << profile.peak_tflops << " TFLOP/s";
  else
    os << "MFU unknown (the profile has no peak_tflops)";
  os << " (" << format_fixed(tokens > 0 ? model_flops / tokens / 1e9 : 0, 2)
     << " GFLOP per token, recompute not counted)";
  return os.str();
}

std::string CostPrediction::to_string() const {
  std::ostringstream os;
  os << "predicted peak per rank " << format_bytes(peak_bytes) << " at "
     << printable_escape(peak_at)  // a unit's name, maybe from a file
     << ": persistent " << format_bytes(persistent_bytes) << " (fp32 masters + AdamW"
     << (replicated_bytes ? " + NO_SHARD copies" : "") << "), activations "
     << format_bytes(activation_bytes) << ", master gradients " << format_bytes(gradient_bytes)
     << ", gathered/flat-gradient/working " << format_bytes(transient_bytes);
  if (host_bytes) os << "; offloaded to host " << format_bytes(host_bytes);
  os << "\npredicted step " << ms(step_ms) << " ms" << (host_bound ? " (host-bound)" : "")
     << ": compute " << ms(compute_ms) << " (recompute " << ms(recompute_ms)
     << "), parameter passes " << ms(passes_ms) << ", optimizer " << ms(optimizer_ms)
     << ", exposed communication " << ms(exposed_comm_ms) << " of " << ms(comm_ms)
     << (tp_comm_ms > 0 ? " (TP all-reduces " + ms(tp_comm_ms) + ")" : std::string()) << ", offload "
     << ms(offload_ms) << "; host " << ms(host_ms) << "\n";
  return os.str();
}

}  // namespace flatshard
