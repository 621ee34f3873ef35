// flatshard/planner/cost_model.h — predicted peak memory and step time of an explained plan, for a
// transformer of known shape, a batch and a machine profile (planner/machine_profile.h).
//
//   Explanation e = explain(*model, plan, world, options);
//   CostPrediction p = predict_cost(e, shape, {batch, seq}, profile);
//   p.peak_bytes, p.step_ms, p.exposed_comm_ms, p.host_ms, p.host_bound
//
// explain() (planner/explain.h) knows the plan's bytes and collectives but not the model's compute
// or activations; this adds both, from a TransformerShape (planner/model_shape.h: plain data —
// the planner knows no model family and no module name; a family of models/ or a checkpoint's
// description fills it in).
//
// Memory model (per rank, live bytes; what flatshard-bench's "peak MiB" measures):
//   persistent  fp32 master shards + AdamW's two moments (trainable part) + NO_SHARD compute
//               copies. The fp32 master gradients are not persistent: the optimizer's
//               zero_grad sets them to none, and each unit's gradient is allocated when its
//               reduction lands in backward.
//   walked      the step as a sequence of points, units in execution order (root first, then by
//               the layer they belong to): forward of each unit, then backward in reverse. At
//               each point: gathered units (as explain's simulation: the current one, the next
//               `prefetch` ones, kept ones), the activations still saved, the master gradients
//               of units already reduced, the current unit's flat gradient and the previous
//               one's held reduction buffer, and the backward working set of one layer; after
//               each unit's backward, its reduction (flat gradient + the backend's staging,
//               MachineProfile::collective_staging). One rank without replicas has no flat
//               gradient and no collectives (Note [One-rank reduction]). Offloaded units:
//               the fp32 master uploaded to a device buffer before its cast at a gather (level
//               1: the first of the step; level 2: every one), the fp32 reduced shard on the
//               device until its copy to the host.
//   activations per layer and token: TransformerShape's per-token terms (planner/model_shape.h),
//               filled by the model's description — the closed forms of what autograd saves
//               live with the family that has them (models/gpt.h, models/llama.h). At the
//               loss: the logits (V e) and their fp32 copy (4 V, when e != 4) in forward, two
//               more fp32 [tokens, V] gradients at the start of backward.
//     A recompute unit that holds whole layers keeps only TransformerShape::recompute_keeps per
//     token and layer; its backward materialises all of its layers' activations again. Units
//     smaller than a layer (leaf granularity) save what the layer saves, recompute or not (the
//     ops between the leaves run outside any unit), less recomputed_leaf_savings. Everything is
//     multiplied by MachineProfile::activation_scale.
//   peak_bytes = the walk's maximum x (1 + allocator_slack).
//
// Step-time model (ms, per rank):
//   compute     tokens x FLOPs / compute_tflops, FLOPs = 6 N_matmul + L x
//               attention_flops_per_token_per_position x seq per token (the families' closed
//               form at this seq), plus a second forward (2 N_layer + 4 d seq) of
//               every layer a recompute unit holds (a recompute unit smaller than a layer: its
//               share of the layer's forward, the layer's FLOPs split evenly over its units).
//   passes      per-parameter memory passes at memory_gbps: the fp32 -> compute-dtype cast
//               before each all-gather ((4 + e) B per shard element, when e != 4), the gradient
//               upcast ((e + 4) B, when the reduce dtype is not fp32), and AdamW
//               (optimizer_bytes_per_param per trainable shard element, on the device unless the
//               unit is offloaded).
//   collectives latency + bus bytes / bandwidth of the group each runs over (planner/
//               topology.h: the shard group's all-gathers and reductions, the replicate group's
//               all-reduce, each on its own links: NVLink inside a node, the NICs across);
//               world 1: device copies
//               (2 x bytes at memory_gbps). Overlap: a unit's forward all-gather is issued
//               `forward_prefetch` units ahead and hides behind their forward compute; a
//               backward all-gather behind the backward compute of the `backward_prefetch` units
//               after it; a reduction behind the next unit's backward. exposed = what is left.
//   host        host_ms_per_step x layers / host_reference_layers + units x
//               (host_us_per_unit_forward + host_us_per_unit_backward) (machine_profile.h says
//               where they come from); a recompute unit runs its forward hooks again, and a
//               layer it holds whole issues its forward again (the forward share of the layer's
//               host time, taken as the hooks' forward / (forward + backward) ratio).
//   offload     offload_terms() below. Copies ride the collective pipeline above: a unit's
//               uploads (h2d_gbps) lengthen its gathers on the all-gather stream (level 1: the
//               first forward gather; level 2: every gather), its gradient's download (d2h_gbps)
//               its reduction on the reduce stream; what that adds to the exposed time is the
//               offload's (at one rank, where gathers are copies, the uploads alone). Inside
//               the walk's compute spans a copy runs at copy_rate_beside_compute of its rate
//               (the compute keeps its own). Synchronous
//               collectives (comm_overlap 0): all copies beyond the compute time are exposed. The
//               CPU optimizer (cpu_optimizer_params_per_s) overlaps nothing.
//   tensor parallelism (e.mesh.tp() T > 1, docs/tensor-parallel.md): the workload is the tp
//               group's (batch sequences per data-parallel rank, each of its T ranks computing
//               on all of them); a layer's matmul and attention FLOPs are divided by T (the head
//               is not: the default plans keep it whole), the persistent and gathered bytes are
//               explain's TP-local ones, activations are NOT divided (the replicated norms and
//               residuals are saved whole, the split parts counted whole too: an upper bound).
//               The TP all-reduces (explain's TpCollectives: 2 forward + 2 backward per GPT
//               layer of tokens x d_model) cost latency + 2(T-1)/T x bytes / bandwidth each on
//               the tp group's links (T consecutive ranks; the shard group is then S ranks T
//               apart, replicas S x T apart, planner/topology.h) and are all exposed: they sit
//               between a layer's matmuls on the compute stream (tp_comm_ms).
//   gpu_ms = compute + passes + optimizer + exposed + offload; step_ms = the
//   host_overlap_norm-norm of (gpu_ms, host_ms) (machine_profile.h: imperfect overlap; the max
//   for a large norm); host_bound when host_ms > gpu_ms.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "planner/model_shape.h"

namespace flatshard {

struct Workload {
  int64_t batch = 1;  // sequences per rank per step
  int64_t seq = 1;    // tokens per sequence
  int64_t tokens() const { return batch * seq; }
};

// Offload (Note [CPU offload], flat_param/offload.h; a unit's level is UnitExplanation::offload,
// as resolve.h gives it): level 1 keeps the fp32 master, its gradient and AdamW state in host
// memory and a compute-dtype shard on the device; level 2 keeps nothing persistent there.
struct OffloadTerms {
  int64_t device_bytes_saved = 0;  // master + AdamW state no longer on the device
  int64_t resident_bytes = 0;      // level 1: the compute-dtype shard kept on the device
  int64_t host_bytes = 0;          // master + gradient + AdamW state in host memory
  int64_t h2d_bytes = 0;           // per step: fp32 master uploads (level 2: before each gather)
  int64_t d2h_bytes = 0;           // per step: the fp32 reduced gradient shard
  int64_t cpu_optimizer_params = 0;
};
// One unit's offload terms at `level` (0: none). Level 1: one H2D of the fp32 master shard
// (4 B per shard element) before the first gather, one D2H of the gradient shard; level 2: an
// H2D before every gather (forward, and backward when the unit reshards after forward).
OffloadTerms offload_terms(const UnitExplanation& u, int level, c10::ScalarType param_dtype);

struct CostPrediction {
  // Memory (bytes per rank).
  int64_t persistent_bytes = 0;  // masters + AdamW + NO_SHARD copies (+ offload residents)
  int64_t activation_bytes = 0;  // activations alive at the peak
  int64_t gradient_bytes = 0;    // master gradients allocated at the peak
  int64_t transient_bytes = 0;   // gathered buffers, flat gradients, backward working set
  int64_t peak_bytes = 0;        // the walk's maximum, slack included
  std::string peak_at;           // "forward of blocks.3", "backward of <root>", ...
  int64_t host_bytes = 0;        // offloaded state in host memory
  // Time (ms per step per rank).
  double compute_ms = 0, passes_ms = 0, optimizer_ms = 0, comm_ms = 0, exposed_comm_ms = 0,
         exposed_all_gather_ms = 0, host_ms = 0, offload_ms = 0, recompute_ms = 0, gpu_ms = 0,
         step_ms = 0;
  double cpu_optimizer_ms = 0;  // the CPU optimizer of offloaded units (a part of offload_ms)
  // Tensor parallelism: the all-reduces over the tp group, all exposed (a part of comm_ms and
  // exposed_comm_ms; see the contract).
  double tp_comm_ms = 0;
  bool host_bound = false;
  int64_t replicated_bytes = 0;  // NO_SHARD units' master + gradient + AdamW state per rank
  // Throughput: the model's FLOPs of one step on this rank (forward + backward, recompute left
  // out: what MFU counts, as the compute term's 6 N + attention per token) and its tokens.
  // Under tensor parallelism `tokens` is each GPU's share of its tp group's (workload / tp).
  double model_flops = 0, tokens = 0;
  double tokens_per_s() const;              // per rank (GPU): tokens / step
  double mfu(double peak_tflops) const;     // model FLOPs / step / peak; 0 if the peak is unknown
  // "predicted throughput: N tokens/s per GPU, MFU x% of <peak> TFLOP/s (<F> GFLOP per token)";
  // without the profile's peak_tflops, MFU is said to be unknown.
  std::string throughput(const MachineProfile& profile) const;

  std::string to_string() const;  // a few lines: memory breakdown, time breakdown
};

// Each unit is costed at its own offload level (UnitExplanation::offload, from the plan and
// ShardingOptions::offload), or at `offload_level` where that is higher (0: as explained). Throws
// c10::Error for a workload with batch or seq < 1, or a shape whose sizes are not positive (naming
// the values).
CostPrediction predict_cost(const Explanation& e, const TransformerShape& shape,
                            const Workload& workload, const MachineProfile& profile,
                            int offload_level = 0);

}  // namespace flatshard
