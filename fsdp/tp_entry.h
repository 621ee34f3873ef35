// flatshard/fsdp/tp_entry.h — what flatshard::call (fsdp/call.h) needs to know about a module
// that tensor parallelism splits (fsdp/tensor_parallel.h keeps the registry). Its own header so
// call.h stays light.
//
// Contract
//   * find_tp(m): kind == kNone when `m` is not a colwise/rowwise module of a live
//     TensorParallel with more than one tp rank (the common case: one atomic load, no lock).
//   * tp_enter_colwise(e, x): Megatron's f, identity forward, all-reduce (sum) of the input
//     gradient over the tp group backward. With e.sequence: all-gather of x [B, T/tp, ...]
//     along dim 1 forward, reduce-scatter of the gradient backward.
//   * tp_exit_replicated(e, y): a colwise module kept whole (Note [Replicated kv heads],
//     fsdp/tensor_parallel.cpp): forward this rank's head group of the output, backward the
//     output gradient (zero outside that group) all-reduced over the tp group.
//   * tp_enter_vocab(e, ids) / tp_exit_vocab(e, ids, y): a vocabulary-parallel embedding
//     (Megatron's VocabParallelEmbedding): the entry maps the ids to this rank's rows
//     [tp_rank * vocab_rows, (tp_rank + 1) * vocab_rows) (ids outside: row 0, masked after); the
//     exit zeroes the rows of ids outside the range and all-reduces (sum) the output over the tp
//     group forward, identity backward. ids on the CPU are checked against [0, vocab_rows * tp).
//   * tp_exit_rowwise(e, m, y): Megatron's g, all-reduce (sum) of the output over the tp
//     group forward, identity backward; `m`'s replicated bias (a parameter named "bias", if
//     any) is added once, not once per rank. With e.sequence: reduce-scatter of y [B, T, ...]
//     along dim 1 forward, all-gather of the gradient backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class Communicator;

namespace detail {

// A TensorParallel's per-step collective counts (TensorParallel::counters()); the autograd
// functions add to them from the forward and the autograd threads.
struct TpCounterCells {
  std::atomic<int64_t> forward_all_reduces{0}, backward_all_reduces{0};
  std::atomic<int64_t> forward_all_gathers{0}, forward_reduce_scatters{0};
  std::atomic<int64_t> backward_all_gathers{0}, backward_reduce_scatters{0};
  std::atomic<int64_t> forward_bytes{0}, backward_bytes{0};
  std::atomic<int64_t> grad_all_reduces{0}, grad_bytes{0};
  std::atomic<int64_t> boundary_all_gathers{0}, boundary_bytes{0};
  std::atomic<int64_t> loss_all_reduces{0}, loss_bytes{0};
};

struct TpEntry {
  enum class Kind : uint8_t { kNone, kColwise, kRowwise, kReplicatedHeads, kVocab };
  Kind kind = Kind::kNone;
  Communicator* group = nullptr;     // the tp group
  const std::string* path = nullptr;  // the module's path, for messages
  TpCounterCells* counters = nullptr;  // its TensorParallel's
  bool sequence = false;  // sequence parallelism: gather / reduce-scatter along dim 1 instead
  int64_t groups = 0;  // kReplicatedHeads: the output's head groups G (TpModule::replicated_groups)
  int tp_rank = 0, tp_size = 1;  // kReplicatedHeads: which group this rank uses; kVocab: rows
  int64_t vocab_rows = 0;  // kVocab: the rows (ids) each rank holds, vocabulary / tp
};

// kVocab's entry: the ids this rank looks up (`local`) and where they fall outside its rows.
struct VocabIds {
  at::Tensor local, outside;
};

TpEntry find_tp(const torch::nn::Module* m);
at::Tensor tp_enter_colwise(const TpEntry& e, const at::Tensor& x);
at::Tensor tp_exit_rowwise(const TpEntry& e, const torch::nn::Module* m, const at::Tensor& y);
at::Tensor tp_exit_replicated(const TpEntry& e, const at::Tensor& y);
VocabIds tp_enter_vocab(const TpEntry& e, const at::Tensor& ids);
at::Tensor tp_exit_vocab(const TpEntry& e, const at::Tensor& outside, const at::Tensor& y);
// A module the TP plan names whose forward is not Tensor -> Tensor.
[[noreturn]] void tp_bad_signature(const TpEntry& e);

}  // namespace detail
}  // namespace flatshard
