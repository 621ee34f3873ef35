// flatshard/checkpoint/checkpoint.h — save and resume sharded training, at any world size.
//
//   flatshard::save_checkpoint(*fsdp, &opt, "ckpt/step-1000");                // every rank
//   ...
//   auto fsdp = flatshard::fully_shard(model, other_plan, comm);           // any world size
//   torch::optim::AdamW opt(fsdp->parameters(), same_options);
//   flatshard::load_checkpoint(*fsdp, &opt, "ckpt/step-1000");             // every rank
//   flatshard::load_full_into_module(*plain_model, "ckpt/step-1000");      // no flatshard needed
//
// Contract
// - save_checkpoint / load_checkpoint are collective: every rank of the model's communicator
//   calls them with the same arguments, between training steps (no forward or backward in
//   flight). If any rank fails, every rank throws (no rank is left waiting).
// - kSharded: each rank writes `shard-RRRRR-of-WWWWW.safetensors` holding, for every parameter,
//   the part of it inside that rank's shard (tensor named after the parameter; optimizer state
//   as `<name>.<field>`), in parallel. kFull: rank 0 writes `model.safetensors` (every
//   parameter and buffer, fp32, original name and shape; a tied parameter under each of its
//   names, as state_dict() lists it) and `optim.safetensors` (`<name>.exp_avg`, ...), gathering
//   one unit at a time to CPU, so the model need not fit on one device. Both write
//   `manifest.json` last (checkpoint/manifest.h) and are crash safe: the directory is replaced
//   only once the new checkpoint is complete (Note [Checkpoint publication], file_io.h). A save
//   deletes nothing flatshard did not make: it refuses an existing directory holding files the
//   checkpoint did not write (naming them), touches only its own marked side directories
//   beside it, and follows a `dir` that is a symlink (the link is kept).
// - Loads read either kind, at any world size, into any plan of the same model: parameters are
//   matched by name (or tied alias) and each rank reads only the ranges its shards need.
//   Everything it reads is checked: sizes, header and data CRC-32s, names, dtypes and shapes;
//   errors name the file, the tensor, expected and actual values, and the rank. The manifest is
//   untrusted input: it is validated whole before any file is opened (Note [Strict manifest],
//   manifest.cpp) and names only plain files inside `dir` (Note [Checkpoint confinement]). A
//   missing `dir` is an error, never silently replaced by a backup (see recover_checkpoint).
// - Optimizer: torch::optim::AdamW or Adam built on ShardedModel::parameters(). Their per-unit
//   state (step, exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad) is saved per parameter and
//   resharded like the parameters, so a resumed run continues exactly. A new unit whose
//   parameters come with different step counts is an error. Hyperparameters (lr, betas, ...)
//   are recorded in the manifest but not restored: they belong to the code that builds the
//   optimizer (and its schedule). Pass nullptr to save or load the model alone.
// - Grad scaler (fp16 loss scaling, fsdp/grad_scaler.h): with CheckpointOptions::grad_scaler
//   set to an enabled scaler, the manifest carries its state (scale, growth tracker, constants);
//   LoadOptions::grad_scaler restores it on every rank, so a resumed run continues with the same
//   scale. The values are untrusted like the rest of the manifest (a non-finite or non-positive
//   scale is an error naming it). Loading into an enabled scaler from a checkpoint without that
//   state is an error; a disabled scaler neither saves nor loads. Save between steps (after
//   update()).
// - Training state: CheckpointOptions::training_state, a JSON object the caller fills (step,
//   data position, schedule, RNG, anything else), is checked on every rank before anything is
//   written (valid JSON, an object, at most kMaxTrainingStateBytes) and rank 0's is stored in
//   the manifest, so it is published atomically with the tensors; LoadOptions::training_state
//   gets it back (compact JSON text; "" when the checkpoint has none), as does
//   read_manifest(dir).training_state without a model. Untrusted on load like the manifest.
// - Buffers (module.named_buffers()) are saved from rank 0 and loaded on every rank.
// - HSDP (fully_shard with a ShardingMesh): collective over all R * S ranks. The shard group
//   of replicate rank 0 writes a checkpoint of S shards; the other groups only join the final
//   agreement (Note [HSDP checkpoints], save.cpp). Every rank loads (reads its own ranges).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace flatshard {

class ShardedModel;
class ShardedGradScaler;

enum class CheckpointKind { kSharded, kFull };

struct CheckpointProgress {
  int64_t units_done = 0;
  int64_t units_total = 0;
  int64_t bytes_done = 0;  // written or read by this rank so far
  double seconds = 0;
};
using ProgressFn = std::function<void(const CheckpointProgress&)>;

struct CheckpointOptions {
  CheckpointKind kind = CheckpointKind::kSharded;
  // fsync every file and directory before it is renamed into place, so that a power loss (not
  // only a crashed process) cannot leave a published checkpoint with missing data.
  bool durable = true;
  // Data bytes covered by one CRC-32 in the manifest: a load verifies whole chunks, so smaller
  // chunks mean less over-read when resharding and a larger manifest.
  int64_t crc_chunk_bytes = int64_t{1} << 20;
  // Called after every unit on every rank. Unset: rank 0 logs to stderr once the save has run
  // longer than log_after_seconds (<= 0: never).
  ProgressFn progress;
  double log_after_seconds = 10;
  // Test seam (Note [Checkpoint publication]): called on this rank before/after every write,
  // rename and publication step; a throw aborts the save there.
  IoHook fault_hook;
  // false: publish with two renames even where RENAME_EXCHANGE works (tests that path).
  bool use_rename_exchange = true;
  // fp16 training: the scaler whose state the checkpoint carries (nullptr: none). Not owned.
  const ShardedGradScaler* grad_scaler = nullptr;
  // The caller's training state, a JSON object as text ("": none). See the contract.
  std::string training_state;
};

struct LoadOptions {
  ProgressFn progress;
  double log_after_seconds = 10;
  // fp16 training: the scaler the checkpoint's scaler state is restored into (nullptr: none,
  // and any saved state is ignored). Not owned.
  ShardedGradScaler* grad_scaler = nullptr;
  // Set: receives the checkpoint's training state (compact JSON text; "" when it has none).
  // Not owned.
  std::string* training_state = nullptr;
};

void save_checkpoint(const ShardedModel& model, const torch::optim::Optimizer* optimizer,
                     const std::string& dir, const CheckpointOptions& options = {});

void load_checkpoint(ShardedModel& model, torch::optim::Optimizer* optimizer,
                     const std::string& dir, const LoadOptions& options = {});

// Not collective: loads a checkpoint of either kind into an unwrapped module (e.g. for
// inference). Strict: every parameter and buffer of `module` must be in the checkpoint with the
// same shape (values are converted to the module's dtype), and the checkpoint must hold nothing
// the module lacks.
void load_full_into_module(torch::nn::Module& module, const std::string& dir,
                           const LoadOptions& options = {});

// Not collective (call it on one rank, before the load). A save that stopped between the two
// renames of the fallback publication (filesystems without RENAME_EXCHANGE; Note [Checkpoint
// publication]) leaves `dir` missing and the previous checkpoint in flatshard's marked backup
// `<dir>.flatshard-old-<token>`; a load then fails naming it. This renames that backup back to
// `dir`, says so on stderr and returns true; false if `dir` already holds a checkpoint. Throws
// if `dir` is missing and no complete, marked backup exists (it never guesses further).
bool recover_checkpoint(const std::string& dir);

// The manifest of the checkpoint at `dir`, checked (e.g. to find its kind or step count).
Manifest read_manifest(const std::string& dir);

}  // namespace flatshard
