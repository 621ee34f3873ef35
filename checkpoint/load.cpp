// load_checkpoint() and load_full_into_module(): match the model's parameters to the manifest by
// name, read (and verify) the ranges this rank needs into CPU staging buffers, agree across
// ranks, and only then apply them — a failed load leaves model and optimizer untouched.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/checkpoint.h"
#include "checkpoint/load_into_shards.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/progress.h"
#include "checkpoint/rank_sync.h"
#include "support/input_file.h"
#include "checkpoint/tensor_file.h"
#include "checkpoint/unit_ranges.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/sharded_model.h"
#include "fsdp/tensor_parallel.h"

namespace flatshard {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << c10::IntArrayRef(s);
  return os.str();
}

// Reads ranges of parameters (or their optimizer state) from a checkpoint's files, opening and
// checking each file once, on first use.
class ValueReader {
 public:
  ValueReader(std::string dir, const Manifest& m) : dir_(std::move(dir)), m_(m) {}

  // Elements [begin, end) of the full value `v` (field empty) or of its optimizer field, in
  // the full value's row-major order, into `dst` (CPU, contiguous, end - begin elements of any
  // dtype; converted from the stored one). A value whose tp-major order (manifest.h) differs
  // from that is read whole, once (full()).
  void read(const ValueRecord& v, const std::string& field, int64_t begin, int64_t end,
            const at::Tensor& dst) {
    if (!tp_reordered(v)) return read_stored(v, field, begin, end, dst);
    dst.copy_(full(v, field).narrow(0, begin, end - begin));
  }

  // The whole full value, flat, in its stored dtype; the last one read is kept (each rank asks
  // for the fields of one parameter in turn).
  const at::Tensor& full(const ValueRecord& v, const std::string& field) {
    const std::string tensor = field.empty() ? v.name : v.name + "." + field;
    if (!cached_.defined() || cached_name_ != tensor) {
      cached_ = at::Tensor();
      at::Tensor stored = at::empty({v.numel()}, at::TensorOptions().dtype(v.dtype));
      read_stored(v, field, 0, v.numel(), stored);
      cached_ = tp_unslice(stored, v.shape, v.tp, m_.tp_size).reshape({-1});
      cached_name_ = tensor;
    }
    return cached_;
  }

  // Elements [begin, end) in the stored order (tp-major for a split value; manifest.h).
  void read_stored(const ValueRecord& v, const std::string& field, int64_t begin, int64_t end,
                   const at::Tensor& dst) {
    const std::string tensor = field.empty() ? v.name : v.name + "." + field;
    const int64_t es = static_cast<int64_t>(c10::elementSize(v.dtype));
    int64_t covered = 0;
    for (const Piece& p : v.pieces) {
      TORCH_CHECK(0 <= p.begin && p.begin <= p.end && p.end <= v.numel(), "manifest: '", v.name,
                  "' has a piece [", p.begin, ", ", p.end, ") outside its ", v.numel(),
                  " elements");
      const int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
      if (lo >= hi) continue;
      const std::string& file_name =
          field.empty() || m_.optimizer->file.empty() ? p.file : m_.optimizer->file;
      at::Tensor raw = at::empty({hi - lo}, at::TensorOptions().dtype(v.dtype));
      file(file_name).read(tensor, (lo - p.begin) * es, (hi - p.begin) * es, raw.data_ptr());
      dst.narrow(0, lo - begin, hi - lo).copy_(raw);
      covered += hi - lo;
      bytes_ += (hi - lo) * es;
    }
    TORCH_CHECK(covered == end - begin, "checkpoint '", dir_, "': elements [", begin, ", ", end,
                ") of '", tensor, "' are not all in its files (", covered,
                " found); the manifest's pieces are incomplete");
  }
  int64_t bytes() const { return bytes_; }
  int tp_size() const { return m_.tp_size; }

 private:
  bool tp_reordered(const ValueRecord& v) const {
    return m_.tp_size > 1 && v.tp.style != TpStyle::kReplicate &&
           !(v.tp.style == TpStyle::kColwise && v.tp.parts == 1);
  }

  const TensorFileReader& file(const std::string& name) {
    auto it = open_.find(name);
    if (it != open_.end()) return *it->second;
    const FileRecord* rec = m_.file(name);
    TORCH_CHECK(rec != nullptr, "checkpoint '", dir_, "': file '", name,
                "' is used by the manifest's pieces but not listed in its files");
    auto reader = std::make_unique<TensorFileReader>(dir_, *rec, m_.crc_chunk_bytes);
    return *open_.emplace(name, std::move(reader)).first->second;
  }

  std::string dir_;
  const Manifest& m_;
  std::map<std::string, std::unique_ptr<TensorFileReader>> open_;
  int64_t bytes_ = 0;
  std::string cached_name_;
  at::Tensor cached_;
};

// Lookup by name or tied alias, tracking which records were used (strict loads).
class RecordIndex {
 public:
  RecordIndex(const std::vector<ValueRecord>& records, const char* kind) : kind_(kind) {
    for (const auto& r : records) {
      by_name_[r.name] = &r;
      for (const auto& a : r.aliases) by_name_.emplace(a, &r);
    }
    all_ = &records;
  }
  const ValueRecord& get(const std::string& name, const std::vector<int64_t>& shape,
                         const std::string& where) {
    auto it = by_name_.find(name);
    TORCH_CHECK(it != by_name_.end(), kind_, " '", name, "'", where,
                " is not in the checkpoint; was it saved from another model?");
    TORCH_CHECK(it->second->shape == shape, kind_, " '", name, "'", where,
                ": the checkpoint has shape ", shape_str(it->second->shape), ", the model ",
                shape_str(shape));
    used_.insert(it->second);
    return *it->second;
  }
  void check_all_used() const {
    std::string extra;
    int n = 0;
    for (const auto& r : *all_)
      if (!used_.count(&r) && n++ < 5) extra += (extra.empty() ? "'" : ", '") + r.name + "'";
    TORCH_CHECK(n == 0, "the checkpoint has ", n, " ", kind_, "(s) the model lacks: ", extra,
                n > 5 ? ", ..." : "", "; was it saved from another model?");
  }

 private:
  const char* kind_;
  const std::vector<ValueRecord>* all_ = nullptr;
  std::unordered_map<std::string, const ValueRecord*> by_name_;
  std::unordered_set<const ValueRecord*> used_;
};

Manifest read_manifest_at(const std::string& dir) {
  const std::string path = join_path(dir, kManifestName);
  // No fallback to a backup (Note [Checkpoint publication]): a missing checkpoint is an error
  // that says what an interrupted save left and how to recover it.
  TORCH_CHECK(path_exists(path), "no checkpoint at '", dir, "': ", kManifestName, " is missing",
              describe_side_dirs(dir, kManifestName));
  return Manifest::parse(read_text_file(path), path);
}

// One unit's staged values on this rank: the master range and each optimizer field.
struct StagedUnit {
  at::Tensor master;
  std::vector<at::Tensor> fields;
  int64_t step = 0;
};

struct StagedValue {
  at::Tensor target;
  at::Tensor value;
};

}  // namespace

Manifest read_manifest(const std::string& dir) { return read_manifest_at(normalize_dir(dir)); }

bool recover_checkpoint(const std::string& dir) {
  return recover_interrupted_save(dir, kManifestName);
}

namespace {

// A sharded flatshard checkpoint as a ParamLoader (checkpoint/load_into_shards.h): the
// manifest is read and validated once, at check; each read goes through ValueReader, so it
// reads only the pieces that overlap the requested range and verifies their chunks' CRCs.
class CheckpointLoader {
 public:
  CheckpointLoader(std::string dir, NameMap name_map, std::shared_ptr<LoadStats> stats)
      : dir_(std::move(dir)), name_map_(std::move(name_map)), stats_(std::move(stats)) {}

  void check(const std::vector<PlannedParam>& params) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!manifest_) {
      manifest_ = std::make_unique<Manifest>(read_manifest_at(normalize_dir(dir_)));
      index_ = std::make_unique<RecordIndex>(manifest_->params, "parameter");
      reader_ = std::make_unique<ValueReader>(normalize_dir(dir_), *manifest_);
    }
    const std::string where = " (checkpoint '" + dir_ + "')";
    for (const PlannedParam& p : params) {
      const std::string stored = name_map_ ? name_map_(p.name) : p.name;
      records_[p.name] = &index_->get(stored, p.shape, where);
    }
  }

  void read(const std::string& name, int64_t begin, int64_t end, const at::Tensor& dst) {
    if (end <= begin) return;
    at::Tensor staged = at::empty({end - begin}, at::TensorOptions().dtype(at::kFloat));
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = records_.find(name);
      TORCH_CHECK(it != records_.end(), "checkpoint loader: parameter '", name,
                  "' was not checked; fully_shard calls check() first");
      const int64_t before = reader_->bytes();
      reader_->read(*it->second, "", begin, end, staged);
      if (stats_) {
        stats_->bytes += reader_->bytes() - before;
        stats_->reads += 1;
      }
    }
    dst.copy_(staged);
  }

 private:
  std::string dir_;
  NameMap name_map_;
  std::shared_ptr<LoadStats> stats_;
  std::mutex mu_;  // rank threads share one loader
  std::unique_ptr<Manifest> manifest_;
  std::unique_ptr<RecordIndex> index_;
  std::unique_ptr<ValueReader> reader_;
  std::unordered_map<std::string, const ValueRecord*> records_;
};

}  // namespace

ParamLoader checkpoint_loader(const std::string& dir, NameMap name_map,
                              std::shared_ptr<LoadStats> stats) {
  return ParamLoader::over(
      std::make_shared<CheckpointLoader>(dir, std::move(name_map), std::move(stats)));
}

void load_checkpoint(ShardedModel& model, torch::optim::Optimizer* optimizer,
                     const std::string& dir_arg, const LoadOptions& o) {
  at::NoGradGuard no_grad;
  // Note [Offload step in backward]: no step may write after us; Note [Delayed offload step]:
  // the next forward reads the loaded masters, not the copies held from before.
  model.sync_offload_params();
  Communicator& comm = model.comm();
  const int rank = comm.rank();
  const std::string dir = normalize_dir(dir_arg);
  const std::string what = "load_checkpoint('" + dir + "')";

  std::vector<StagedUnit> staged(model.num_units());
  std::vector<StagedValue> buffers;
  std::optional<OptimizerRecord> want;
  std::optional<GradScalerState> scaler_state;
  std::string training_state;
  // Tensor parallelism: each parameter's slice for this tp rank, whatever tp the checkpoint
  // was saved at (docs/tensor-parallel.md, "Checkpoints").
  const int tp = model.mesh().size(MeshDim::kTp), tp_rank = model.mesh().coord(MeshDim::kTp);
  const TensorParallel* tpx = tp > 1 ? find_tensor_parallel(&model.module()) : nullptr;
  run_agreed(comm, what, [&] {
    TORCH_CHECK(tp == 1 || (tpx != nullptr && tpx->tp_size() == tp), "the mesh has tp ", tp,
                " (", model.mesh().describe_rank(), ") but the model was not parallelized over "
                "it (fsdp/tensor_parallel.h)");
    const Manifest m = read_manifest_at(dir);
    training_state = m.training_state.value_or("");
    if (o.grad_scaler && o.grad_scaler->enabled()) {
      TORCH_CHECK(m.grad_scaler.has_value(),
                  "the checkpoint was saved without grad scaler state (no "
                  "CheckpointOptions::grad_scaler, or a disabled scaler); load without "
                  "LoadOptions::grad_scaler to keep the scaler's current scale (",
                  o.grad_scaler->get_scale(), ")");
      scaler_state = m.grad_scaler;  // checked by the manifest's parse
    }
    if (optimizer) {
      want = describe_optimizer(*optimizer);
      TORCH_CHECK(m.optimizer.has_value(),
                  "the checkpoint was saved without optimizer state; "
                  "pass nullptr to load the model alone");
      TORCH_CHECK(m.optimizer->type == want->type, "the checkpoint holds ", m.optimizer->type,
                  " state, the optimizer is ", want->type);
      for (const auto& f : want->fields)
        TORCH_CHECK(std::find(m.optimizer->fields.begin(), m.optimizer->fields.end(), f) !=
                        m.optimizer->fields.end(),
                    "the optimizer needs state '", f, "', which the checkpoint lacks (amsgrad?)");
    }
    ValueReader reader(dir, m);
    RecordIndex params(m.params, "parameter");
    ProgressReporter progress(o.progress, o.log_after_seconds, rank, what,
                              static_cast<int64_t>(model.num_units()));
    const auto cpu_f32 = at::TensorOptions().dtype(at::kFloat);
    for (size_t u = 0; u < model.num_units(); ++u) {
      const FlatParam& f = model.unit(u).flat();
      const FlatLayout& l = f.layout();
      const std::string where = " (unit '" + f.unit_name() + "')";
      std::vector<const ValueRecord*> recs;
      std::vector<TpPlacement> placements;
      for (size_t i = 0; i < f.params().size(); ++i) {
        placements.push_back(tpx ? tpx->placement(f.params()[i].name) : TpPlacement{});
        recs.push_back(&params.get(f.params()[i].name,
                                   tp_full_shape(l.shapes[i], placements[i], tp), where));
      }
      if (l.padded_numel == 0) continue;
      const FlatRange held = master_range(f, rank);
      StagedUnit& s = staged[u];
      const size_t n_fields = want ? want->fields.size() : 0;
      for (size_t k = 0; k <= n_fields; ++k) {
        at::Tensor buf = at::zeros({held.size()}, cpu_f32);  // padding stays zero
        for (size_t i = 0; i < recs.size(); ++i) {
          const FlatRange param{l.offsets[i], l.offsets[i] + l.numels[i]};
          const FlatRange o = intersect(param, held);
          if (o.size() <= 0) continue;
          const std::string field = k == 0 ? "" : want->fields[k - 1];
          const int64_t lo = o.begin - param.begin, hi = o.end - param.begin;
          const at::Tensor dst = buf.narrow(0, o.begin - held.begin, o.size());
          const ValueRecord& r = *recs[i];
          if (placements[i].style == TpStyle::kReplicate) {
            reader.read(r, field, lo, hi, dst);
          } else if (reader.tp_size() == tp && r.tp == placements[i]) {
            // Saved at this tp size and placement: this rank's slice is stored as is.
            const int64_t base = tp_rank * l.numels[i];
            reader.read_stored(r, field, base + lo, base + hi, dst);
          } else {
            const at::Tensor full = reader.full(r, field).view(r.shape);
            dst.copy_(tp_slice(full, placements[i], tp, tp_rank).reshape({-1}).narrow(0, lo, hi - lo));
          }
        }
        (k == 0 ? s.master : s.fields.emplace_back()) = buf;
      }
      if (want) {
        check_optimizer_holds(*optimizer, f);
        s.step = recs.front()->step;
        for (const ValueRecord* r : recs)
          TORCH_CHECK(r->step == s.step, "unit '", f.unit_name(), "' gets parameters with ",
                      "different optimizer step counts: '", recs.front()->name, "' (", s.step,
                      ") and '", r->name, "' (", r->step, "); load into a plan that keeps them ",
                      "in separate units, or without the optimizer");
      }
      progress.update(static_cast<int64_t>(u + 1), reader.bytes());
    }
    params.check_all_used();
    RecordIndex bufs(m.buffers, "buffer");
    for (const auto& b : model.module().named_buffers(/*recurse=*/true)) {
      const ValueRecord& r = bufs.get(b.key(), b.value().sizes().vec(), "");
      at::Tensor v = at::empty({r.numel()}, at::TensorOptions().dtype(r.dtype));
      reader.read(r, "", 0, r.numel(), v);
      buffers.push_back(StagedValue{b.value(), v.view(r.shape)});
    }
    bufs.check_all_used();
    progress.finish();
  });

  for (size_t u = 0; u < model.num_units(); ++u) {
    FlatParam& f = model.unit(u).flat();
    if (!staged[u].master.defined()) continue;
    const at::Tensor master = f.master().detach();
    master.copy_(staged[u].master);
    if (!want) continue;
    std::vector<at::Tensor> fields;
    for (const auto& t : staged[u].fields) fields.push_back(t.to(master.device()));
    set_unit_optimizer_state(*optimizer, *want, f, staged[u].step, fields);
  }
  for (auto& b : buffers) b.target.copy_(b.value);
  if (scaler_state) o.grad_scaler->load_state_dict(*scaler_state);
  if (o.training_state) *o.training_state = training_state;
}

void load_full_into_module(torch::nn::Module& module, const std::string& dir_arg,
                           const LoadOptions& o) {
  at::NoGradGuard no_grad;
  const std::string dir = normalize_dir(dir_arg);
  const std::string what = "load_full_into_module('" + dir + "')";
  std::vector<StagedValue> staged;
  try {
    const Manifest m = read_manifest_at(dir);
    ValueReader reader(dir, m);
    RecordIndex params(m.params, "parameter"), bufs(m.buffers, "buffer");
    const auto named_params = module.named_parameters(/*recurse=*/true);
    ProgressReporter progress(o.progress, o.log_after_seconds, 0, what,
                              static_cast<int64_t>(named_params.size()));
    auto stage = [&](RecordIndex& index, const std::string& name, const at::Tensor& target) {
      const ValueRecord& r = index.get(name, target.sizes().vec(), "");
      at::Tensor v = at::empty({r.numel()}, at::TensorOptions().dtype(r.dtype));
      reader.read(r, "", 0, r.numel(), v);
      staged.push_back(StagedValue{target, v.view(r.shape)});
    };
    int64_t done = 0;
    for (const auto& p : named_params) {
      stage(params, p.key(), p.value());
      progress.update(++done, reader.bytes());
    }
    for (const auto& b : module.named_buffers(/*recurse=*/true)) stage(bufs, b.key(), b.value());
    params.check_all_used();
    bufs.check_all_used();
    progress.finish();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, ": ", e.msg());
  }
  for (auto& s : staged) s.target.detach().copy_(s.value);
}

}  // namespace flatshard
