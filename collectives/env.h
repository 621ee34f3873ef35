// flatshard/collectives/env.h — every FLATSHARD_* environment knob, declared in one place.
//
// Contract
// - Each knob has a name, a default and a meaning (the table `knobs()`; tools print it).
// - Readers validate: a value that does not parse, or is out of range, throws c10::Error naming
//   the variable, the value it holds and what is accepted ("environment variable
//   FLATSHARD_TIMEOUT_MS='0' is out of range: expected an integer in [1, 1099511627776]"). An
//   unset or empty variable yields the default. check_all() validates all of them at once.
// - Values are read when asked (no caching), so tests may setenv() before constructing objects.
//
// The launcher's own variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) are not knobs; they are read
// by collectives/launch_env.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace flatshard {
namespace env {

struct Knob {
  const char* name;
  const char* default_value;
  const char* meaning;
};

// FLATSHARD_TIMEOUT_MS (default 600000): collective timeout of communicators created from the
// environment; a collective not finished this long after it was issued fails on every rank.
inline constexpr const char* kTimeoutMs = "FLATSHARD_TIMEOUT_MS";
// FLATSHARD_STORE_TIMEOUT_MS (default 300000): how long rendezvous waits for the store (connect,
// key lookups such as the NCCL unique id).
inline constexpr const char* kStoreTimeoutMs = "FLATSHARD_STORE_TIMEOUT_MS";
// FLATSHARD_NCCL_WATCHDOG (default 1): 1 = record an event after each NCCL collective and let a
// watchdog thread enforce the timeout; 0 = no events, no watchdog (no timeout detection).
inline constexpr const char* kNcclWatchdog = "FLATSHARD_NCCL_WATCHDOG";
// FLATSHARD_WATCHDOG_POLL_MS (default 100): how often the watchdog polls outstanding events and
// NCCL's asynchronous errors. Detection latency is timeout + up to one poll period.
inline constexpr const char* kWatchdogPollMs = "FLATSHARD_WATCHDOG_POLL_MS";
// FLATSHARD_NCCL_TERMINATE_ON_ERROR (default 0): 1 = after the watchdog logs a timeout or an NCCL
// asynchronous error, terminate the process (exit code 70) instead of aborting the communicators
// and making the next call throw. Use it when user threads may sit in a device synchronisation
// that an abort cannot release (like PyTorch's TORCH_NCCL_ASYNC_ERROR_HANDLING).
inline constexpr const char* kNcclTerminateOnError = "FLATSHARD_NCCL_TERMINATE_ON_ERROR";

// FLATSHARD_NCCL_EAGER_CONNECT (default 1): 1 = unless NCCL_RUNTIME_CONNECT is already set, set
// it to 0 before the first NCCL communicator is created, so NCCL connects peers during
// communicator creation (all ranks present) instead of inside the first collective of each
// algorithm, where a host thread would wait for a peer without any bound (Note [Watchdog]).
inline constexpr const char* kNcclEagerConnect = "FLATSHARD_NCCL_EAGER_CONNECT";

// FLATSHARD_DEBUG (default 0): 1 = extra cross-rank checks that cost a collective and a host
// sync each: before each unit's first collective in a forward or backward pass, all ranks
// compare which unit they are entering, and fail naming both units if they differ (ranks
// calling units in different orders would otherwise mix unrelated parameters or hang); and the
// padding of every gathered flat parameter is filled with NaN, so a read of padding shows up.
inline constexpr const char* kDebug = "FLATSHARD_DEBUG";

// FLATSHARD_UPCAST_KERNEL (default 1): 0 = convert reduced bf16 gradient shards to fp32 with
// ATen instead of flatshard's vectorized kernel (flat_param/upcast.h), for A/B measurements.
inline constexpr const char* kUpcastKernel = "FLATSHARD_UPCAST_KERNEL";
// FLATSHARD_GROUPED_GRAD_COPY (default 1): 0 = copy a unit's parameter gradients into its flat
// gradient (or, at one rank, its master gradient) one launch per parameter instead of one
// grouped launch per unit (Note [Grouped gradient copies], flat_param/flat_param.cpp), for A/B
// measurements.
inline constexpr const char* kGroupedGradCopy = "FLATSHARD_GROUPED_GRAD_COPY";
// FLATSHARD_STEP_COMPUTE_COPY (default 1): 0 = an attached FusedAdamW does not write the
// compute-dtype copies units keep on the device (Note [Compute copy in the step],
// optim/fused_adamw.h); their next gather recasts the master instead. For A/B measurements.
inline constexpr const char* kStepComputeCopy = "FLATSHARD_STEP_COMPUTE_COPY";
// FLATSHARD_ADAMW_KERNEL (default 1): 0 = FusedAdamW's CUDA fp32 steps run ATen's fused AdamW
// (then a cast where a copy is written, an upcast for a bf16 / fp16 gradient) instead of
// flatshard's one-pass kernel (optim/adamw_kernel.cu), for A/B measurements.
inline constexpr const char* kAdamwKernel = "FLATSHARD_ADAMW_KERNEL";
// FLATSHARD_PRE_BACKWARD_HOOK (default 1): 0 = a unit's outputs go through a PreBackward
// autograd identity node per call instead of a pre-hook on the outputs' own nodes (Note
// [Pre-backward hook], fsdp/runtime.cpp), for A/B measurements.
inline constexpr const char* kPreBackwardHook = "FLATSHARD_PRE_BACKWARD_HOOK";
// FLATSHARD_RANGE_COPY_KERNEL (default 1): 0 = a unit's gather cast and gradient copies run as
// ATen ops on views (copy_, _foreach_copy_, _foreach_zero_) instead of flatshard's one-launch
// range copy (Note [Range copies], flat_param/range_copy_kernel.h), for A/B measurements.
inline constexpr const char* kRangeCopyKernel = "FLATSHARD_RANGE_COPY_KERNEL";

// FLATSHARD_OFFLOAD_STEP_THREADS (default 0): intra-op threads of the CPU optimizer steps
// flatshard runs on its own thread (offload_step = backward or delayed, fsdp/offload_step.h);
// 0 = ATen's default (one per core), N = N, leaving the other cores to the thread that issues
// the device's work.
inline constexpr const char* kOffloadStepThreads = "FLATSHARD_OFFLOAD_STEP_THREADS";
// FLATSHARD_OFFLOAD_HOST_COPY (default 0): 1 = with offload_step backward or delayed, Note [Host
// compute copy] (flat_param/collective_plan.h): gradients come down in the reduce dtype and the
// CPU step writes the compute-dtype copy that goes up, instead of the fp32 host path. Off by
// default: on the H200 host it made the step slower (the CPU step is the bound; measured in
// benchmarks/RESULTS.md "Offload").
inline constexpr const char* kOffloadHostCopy = "FLATSHARD_OFFLOAD_HOST_COPY";

// FLATSHARD_TRACE (default unset = off): where each rank writes its Chrome/Perfetto trace when
// ShardingOptions::trace.path is empty (fsdp/trace.h; same syntax: "{rank}", ".rank<R>", "nvtx").
inline constexpr const char* kTrace = "FLATSHARD_TRACE";
// FLATSHARD_TRACE_STEPS (default 64): steps recorded with FLATSHARD_TRACE, from the first.
inline constexpr const char* kTraceSteps = "FLATSHARD_TRACE_STEPS";

// The table of all knobs above (name, default, meaning), in declaration order.
const std::vector<Knob>& knobs();

// Reads every knob of the table with its typed accessor, so a bad value fails now, naming the
// variable, its value and what is accepted, whichever of them this program goes on to use (the
// threads backend on CPU reads fewer than NCCL does; a typo must not depend on the device).
// Tools call it after their --help has been handled, never before.
void check_all();

// Raw value, or "" when unset.
std::string get(const char* name);
// Integer in [lo, hi]; `fallback` when unset or empty.
int64_t get_int(const char* name, int64_t fallback, int64_t lo, int64_t hi);
// 0/1/true/false/yes/no/on/off (case-insensitive); `fallback` when unset or empty.
bool get_bool(const char* name, bool fallback);

// Typed accessors for the knobs above.
std::chrono::milliseconds timeout();
std::chrono::milliseconds store_timeout();
bool nccl_watchdog();
std::chrono::milliseconds watchdog_poll();
bool nccl_terminate_on_error();
bool nccl_eager_connect();
bool debug();
bool upcast_kernel();
bool grouped_grad_copy();
bool step_compute_copy();
bool adamw_kernel();
bool range_copy_kernel();
bool pre_backward_hook();
int offload_step_threads();  // 0: ATen's default
bool offload_host_copy();
std::string trace_path();  // "" when unset
int trace_steps();

}  // namespace env
}  // namespace flatshard
