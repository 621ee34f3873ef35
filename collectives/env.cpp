#include "collectives/env.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

namespace flatshard {
namespace env {

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = {
      {kTimeoutMs, "600000",
       "collective timeout (ms) of communicators created from the environment"},
      {kStoreTimeoutMs, "300000", "rendezvous store timeout (ms): connect and key lookups"},
      {kNcclWatchdog, "1",
       "1: event after each NCCL collective + watchdog thread enforcing the timeout; 0: off"},
      {kWatchdogPollMs, "100", "watchdog poll period (ms)"},
      {kNcclTerminateOnError, "0",
       "1: terminate the process (exit 70) after the watchdog logs an error; 0: abort the NCCL "
       "communicators and make the next call throw"},
      {kNcclEagerConnect, "1",
       "1: set NCCL_RUNTIME_CONNECT=0 (unless set) so NCCL connects peers at communicator "
       "creation, never inside a collective launch"},
      {kDebug, "0",
       "1: before each unit's first collective per pass, check all ranks enter the same unit "
       "(one extra collective + host sync each); fill the padding of gathered flat parameters "
       "with NaN"},
      {kUpcastKernel, "1",
       "1: flatshard's vectorized bf16 -> fp32 kernel for reduced gradient shards (when built "
       "with nvcc); 0: ATen's conversion"},
      {kGroupedGradCopy, "1",
       "1: one grouped launch per unit copies its parameters' gradients into the flat (or, at "
       "one rank, master) gradient; 0: one launch per parameter"},
      {kStepComputeCopy, "1",
       "1: an attached FusedAdamW writes the compute-dtype copies units keep on the device in "
       "its step; 0: their next gather recasts the master"},
      {kAdamwKernel, "1",
       "1: that step is flatshard's one-pass CUDA kernel; 0: ATen's fused AdamW, then a cast"},
      {kPreBackwardHook, "1",
       "1: a unit's pre-backward runs as a pre-hook on its outputs' autograd nodes; 0: through "
       "an identity autograd node per unit call"},
      {kOffloadStepThreads, "0",
       "intra-op threads of flatshard's CPU optimizer-step thread (offload_step backward or "
       "delayed); 0: ATen's default (one per core)"},
      {kOffloadHostCopy, "0",
       "1: with offload_step backward or delayed, gradients come down in the reduce dtype and "
       "the CPU step writes the compute-dtype copy that goes up (half the PCIe bytes, more "
       "host time); 0: the fp32 host path"},
      {kTrace, "",
       "path of each rank's Chrome/Perfetto trace (\"{rank}\" or .rank<R> per rank; \"nvtx\": "
       "NVTX ranges only); unset: no trace unless TraceOptions::path is set"},
      {kTraceSteps, "64", "steps recorded with FLATSHARD_TRACE, from the first"},
  };
  return table;
}

std::string get(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

int64_t get_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const std::string v = get(name);
  if (v.empty()) return fallback;
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  // errno: too large for long long (strtoll saturates); the value then is out of range too.
  const bool parsed = end != v.c_str() && *end == '\0';
  TORCH_CHECK(parsed, "environment variable ", name, "='", v,
              "' is not an integer: expected an integer in [", lo, ", ", hi, "]");
  TORCH_CHECK(errno == 0 && x >= lo && x <= hi, "environment variable ", name, "='", v,
              "' is out of range: expected an integer in [", lo, ", ", hi, "]");
  return x;
}

bool get_bool(const char* name, bool fallback) {
  std::string v = get(name);
  if (v.empty()) return fallback;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  TORCH_CHECK(false, "environment variable ", name, "='", get(name),
              "' is not a boolean (use 0/1, true/false, yes/no, on/off)");
}

std::chrono::milliseconds timeout() {
  return std::chrono::milliseconds(get_int(kTimeoutMs, 600000, 1, int64_t{1} << 40));
}
std::chrono::milliseconds store_timeout() {
  return std::chrono::milliseconds(get_int(kStoreTimeoutMs, 300000, 1, int64_t{1} << 40));
}
bool nccl_watchdog() { return get_bool(kNcclWatchdog, true); }
std::chrono::milliseconds watchdog_poll() {
  return std::chrono::milliseconds(get_int(kWatchdogPollMs, 100, 1, 60000));
}
bool nccl_terminate_on_error() { return get_bool(kNcclTerminateOnError, false); }
bool nccl_eager_connect() { return get_bool(kNcclEagerConnect, true); }
bool debug() { return get_bool(kDebug, false); }
bool upcast_kernel() { return get_bool(kUpcastKernel, true); }
bool grouped_grad_copy() { return get_bool(kGroupedGradCopy, true); }
bool step_compute_copy() { return get_bool(kStepComputeCopy, true); }
bool adamw_kernel() { return get_bool(kAdamwKernel, true); }
bool range_copy_kernel() { return get_bool(kRangeCopyKernel, true); }
bool pre_backward_hook() { return get_bool(kPreBackwardHook, true); }
int offload_step_threads() { return static_cast<int>(get_int(kOffloadStepThreads, 0, 0, 4096)); }
bool offload_host_copy() { return get_bool(kOffloadHostCopy, false); }
std::string trace_path() { return get(kTrace); }
int trace_steps() { return static_cast<int>(get_int(kTraceSteps, 64, 0, 1000000)); }

void check_all() {
  timeout();
  store_timeout();
  nccl_watchdog();
  watchdog_poll();
  nccl_terminate_on_error();
  nccl_eager_connect();
  debug();
  upcast_kernel();
  grouped_grad_copy();
  step_compute_copy();
  adamw_kernel();
  range_copy_kernel();
  pre_backward_hook();
  offload_step_threads();
  offload_host_copy();
  trace_steps();
}

}  // namespace env
}  // namespace flatshard
