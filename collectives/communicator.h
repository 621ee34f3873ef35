// flatshard/collectives/communicator.h — the seam between the sharding runtime and a transport.
//
// Contract
// - One Communicator per rank per process group. Every rank must issue the same collectives in
//   the same order (host order). Collectives of one Communicator may run concurrently with those
//   of another (the NCCL backend uses separate NCCL communicators per Lane for that).
// - Buffers: contiguous, same dtype (float32, bfloat16 or float16; all_gather also uint8, the
//   wire of the quantized gathers, flat_param/quantized_gather.h) and device on every rank,
//   equal sizes across ranks. Violations throw c10::Error naming the call, the rank and the
//   values.
// - Streams: each call takes the stream it is enqueued on (`c10::Stream`). CUDA backends launch
//   asynchronously on that stream and return immediately; the caller orders consumers with
//   events. The CPU backend ignores the stream and completes before returning.
// - In-place: all_gather may be called with `input` aliasing `output.narrow(0, rank*n, n)`;
//   reduce_scatter with `output` aliasing `input.narrow(0, rank*n, n)`.
// - Errors: a collective that does not finish within the communicator's timeout fails on every
//   surviving rank (CPU: the call throws; NCCL: the communicator is aborted and the next call,
//   or the watchdog, reports it). Destructors never throw.
#pragma once

#include <c10/core/Stream.h>
#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace at {
class Tensor;
}

namespace flatshard {

// kMax: the quantized gathers' amax (flat_param/quantized_gather.h).
enum class ReduceOp { kSum, kAvg, kMax };
const char* to_string(ReduceOp op);

// Which underlying channel a collective uses. Collectives on different lanes may overlap on the
// GPU; collectives on one lane are serialised in issue order. kAllGather carries the gathers
// (and broadcasts), kReduce the gradient reductions: reduce-scatters and all-reduces.
enum class Lane { kAllGather, kReduce };

struct CommCounters {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;
  int64_t broadcasts = 0;
  int64_t bytes = 0;  // payload bytes this rank sent into collectives (input sizes)
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend_name() const = 0;
  // Device this communicator's buffers live on (CPU or one CUDA device).
  virtual c10::Device device() const = 0;

  // output[r*n:(r+1)*n] = input of rank r, n = input.numel(). output.numel() == n * world_size.
  virtual void all_gather(const at::Tensor& input, const at::Tensor& output, c10::Stream stream) = 0;
  // output = op over ranks of input[rank*n:(rank+1)*n], n = output.numel().
  virtual void reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                              c10::Stream stream) = 0;
  // In place: tensor = op over ranks of tensor. Runs on `lane` (default: the reduce-scatter lane).
  virtual void all_reduce(const at::Tensor& tensor, ReduceOp op, c10::Stream stream,
                          Lane lane = Lane::kReduce) = 0;
  // In place: tensor = tensor of rank `root`.
  virtual void broadcast(const at::Tensor& tensor, int root, c10::Stream stream) = 0;
  // Host-blocking barrier across ranks (waits for this rank's pending work first).
  virtual void barrier() = 0;

  // Collectives between group_start() and group_end() on one lane may be fused into one launch.
  virtual void group_start(Lane lane) {}
  virtual void group_end(Lane lane) {}

  virtual std::chrono::milliseconds timeout() const = 0;

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = CommCounters{}; }

  // The stream a call should use when the caller has no preference: the current stream of
  // this communicator's device (CPU: the default CPU stream).
  c10::Stream current_stream() const;

 protected:
  CommCounters counters_;
};

// Argument checks shared by all backends. Throw c10::Error with the call name, rank and values.
namespace detail {
// `bytes_ok`: uint8 is accepted too (all_gather only: bytes are gathered, never reduced).
void check_tensor(const char* call, int rank, const char* what, const at::Tensor& t,
                  c10::Device device, bool bytes_ok = false);
void check_same_dtype(const char* call, int rank, const at::Tensor& a, const at::Tensor& b);
void check_all_gather(const char* call, int rank, int world, const at::Tensor& input,
                      const at::Tensor& output, c10::Device device);
void check_reduce_scatter(const char* call, int rank, int world, const at::Tensor& input,
                          const at::Tensor& output, c10::Device device);
}  // namespace detail

}  // namespace flatshard
