// flatshard/checkpoint/load_into_shards.h — a ParamLoader (fsdp/options.h) over safetensors
// files: fully_shard of a meta-built model reads each rank's shards straight from the files.
//
//   flatshard::gpt::GPT model{nullptr};
//   { flatshard::MetaInit meta;  model = flatshard::gpt::GPT(cfg, seed); }   // shapes only
//   flatshard::ShardingOptions options;
//   options.load = flatshard::safetensors_loader("llama-1b/");                  // every rank
//   auto fsdp = flatshard::fully_shard(model.ptr(), policy, comm, options);
//
// Contract
// - `path`: a `.safetensors` file; an index file (`*.index.json`: {"weight_map": {tensor:
//   file}}, files named relative to it, as the Hugging Face hub publishes sharded weights); or a
//   directory holding `model.safetensors` (preferred, as transformers) or
//   `model.safetensors.index.json`. A
//   flatshard full checkpoint is such a directory (its manifest.json is not read, so its CRCs
//   are not checked; load_checkpoint does check them). A sharded flatshard checkpoint (shard
//   files, no model.safetensors) is read through its manifest: checkpoint_loader() below.
// - `name_map`: model parameter name → tensor name in the files (e.g. "blocks.0.attn.qkv.weight"
//   → "model.layers.0..."); empty: identity. It is called once per parameter, during check.
//   A tied parameter is one parameter (planned once, under the name the plan lists it by), so
//   it is looked up once and its aliases need no entry. The map may send several parameters to
//   one tensor: each must have the tensor's shape (else the shape error below) and each is
//   loaded with its own copy (e.g. initialising an untied model's embedding and output layer
//   from a checkpoint that stores one tied matrix). Since the model does not tie them, check
//   warns once (TORCH_WARN) naming the parameters and the tensor.
// - Lazy: the factory only records its arguments. Everything that can fail happens inside
//   fully_shard, where failures agree across ranks: check() opens the files, reads and
//   validates every header (SafetensorsHeader::read: offsets in bounds, no overlaps), then for
//   every planned parameter requires that its mapped name exists (error naming the model name,
//   the mapped name and the file or index), that the shapes are equal (both shapes), and that
//   the dtype is F32, BF16 or F16 — converted to fp32 on read (other dtypes, F64 included, are
//   refused naming the tensor: narrowing F64 or loading integers would change values silently).
// - read(): pread (not mmap) of exactly the bytes of the requested element range, in chunks of
//   at most 64 MiB into a CPU buffer (pinned when the master is on CUDA), converted to fp32 by
//   copy_ into the master's slice on its device. pread because the files are opened once,
//   confined (Note [Checkpoint confinement]: regular files only; a symlink is followed only
//   from a Hugging Face hub-cache snapshot into its repository's blobs/, Note [Hub snapshots]
//   in checkpoint/file_io.h, any other is refused naming it), a file truncated after the check
//   fails with an error naming it instead of a SIGBUS, and the bytes read are exactly the shard's.
// - A directory holding both model.safetensors and model.safetensors.index.json is read from
//   model.safetensors, as transformers reads it, with a warning naming both (Note [Weights
//   file of a directory], checkpoint/file_io.h).
// - Tensors of the files that no planned parameter reads are reported once per loader
//   (TORCH_WARN naming them, the first 8 and a count), as transformers reports its UNEXPECTED
//   keys; `unread_ok` names the ones that may stay unread silently.
// - `stats` (optional): bytes and reads of tensor data this loader did (headers not counted).
//   Thread-safe: one loader may serve several rank threads.
// - Host little-endian only (checked), as safetensors' data is little-endian.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "fsdp/options.h"

namespace flatshard {

using NameMap = std::function<std::string(const std::string& model_name)>;

struct LoadStats {
  std::atomic<int64_t> bytes{0};  // tensor data bytes read
  std::atomic<int64_t> reads{0};  // pread calls for tensor data
};

// Tensor names (in the files) that may stay unread without a report, e.g. Hugging Face's
// rotary `*.inv_freq` buffers; empty: every unread tensor is reported.
using UnreadFilter = std::function<bool(const std::string& tensor)>;

ParamLoader safetensors_loader(const std::string& path, NameMap name_map = {},
                               std::shared_ptr<LoadStats> stats = nullptr,
                               UnreadFilter unread_ok = {});

// Whether tensors `a` and `b` of the weights at `path` (as safetensors_loader reads it) hold
// equal values (same shape, equal after conversion to fp32: torch.equal on the loaded
// parameters, transformers' test for tying two weights); nullopt when either is missing.
// Reads both whole, a bounded piece at a time. Errors as check() and read().
std::optional<bool> safetensors_tensors_equal(const std::string& path, const std::string& a,
                                              const std::string& b);

// A flatshard checkpoint directory (full or sharded, checkpoint/checkpoint.h) as a loader: its
// manifest is read and validated (Note [Strict manifest]) at check, each planned parameter must
// be in it with the same shape (name_map applies, as above), and read() copies only the pieces
// that overlap the requested range, verifying their chunks' CRC-32s — so a rank of any world
// size and plan reads its own shards of a checkpoint written at another. Parameters only; the
// optimizer state is load_checkpoint's. safetensors_loader() on a directory with a manifest and
// no model.safetensors (a sharded checkpoint) returns this.
ParamLoader checkpoint_loader(const std::string& dir, NameMap name_map = {},
                              std::shared_ptr<LoadStats> stats = nullptr);

}  // namespace flatshard
