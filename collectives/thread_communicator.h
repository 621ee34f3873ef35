// flatshard/collectives/thread_communicator.h — CPU backend: ranks are threads of one process.
//
// Used by the CPU test suite and the CPU benchmark. Same semantics as the NCCL backend, computed
// with ATen ops on CPU tensors; every call completes before it returns (the stream is ignored).
// Reductions run in rank order 0..N-1 (bf16 is accumulated in fp32 and rounded once), so every
// rank gets bit-identical results.
//
// Failure semantics: each collective first checks that all ranks called the same collective with
// the same dtype and sizes (else every rank throws, naming the first difference). A rank that
// throws or does not arrive within the timeout makes every waiting rank throw — never a hang.
#pragma once

#include "collectives/communicator.h"

#include <functional>
#include <memory>
#include <vector>

namespace flatshard {

class ThreadWorld;

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadWorld> world, int rank);

  int rank() const override { return rank_; }
  int world_size() const override;
  std::string backend_name() const override { return "threads"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }

  void all_gather(const at::Tensor& input, const at::Tensor& output, c10::Stream stream) override;
  void reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                      c10::Stream stream) override;
  void all_reduce(const at::Tensor& tensor, ReduceOp op, c10::Stream stream,
                  Lane lane = Lane::kReduce) override;
  void broadcast(const at::Tensor& tensor, int root, c10::Stream stream) override;
  void barrier() override;
  std::chrono::milliseconds timeout() const override;

 private:
  std::shared_ptr<ThreadWorld> world_;
  int rank_;
};

// Shared state of `world_size` in-process ranks.
class ThreadWorld : public std::enable_shared_from_this<ThreadWorld> {
 public:
  static std::shared_ptr<ThreadWorld> create(int world_size, std::chrono::milliseconds timeout);
  ~ThreadWorld();

  int world_size() const;
  std::chrono::milliseconds timeout() const;
  std::unique_ptr<ThreadCommunicator> communicator(int rank);
  // Makes every rank blocked in (or later entering) a collective throw with `reason`.
  void abort(const std::string& reason);

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  explicit ThreadWorld(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Runs fn(comm) on `world_size` threads, one per rank, each with at::set_num_threads(1).
// If any rank throws, the world is aborted (the others fail fast instead of waiting for the
// timeout), all threads are joined, and the lowest-ranked original error is rethrown prefixed
// with "rank R: ".
void run_ranks(int world_size, const std::function<void(Communicator&)>& fn,
               std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

}  // namespace flatshard
