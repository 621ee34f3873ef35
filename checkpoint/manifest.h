// flatshard/checkpoint/manifest.h — what a checkpoint directory holds: manifest.json.
//
// The manifest is the last file a save writes (Note [Checkpoint publication]) and the first a
// load reads. It describes, independently of any plan or world size:
// - every parameter and buffer by its original name: dtype, shape, tied aliases, the unit that
//   owned it and its optimizer step count, and its *pieces*: which file holds which range
//   [begin, end) of its flattened elements, as a tensor named after the parameter (optimizer
//   state as `<name>.<field>`, e.g. `wte.weight.exp_avg`). A full checkpoint has one piece per
//   value; a sharded one a piece per rank whose shard overlaps it. Loading at any world size and
//   plan is then a matter of copying the overlapping ranges, by name (fsdp-independent);
// - every file: its size, the CRC-32 of its header, and for each tensor in it dtype, shape,
//   byte offsets and the CRC-32 of each `crc_chunk_bytes` chunk of its data (so a load that reads
//   part of a tensor verifies only what it reads);
// - the unit plan and world size it was written with (informational) and the optimizer's type,
//   hyperparameters (informational) and state fields;
// - optionally (only when a save was given an enabled ShardedGradScaler) the scaler's state:
//   `grad_scaler` {scale, growth_factor, backoff_factor, growth_interval, growth_tracker}, checked
//   by GradScalerState::check (fsdp/grad_scaler.h). Manifests without it are unchanged.
// - optionally (only when a save was given one, CheckpointOptions::training_state) the user's
//   training state: `training_state`, one JSON object (step, data position, schedule, RNG, ...)
//   of at most kMaxTrainingStateBytes, kept as compact JSON text; flatshard does not interpret
//   it. It is inside the manifest, so it is published atomically with the checkpoint and covered
//   by the manifest's CRC.
// - under tensor parallelism (docs/tensor-parallel.md, "Checkpoints"), `tp_size` (written only
//   when more than 1) and, per parameter, `tp`: its placement ("colwise", "colwise/3",
//   "rowwise", "replicate"; fsdp/tensor_parallel.h TpPlacement). The shape is always the FULL
//   shape. A split value's elements are numbered in tp-major order: tp rank 0's slice
//   (tp_slice), flattened, then rank 1's, ...; for colwise with one block that is the full
//   value's own row-major order. ValueReader (checkpoint/load.cpp) gives readers the full value.
// The manifest carries its own CRC-32 (`manifest_crc32`, over the text before it); parse()
// checks it and every field, throwing with the path and the field at fault (a JSON Pointer,
// e.g. "manifest.json: /params/3/step: expected an integer, got 1.5 (entry 'wte.weight')").
// The CRC catches accidents, not edits (anyone can recompute it), so parse() also validates
// the whole manifest before a load opens any file (Note [Strict manifest], manifest.cpp): a
// newer format version is refused first with its own message; unknown fields, duplicate keys
// (support/json.h), file names that are not plain names, shapes overflowing int64, pieces that
// are unsorted, overlap or leave gaps, a piece whose file tensor has another dtype or element
// count, negative step counts and step counts that differ within a unit are all errors.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/tensor_parallel.h"

namespace flatshard {

namespace json {
class Node;  // support/json.h
}  // namespace json

inline constexpr const char* kManifestName = "manifest.json";
inline constexpr int kCheckpointFormatVersion = 1;
// The largest training state (compact JSON text) a checkpoint carries: far more than a step, a
// data position, a schedule and RNG states need; a bound so that a manifest stays small.
inline constexpr int64_t kMaxTrainingStateBytes = int64_t{1} << 20;

struct Piece {
  std::string file;
  int64_t begin = 0;  // elements of the flattened value
  int64_t end = 0;
};

struct ValueRecord {
  std::string name;
  std::vector<std::string> aliases;  // other names of the same (tied) tensor
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::string unit;  // parameters: the unit that owned it when saved
  int64_t step = 0;  // parameters: optimizer steps taken (0: no optimizer state)
  std::vector<Piece> pieces;
  TpPlacement tp;  // parameters of a manifest with tp_size > 1; kReplicate otherwise
  int64_t numel() const;
};

struct FileTensor {
  TensorEntry entry;            // as in the file's safetensors header
  std::vector<uint32_t> crc32;  // one per chunk of the data, in order
};

struct FileRecord {
  std::string name;  // relative to the checkpoint directory
  int64_t bytes = 0;
  uint32_t header_crc32 = 0;
  std::vector<FileTensor> tensors;
  const FileTensor* find(const std::string& tensor) const;
};

struct OptimizerRecord {
  std::string type;                 // "AdamW" or "Adam"
  std::vector<std::string> fields;  // state tensors per parameter, e.g. exp_avg, exp_avg_sq
  std::string file;                 // where `<name>.<field>` live; empty: next to each piece
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;  // of the first group
  bool amsgrad = false;
};

struct UnitRecord {
  std::string name;
  std::string strategy;
  int64_t numel = 0;
  int64_t padded_numel = 0;
};

struct Manifest {
  int version = kCheckpointFormatVersion;
  std::string kind;  // "sharded" or "full"
  int world_size = 1;
  int tp_size = 1;  // tensor-parallel ranks it was saved from (each param's `tp`)
  int64_t crc_chunk_bytes = 0;
  std::vector<UnitRecord> units;
  std::vector<ValueRecord> params;
  std::vector<ValueRecord> buffers;
  std::optional<OptimizerRecord> optimizer;
  std::optional<GradScalerState> grad_scaler;  // fp16 loss scaling (fsdp/grad_scaler.h)
  std::optional<std::string> training_state;   // compact JSON text of an object (see above)
  std::vector<FileRecord> files;

  std::string to_json() const;
  static Manifest parse(const std::string& text, const std::string& path);

  const FileRecord* file(const std::string& name) const;
};

// `text` (a JSON object of at most kMaxTrainingStateBytes) in compact form; c10::Error naming
// `what` otherwise (invalid JSON, not an object, too large).
std::string check_training_state(const std::string& text, const std::string& what);

// One file's entry as JSON text and back (ranks send theirs to rank 0 as text).
std::string file_record_json(const FileRecord& f);
FileRecord parse_file_record(const json::Node& j);

}  // namespace flatshard
