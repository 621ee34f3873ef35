// NcclCommunicator, part 1: creation, argument checks, launching collectives, groups, barrier.
// Waiting, failure handling and teardown are in nccl_watchdog.cpp.
#include "collectives/nccl_communicator.h"

#include "collectives/env.h"
#include "collectives/launch_env.h"
#include "collectives/nccl_check.h"
#include "collectives/rendezvous.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace flatshard {

namespace {

ncclDataType_t nccl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kByte:  // all_gather only (detail::check_all_gather)
      return ncclUint8;
    default:
      TORCH_INTERNAL_ASSERT(false, "nccl_dtype: unsupported dtype ", t,
                            " passed the argument checks");
  }
  return ncclFloat32;  // unreachable
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kSum:
      break;
  }
  return ncclSum;
}

// The n-th communicator created with `prefix` in this process (all ranks create in one order).
int next_instance(const std::string& prefix) {
  static std::mutex mu;
  static auto* counts = new std::unordered_map<std::string, int>();  // leaked: no exit order
  std::lock_guard<std::mutex> lock(mu);
  return (*counts)[prefix]++;
}

// In-place forms are the only overlap NCCL defines; anything else would read what it writes.
void check_alias(const char* call, int rank, const char* part_name, const at::Tensor& part,
                 const char* whole_name, const at::Tensor& whole, int slot) {
  const auto p = reinterpret_cast<std::uintptr_t>(part.const_data_ptr());
  const auto w = reinterpret_cast<std::uintptr_t>(whole.const_data_ptr());
  const auto pb = static_cast<std::uintptr_t>(part.nbytes());
  const auto wb = static_cast<std::uintptr_t>(whole.nbytes());
  if (!(p < w + wb && w < p + pb)) return;
  TORCH_CHECK(p == w + slot * pb, call, " (rank ", rank, "): ", part_name, " and ", whole_name,
              " overlap but not in NCCL's in-place form: the ", part_name, " must be exactly slot ",
              slot, " of the ", whole_name, " (byte offset ", slot * pb, "), found byte offset ",
              static_cast<std::intptr_t>(p - w));
}

struct Unlocker {  // releases the lane locks group_start() took, on every exit of group_end()
  std::recursive_timed_mutex& a;
  std::recursive_timed_mutex& b;
  ~Unlocker() {
    b.unlock();
    a.unlock();
  }
};

}  // namespace

NcclOptions NcclOptions::from_env() {
  NcclOptions o;
  o.timeout = env::timeout();
  o.watchdog = env::nccl_watchdog();
  o.watchdog_poll = env::watchdog_poll();
  o.terminate_on_error = env::nccl_terminate_on_error();
  o.eager_connect = env::nccl_eager_connect();
  return o;
}

const char* NcclCommunicator::op_name(Op op) {
  switch (op) {
    case Op::kAllGather:
      return "all_gather";
    case Op::kReduceScatter:
      return "reduce_scatter";
    case Op::kAllReduce:
      return "all_reduce";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kBarrier:
      return "barrier";
  }
  return "?";
}

const char* NcclCommunicator::lane_name(Lane lane) {
  return lane == Lane::kAllGather ? "all_gather" : "reduce";
}

cudaError_t NcclCommunicator::ready(cudaError_t query_result) {
  if (query_result == cudaErrorNotReady) (void)cudaGetLastError();
  return query_result;
}

std::string NcclCommunicator::describe_op(int64_t seq, Op op, Lane lane, at::ScalarType dtype,
                                          int64_t numel) {
  return c10::str("collective #", seq, " ", op_name(op), " (lane ", lane_name(lane), ", ", dtype,
                  ", ", numel, " elements)");
}

// =============================================================================================
// Creation
NcclCommunicator::NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                                   c10::Device device, const NcclOptions& options)
    : rank_(rank),
      world_(world),
      device_(device),
      options_(options),
      store_(std::move(store)),
      barrier_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(c10::intrusive_ptr<c10d::Store> store,
                                                           int rank, int world_size,
                                                           c10::Device device,
                                                           std::chrono::milliseconds timeout,
                                                           const std::string& prefix) {
  NcclOptions options = NcclOptions::from_env();
  options.timeout = timeout;
  return create(std::move(store), rank, world_size, device, options, prefix);
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(c10::intrusive_ptr<c10d::Store> store,
                                                           int rank, int world_size,
                                                           c10::Device device,
                                                           const NcclOptions& options,
                                                           const std::string& prefix) {
  const char* call = "NcclCommunicator::create";
  TORCH_CHECK(store, call, " (rank ", rank, "): the store is null");
  TORCH_CHECK(world_size >= 1, call, " (rank ", rank, "): world_size must be >= 1, got ",
              world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, call, ": rank ", rank,
              " out of range for world_size ", world_size);
  TORCH_CHECK(device.is_cuda() && device.has_index(), call, " (rank ", rank,
              "): device must be a CUDA device with an index, got ", device);
  const int ndev = c10::cuda::device_count();
  TORCH_CHECK(device.index() < ndev, call, " (rank ", rank, "): device ", device, " but only ",
              ndev, " CUDA devices are visible");
  TORCH_CHECK(options.timeout.count() > 0, call, " (rank ", rank,
              "): timeout must be positive, got ", options.timeout.count(), " ms");
  TORCH_CHECK(options.watchdog_poll.count() > 0, call, " (rank ", rank,
              "): watchdog poll period must be positive, got ", options.watchdog_poll.count(),
              " ms");
  c10::cuda::CUDAGuard guard(device);
  // Note [Watchdog]: connect peers while creating (every rank is here), not inside the first
  // collective of each algorithm. NCCL reads the variable when it initialises, i.e. below.
  if (options.eager_connect && env::get("NCCL_RUNTIME_CONNECT").empty())
    setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);

  // One id per lane, published by rank 0 in one key.
  const std::string key = prefix + "/nccl_ids/" + std::to_string(next_instance(prefix));
  std::array<ncclUniqueId, 2> ids{};
  if (rank == 0) {
    for (auto& id : ids) FLATSHARD_NCCL_CHECK(ncclGetUniqueId(&id), nullptr, rank);
    std::vector<uint8_t> bytes(sizeof(ids));
    std::memcpy(bytes.data(), ids.data(), sizeof(ids));
    store->set(key, bytes);
  } else {
    std::vector<uint8_t> bytes;
    try {
      bytes = store->get(key);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, call, " (rank ", rank, "): did not get the NCCL unique ids from rank 0 ",
                  "under store key '", key, "' within ", store->getTimeout().count(),
                  " ms: ", e.what_without_backtrace());
    }
    TORCH_CHECK(bytes.size() == sizeof(ids), call, " (rank ", rank, "): store key '", key,
                "' holds ", bytes.size(), " bytes, expected ", sizeof(ids),
                " (two ncclUniqueIds); is another program using the same store prefix?");
    std::memcpy(ids.data(), bytes.data(), sizeof(ids));
  }

  std::unique_ptr<NcclCommunicator> c(
      new NcclCommunicator(std::move(store), rank, world_size, device, options));
  static const char* const kCommNames[2] = {"flatshard-all_gather", "flatshard-reduce_scatter"};
  for (int i = 0; i < 2; ++i) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    // Blocking: NCCL's nonblocking mode costs ~100 us of host time per collective (measured,
    // NCCL 2.28.9, 2x H200). Waits for peers happen here instead (eager connect).
    config.blocking = 1;
    config.commName = kCommNames[i];
    ncclComm_t comm = nullptr;
    FLATSHARD_NCCL_CHECK(ncclCommInitRankConfig(&comm, world_size, ids[i], rank, &config),
                         nullptr, rank);
    c->lanes_[i].comm = comm;  // from here on, a throw makes `c`'s destructor abort it
  }
  if (options.watchdog) c->watchdog_ = std::thread([p = c.get()] { p->watchdog_loop(); });
  return c;
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::from_env(const std::string& prefix) {
  const LaunchEnv e = LaunchEnv::from_env();
  const char* local_var = e.launcher == LaunchEnv::Launcher::kTorchrun ? "LOCAL_RANK"
                          : e.launcher == LaunchEnv::Launcher::kSlurm
                              ? "SLURM_LOCALID"
                              : "OMPI_COMM_WORLD_LOCAL_RANK";
  const int ndev = c10::cuda::device_count();
  TORCH_CHECK(e.local_rank < ndev, "NcclCommunicator::from_env (rank ", e.rank, "): ", local_var,
              "=", e.local_rank, " selects CUDA device ", e.local_rank, " but only ", ndev,
              " CUDA devices are visible (CUDA_VISIBLE_DEVICES='",
              env::get("CUDA_VISIBLE_DEVICES"), "')");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(e.local_rank));
  auto store = create_store(e, env::store_timeout());
  return create(std::move(store), e.rank, e.world_size,
                c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(e.local_rank)),
                NcclOptions::from_env(), prefix);
}

// =============================================================================================
// Collectives
cudaStream_t NcclCommunicator::cuda_stream(const char* call, c10::Stream stream) const {
  TORCH_CHECK(stream.device_type() == c10::DeviceType::CUDA &&
                  stream.device_index() == device_.index(),
              call, " (rank ", rank_, "): stream ", stream,
              " is not a stream of this communicator's device ", device_);
  return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
}

void NcclCommunicator::check_ok(const char* call) const {
  if (C10_LIKELY(!failed())) return;
  C10_THROW_ERROR(DistBackendError,
                  c10::str(call, " (rank ", rank_, "): the NCCL communicator has failed: ", error()));
}

std::string NcclCommunicator::error() const {
  std::lock_guard<std::mutex> lock(err_mu_);
  return error_;
}

namespace {
// Marks a lane as "inside NCCL on the host" for the watchdog while in scope.
struct InflightMark {
  std::atomic<int64_t>& since_ns;
  InflightMark(std::atomic<int64_t>& since, std::atomic<int64_t>& seq_slot,
               std::atomic<int>& op_slot, int64_t seq, int op)
      : since_ns(since) {
    seq_slot.store(seq, std::memory_order_relaxed);
    op_slot.store(op, std::memory_order_relaxed);
    since_ns.store(std::chrono::steady_clock::now().time_since_epoch().count() | 1,
                   std::memory_order_release);
  }
  ~InflightMark() { since_ns.store(0, std::memory_order_release); }
};
}  // namespace

template <class Enqueue>
void NcclCommunicator::launch(Op op, Lane lane, const at::Tensor& t, int64_t bytes,
                              cudaStream_t stream, bool count, bool enqueues,
                              Enqueue&& enqueue) {
  const char* call = op_name(op);
  check_ok(call);
  c10::cuda::CUDAGuard guard(device_);
  const int li = static_cast<int>(lane);
  LaneComm& lc = lanes_[li];
  const int64_t numel = t.numel();
  std::lock_guard<std::recursive_timed_mutex> lane_lock(lc.mu);
  check_ok(call);  // an abort may have happened while this thread waited for the lane
  TORCH_INTERNAL_ASSERT(lc.comm != nullptr, "rank ", rank_, ": lane ", lane_name(lane),
                        " has no NCCL communicator although the communicator has not failed");
  int64_t seq = 0;
  {
    std::lock_guard<std::mutex> work_lock(work_mu_);
    seq = next_seq_++;
    if (count) {
      switch (op) {
        case Op::kAllGather:
          ++counters_.all_gathers;
          break;
        case Op::kReduceScatter:
          ++counters_.reduce_scatters;
          break;
        case Op::kAllReduce:
          ++counters_.all_reduces;
          break;
        case Op::kBroadcast:
          ++counters_.broadcasts;
          break;
        case Op::kBarrier:
          break;
      }
      counters_.bytes += bytes;
    }
  }
  if (numel == 0 || !enqueues) return;
  {
    InflightMark mark(inflight_[li].since_ns, inflight_[li].seq, inflight_[li].op, seq,
                      static_cast<int>(op));
    enqueue(lc.comm, stream);
  }
  if (!options_.watchdog) return;
  std::lock_guard<std::mutex> work_lock(work_mu_);
  if (group_depth_ > 0)
    group_pending_.push_back(Pending{seq, op, lane, t.scalar_type(), numel, stream});
  else
    track_locked(seq, op, lane, t.scalar_type(), numel, 1, stream);
}

cudaEvent_t NcclCommunicator::take_event_locked() {
  if (!free_events_.empty()) {
    cudaEvent_t ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  cudaEvent_t ev = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return ev;
}

void NcclCommunicator::track_locked(int64_t seq, Op op, Lane lane, at::ScalarType dtype,
                                    int64_t numel, int64_t group_ops, cudaStream_t stream) {
  cudaEvent_t ev = take_event_locked();
  const cudaError_t err = cudaEventRecord(ev, stream);
  if (err != cudaSuccess) {
    free_events_.push_back(ev);
    C10_CUDA_CHECK(err);
  }
  work_.push_back(Work{seq, op, lane, dtype, numel, group_ops, ev,
                       std::chrono::steady_clock::now()});
}

// Note [One-rank NCCL]
// A one-rank communicator (the shard group of HSDP with one GPU per replica, a 1-GPU run)
// never calls NCCL for data: NCCL before 2.29.7 drops the last count % blocks elements of a
// one-rank reduction with ncclAvg (NVIDIA/nccl#1950; torch 2.11's wheel ships 2.28.9). Seen
// here as one zero at the end of each Block's flat gradient on a 2x1 HSDP mesh, which
// gpu_hsdp_test caught. With one rank every collective is the identity, so a copy (or nothing,
// in place) on the caller's stream is exact and cheaper; the work is still counted, and a copy is
// tracked by the watchdog like any other collective. In place there is nothing to enqueue, so
// nothing is tracked: an event recorded and polled per gather was host time for no work (every
// unit's gather in a 1-GPU run). The barrier keeps its NCCL call (its value is unused).
void NcclCommunicator::one_rank_copy(const at::Tensor& dst, const at::Tensor& src,
                                     cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(dst.nbytes() == src.nbytes(), "rank ", rank_, ": one-rank copy of ",
                        src.nbytes(), " bytes into ", dst.nbytes());
  if (dst.data_ptr() == src.data_ptr() || dst.nbytes() == 0) return;
  C10_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.const_data_ptr(), src.nbytes(),
                                 cudaMemcpyDeviceToDevice, stream));
}

void NcclCommunicator::all_gather(const at::Tensor& input, const at::Tensor& output,
                                  c10::Stream stream) {
  detail::check_all_gather("all_gather", rank_, world_, input, output, device_);
  const cudaStream_t s = cuda_stream("all_gather", stream);
  const int64_t n = input.numel();
  if (n > 0) check_alias("all_gather", rank_, "input", input, "output", output, rank_);
  // Note [One-rank NCCL]: in place, one rank's gather is nothing.
  const bool enqueues = world_ > 1 || input.data_ptr() != output.data_ptr();
  launch(Op::kAllGather, Lane::kAllGather, input, input.nbytes(), s, true, enqueues,
         [&](ncclComm* comm, cudaStream_t st) {
           if (world_ == 1) return one_rank_copy(output, input, st);  // Note [One-rank NCCL]
           FLATSHARD_NCCL_CHECK(ncclAllGather(input.const_data_ptr(), output.data_ptr(),
                                                     static_cast<size_t>(n),
                                                     nccl_dtype(input.scalar_type()), comm, st),
                                       comm, rank_);
         });
}

void NcclCommunicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                      ReduceOp op, c10::Stream stream) {
  detail::check_reduce_scatter("reduce_scatter", rank_, world_, input, output, device_);
  const cudaStream_t s = cuda_stream("reduce_scatter", stream);
  const int64_t n = output.numel();
  if (n > 0) check_alias("reduce_scatter", rank_, "output", output, "input", input, rank_);
  const bool enqueues = world_ > 1 || input.data_ptr() != output.data_ptr();
  launch(Op::kReduceScatter, Lane::kReduce, output, input.nbytes(), s, true, enqueues,
         [&](ncclComm* comm, cudaStream_t st) {
           if (world_ == 1) return one_rank_copy(output, input, st);  // Note [One-rank NCCL]
           FLATSHARD_NCCL_CHECK(
               ncclReduceScatter(input.const_data_ptr(), output.data_ptr(), static_cast<size_t>(n),
                                 nccl_dtype(input.scalar_type()), nccl_op(op), comm, st),
               comm, rank_);
         });
}

void NcclCommunicator::all_reduce(const at::Tensor& tensor, ReduceOp op, c10::Stream stream,
                                  Lane lane) {
  detail::check_tensor("all_reduce", rank_, "tensor", tensor, device_);
  const cudaStream_t s = cuda_stream("all_reduce", stream);
  launch(Op::kAllReduce, lane, tensor, tensor.nbytes(), s, true, /*enqueues=*/world_ > 1,
         [&](ncclComm* comm, cudaStream_t st) {
           if (world_ == 1) return;  // in place: already the result (Note [One-rank NCCL])
           FLATSHARD_NCCL_CHECK(
               ncclAllReduce(tensor.const_data_ptr(), tensor.data_ptr(),
                             static_cast<size_t>(tensor.numel()), nccl_dtype(tensor.scalar_type()),
                             nccl_op(op), comm, st),
               comm, rank_);
         });
}

void NcclCommunicator::broadcast(const at::Tensor& tensor, int root, c10::Stream stream) {
  detail::check_tensor("broadcast", rank_, "tensor", tensor, device_);
  TORCH_CHECK(root >= 0 && root < world_, "broadcast (rank ", rank_, "): root ", root,
              " out of range for world_size ", world_);
  const cudaStream_t s = cuda_stream("broadcast", stream);
  launch(Op::kBroadcast, Lane::kAllGather, tensor, tensor.nbytes(), s, true,
         /*enqueues=*/world_ > 1,
         [&](ncclComm* comm, cudaStream_t st) {
           if (world_ == 1) return;  // in place, root 0 is this rank (Note [One-rank NCCL])
           FLATSHARD_NCCL_CHECK(
               ncclBroadcast(tensor.const_data_ptr(), tensor.data_ptr(),
                             static_cast<size_t>(tensor.numel()), nccl_dtype(tensor.scalar_type()),
                             root, comm, st),
               comm, rank_);
         });
}

void NcclCommunicator::barrier() {
  check_ok("barrier");
  c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t bs = barrier_stream_.stream();
  if (options_.watchdog) {
    std::lock_guard<std::mutex> lock(work_mu_);
    for (const Work& w : work_) C10_CUDA_CHECK(cudaStreamWaitEvent(bs, w.done, 0));
  } else {
    // Without events there is no record of this rank's pending collectives: drain the device.
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }
  at::Tensor one;
  {
    c10::cuda::CUDAStreamGuard stream_guard(barrier_stream_);  // allocate and fill on bs
    one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
  }
  launch(Op::kBarrier, Lane::kAllGather, one, 0, bs, /*count=*/false, /*enqueues=*/true,
         [&](ncclComm* comm, cudaStream_t st) {
           FLATSHARD_NCCL_CHECK(ncclAllReduce(one.const_data_ptr(), one.data_ptr(), 1,
                                                     ncclFloat32, ncclSum, comm, st),
                                       comm, rank_);
         });
  // Poll instead of cudaStreamSynchronize: a failure (the watchdog's abort, or this deadline
  // when the watchdog is off) ends the wait with an error instead of a hang.
  const auto slack = std::max<std::chrono::milliseconds>(options_.watchdog_poll * 4,
                                                         std::chrono::milliseconds(1000));
  const auto t0 = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    const cudaError_t q = ready(cudaStreamQuery(bs));
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) C10_CUDA_CHECK(q);
    check_ok("barrier");
    if (std::chrono::steady_clock::now() - t0 > options_.timeout + slack) {
      fail(c10::str("rank ", rank_, ": barrier timed out: not complete within ",
                    options_.timeout.count(), " ms (+", slack.count(),
                    " ms slack); a rank is missing or stuck"),
           /*is_error=*/true);
      check_ok("barrier");
    }
    if (spins < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  check_ok("barrier");  // kernels released by an abort also "complete"
  // Everything issued before the barrier is complete now: recycle those events right away.
  std::lock_guard<std::mutex> lock(work_mu_);
  size_t keep = 0;
  for (const Work& w : work_) {
    if (ready(cudaEventQuery(w.done)) == cudaSuccess)
      free_events_.push_back(w.done);
    else
      work_[keep++] = w;
  }
  work_.resize(keep);
}

void NcclCommunicator::group_start(Lane) {
  check_ok("group_start");
  // Both lanes, always in index order (as abort_comms): NCCL's group is per thread and takes
  // whatever lane this thread launches on until group_end().
  lanes_[0].mu.lock();
  lanes_[1].mu.lock();
  try {
    check_ok("group_start");
    FLATSHARD_NCCL_CHECK(ncclGroupStart(), nullptr, rank_);
  } catch (...) {
    lanes_[1].mu.unlock();
    lanes_[0].mu.unlock();
    throw;
  }
  ++group_depth_;
}

void NcclCommunicator::group_end(Lane) {
  // Lock again (recursive): immediate on the group's own thread; elsewhere it waits, and the
  // depth check below then reports the misuse.
  std::lock_guard<std::recursive_timed_mutex> l0(lanes_[0].mu);
  std::lock_guard<std::recursive_timed_mutex> l1(lanes_[1].mu);
  TORCH_CHECK(group_depth_ > 0, "group_end (rank ", rank_,
              "): no open group (group_start was not called on this thread, or the group was "
              "already closed)");
  Unlocker release_group{lanes_[0].mu, lanes_[1].mu};
  --group_depth_;
  std::vector<Pending> pending;
  if (group_depth_ == 0) pending.swap(group_pending_);
  // Comms still alive (a pending abort waits for these locks): close NCCL's group even if the
  // communicator has failed, so that this thread is not left inside it.
  if (lanes_[0].comm && lanes_[1].comm) {
    c10::cuda::CUDAGuard guard(device_);
    InflightMark mark(inflight_[0].since_ns, inflight_[0].seq, inflight_[0].op,
                      pending.empty() ? -1 : pending[0].seq,
                      static_cast<int>(pending.empty() ? Op::kBarrier : pending[0].op));
    FLATSHARD_NCCL_CHECK(ncclGroupEnd(), lanes_[0].comm, rank_);
  }
  check_ok("group_end");
  if (pending.empty()) return;
  // One event per stream of the group, recorded after the fused launch.
  std::lock_guard<std::mutex> work_lock(work_mu_);
  std::vector<cudaStream_t> seen;
  for (const Pending& p : pending) {
    if (std::find(seen.begin(), seen.end(), p.stream) != seen.end()) continue;
    seen.push_back(p.stream);
    int64_t ops = 0;
    for (const Pending& q : pending) ops += q.stream == p.stream;
    track_locked(p.seq, p.op, p.lane, p.dtype, p.numel, ops, p.stream);
  }
}

}  // namespace flatshard
