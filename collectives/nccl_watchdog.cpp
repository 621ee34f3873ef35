// NcclCommunicator, part 2: waiting for NCCL, the watchdog, failing, aborting, tearing down.
//
// Note [Watchdog]
// An event is recorded right after each collective. A watchdog thread polls those events every
// watchdog_poll: completed ones return their event to the pool; one still pending `timeout`
// after it was issued fails the communicator. Failing = record the first error (every later
// call throws it), log it, then either terminate the process (terminate_on_error) or
// ncclCommAbort both lanes: NCCL kernels poll an abort flag, so a kernel waiting for a peer
// that never comes exits, and the streams (and host threads synchronising on them) move on.
// Aborting takes the lane locks, so a comm is never freed under a launch; if a lane stays held
// for kAbortLockWait, the process terminates rather than hang. Both lanes are aborted at once
// (Note [Abort order]). The watchdog also reports NCCL's
// asynchronous errors (ncclCommGetAsyncError).
// The host side: NCCL >= 2.22 connects a communicator's peers the first time it uses an
// algorithm, inside that collective's launch, and a blocking communicator then waits there for
// the peers without bound (seen: a rank skipping the first collective hung the other forever).
// Nonblocking communicators would make that wait pollable but cost ~100 us of host time per
// collective (measured, NCCL 2.28.9), so instead NCCL_RUNTIME_CONNECT=0 (eager_connect) moves
// all connecting into create(), where every rank participates. As a last resort the watchdog
// also watches launches in progress (inflight_): one inside NCCL for longer than the timeout
// cannot be aborted safely (the comm is in use), so the process terminates with a clear error.
//
// Note [Communicator teardown]
// ncclCommDestroy and ncclCommAbort call into CUDA. A communicator owned by a static or a global
// is destroyed after the CUDA runtime has begun unloading; calling NCCL then crashes or hangs.
// So: shutdown() — explicit, while CUDA is certainly alive, on every rank — finalizes and
// destroys; the destructor only aborts (local: never waits for peers, unlike finalize) and only
// when the CUDA runtime still answers; otherwise it leaks the handles on purpose (the OS
// reclaims them at exit).
#include "collectives/nccl_communicator.h"

#include "collectives/nccl_check.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace flatshard {

namespace {

constexpr int kExitOnError = 70;  // EX_SOFTWARE; FLATSHARD_NCCL_TERMINATE_ON_ERROR=1
// How long an abort waits for a thread that holds a lane (inside a launch or an open group), and
// for ncclCommAbort itself (Note [Abort order]).
constexpr std::chrono::seconds kAbortLockWait{10};

void log_line(const std::string& s) {
  std::fprintf(stderr, "[flatshard] %s\n", s.c_str());
  std::fflush(stderr);
}

// False once the CUDA runtime is unloading (static destruction at exit) or unusable.
bool cuda_runtime_alive() {
  int dev = -1;
  if (cudaGetDevice(&dev) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

std::string env_or_unset(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "<unset>";
}

std::string last_nccl_error(ncclComm* comm) {
  const char* last = ncclGetLastError(comm);
  return (last && *last) ? last : "(none)";
}

}  // namespace

// =============================================================================================
// The watchdog
std::string NcclCommunicator::describe(const Work& w,
                                       std::chrono::steady_clock::time_point now) const {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - w.issued).count();
  return c10::str(describe_op(w.seq, w.op, w.lane, w.dtype, w.numel),
                  w.group_ops > 1 ? c10::str(" (first of a fused group of ", w.group_ops, ")") : "",
                  " issued ", ms, " ms ago");
}

void NcclCommunicator::watchdog_loop() {
  // A thread's first CUDA call would otherwise bind it to device 0 (and create a context there).
  if (cudaSetDevice(device_.index()) != cudaSuccess) {
    (void)cudaGetLastError();
    log_line(c10::str("rank ", rank_, ": watchdog cannot select ", device_,
                      "; collective timeouts are NOT enforced on the device"));
    return;
  }
  std::unique_lock<std::mutex> lock(wd_mu_);
  while (!stop_) {
    wd_cv_.wait_for(lock, options_.watchdog_poll, [this] { return stop_; });
    if (stop_) break;
    lock.unlock();
    poll_once();
    lock.lock();
  }
}

void NcclCommunicator::poll_once() {
  if (failed()) return;  // nothing left to watch
  const auto now = std::chrono::steady_clock::now();
  std::string problem;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    size_t keep = 0;
    bool unloading = false;  // process exit in progress: CUDA is going away, nothing to enforce
    for (size_t i = 0; i < work_.size(); ++i) {
      Work& w = work_[i];
      const cudaError_t q = unloading ? cudaErrorNotReady : ready(cudaEventQuery(w.done));
      if (q == cudaSuccess) {
        free_events_.push_back(w.done);
        continue;
      }
      if (q == cudaErrorCudartUnloading || q == cudaErrorInitializationError) {
        (void)cudaGetLastError();
        unloading = true;
      } else if (unloading) {
        // keep the rest untouched
      } else if (q != cudaErrorNotReady && problem.empty()) {
        (void)cudaGetLastError();
        problem = c10::str("flatshard NCCL watchdog: rank ", rank_,
                           ": CUDA error while waiting for ", describe(w, now), ": ",
                           cudaGetErrorString(q));
      } else if (problem.empty() && now - w.issued > options_.timeout) {
        problem = c10::str(
            "flatshard NCCL watchdog: rank ", rank_, ": ", describe(w, now),
            " timed out: not complete within ", options_.timeout.count(),
            " ms; aborting the NCCL communicators. Usual causes: a rank skipped or reordered a "
            "collective, a rank died or is stuck, or FLATSHARD_TIMEOUT_MS is too short");
      }
      work_[keep++] = w;
    }
    work_.resize(keep);
    if (unloading) return;
  }
  for (int i = 0; i < 2; ++i) {  // a launch stuck inside NCCL on the host: last resort
    const int64_t since = inflight_[i].since_ns.load(std::memory_order_acquire);
    if (since == 0) continue;
    const auto stuck = now - std::chrono::steady_clock::time_point(
                                 std::chrono::steady_clock::duration(since));
    if (stuck <= options_.timeout) continue;
    log_line(c10::str(
        "ERROR flatshard NCCL watchdog: rank ", rank_, ": the launch of collective #",
        inflight_[i].seq.load(), " ", op_name(static_cast<Op>(inflight_[i].op.load())),
        " on lane ", lane_name(static_cast<Lane>(i)), " has been inside NCCL on the host for ",
        std::chrono::duration_cast<std::chrono::milliseconds>(stuck).count(),
        " ms (timeout ", options_.timeout.count(), " ms), presumably waiting for a peer "
        "(NCCL_RUNTIME_CONNECT=", env_or_unset("NCCL_RUNTIME_CONNECT"),
        "); an NCCL call in progress cannot be aborted safely: terminating the process"));
    std::_Exit(kExitOnError);
  }
  for (int i = 0; i < 2 && problem.empty(); ++i) {
    LaneComm& lc = lanes_[i];
    std::unique_lock<std::recursive_timed_mutex> lock(lc.mu, std::try_to_lock);
    if (!lock.owns_lock() || lc.comm == nullptr) continue;  // busy: check next round
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(lc.comm, &state);
    if (r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress)
      problem = c10::str("flatshard NCCL watchdog: rank ", rank_, ": NCCL asynchronous error on ",
                         "lane ", lane_name(static_cast<Lane>(i)), " (NCCL ",
                         detail::nccl_version_string(), "): ", ncclGetErrorString(state),
                         "; last NCCL error: ", last_nccl_error(lc.comm));
  }
  if (!problem.empty()) fail(problem, /*is_error=*/true);
}

void NcclCommunicator::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lock(wd_mu_);
    stop_ = true;
  }
  wd_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

// =============================================================================================
// Failing
void NcclCommunicator::fail(const std::string& reason, bool is_error) {
  {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    error_ = reason;
    failed_.store(true, std::memory_order_release);
  }
  if (is_error) {
    log_line("ERROR " + reason);
    if (options_.terminate_on_error) {
      log_line(c10::str("rank ", rank_,
                        ": terminating the process (FLATSHARD_NCCL_TERMINATE_ON_ERROR=1)"));
      std::_Exit(kExitOnError);
    }
  }
  abort_comms();
}

// Note [Abort order]
// ncclCommAbort first raises its communicator's abort flag (its kernels then exit), then frees
// its resources, and freeing can wait for the whole device. Aborting the lanes one after the
// other therefore deadlocks when a kernel of the second lane is stuck: the first abort's free
// waits for a kernel that only the second abort would stop (seen: 2x H200, NCCL 2.28.9, a rank
// skipping a collective; the stream never drained and the process hung). So every lane is
// aborted at the same time, each on its own thread, and the wait for them is bounded: past
// kAbortLockWait the process terminates rather than hang.
void NcclCommunicator::abort_lanes_locked() {
  std::vector<ncclComm*> comms;
  for (auto& lc : lanes_) {
    if (lc.comm) comms.push_back(lc.comm);
    lc.comm = nullptr;
  }
  if (comms.empty() || !cuda_runtime_alive()) return;  // Note [Communicator teardown]
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    size_t count = 0;
  };
  auto done = std::make_shared<Done>();
  const int device = device_.index(), rank = rank_;
  for (ncclComm* comm : comms) {
    std::thread([comm, done, device, rank] {
      // A new thread's first CUDA call would otherwise bind it to device 0.
      if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
      const ncclResult_t r = ncclCommAbort(comm);
      if (r != ncclSuccess)
        log_line(c10::str("rank ", rank, ": ncclCommAbort returned ", ncclGetErrorString(r)));
      std::lock_guard<std::mutex> lock(done->mu);
      ++done->count;
      done->cv.notify_all();
    }).detach();
  }
  std::unique_lock<std::mutex> lock(done->mu);
  if (!done->cv.wait_for(lock, kAbortLockWait, [&] { return done->count == comms.size(); })) {
    log_line(c10::str("ERROR rank ", rank_, ": ncclCommAbort did not return within ",
                      kAbortLockWait.count(),
                      " s (Note [Abort order]); terminating the process instead of hanging"));
    std::_Exit(kExitOnError);
  }
}

void NcclCommunicator::abort_comms() {
  // Lanes in index order, as group_start(); a thread that holds one (inside a launch or an open
  // group) for kAbortLockWait would keep us from ever aborting: terminate instead.
  std::unique_lock<std::recursive_timed_mutex> l0(lanes_[0].mu, std::defer_lock);
  std::unique_lock<std::recursive_timed_mutex> l1(lanes_[1].mu, std::defer_lock);
  for (auto* l : {&l0, &l1}) {
    if (!l->try_lock_for(kAbortLockWait)) {
      log_line(c10::str("ERROR rank ", rank_, ": cannot abort the NCCL communicators: a thread ",
                        "has held a lane for ", kAbortLockWait.count(),
                        " s (inside an NCCL launch or an open group); terminating the process "
                        "instead of hanging"));
      std::_Exit(kExitOnError);
    }
  }
  abort_lanes_locked();
}

void NcclCommunicator::abort(const std::string& reason) {
  fail(c10::str("rank ", rank_, ": aborted by the caller: ", reason), /*is_error=*/false);
}

int64_t NcclCommunicator::outstanding() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  return static_cast<int64_t>(work_.size());
}

// =============================================================================================
// Tearing down (Note [Communicator teardown])
void NcclCommunicator::destroy_events_locked() {
  for (const Work& w : work_) (void)cudaEventDestroy(w.done);
  for (cudaEvent_t ev : free_events_) (void)cudaEventDestroy(ev);
  work_.clear();
  free_events_.clear();
}

void NcclCommunicator::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  c10::cuda::CUDAGuard guard(device_);
  // 1. This rank's collectives must finish first: finalizing with work in flight would wait.
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  if (!failed() && !options_.watchdog) C10_CUDA_CHECK(cudaDeviceSynchronize());
  while (!failed()) {
    int64_t pending = 0;
    {
      std::lock_guard<std::mutex> lock(work_mu_);
      for (const Work& w : work_) pending += ready(cudaEventQuery(w.done)) == cudaErrorNotReady;
    }
    if (pending == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      fail(c10::str("rank ", rank_, ": shutdown: ", pending,
                    " collectives still not complete after the timeout of ",
                    options_.timeout.count(), " ms"),
           /*is_error=*/true);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  stop_watchdog();
  // 2. Finalize and destroy both lanes; aborted lanes are gone.
  std::string problem;
  {
    std::lock_guard<std::recursive_timed_mutex> l0(lanes_[0].mu);
    std::lock_guard<std::recursive_timed_mutex> l1(lanes_[1].mu);
    for (int i = 0; i < 2 && problem.empty(); ++i) {
      LaneComm& lc = lanes_[i];
      if (lc.comm == nullptr) continue;
      ncclResult_t r = ncclCommFinalize(lc.comm);  // blocking: flushes this rank's operations
      if (r == ncclSuccess) r = ncclCommDestroy(lc.comm);
      if (r == ncclSuccess) {
        lc.comm = nullptr;
        continue;
      }
      problem = c10::str("shutdown (rank ", rank_, "): finalizing lane ",
                         lane_name(static_cast<Lane>(i)), " failed (NCCL ",
                         detail::nccl_version_string(), "): ", ncclGetErrorString(r),
                         "; the communicators were aborted instead");
    }
    if (!problem.empty()) abort_lanes_locked();
  }
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    destroy_events_locked();
  }
  {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (!failed_.load(std::memory_order_relaxed)) {
      error_ = "the communicator was shut down (shutdown() was called)";
      failed_.store(true, std::memory_order_release);
    }
  }
  if (!problem.empty()) C10_THROW_ERROR(DistBackendError, problem);
}

NcclCommunicator::~NcclCommunicator() {
  try {
    stop_watchdog();
    const bool holds = lanes_[0].comm || lanes_[1].comm || !work_.empty() || !free_events_.empty();
    if (!holds) return;
    if (!cuda_runtime_alive()) return;  // Note [Communicator teardown]: leak on purpose
    c10::cuda::CUDAGuard guard(device_);
    {
      std::lock_guard<std::recursive_timed_mutex> l0(lanes_[0].mu);
      std::lock_guard<std::recursive_timed_mutex> l1(lanes_[1].mu);
      abort_lanes_locked();
    }
    std::lock_guard<std::mutex> lock(work_mu_);
    destroy_events_locked();
  } catch (...) {
    // Destructors never throw (communicator.h).
  }
}

}  // namespace flatshard
