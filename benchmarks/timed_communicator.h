// flatshard/benchmarks/timed_communicator.h — a Communicator decorator that measures host time
// spent inside collectives.
//
// Why: on the CPU backend every collective completes before it returns (ranks as threads,
// synchronous copies and reductions), so the host time inside collectives is exactly the
// communication the step could not hide: flatshard-bench reports it as the exposed share. On a
// CUDA backend the same number is only launch overhead, which is why the benchmark does not
// report it there.
//
// Contract: forwards every call to `inner` unchanged (same rank, device, streams, lanes);
// counters() mirror the inner communicator's after each call. nanoseconds() sums the wall time
// of all_gather, reduce_scatter, all_reduce, broadcast and barrier calls since the last reset().
// Not thread safe across threads issuing on one instance (neither is one rank's runtime).
#pragma once

#include <cstdint>

#include "collectives/communicator.h"

namespace flatshard {
namespace bench {

class TimedCommunicator final : public Communicator {
 public:
  explicit TimedCommunicator(Communicator& inner) : inner_(inner) {}

  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string backend_name() const override { return inner_.backend_name() + "+timed"; }
  c10::Device device() const override { return inner_.device(); }

  void all_gather(const at::Tensor& input, const at::Tensor& output, c10::Stream stream) override;
  void reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                      c10::Stream stream) override;
  void all_reduce(const at::Tensor& tensor, ReduceOp op, c10::Stream stream,
                  Lane lane = Lane::kReduce) override;
  void broadcast(const at::Tensor& tensor, int root, c10::Stream stream) override;
  void barrier() override;
  void group_start(Lane lane) override { inner_.group_start(lane); }
  void group_end(Lane lane) override { inner_.group_end(lane); }
  std::chrono::milliseconds timeout() const override { return inner_.timeout(); }

  int64_t nanoseconds() const { return ns_; }
  void reset_time() { ns_ = 0; }

 private:
  template <class Fn>
  void timed(Fn&& fn);

  Communicator& inner_;
  int64_t ns_ = 0;
};

}  // namespace bench
}  // namespace flatshard
