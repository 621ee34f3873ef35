// flatshard/planner/machine_profile.h — the measured numbers of one machine that the step-time and
// memory model (planner/cost_model.h) and the plan advisor (planner/advisor.h) read.
//
//   MachineProfile p = load_profile("machine.json");   // or MachineProfile::defaults()
//   std::cout << p.to_json();                          // what save_profile() writes
//
// Contract
// - A profile is a flat JSON object (support/json.h's strict reader: duplicate keys, NaN,
//   comments are errors) with "format": "flatshard-machine-profile", "version": 1, an optional
//   "source" string (where and how it was measured) and the numeric keys below. Keys left out
//   keep their default (so a profile may state only what it measured). Unknown keys, wrong
//   types, NaN or infinite values, and values outside the key's physical bounds (stated next to
//   each key below, [lo, hi]) are errors naming the key, the value, the bounds and the file: the
//   file is untrusted input, and a value inside double's range but outside any machine's
//   (compute_tflops 1e-308, host_overlap_norm 0.001, allocator_slack 1e9) would turn every
//   prediction into a 60-digit or infinite number. The bounds hold every default and every
//   profile flatshard-bench writes (CPU runs of the tiny GPT on a loaded host included: rates far
//   below any GPU's). The file is read through support/input_file.h: a regular file (a FIFO is
//   refused, not waited on) of at most 1 MiB.
// - "source" is any string; control bytes in it (ESC, BEL, newlines) are kept as "\xNN" text
//   (support/input_file.h's printable_escape), since tools print it to a terminal.
// - "sources" (optional): an object from numeric keys to strings saying where each number comes
//   from, each starting "spec:", "measured:" or "estimate:" (the named profiles, planner/
//   profiles/*.json, state one per number). Unknown keys and other prefixes are errors.
// - check_profile() applies the bounds to a profile built in code; save_profile() calls it, so
//   flatshard-bench never writes a profile that explain would refuse.
// - Times: t(collective) = latency + bytes / bandwidth, with bytes as nccl-tests' bus bytes of
//   this rank (all-gather and reduce-scatter: bytes sent x (W-1)/W; all-reduce: 2 (W-1)/W x
//   bytes). World 1 collectives are device copies (Note [One-rank NCCL]): memory_gbps. With the
//   topology keys, latency and bandwidth are those of the group's links (planner/topology.h).
// - defaults(): every number says in its comment where it comes from (benchmarks/RESULTS.md,
//   docs/design.md) or that it is a stated guess; source is "defaults".
// - flatshard-bench --write-profile FILE writes one measured on the machine the bench runs on
//   (benchmarks/bench_profile.h says which numbers it measures and which it keeps).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace flatshard {

struct MachineProfile {
  std::string source = "defaults";

  // Collectives: fixed cost per call and bus bandwidth. 2x H200 NVLink, NCCL 2.28
  // (benchmarks/RESULTS.md "Collectives (2x H200)", docs/design.md "Numbers to design against"):
  // an all-gather of 1 MiB takes 52 us and of 16 MiB 56 us (latency ~50 us), 1 GiB 2.0 ms (bus
  // ~270 GB/s); reduce-scatter fp32 ~280 GB/s. All-reduce: the same latency, its bus bandwidth
  // taken as reduce-scatter's (nccl-tests' busbw of a ring all-reduce is close to RS's).
  // Bounds: latencies [0, 1e6] us (0: the CPU threads backend, bandwidth only); bandwidths
  // [1e-4, 1e5] GB/s (the CPU backend measured on a loaded host: well under 1 GB/s).
  double all_gather_latency_us = 50;       // [0, 1e6] us
  double all_gather_gbps = 270;            // [1e-4, 1e5] GB/s
  double reduce_scatter_latency_us = 50;   // [0, 1e6] us
  double reduce_scatter_gbps = 280;        // [1e-4, 1e5] GB/s
  double all_reduce_latency_us = 50;       // [0, 1e6] us
  double all_reduce_gbps = 280;            // [1e-4, 1e5] GB/s

  // Host issue time. host_ms_per_step: the model's own kernel launches, loss and optimizer call
  // with no sharding hooks — flatshard-bench `local` on 1x H200: host 15.0-21.2 ms per 1B GPT
  // step, about equal at 1 and 4 sequences (RESULTS.md, 2026-12-01); 15 ms is taken, for its
  // 16 layers (cost_model.h scales it by layers / host_reference_layers).
  // host_us_per_unit_{forward,backward}: hooks, casts, collectives and events of one unit per
  // pass. RESULTS.md "(leaf host ms - layer host
  // ms) / 83 units" gave 0.2-0.8 ms per unit per step with a 2x run-to-run spread; the 12:33 run
  // (leaf 30.7 ms, layer 30.6 / 20.3 ms, local 15.2 ms, 18 layer units) gives ~0.15 ms per unit
  // per step: 60 us forward + 90 us backward is taken.
  double host_ms_per_step = 15;            // [0, 1e6] ms
  // host_ms_per_step was measured with this many layers.
  double host_reference_layers = 16;       // [1, 1e6]
  double host_us_per_unit_forward = 60;    // [0, 1e6] us
  double host_us_per_unit_backward = 90;   // [0, 1e6] us
  // Host and device overlap imperfectly (the device idles while the host issues the step's
  // first kernels, and a host-heavy unit leaves gaps): step = (gpu^p + host^p)^(1/p). p = 3
  // reproduces the 1x H200 1B-GPT runs of RESULTS.md 2026-12-01 12:33 within 2% (layer 4 seq:
  // device 95.4 ms, host 30.6 -> 96.4 vs 95.2 measured; layer 1 seq: 33.2, 20.3 -> 35.6 vs
  // 36.0; leaf 1 seq: 33.5, 30.7 -> 40.5 vs 39.9), a fit to those three rows, not a law. Large
  // p: the plain max.
  double host_overlap_norm = 3;            // [1, 64]: 1 a sum (CPU), 64 as good as the max

  // Achieved matmul rate of forward + backward in the compute dtype: flatshard-bench `local`,
  // 1B GPT, 4 seq, 1x H200: ~83 ms fwd+bwd for 8192 tokens x 6.04 GFLOP/token = 596 TFLOP/s
  // (60% of 989 dense bf16; RESULTS.md 2026-12-01). fp32 runs (CPU) must measure their own.
  // Bounds [1e-6, 1e5] TFLOP/s: a tiny model on a busy CPU core up to a rack.
  double compute_tflops = 596;             // [1e-6, 1e5] TFLOP/s
  // Per-parameter memory passes (fp32->bf16 casts, bf16->fp32 gradient upcast, AdamW): "~4 TB/s
  // these kernels reach" (RESULTS.md, breakdown of per-layer - local). AdamW moves
  // optimizer_bytes_per_param per fp32 master element (reads p, g, m, v; writes p, m, v).
  double memory_gbps = 4000;               // [1e-4, 1e5] GB/s
  double optimizer_bytes_per_param = 28;   // [0, 1024] bytes

  // Offload (CPU offload levels 1/2, Note [CPU offload]): pinned host<->device copies and the
  // CPU optimizer, 1x H200 (benchmarks/RESULTS.md "CPU offload", 2026-12-01 14:26): pinned
  // 1 GiB copies H2D 55.3 GB/s, D2H 55.2 GB/s (tools/pcie_probe.py); ATen's fused CPU AdamW
  // over the 1B GPT's 0.944 G fp32 parameters in 215.4 ms = 4.4e9 parameters/s (the host's
  // ~130 GB/s). An unfused CPU AdamW is several times slower: measure it if that is what runs.
  double h2d_gbps = 55;                    // [1e-4, 1e5] GB/s
  double d2h_gbps = 55;                    // [1e-4, 1e5] GB/s
  double cpu_optimizer_params_per_s = 4.4e9;  // [1e3, 1e13] parameters/s
  // The share of a copy's rate it keeps while compute kernels run beside it (1: none lost;
  // cost_model.h's pipeline walk slows the copies inside compute spans, not the compute: on the
  // H200 the 1B GPT's offloaded forward + backward took as long with recompute as without, the
  // LLaMA's grew by the recompute). flatshard-bench --write-profile fits it from the calibration
  // plan at offload 1, after the copy rates from the one-unit plan (nothing overlaps there),
  // when both ran (bench_profile.h). Replaces offload_overlap (a share of the hidden copy time
  // exposed anyway), which could not say why recompute hid under the GPT's copies.
  double copy_rate_beside_compute = 1.0;   // [1e-3, 1] (the bench's bisection range)

  // Activation memory: the analytic bytes per token of cost_model.h multiplied by this factor
  // (1: the closed form as is; a profile written by flatshard-bench stores measured / predicted
  // of its calibration run). Allocator slack: the fraction of the predicted peak added for the
  // caching allocator's rounding and fragmentation (0: the predicted peak is of live bytes, what
  // flatshard-bench's peak column measures).
  double activation_scale = 1.0;           // [1e-2, 1e2]
  double allocator_slack = 0.0;            // [0, 10]: at most 11x the live bytes
  // Full-size staging copies a backend allocates per collective: NCCL gathers and reduces in
  // place (0); the CPU threads backend (collectives/thread_communicator.cpp) builds each
  // all-gather's result with at::cat and each reduction's sum in a new tensor (1).
  double collective_staging = 0.0;         // [0, 16] copies
  // 1: collectives run on their own streams beside compute (NCCL), overlapped as cost_model.h
  // says; 0: they are synchronous on the issuing thread (the CPU threads backend), all exposed.
  double comm_overlap = 1.0;               // 0 or 1

  // Topology (planner/topology.h says how a group's collective is costed from these). The
  // collective keys above are the numbers inside one node (NVLink / NVSwitch); these add the
  // nodes. gpus_per_node 0: no topology, every group inside one node (profiles written before
  // these keys, and the CPU backend). flatshard-explain --gpus-per-node overrides it.
  double gpus_per_node = 0;                // [0, 1e6], a whole number
  // Latency of each ring step beyond the 2-rank ring the *_latency_us keys were measured on:
  // inside a node (NVLink) and across nodes (NIC + switch). Defaults: 0 inside a node (the
  // fixed cost alone, as before these keys); 9.6 us across nodes, NCCL's own model of a ring
  // step over the network (src/graph/tuning.cc hwLat, Ring/Simple; an estimate, not measured
  // here). The named profiles (planner/profiles/) set both.
  double intra_node_hop_latency_us = 0;    // [0, 1e6] us
  double inter_node_hop_latency_us = 9.6;  // [0, 1e6] us
  // Network bandwidth per GPU, one NIC each (rail-aligned): ConnectX-7 at 400 Gb/s = 50 GB/s
  // per direction (NVIDIA spec; nccl-tests reach less than the line rate).
  double inter_node_gbps = 50;             // [1e-4, 1e5] GB/s
  // For tokens/s and MFU, and --suggest's default budget: the device's peak dense matmul rate
  // in the compute dtype (spec sheet) and its memory. 0: unknown (MFU and the default budget are
  // not given).
  double peak_tflops = 0;                  // [0, 1e5] TFLOP/s
  double device_memory_gb = 0;             // [0, 1e6] GB (1e9 bytes)

  // Where each number comes from, by key: "spec: ...", "measured: ..." or "estimate: ..."
  // (the JSON object "sources"; keys must be numeric keys of the profile). The named profiles
  // carry one per number; flatshard-bench's profiles have none (their "source" says the run).
  std::map<std::string, std::string> sources;

  static MachineProfile defaults() { return MachineProfile{}; }

  // The JSON object save_profile() writes (every key, in the order above).
  std::string to_json() const;
  // One line per number, for flatshard-explain's output.
  std::string to_string() const;
};

// The bound of every latency (us), for options that override one (e.g. a tool's
// --collective-latency-us): the same as the profile's.
inline constexpr double kMaxLatencyUs = 1e6;

// Parses a profile from JSON text; `origin` (e.g. the path) starts every error message.
MachineProfile parse_profile(const std::string& text, const std::string& origin);
// Reads and parses a file: a regular file of at most 1 MiB (missing, unreadable, not regular or
// larger files are errors naming the path).
MachineProfile load_profile(const std::string& path);
// The profiles of published machines shipped with flatshard (planner/profiles/*.json, compiled
// in): their names ("h100-ib400", ...), sorted.
std::vector<std::string> named_profiles();
// A named profile when `name_or_path` is one of named_profiles(), else load_profile() of the
// path (write ./h100-ib400 for a file of that name). Unknown names that are not files: the error
// lists the names.
MachineProfile load_profile_named(const std::string& name_or_path);
// Throws c10::Error "<origin>: '<key>' = <value> is outside its bounds [lo, hi] ..." for the
// first number outside the bounds above (NaN included).
void check_profile(const MachineProfile& profile, const std::string& origin);
// check_profile(), then writes to_json() to `path` (replacing it); throws c10::Error naming the
// path on failure.
void save_profile(const MachineProfile& profile, const std::string& path);

}  // namespace flatshard
