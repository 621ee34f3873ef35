// flatshard/fsdp/options.h — the knobs of fully_shard(), as plain structs with documented
// defaults. Per-unit overrides come from the plan (wrap_policies/plan.h: UnitOptions).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flat_param/flat_param_config.h"
#include "wrap_policies/plan.h"

namespace at {
class Tensor;
}

namespace flatshard {

// Gives one parameter or buffer of a model built on the meta device its initial values:
// `name` as the model's named_parameters() / named_buffers() spell it (a tied parameter: the
// name the plan lists it under); `values` is a tensor of its shape and dtype on the
// communicator's device, to be filled in place (under NoGradGuard). Note [Deferred
// initialization] (fsdp/deferred_init.h).
using TensorInit = std::function<void(const std::string& name, const at::Tensor& values)>;

// One parameter fully_shard will load: its name (as the plan lists it) and shape.
struct PlannedParam {
  std::string name;
  std::vector<int64_t> shape;
};

// Parameter values read from storage straight into each rank's master shard, for a model
// built on the meta device (Note [Loading into shards], fsdp/deferred_init.h). A plain
// pair of callbacks, so fsdp/ knows no file format; checkpoint/load_into_shards.h makes one
// from safetensors files (flatshard::safetensors_loader).
struct ParamLoader {
  // Called once per rank during setup, before any unit is built and before `read`, with every
  // parameter of the plan (plan order; a tied parameter once, under the name the plan lists
  // it by). Throws c10::Error naming the tensor for anything `read` could not load (missing,
  // wrong shape, unsupported dtype, unreadable file). Errors reach every rank (one agree point).
  std::function<void(const std::vector<PlannedParam>& params)> check;
  // Elements [begin, end) of parameter `name`, flattened row-major, into `dst`: a 1-D fp32
  // tensor of end - begin elements on the communicator's device (a slice of this rank's
  // master shard), written in place. Called only for ranges this rank's shard holds; may run
  // on several rank threads at once (threads backend), each with its own ranges.
  std::function<void(const std::string& name, int64_t begin, int64_t end, const at::Tensor& dst)>
      read;
  explicit operator bool() const { return static_cast<bool>(read); }

  // Both callbacks over one shared object with check(params) and read(name, begin, end, dst)
  // members (a format's loader): the copies of the ParamLoader keep it alive.
  template <class Loader>
  static ParamLoader over(std::shared_ptr<Loader> loader) {
    ParamLoader out;
    out.check = [loader](const std::vector<PlannedParam>& params) { loader->check(params); };
    out.read = [loader](const std::string& name, int64_t begin, int64_t end,
                        const at::Tensor& dst) { loader->read(name, begin, end, dst); };
    return out;
  }
};

struct MixedPrecision {
  // dtype of the gathered parameters, of compute and of the all-gather. The optimizer always
  // sees fp32 master shards. Default: float32 (no mixed precision).
  c10::ScalarType param_dtype = c10::kFloat;
  // dtype of the gradient reduce-scatter / all-reduce. Default: param_dtype.
  std::optional<c10::ScalarType> reduce_dtype;
  // Keep the master shards' gradients (master().grad, what the optimizer reads) in the reduce
  // dtype instead of upcasting them to fp32: half the gradient memory and no upcast pass, at
  // the price of clipping and accumulation rounding in that dtype (Note [Low-precision master
  // gradient], flat_param/collective_plan.h). Not with offload or the gradient scaler.
  // Default: off (fp32 gradients, as FSDP1's keep_low_precision_grads=False and FSDP2).
  bool keep_low_precision_grads = false;
  // What sharded units' all-gathers put on the wire (forward and backward gathers alike):
  // kParam the shard in param_dtype; kFp8 float8_e4m3fn with one scale per parameter (plus
  // one small all-reduce(max) per gather); kInt8 block-wise int8 (one scale per 256
  // elements); kFp8Delayed fp8 with the previous gather's amax, no all-reduce after a unit's
  // first gather (Note [Delayed fp8 amax]: values above that amax saturate at +-448 * scale).
  // The gathered parameters are param_dtype either way; gradients, reductions and
  // the fp32 masters are unchanged (flat_param/quantized_gather.h, docs/mixed-precision.md).
  // NO_SHARD units gather nothing and ignore it; not with offload. Default: kParam.
  GatherDtype gather_dtype = GatherDtype::kParam;
  // dtype floating-point buffers (module.named_buffers()) are cast to at setup; integer and
  // bool buffers keep theirs. Default: every buffer keeps its own dtype, whatever param_dtype
  // is — buffers are not parameters and are not cast with them (a rotary inv_freq, for one,
  // must stay fp32: fsdp/buffers.h). Buffers are never sharded.
  std::optional<c10::ScalarType> buffer_dtype;
};

// Per-unit step traces (fsdp/trace.h). Off by default; off costs one null-pointer test per hook.
struct TraceOptions {
  // Where each rank writes its Chrome/Perfetto JSON trace (on ShardedModel::write_trace() and
  // when the ShardedModel is destroyed). "{rank}" is replaced by the rank; without it, world
  // sizes > 1 get ".rank<R>" before ".json". "nvtx": NVTX ranges only, no file. Empty: the
  // FLATSHARD_TRACE environment variable decides (same syntax; unset = off).
  std::string path;
  // Steps recorded, from the first; later steps run untraced, so memory stays bounded.
  int max_steps = 64;
};

// When offloaded units' CPU optimizer step runs (Note [Offload step in backward],
// fsdp/offload_step.h).
enum class OffloadStep {
  kAfterBackward,  // in optimizer.step(), after backward (default; any torch optimizer)
  kBackward,       // per unit during backward, as its gradient reaches the host (FusedAdamW)
  // Opt-in, ZeRO-Offload's one-step-delayed update: as kBackward, but the device keeps
  // computing with the parameters of one step before, so step N's CPU update runs beside step
  // N+1's forward and backward. Parameters are one step stale (Note [Delayed offload step]).
  kDelayed,
};

struct ShardingOptions {
  // Strategy for units whose plan entry sets none.
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // FULL_SHARD units free their gathered parameters after forward (true) or keep them until
  // backward (false, i.e. SHARD_GRAD_OP behaviour). The root unit defaults to false because
  // its backward starts right after the forward ends; a plan option overrides both.
  bool reshard_after_forward = true;
  MixedPrecision mixed_precision;
  // Units whose all-gather is issued ahead of use: in forward, the next N units in the order
  // recorded on the previous step; in backward, the next N in reverse forward order.
  int forward_prefetch = 1;
  int backward_prefetch = 1;
  // Broadcast rank 0's initial parameter and buffer values at setup (within the shard group,
  // then across replicas with HSDP), so ranks need not initialise alike. Off: ranks must hold
  // equal values; the setup fingerprint compares buffer values and fails naming the buffer.
  bool sync_module_states = true;
  // Alignment of each parameter inside a flat parameter, in elements.
  int64_t align = 8;
  // CPU offload level for units whose plan entry sets none (UnitOptions::offload; Note [CPU
  // offload], flat_param/offload.h): 0 off (default); 1 fp32 master shards, their gradients and
  // the optimizer's state in pinned host memory (the optimizer steps on the CPU), the device
  // keeping a compute-dtype shard; 2 the compute-dtype shard on the host as well, uploaded
  // before each all-gather. NO_SHARD units keep their compute copy on the device (level 2 acts
  // as 1 for them).
  int offload = 0;
  // Offloaded units' CPU optimizer step: after backward (default), or per unit during backward,
  // overlapping the device's backward (needs ShardedModel::attach_optimizer with a FusedAdamW;
  // every synced backward is then an optimizer step; clip_grad_norm_ is refused). Exact either
  // way (Note [Offload step in backward]). kDelayed: one step stale, level 1 only (Note
  // [Delayed offload step]).
  OffloadStep offload_step = OffloadStep::kAfterBackward;
  // Note [Kept compute shard] (flat_param/collective_plan.h): sharded units computing below fp32
  // and not offloaded keep their master shard's compute-dtype cast on the device (+2 B per
  // parameter / shard ranks for bf16); an attached FusedAdamW (ShardedModel::attach_optimizer)
  // writes it in its pass, so the gathers all-gather it without casting. Exact either way. Off
  // by default; no effect on NO_SHARD units (they keep their copy anyway), offloaded ones or fp32.
  bool keep_compute_shard = false;

  // Race exposure for tests (GPU only; 0 = off): a device sleep of this many cycles is queued
  // on the all-gather / reduce-scatter stream before every all-gather / reduction, so a
  // missing event wait shows up as wrong numbers instead of passing by luck.
  int64_t debug_sleep_before_all_gather_cycles = 0;
  int64_t debug_sleep_before_reduce_cycles = 0;

  TraceOptions trace;

  // A plan whose policy had rules and matched no module (so the root unit would hold the whole
  // model, e.g. a misspelt type=DecoderLayr) makes fully_shard fail with the text of
  // Plan::unmatched_warning() (the model's type names and top-level paths); false: it warns
  // (TORCH_WARN, once) and shards the root alone. The deliberate one-unit plan, the policy
  // 'none', is accepted either way.
  bool strict_plan = true;

  // Deferred initialization (fsdp/deferred_init.h), used when the model's parameters are on
  // the meta device: fully_shard materialises one unit at a time and calls `init` for each of
  // its parameters (and, first, for each meta buffer). Empty (default): each tensor's nearest
  // enclosing module that implements flatshard::InitializesItself (the GPT and LLaMA models
  // do) initialises it, so the sharded values equal the eagerly built model's. Ignored for a
  // model whose parameters hold values.
  TensorInit init;

  // Loading instead of initialising (Note [Loading into shards]): when set, the parameters of
  // a meta-built model take their values from `load` (each rank reads only its shard's
  // ranges); buffers still come from `init` / InitializesItself as above. fully_shard throws
  // if it is set for a model whose parameters hold values. Default: unset (initialise).
  ParamLoader load;
};

// Queues a device sleep of `cycles` on `stream` (CUDA); a no-op on CPU.
void device_sleep(const c10::Stream& stream, int64_t cycles);

}  // namespace flatshard
