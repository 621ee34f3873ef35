// export_safetensors(): see export.h for the contract. The shape of save_checkpoint's full
// save (save.cpp): every rank gathers unit by unit, rank 0 writes; local errors wait for the
// next agree() so no rank is left in a collective.
#include "checkpoint/export.h"

#include <torch/nn/module.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "checkpoint/progress.h"
#include "checkpoint/rank_sync.h"
#include "checkpoint/tensor_file.h"
#include "checkpoint/unit_ranges.h"
#include "fsdp/sharded_model.h"
#include "fsdp/tensor_parallel.h"
#include "support/input_file.h"
#include "support/json.h"

namespace flatshard {

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kTempSuffix = ".tmp";  // AtomicFile's (file_io.h): `<name>.tmp`

std::string numbered_file(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// "model-NNNNN-of-NNNNN.safetensors": a file some export wrote.
bool is_numbered_file(const std::string& name) {
  unsigned a = 0, b = 0;
  return std::sscanf(name.c_str(), "model-%5u-of-%5u", &a, &b) == 2 && a >= 1 && a <= b &&
         name == numbered_file(a - 1, b);
}

// One exported tensor: which parameter of which unit, and where it goes.
struct Item {
  std::string model_name, name;  // name: in the files
  size_t unit = 0, param = 0;     // FlatParam::params() index
  std::vector<int64_t> shape;   // the full shape (tensor parallelism: of every tp slice joined)
  TpPlacement tp;               // how the model's tp ranks split it
  int64_t bytes = 0;
  size_t file = 0;
};

// The export's layout, the same on every rank: items in named_parameters() order, split into
// files.
struct Layout {
  std::vector<Item> items;
  std::vector<std::string> files;
  int64_t total_bytes = 0;
  std::map<std::pair<size_t, size_t>, size_t> by_param;  // (unit, param) -> item
};

Layout lay_out(const ShardedModel& model, const ExportOptions& o) {
  std::map<std::string, std::pair<size_t, size_t>> owner;  // model name -> (unit, param)
  for (size_t u = 0; u < model.num_units(); ++u) {
    const auto& params = model.unit(u).flat().params();
    for (size_t i = 0; i < params.size(); ++i) owner[params[i].name] = {u, i};
  }
  const int64_t elem = static_cast<int64_t>(c10::elementSize(o.dtype));
  const int tp = model.mesh().size(MeshDim::kTp);
  const TensorParallel* par = tp > 1 ? find_tensor_parallel(&model.module()) : nullptr;
  TORCH_CHECK(tp == 1 || (par != nullptr && par->tp_size() == tp), "export_safetensors: the mesh ",
              "has tp ", tp, " but the model was not parallelized over it (fsdp/tensor_parallel.h)");
  Layout l;
  std::map<std::string, std::string> taken;  // file name -> model name
  for (const auto& p : model.module().named_parameters(/*recurse=*/true)) {
    auto it = owner.find(p.key());
    if (it == owner.end()) continue;  // a tied alias: its owner is written
    Item item;
    item.model_name = p.key();
    item.name = o.name_map ? o.name_map(p.key()) : p.key();
    TORCH_CHECK(!item.name.empty(), "export_safetensors: the name map gives parameter '",
                p.key(), "' an empty name");
    // The header's metadata sits under this key beside the tensors: a tensor of that name
    // makes a duplicate key that readers refuse.
    TORCH_CHECK(item.name != kMetadataKey, "export_safetensors: the name map gives parameter '",
                p.key(), "' the name '", kMetadataKey,
                "', which safetensors reserves for the header's metadata; map it to another name");
    auto [t, fresh] = taken.emplace(item.name, p.key());
    TORCH_CHECK(fresh, "export_safetensors: the name map gives parameters '", t->second, "' and '",
                p.key(), "' the same name '", item.name, "'");
    item.unit = it->second.first;
    item.param = it->second.second;
    if (par) item.tp = par->placement(p.key());
    item.shape = tp_full_shape(p.value().sizes().vec(), item.tp, tp);
    int64_t numel = 1;
    for (int64_t d : item.shape) numel *= d;
    item.bytes = numel * elem;
    l.by_param[it->second] = l.items.size();
    l.items.push_back(std::move(item));
  }
  // Greedy split in model order: a new file when the next tensor would overflow this one.
  int64_t in_file = 0;
  size_t file = 0;
  for (Item& item : l.items) {
    if (in_file > 0 && in_file + item.bytes > o.max_file_bytes) {
      ++file;
      in_file = 0;
    }
    item.file = file;
    in_file += item.bytes;
    l.total_bytes += item.bytes;
  }
  const size_t n = l.items.empty() ? 1 : file + 1;
  for (size_t i = 0; i < n; ++i) l.files.push_back(n == 1 ? kSingleFile : numbered_file(i, n));
  return l;
}

std::string index_json(const Layout& l) {
  json::Json j = json::Json::object();
  j["metadata"] = {{"total_size", l.total_bytes}};
  json::Json map = json::Json::object();
  std::map<std::string, std::string> sorted;  // transformers writes the map sorted by name
  for (const Item& item : l.items) sorted[item.name] = l.files[item.file];
  for (const auto& [name, file] : sorted) map[name] = file;
  j["weight_map"] = std::move(map);
  return j.dump(2) + "\n";
}

// begin_save's check of an existing `dir`: only an earlier export may be replaced.
void check_earlier_export(const std::string& dir, const ExportOptions& o) {
  TORCH_CHECK(has_marker(dir), "export_safetensors: refusing to replace '", dir,
              "': flatshard did not write it (no ", kMarkerName,
              "; e.g. a downloaded model); export elsewhere or move it yourself");
  std::set<std::string> ours = {kMarkerName, kSingleFile, kIndexFile};
  for (const auto& [name, text] : o.text_files) ours.insert(name);
  std::vector<std::string> foreign;
  for (const std::string& name : list_dir(dir))
    if (!ours.count(name) && !is_numbered_file(name)) foreign.push_back(name);
  if (foreign.empty()) return;
  std::string list;
  for (size_t i = 0; i < foreign.size() && i < 10; ++i) list += (i ? ", '" : "'") + foreign[i] + "'";
  TORCH_CHECK(false, "export_safetensors: refusing to replace '", dir, "': it holds ",
              foreign.size(), " file(s) an export does not write: ", list,
              foreign.size() > 10 ? ", ..." : "", "; move them out or export elsewhere");
}

void export_in_group(const ShardedModel& model, const std::string& dir_arg,
                     const ExportOptions& o) {
  at::NoGradGuard no_grad;
  Communicator& comm = model.comm();
  // Tensor parallelism: the grid is shard x tp; (shard 0, tp 0) writes the full tensors.
  const Mesh& mesh = model.mesh();
  const int tp = mesh.size(MeshDim::kTp);
  const bool writer_rank = comm.rank() == 0 && mesh.coord(MeshDim::kTp) == 0;
  std::string dir = normalize_dir(dir_arg);
  const std::string what = "export_safetensors('" + dir + "')";
  std::exception_ptr err;
  Layout layout;
  std::string staging;
  const std::string complete = !o.text_files.empty() ? o.text_files.back().first : "";
  try {
    TORCH_CHECK(o.dtype == at::kFloat || o.dtype == at::kBFloat16, what, ": dtype ", o.dtype,
                " is not exported (kFloat or kBFloat16)");
    TORCH_CHECK(o.max_file_bytes > 0, what, ": max_file_bytes must be positive, got ",
                o.max_file_bytes);
    std::set<std::string> names;
    auto own = [](const std::string& name) {
      return name == kSingleFile || name == kIndexFile || is_numbered_file(name) ||
             name == kMarkerName;
    };
    for (const auto& [name, text] : o.text_files) {
      check_plain_name(name, what + ": text file");
      TORCH_CHECK(!own(name) && names.insert(name).second, what, ": text file '",
                  printable_escape(name), "' repeats or clashes with the export's own files");
    }
    // Every file is written as `<name>.tmp` and renamed: a text file named like another file's
    // temporary would be overwritten by that file's write and renamed away.
    for (const auto& [name, text] : o.text_files) {
      const size_t n = std::strlen(kTempSuffix);
      if (name.size() <= n || name.compare(name.size() - n, n, kTempSuffix) != 0) continue;
      const std::string stem = name.substr(0, name.size() - n);
      TORCH_CHECK(!own(stem) && !names.count(stem), what, ": text file '", printable_escape(name),
                  "' is the name the export writes '", printable_escape(stem),
                  "' under before renaming it (its temporary); rename the text file");
    }
    layout = lay_out(model, o);
    if (writer_rank) {
      dir = resolve_save_dir(dir);  // a symlink is followed (Note [Checkpoint publication])
      const std::string marks =
          !complete.empty() ? complete : layout.files.size() > 1 ? kIndexFile : kSingleFile;
      staging = begin_save(dir, marks, o.durable,
                           [&](const std::string& d) { check_earlier_export(d, o); });
    }
  } catch (...) {
    err = std::current_exception();
  }

  std::vector<std::unique_ptr<TensorFileWriter>> writers;
  auto guarded = [&](const std::function<void()>& fn) {
    if (!writer_rank || err) return;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
  };
  try {
    // Inside the try: a failure on another rank (a name map that throws there) removes the
    // staging directory this rank made.
    agree_tp(mesh, comm, err, what);
    guarded([&] {
      std::vector<std::vector<TensorEntry>> entries(layout.files.size());
      for (const Item& item : layout.items) {
        TensorEntry e;
        e.name = item.name;
        e.dtype = o.dtype;
        e.shape = item.shape;
        entries[item.file].push_back(std::move(e));
      }
      for (size_t f = 0; f < layout.files.size(); ++f)
        writers.push_back(std::make_unique<TensorFileWriter>(
            staging, layout.files[f], std::move(entries[f]), Metadata{{"format", "pt"}},
            int64_t{1} << 20, o.fault_hook, o.durable));
    });
    ProgressReporter progress(o.progress, o.log_after_seconds, comm.rank(), what,
                              static_cast<int64_t>(model.num_units()));
    int64_t bytes = 0;
    for (size_t u = 0; u < model.num_units(); ++u) {
      const FlatParam& f = model.unit(u).flat();
      const FlatLayout& l = f.layout();
      if (l.padded_numel > 0) {
        at::Tensor full = f.gather_whole(f.master()).contiguous();  // every rank
        if (tp > 1) {  // every tp rank's unit, in tp order (the same layout on each)
          at::Tensor all = at::empty({tp * full.numel()}, full.options());
          mesh.tp()->all_gather(full, all, mesh.tp()->current_stream());
          full = all;
        }
        guarded([&] {
          const at::Tensor cpu = full.to(at::kCPU).contiguous();
          const int64_t unit_numel = cpu.numel() / tp;
          for (size_t i = 0; i < f.params().size(); ++i) {
            auto it = layout.by_param.find({u, i});
            if (it == layout.by_param.end()) continue;
            const Item& item = layout.items[it->second];
            at::Tensor value = cpu.narrow(0, l.offsets[i], l.numels[i]);
            if (tp > 1 && item.tp.style != TpStyle::kReplicate) {
              std::vector<at::Tensor> slices;  // tp-major order, joined by tp_unslice
              for (int k = 0; k < tp; ++k)
                slices.push_back(cpu.narrow(0, k * unit_numel + l.offsets[i], l.numels[i]));
              value = tp_unslice(at::cat(slices), item.shape, item.tp, tp).reshape({-1});
            }
            writers[item.file]->write(item.name, value.to(o.dtype).contiguous());
            bytes += item.bytes;
          }
        });
      }
      progress.update(static_cast<int64_t>(u + 1), bytes);
    }
    guarded([&] {
      for (auto& w : writers) w->finish();
      if (layout.files.size() > 1)
        write_text_file_atomic(join_path(staging, kIndexFile), index_json(layout), o.fault_hook,
                               o.durable);
      for (const auto& [name, text] : o.text_files)
        write_text_file_atomic(join_path(staging, name), text, o.fault_hook, o.durable);
    });
    agree_tp(mesh, comm, err, what);
    progress.finish();
    run_agreed_tp(mesh, comm, what, [&] {
      if (writer_rank) publish(dir, staging, o.fault_hook, o.durable, /*use_exchange=*/true);
    });
  } catch (...) {
    writers.clear();  // uncommitted temporaries are removed
    if (writer_rank) abandon_save(staging);
    throw;
  }
}

}  // namespace

void export_safetensors(const ShardedModel& model, const std::string& dir,
                        const ExportOptions& o) {
  model.wait_offload_steps();  // Note [Offload step in backward]: masters still being stepped
  write_from_first_replica(model.mesh(), "export_safetensors('" + dir + "')",
                           [&] { export_in_group(model, dir, o); });
}

}  // namespace flatshard
