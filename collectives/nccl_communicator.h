// flatshard/collectives/nccl_communicator.h — the production backend: NCCL on one CUDA device.
//
// Contract (in addition to collectives/communicator.h)
// - One NCCL communicator per Lane: all_gather and broadcast use the all-gather lane,
//   reduce_scatter the reduce-scatter lane, all_reduce the lane it is given. NCCL serialises the
//   launches of one communicator in host order even across streams, so two lanes are what lets an
//   all-gather overlap a reduce-scatter. All ranks must issue the same collectives per lane in
//   the same order (there is no cross-rank argument check: a mismatch shows up as a timeout).
// - Calls launch on the caller's stream and return; a zero-element collective launches nothing.
//   In place: all_gather with input == output slot `rank`, reduce_scatter with output == input
//   slot `rank` (NCCL's in-place forms); any other overlap of input and output is rejected.
// - group_start()/group_end() wrap ncclGroupStart/End. NCCL groups are per thread and span both
//   lanes: every collective this thread issues in between is fused into the launch at the
//   outermost group_end(). Pair them on one thread; other threads' launches wait meanwhile.
// - Timeouts (Note [Watchdog], nccl_watchdog.cpp): a collective not complete `timeout` after it
//   was issued fails the communicator on that rank: a watchdog thread polls an event recorded
//   after each collective (FLATSHARD_NCCL_WATCHDOG=1, the default), logs the error (rank,
//   operation, sequence number, elapsed time), aborts both NCCL communicators (which releases
//   kernels stuck waiting for a peer, and host threads synchronising on them), and every later
//   call throws that error. NCCL asynchronous errors (ncclCommGetAsyncError) fail it the same
//   way. With FLATSHARD_NCCL_TERMINATE_ON_ERROR=1 it terminates the process instead (exit code
//   70), for programs whose threads may sit in a device sync that an abort cannot release.
//   Launches never wait for peers on the host: NCCL connects them during create()
//   (FLATSHARD_NCCL_EAGER_CONNECT); should a launch still sit inside NCCL past the timeout, the
//   watchdog terminates the process, since an NCCL call in progress cannot be aborted safely.
// - Lifetime (Note [Communicator teardown]): shutdown() is the clean, collective end: it waits
//   (up to the timeout) for this rank's collectives, then ncclCommFinalize + ncclCommDestroy on
//   both lanes — call it on every rank before leaving main(). The destructor never destroys: if
//   shutdown() was not called it uses ncclCommAbort (local, never waits for peers), and only if
//   the CUDA runtime is still alive; after CUDA shutdown (a communicator in a static destroyed
//   at exit) it deliberately leaks the NCCL and CUDA handles, because calling into them then
//   crashes or hangs. Destructors never throw.
// - Thread safety: collectives of different lanes may be issued from different threads.
//   counters() are updated under an internal lock but read without one.
#pragma once

#include "collectives/communicator.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/util/intrusive_ptr.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

struct ncclComm;

namespace c10d {
class Store;
}

namespace flatshard {

struct NcclOptions {
  std::chrono::milliseconds timeout{600000};      // FLATSHARD_TIMEOUT_MS
  bool watchdog = true;                           // FLATSHARD_NCCL_WATCHDOG
  std::chrono::milliseconds watchdog_poll{100};   // FLATSHARD_WATCHDOG_POLL_MS
  bool terminate_on_error = false;                // FLATSHARD_NCCL_TERMINATE_ON_ERROR
  bool eager_connect = true;                      // FLATSHARD_NCCL_EAGER_CONNECT
  // The knobs of collectives/env.h, with `timeout` from FLATSHARD_TIMEOUT_MS.
  static NcclOptions from_env();
};

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `world_size` processes: rank 0 puts two ncclUniqueIds (one per lane) into
  // `store` under `prefix`, everyone reads them and initialises both NCCL communicators on
  // `device` (a CUDA device). Every rank must create its communicators in the same order with
  // the same prefix; the n-th communicator created with a prefix in this process uses key
  // "<prefix>/nccl_ids/<n>", so repeated creation needs no fresh prefix. The store is kept
  // alive as long as the communicator (rank 0 may host it).
  static std::unique_ptr<NcclCommunicator> create(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                  int world_size, c10::Device device,
                                                  const NcclOptions& options,
                                                  const std::string& prefix = "flatshard");
  static std::unique_ptr<NcclCommunicator> create(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                  int world_size, c10::Device device,
                                                  std::chrono::milliseconds timeout,
                                                  const std::string& prefix = "flatshard");
  // Rendezvous from the launcher's environment (collectives/launch_env.h), device cuda:LOCAL_RANK
  // (made current), the store of collectives/rendezvous.h, options from the FLATSHARD_* knobs.
  static std::unique_ptr<NcclCommunicator> from_env(const std::string& prefix = "flatshard");

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "nccl"; }
  c10::Device device() const override { return device_; }

  void all_gather(const at::Tensor& input, const at::Tensor& output, c10::Stream stream) override;
  void reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                      c10::Stream stream) override;
  void all_reduce(const at::Tensor& tensor, ReduceOp op, c10::Stream stream,
                  Lane lane = Lane::kReduce) override;
  void broadcast(const at::Tensor& tensor, int root, c10::Stream stream) override;
  // Waits for this rank's outstanding collectives, then a one-element all-reduce on the
  // all-gather lane, then blocks the host until it completes (polling, so a failure or the
  // timeout ends it with an error rather than a hang).
  void barrier() override;
  void group_start(Lane lane) override;
  void group_end(Lane lane) override;
  std::chrono::milliseconds timeout() const override { return options_.timeout; }

  // Clean, collective teardown (see the contract). Idempotent; after it every call throws.
  void shutdown();
  // Fails the communicator now: aborts both NCCL communicators; later calls throw `reason`.
  void abort(const std::string& reason);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // The error that failed the communicator ("" if none).
  std::string error() const;
  // Throws the failure error, if any.
  void check_ok(const char* call = "check_ok") const;
  // Collectives issued whose completion the watchdog has not yet observed.
  int64_t outstanding() const;
  // The rendezvous store (kept alive with the communicator; tests use it for host barriers).
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  const NcclOptions& options() const { return options_; }

 private:
  enum class Op { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier };
  static const char* op_name(Op op);
  static const char* lane_name(Lane lane);
  // cudaEventQuery/cudaStreamQuery also leave "not ready" in the calling thread's last-error
  // slot; this clears it, or the next kernel-launch check in that thread would fail.
  static cudaError_t ready(cudaError_t query_result);

  // One NCCL communicator and the lock that orders its use against abort/destroy.
  struct LaneComm {
    ncclComm* comm = nullptr;
    // Recursive: group_start() holds both lanes until group_end(), and the collectives in
    // between lock their lane again on the same thread. Timed: abort gives up instead of hanging.
    std::recursive_timed_mutex mu;
  };

  // A collective (or a fused group) whose completion the watchdog waits for.
  struct Work {
    int64_t seq;
    Op op;
    Lane lane;
    at::ScalarType dtype;
    int64_t numel;
    int64_t group_ops;  // > 1: a fused group, described by its first collective
    cudaEvent_t done;   // recorded on the collective's stream right after its launch
    std::chrono::steady_clock::time_point issued;
  };

  // A collective inside an open group: its event can only be recorded after ncclGroupEnd.
  struct Pending {
    int64_t seq;
    Op op;
    Lane lane;
    at::ScalarType dtype;
    int64_t numel;
    cudaStream_t stream;
  };

  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world, c10::Device device,
                   const NcclOptions& options);

  // --- nccl_communicator.cpp: launching
  cudaStream_t cuda_stream(const char* call, c10::Stream stream) const;
  // Counts the collective, then launches `enqueue(comm, stream)` on `lane` and books it for the
  // watchdog, unless t.numel() == 0 or `enqueues` is false (nothing to enqueue or watch: Note
  // [One-rank NCCL], one rank in place).
  template <class Enqueue>
  void launch(Op op, Lane lane, const at::Tensor& t, int64_t bytes, cudaStream_t stream,
              bool count, bool enqueues, Enqueue&& enqueue);
  // One rank: the collective is a copy of src into dst on `stream` (Note [One-rank NCCL]).
  void one_rank_copy(const at::Tensor& dst, const at::Tensor& src, cudaStream_t stream);
  void track_locked(int64_t seq, Op op, Lane lane, at::ScalarType dtype, int64_t numel,
                    int64_t group_ops, cudaStream_t stream);
  cudaEvent_t take_event_locked();
  static std::string describe_op(int64_t seq, Op op, Lane lane, at::ScalarType dtype,
                                 int64_t numel);

  // --- nccl_watchdog.cpp: waiting, failing, tearing down
  std::string describe(const Work& w, std::chrono::steady_clock::time_point now) const;
  void watchdog_loop();
  void poll_once();
  void stop_watchdog();
  // Records the first error (later calls throw it); if `is_error`, logs it and, with
  // terminate_on_error, exits; then aborts both lanes.
  void fail(const std::string& reason, bool is_error);
  void abort_comms();         // takes both lane locks (bounded wait), then abort_lanes_locked()
  void abort_lanes_locked();  // caller holds both lanes; aborts them concurrently, bounded
  void destroy_events_locked();

  const int rank_;
  const int world_;
  const c10::Device device_;
  const NcclOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::array<LaneComm, 2> lanes_;  // indexed by static_cast<int>(Lane)

  mutable std::mutex work_mu_;     // guards work_, free_events_, next_seq_, counters_
  std::vector<Work> work_;         // issued, completion not yet observed (watchdog on)
  // Recycled completion events (cudaEventDisableTiming): a collective costs one cudaEventRecord,
  // not an event create/destroy pair.
  std::vector<cudaEvent_t> free_events_;
  int64_t next_seq_ = 0;

  // Group state; written only while holding both lane locks (the group's thread).
  int group_depth_ = 0;
  std::vector<Pending> group_pending_;

  // A call inside NCCL on the host, per lane (Note [Watchdog]): since when (ns, 0 = none) and
  // which collective. Written by the launching thread, read by the watchdog.
  struct Inflight {
    std::atomic<int64_t> since_ns{0};
    std::atomic<int64_t> seq{-1};
    std::atomic<int> op{0};
  };
  std::array<Inflight, 2> inflight_;

  std::atomic<bool> failed_{false};
  mutable std::mutex err_mu_;      // guards error_
  std::string error_;
  bool shut_down_ = false;

  // Its own stream so that a barrier waits only for this communicator's collectives (through
  // their events), not for unrelated work queued on the caller's current stream.
  c10::cuda::CUDAStream barrier_stream_;

  std::mutex wd_mu_;               // guards stop_, with wd_cv_
  std::condition_variable wd_cv_;  // wakes the watchdog early on stop
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace flatshard
