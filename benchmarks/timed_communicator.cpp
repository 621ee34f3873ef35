// flatshard/benchmarks/timed_communicator.cpp — see timed_communicator.h for the contract.
#include "benchmarks/timed_communicator.h"

#include <chrono>

namespace flatshard {
namespace bench {

template <class Fn>
void TimedCommunicator::timed(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  // Account the time even when the call throws: the error propagates, the number stays honest.
  struct Add {
    TimedCommunicator* self;
    std::chrono::steady_clock::time_point t0;
    ~Add() {
      self->ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - t0)
                       .count();
      self->counters_ = self->inner_.counters();
    }
  } add{this, t0};
  fn();
}

void TimedCommunicator::all_gather(const at::Tensor& input, const at::Tensor& output,
                                   c10::Stream stream) {
  timed([&] { inner_.all_gather(input, output, stream); });
}

void TimedCommunicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                       ReduceOp op, c10::Stream stream) {
  timed([&] { inner_.reduce_scatter(input, output, op, stream); });
}

void TimedCommunicator::all_reduce(const at::Tensor& tensor, ReduceOp op, c10::Stream stream,
                                   Lane lane) {
  timed([&] { inner_.all_reduce(tensor, op, stream, lane); });
}

void TimedCommunicator::broadcast(const at::Tensor& tensor, int root, c10::Stream stream) {
  timed([&] { inner_.broadcast(tensor, root, stream); });
}

void TimedCommunicator::barrier() {
  timed([&] { inner_.barrier(); });
}

}  // namespace bench
}  // namespace flatshard
