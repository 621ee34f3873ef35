// flatshard/checkpoint/export.h — a sharded model written as plain safetensors files for other
// tools (transformers, vLLM, converters): the model's names mapped to theirs, fp32 or bf16, one
// file or several with an index. models/hf.h's save_hf is built on it.
//
//   ExportOptions o;
//   o.name_map = [](const std::string& n) { return "model." + n; };
//   o.dtype = at::kBFloat16;
//   o.text_files = {{"config.json", config_text}};
//   flatshard::export_safetensors(*fsdp, "out/my-model", o);                   // every rank
//
// Contract
// - Collective: every rank of the model's communicator calls it with the same arguments,
//   between steps (HSDP: the shard group of replicate rank 0 writes, as save_checkpoint;
//   tensor parallelism: every rank of the mesh, each unit gathered over shard then tp, and
//   shard 0 of tp 0 writes the full tensors, joined by tp_unslice). If any
//   rank fails (also in the name map), every rank throws, nothing is published and no staging
//   directory is left.
// - What is written: every parameter once, under name_map(its name) (identity when unset), in
//   named_parameters() order, shape as the model's, values of the fp32 master converted to
//   `dtype` (kFloat or kBFloat16); a tied parameter once, under the name its unit lists it by
//   (its aliases are not written: readers tie them from their config). Buffers are not written
//   (what transformers' model files hold). Mapped names must be non-empty, distinct and not
//   `__metadata__` (the header's metadata key): a collision is an error naming both
//   parameters, before anything is written.
// - Files: tensors in order, a new file whenever the next tensor would take the current one
//   above max_file_bytes (a tensor is never split): one file is `model.safetensors`; several
//   are `model-00001-of-0000N.safetensors` ... with `model.safetensors.index.json`
//   ({"metadata": {"total_size": tensor bytes}, "weight_map": {name: file}}), the layout
//   transformers' save_pretrained writes and safetensors_loader reads. Header metadata
//   {"format": "pt"} (transformers requires it). Then `text_files` in order; the last one (or,
//   with none, the index or the single file) marks the export complete. Every file is written
//   as `<name>.tmp` and renamed, so a text file named `<name>.tmp` for a file the export
//   writes (`config.json.tmp` beside `config.json`) is an error: every text file asked for is
//   in the result or refused.
// - Memory: ranks gather one unit at a time (the same all-gathers as a full checkpoint) and
//   rank 0 writes it, so no rank holds more than one unit's full parameters beside its shards.
// - Crash safe and non-destructive as save_checkpoint (Note [Checkpoint publication],
//   file_io.h): written in a marked staging directory beside `dir`, published by rename. An
//   existing `dir` is replaced only if it is empty or an earlier export (flatshard's marker,
//   holding only files an export writes); anything else — a downloaded model, a user's files —
//   is refused naming it. A failed export leaves `dir` as it was.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"

namespace flatshard {

class ShardedModel;

struct ExportOptions {
  std::function<std::string(const std::string&)> name_map;  // model name -> name in the files
  at::ScalarType dtype = at::kFloat;                         // kFloat or kBFloat16
  int64_t max_file_bytes = int64_t{5} * 1000 * 1000 * 1000;  // per file, tensor bytes
  std::vector<std::pair<std::string, std::string>> text_files;  // name, contents (plain names)
  bool durable = true;  // fsync before each rename (CheckpointOptions::durable)
  ProgressFn progress;  // per unit; unset: rank 0 logs after log_after_seconds
  double log_after_seconds = 10;
  IoHook fault_hook;  // test seam, as CheckpointOptions::fault_hook
};

void export_safetensors(const ShardedModel& model, const std::string& dir,
                        const ExportOptions& options);

}  // namespace flatshard
