// save_checkpoint(): every rank writes its part into the staging directory, rank 0 writes the
// manifest and publishes (Note [Checkpoint publication]). Errors are deferred to agree() points
// so that every rank keeps issuing the same collectives.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <unordered_map>

#include "checkpoint/checkpoint.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/progress.h"
#include "checkpoint/rank_sync.h"
#include "checkpoint/tensor_file.h"
#include "checkpoint/unit_ranges.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/sharded_model.h"
#include "fsdp/tensor_parallel.h"
#include "support/json.h"

namespace flatshard {

namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimFile = "optim.safetensors";

// Under tensor parallelism each tp rank's shard group writes its own files.
std::string shard_file(int rank, int world, int tp_rank, int tp) {
  char buf[96];
  if (tp > 1)
    std::snprintf(buf, sizeof buf, "shard-%05d-of-%05d-tp-%05d-of-%05d.safetensors", rank, world,
                  tp_rank, tp);
  else
    std::snprintf(buf, sizeof buf, "shard-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

// What a save reads from the model, the same on every rank.
struct SaveSource {
  const ShardedModel& model;
  std::optional<OptimizerRecord> optim;
  std::vector<int64_t> steps;                   // per unit (0: no optimizer state)
  std::vector<std::vector<at::Tensor>> fields;  // per unit: optimizer state, as optim->fields
  std::unordered_map<std::string, std::vector<std::string>> aliases;  // owner -> tied names
  const TensorParallel* tp = nullptr;  // when the model is parallelized over more than one rank
  int tp_size = 1, tp_rank = 0;
  TpPlacement placement(const std::string& name) const {
    return tp ? tp->placement(name) : TpPlacement{};
  }
};

SaveSource read_source(const ShardedModel& model, const torch::optim::Optimizer* opt) {
  SaveSource s{model, std::nullopt, {}, {}, {}};
  if (opt) s.optim = describe_optimizer(*opt);
  s.tp_size = model.mesh().size(MeshDim::kTp);
  s.tp_rank = model.mesh().coord(MeshDim::kTp);
  if (s.tp_size > 1) {
    s.tp = find_tensor_parallel(&model.module());
    TORCH_CHECK(s.tp != nullptr && s.tp->tp_size() == s.tp_size, "the mesh has tp ", s.tp_size,
                " but the model was not parallelized over it (fsdp/tensor_parallel.h)");
  }
  for (size_t u = 0; u < model.num_units(); ++u) {
    const FlatParam& f = model.unit(u).flat();
    std::vector<at::Tensor> fields(s.optim ? s.optim->fields.size() : 0);  // undefined: none
    int64_t step = 0;
    if (s.optim) step = get_unit_optimizer_state(*opt, *s.optim, f, fields);
    s.steps.push_back(step);
    s.fields.push_back(std::move(fields));
  }
  for (const auto& [first, others] : model.plan().tied) s.aliases[first] = others;
  return s;
}

// Units, parameters with their pieces, buffers, optimizer: everything but the file records,
// computed identically on every rank.
Manifest describe(const SaveSource& s, CheckpointKind kind, int world, int64_t chunk) {
  Manifest m;
  m.kind = kind == CheckpointKind::kFull ? "full" : "sharded";
  m.world_size = world;
  m.tp_size = s.tp_size;
  m.crc_chunk_bytes = chunk;
  m.optimizer = s.optim;
  if (m.optimizer) m.optimizer->file = kind == CheckpointKind::kFull ? kOptimFile : "";
  for (size_t u = 0; u < s.model.num_units(); ++u) {
    const Unit& unit = s.model.unit(u);
    const FlatParam& f = unit.flat();
    const FlatLayout& l = f.layout();
    m.units.push_back(
        UnitRecord{unit.name(), to_string(unit.strategy()), l.used_numel, l.padded_numel});
    for (size_t i = 0; i < f.params().size(); ++i) {
      ValueRecord v;
      v.name = f.params()[i].name;
      auto it = s.aliases.find(v.name);
      if (it != s.aliases.end()) v.aliases = it->second;
      v.dtype = at::kFloat;
      v.tp = s.placement(v.name);
      v.shape = tp_full_shape(l.shapes[i], v.tp, s.tp_size);  // the full (logical) shape
      v.unit = unit.name();
      v.step = s.steps[u];
      const FlatRange param{l.offsets[i], l.offsets[i] + l.numels[i]};
      if (kind == CheckpointKind::kFull) {
        v.pieces.push_back(Piece{kModelFile, 0, l.numels[i]});
      } else {
        // Tp-major order (manifest.h): tp rank k's slice is elements [k*n, (k+1)*n) of the
        // value; a replicated value is written by tp rank 0's shard group alone.
        const int writers = v.tp.style == TpStyle::kReplicate ? 1 : s.tp_size;
        for (int k = 0; k < writers; ++k) {
          const int64_t base = k * l.numels[i];
          for (int r = 0; r < world; ++r) {
            const FlatRange o = intersect(param, write_range(f, r, world));
            if (o.size() > 0)
              v.pieces.push_back(Piece{shard_file(r, world, k, s.tp_size),
                                       base + o.begin - param.begin, base + o.end - param.begin});
          }
        }
      }
      m.params.push_back(std::move(v));
    }
  }
  for (const auto& b : s.model.module().named_buffers(/*recurse=*/true)) {
    ValueRecord v;
    v.name = b.key();
    v.dtype = b.value().scalar_type();
    v.shape = b.value().sizes().vec();
    v.pieces.push_back(Piece{
        kind == CheckpointKind::kFull ? kModelFile : shard_file(0, world, 0, s.tp_size), 0,
        b.value().numel()});
    m.buffers.push_back(std::move(v));
  }
  return m;
}

TensorEntry entry(const std::string& name, at::ScalarType dtype, std::vector<int64_t> shape) {
  TensorEntry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = std::move(shape);
  return e;
}

at::Tensor to_cpu(const at::Tensor& t) { return t.detach().to(at::kCPU).contiguous(); }

// kSharded: this rank's file, written without collectives.
FileRecord write_shard(const SaveSource& s, const Manifest& m, const std::string& staging, int rank,
                       int world, const CheckpointOptions& o, ProgressReporter& progress) {
  const auto& fields = m.optimizer ? m.optimizer->fields : std::vector<std::string>{};
  const std::string file = shard_file(rank, world, s.tp_rank, s.tp_size);
  const bool buffers = rank == 0 && s.tp_rank == 0;
  // Pieces of this rank, per unit: (param index, range in the flat buffer).
  std::vector<std::vector<std::pair<size_t, FlatRange>>> mine(s.model.num_units());
  std::vector<std::string> suffixes{""};  // the parameter, then each optimizer field
  for (const auto& fld : fields) suffixes.push_back("." + fld);
  std::vector<TensorEntry> entries;
  for (size_t u = 0; u < s.model.num_units(); ++u) {
    const FlatParam& f = s.model.unit(u).flat();
    const FlatLayout& l = f.layout();
    for (size_t i = 0; i < f.params().size(); ++i) {
      const FlatRange o =
          intersect({l.offsets[i], l.offsets[i] + l.numels[i]}, write_range(f, rank, world));
      const bool replicated = s.placement(f.params()[i].name).style == TpStyle::kReplicate;
      if (o.size() > 0 && (s.tp_rank == 0 || !replicated)) mine[u].emplace_back(i, o);
    }
    for (const std::string& suffix : suffixes)
      for (const auto& [i, o] : mine[u])
        entries.push_back(entry(f.params()[i].name + suffix, at::kFloat, {o.size()}));
  }
  if (buffers)
    for (const auto& b : m.buffers) entries.push_back(entry(b.name, b.dtype, b.shape));
  TensorFileWriter writer(
      staging, file, std::move(entries),
      {{"format", "pt"},
       {"flatshard", "shard " + std::to_string(rank) + " of " + std::to_string(world) +
                         (s.tp_size > 1 ? ", tp " + std::to_string(s.tp_rank) + " of " +
                                              std::to_string(s.tp_size)
                                        : "")}},
      o.crc_chunk_bytes, o.fault_hook, o.durable);
  for (size_t u = 0; u < s.model.num_units(); ++u) {
    const FlatParam& f = s.model.unit(u).flat();
    const FlatRange held = master_range(f, rank), written = write_range(f, rank, world);
    auto write_from = [&](const at::Tensor& local, const std::string& suffix) {
      if (mine[u].empty()) return;
      // One device-to-host copy per unit and tensor kind, then views of it per parameter.
      const at::Tensor cpu =
          local.defined() ? to_cpu(local.narrow(0, written.begin - held.begin, written.size()))
                          : at::zeros({written.size()}, at::kFloat);
      for (const auto& [i, o] : mine[u])
        writer.write(f.params()[i].name + suffix, cpu.narrow(0, o.begin - written.begin, o.size()));
    };
    write_from(f.master(), "");
    for (size_t k = 0; k < fields.size(); ++k) write_from(s.fields[u][k], "." + fields[k]);
    progress.update(static_cast<int64_t>(u + 1), writer.bytes_written());
  }
  if (buffers)
    for (const auto& b : s.model.module().named_buffers(true))
      writer.write(b.key(), to_cpu(b.value()));
  return writer.finish();
}

// kFull: every rank gathers unit by unit; rank 0 writes model.safetensors and optim.safetensors
// in model order. Rank 0's write errors are recorded in `err` and stop its writing, never the
// gathers the other ranks are in.
std::vector<FileRecord> write_full(const SaveSource& s, const Manifest& m,
                                   const std::string& staging, const CheckpointOptions& o,
                                   ProgressReporter& progress, std::exception_ptr& err) {
  Communicator& comm = s.model.comm();
  const bool writer_rank = comm.rank() == 0;
  const auto& fields = m.optimizer ? m.optimizer->fields : std::vector<std::string>{};
  std::unique_ptr<TensorFileWriter> model_file, optim_file;
  auto guarded = [&](const std::function<void()>& fn) {
    if (!writer_rank || err) return;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
  };
  guarded([&] {
    std::unordered_map<std::string, const ValueRecord*> owners;
    for (const auto& v : m.params) owners[v.name] = &v;
    std::vector<TensorEntry> model_entries, optim_entries;
    for (const auto& p : s.model.module().named_parameters(/*recurse=*/true)) {
      model_entries.push_back(entry(p.key(), at::kFloat, p.value().sizes().vec()));
      if (owners.count(p.key()))  // tied aliases carry no optimizer state of their own
        for (const auto& fld : fields)
          optim_entries.push_back(entry(p.key() + "." + fld, at::kFloat, p.value().sizes().vec()));
    }
    for (const auto& b : m.buffers) model_entries.push_back(entry(b.name, b.dtype, b.shape));
    model_file = std::make_unique<TensorFileWriter>(staging, kModelFile, std::move(model_entries),
                                                    Metadata{{"format", "pt"}}, o.crc_chunk_bytes,
                                                    o.fault_hook, o.durable);
    if (m.optimizer) {
      Metadata md{{"format", "pt"}, {"optimizer", m.optimizer->type}};
      bool uniform = true;
      for (const auto& v : m.params) uniform = uniform && v.step == m.params.front().step;
      if (uniform && !m.params.empty())
        md.emplace_back("step", std::to_string(m.params.front().step));
      optim_file = std::make_unique<TensorFileWriter>(staging, kOptimFile, std::move(optim_entries),
                                                      std::move(md), o.crc_chunk_bytes,
                                                      o.fault_hook, o.durable);
    }
  });
  int64_t bytes = 0;
  for (size_t u = 0; u < s.model.num_units(); ++u) {
    const FlatParam& f = s.model.unit(u).flat();
    const FlatLayout& l = f.layout();
    for (size_t k = 0; k <= fields.size(); ++k) {
      if (l.padded_numel == 0) break;
      const at::Tensor full = f.gather_whole(k == 0 ? f.master() : s.fields[u][k - 1]);
      guarded([&] {
        const at::Tensor cpu = to_cpu(full);
        for (size_t i = 0; i < f.params().size(); ++i) {
          const std::string& name = f.params()[i].name;
          const at::Tensor t = cpu.narrow(0, l.offsets[i], l.numels[i]);
          if (k > 0) {
            optim_file->write(name + "." + fields[k - 1], t);
            continue;
          }
          model_file->write(name, t);
          auto it = s.aliases.find(name);
          if (it != s.aliases.end())
            for (const auto& alias : it->second) model_file->write(alias, t);
        }
        bytes += cpu.nbytes();
      });
    }
    progress.update(static_cast<int64_t>(u + 1), bytes);
  }
  std::vector<FileRecord> records;
  guarded([&] {
    for (const auto& b : s.model.module().named_buffers(true))
      model_file->write(b.key(), to_cpu(b.value()));
    records.push_back(model_file->finish());
    if (optim_file) records.push_back(optim_file->finish());
  });
  return records;
}

// begin_save's check of an existing checkpoint directory (Note [Checkpoint publication]): it
// may hold only what flatshard wrote there — its manifest, the files the manifest lists and the
// marker. Anything else is the user's, and the save refuses rather than delete it.
void check_only_checkpoint_files(const std::string& dir) {
  const std::string path = join_path(dir, kManifestName);
  Manifest old;
  try {
    old = Manifest::parse(read_text_file(path), path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint: refusing to replace '", dir, "': its ", kManifestName,
                " cannot be read, so flatshard cannot tell its files from anyone else's (",
                e.msg(), "); remove or move the directory yourself");
  }
  std::vector<std::string> foreign;
  for (const std::string& name : list_dir(dir)) {
    bool ours = name == kManifestName || name == kMarkerName;
    for (const auto& f : old.files) ours = ours || f.name == name;
    if (!ours) foreign.push_back(name);
  }
  if (foreign.empty()) return;
  std::sort(foreign.begin(), foreign.end());
  std::string list;
  for (size_t i = 0; i < foreign.size() && i < 10; ++i) list += (i ? ", '" : "'") + foreign[i] + "'";
  TORCH_CHECK(false, "checkpoint: refusing to replace '", dir, "': it holds ", foreign.size(),
              " file(s) the checkpoint did not write: ", list, foreign.size() > 10 ? ", ..." : "",
              "; move them out (a save replaces the whole directory) or save elsewhere");
}

}  // namespace

// The save of one shard group: its ranks hold the whole model between them.
static void save_in_group(const ShardedModel& model, const torch::optim::Optimizer* optimizer,
                   const std::string& dir_arg, const CheckpointOptions& o) {
  at::NoGradGuard no_grad;
  Communicator& comm = model.comm();
  const int rank = comm.rank(), world = comm.world_size();
  // Under tensor parallelism the group is shard x tp: each tp rank's shard group writes its
  // slices' files, and (shard 0, tp 0) writes the manifest and publishes.
  Communicator* tp = model.mesh().size(MeshDim::kTp) > 1 ? model.mesh().tp() : nullptr;
  const bool lead = rank == 0 && model.mesh().coord(MeshDim::kTp) == 0;
  std::string dir = normalize_dir(dir_arg);
  std::string staging;  // begin_save's, on the lead rank; then sent to every rank
  const std::string what = "save_checkpoint('" + dir + "')";
  TORCH_CHECK(o.crc_chunk_bytes > 0, what, ": crc_chunk_bytes must be positive");
  auto agreed = [&](const std::function<void()>& fn) {
    run_agreed_tp(model.mesh(), comm, what, fn);
  };

  std::optional<SaveSource> source;
  Manifest manifest;
  agreed([&] {
    TORCH_CHECK(tp == nullptr || o.kind == CheckpointKind::kSharded,
                "a full checkpoint (CheckpointKind::kFull) of a tensor-parallel model (mesh ",
                model.mesh().shape().to_string(), ") is not supported yet; save kSharded (it "
                "loads at any shard and tp size, also into an unsharded model) or export with "
                "save_hf");
    source.emplace(read_source(model, optimizer));
    manifest = describe(*source, o.kind, world, o.crc_chunk_bytes);
    if (o.grad_scaler && o.grad_scaler->enabled())
      manifest.grad_scaler = o.grad_scaler->state_dict();
    if (!o.training_state.empty())
      manifest.training_state =
          check_training_state(o.training_state, "CheckpointOptions::training_state");
    if (lead) {
      dir = resolve_save_dir(dir);  // a symlink is followed (Note [Checkpoint publication])
      staging = begin_save(dir, kManifestName, o.durable, check_only_checkpoint_files);
    }
  });
  staging = all_gather_text(comm, staging).front();
  if (tp != nullptr) staging = all_gather_text(*tp, staging).front();

  try {
    ProgressReporter progress(o.progress, o.log_after_seconds, rank, what,
                              static_cast<int64_t>(model.num_units()));
    if (o.kind == CheckpointKind::kSharded) {
      FileRecord mine;
      agreed([&] { mine = write_shard(*source, manifest, staging, rank, world, o, progress); });
      for (const std::string& text : all_gather_text(comm, file_record_json(mine))) {
        // Each shard rank's record, then (tp) that shard rank's record on every tp rank.
        const std::vector<std::string> all =
            tp ? all_gather_text(*tp, text) : std::vector<std::string>{text};
        for (const std::string& t : all) {
          const json::Json record = json::parse(t, "file record");
          manifest.files.push_back(parse_file_record(json::Node(record, "file record")));
        }
      }
    } else {
      std::exception_ptr err;  // write_full's collectives defer a local failure to here
      manifest.files = write_full(*source, manifest, staging, o, progress, err);
      agree(comm, err, what);
    }
    progress.finish();
    agreed([&] {
      if (!lead) return;
      write_text_file_atomic(join_path(staging, kManifestName), manifest.to_json(), o.fault_hook,
                             o.durable);
      publish(dir, staging, o.fault_hook, o.durable, o.use_rename_exchange);
    });
  } catch (...) {
    // Whatever is in the staging directory now is incomplete, or the previous checkpoint
    // displaced by publish(): never needed again.
    if (lead) abandon_save(staging);
    throw;
  }
}

// Note [HSDP checkpoints]: replicas hold identical shards, so only the shard group of
// replicate rank 0 writes (a checkpoint of its S ranks, loadable at any world size); the other
// groups wait for its outcome in the agreement across the replicate group, so every rank
// returns after publication or throws the writing group's error. Loads need nothing special:
// each shard group reads the ranges its own shards need.
void save_checkpoint(const ShardedModel& model, const torch::optim::Optimizer* optimizer,
                     const std::string& dir, const CheckpointOptions& o) {
  model.wait_offload_steps();  // Note [Offload step in backward]: masters still being stepped
  write_from_first_replica(model.mesh(), "save_checkpoint('" + dir + "')",
                           [&] { save_in_group(model, optimizer, dir, o); });
}

}  // namespace flatshard
