// Loading weights straight into shards (checkpoint/load_into_shards.h, Note [Loading into
// shards] in fsdp/deferred_init.h), against files the PyPI safetensors package writes
// (tools/setup_deps.sh installs it into the venv; a missing python or package fails, never
// skips):
//   * values: a meta-built GPT and LLaMA (the parity tests' odd sizes) sharded at world 1..4
//     with the loader hold exactly the file's tensors (gather_full_params, bit for bit), equal
//     to the same file copied into the plain model: one file, a 2-file index.json split, bf16
//     (converted by torch for the reference), and a name map (HF-style prefixed names);
//   * reads: each rank reads only its shard's bytes (all ranks together read every byte once;
//     one rank of four well under half of them);
//   * HSDP (2 x 2 threads): every replica reads its own shards, and each holds the file;
//   * a flatshard full checkpoint (a directory: model.safetensors + manifest) loads the same
//     way at another world size; a sharded one is refused naming load_checkpoint;
//   * errors (world 2): a missing tensor, a shape mismatch, an integer dtype, a truncated
//     file, an index naming a missing file, a name map giving an unknown name, a loader on an
//     eager model: every rank throws a c10::Error naming the tensor, none hangs.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/file_io.h"
#include "checkpoint/load_into_shards.h"
#include "checkpoint/safetensors.h"
#include "collectives/sharding_mesh.h"
#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "gpt_parity_spec.h"
#include "llama_parity_spec.h"
#include "models/family.h"
#include "temp_dir.h"
#include "wrap_policies/spec.h"

#ifndef FLATSHARD_PYTHON_EXE
#error "FLATSHARD_PYTHON_EXE (the venv's python) must be defined by CMake"
#endif

using namespace flatshard;
using flatshard_test::read_bytes;
using flatshard_test::TempDir;
using flatshard_test::write_bytes;
// The reference families by descriptor (models/family.h).
using Family = const models::Family*;
const Family kGpt = &models::family("gpt"), kLlama = &models::family("llama");
using models::ModelConfig;

namespace {

constexpr uint64_t kSeed = 7;

// `SPEC OUT VICTIM`: SPEC has one line per parameter, "name d0,d1" ("-" for a scalar). Writes
// random fp32 values under OUT as: single/ (one file), split/ (two files + index.json), bf16/
// (+ bf16_ref.safetensors: torch's bf16 -> fp32 of them), renamed/ ("model." + name), and the
// broken variants around VICTIM: missing/, shape/, int/, split/absent.index.json.
constexpr const char* kScript = R"PY(
import json, os, sys
import torch
from safetensors.torch import save_file

spec, out, victim = sys.argv[1], sys.argv[2], sys.argv[3]
t = {}
for i, line in enumerate(open(spec)):
    name, dims = line.split()
    shape = [] if dims == "-" else [int(d) for d in dims.split(",")]
    t[name] = torch.randn(shape, generator=torch.Generator().manual_seed(1000 + i))
names = list(t)

def put(d, tensors):
    os.makedirs(os.path.join(out, d), exist_ok=True)
    save_file(tensors, os.path.join(out, d, "model.safetensors"))

put("single", t)
os.makedirs(os.path.join(out, "split"))
wm = {}
for k, part in enumerate([names[0::2], names[1::2]]):
    f = f"model-{k + 1:05d}-of-00002.safetensors"
    save_file({n: t[n] for n in part}, os.path.join(out, "split", f))
    wm.update({n: f for n in part})
total = sum(x.numel() * 4 for x in t.values())
with open(os.path.join(out, "split", "model.safetensors.index.json"), "w") as o:
    json.dump({"metadata": {"total_size": total}, "weight_map": wm}, o)
with open(os.path.join(out, "split", "absent.index.json"), "w") as o:
    json.dump({"weight_map": dict(wm, **{victim: "absent.safetensors"})}, o)
bf = {n: x.to(torch.bfloat16) for n, x in t.items()}
put("bf16", bf)
save_file({n: x.float() for n, x in bf.items()}, os.path.join(out, "bf16_ref.safetensors"))
put("renamed", {"model." + n: x for n, x in t.items()})
put("missing", {n: x for n, x in t.items() if n != victim})
put("shape", {n: (x.reshape(-1)[1:].clone() if n == victim else x) for n, x in t.items()})
put("int", {n: (torch.ones(x.shape, dtype=torch.int32) if n == victim else x)
            for n, x in t.items()})
)PY";

ModelConfig config(Family f) {
  return f == kGpt ? ModelConfig::of(flatshard_test::parity_gpt_config())
                   : ModelConfig::of(flatshard_test::parity_llama_config());
}

std::shared_ptr<torch::nn::Module> build_meta(const ModelConfig& c) {
  MetaInit meta;
  return c.build(kSeed);
}

Policy policy(Family f) {
  return parse_policy("type=" + f->modules().layer_type);
}

// The files for `c` under tmp/"files"; returns the victim (a 2-D parameter of the first layer).
std::string write_files(const ModelConfig& c, const TempDir& tmp) {
  std::ostringstream spec;
  std::string victim;
  for (const auto& p : c.build(kSeed)->named_parameters()) {
    const auto& t = p.value();
    spec << p.key() << ' ';
    if (t.dim() == 0) spec << '-';
    for (int64_t d = 0; d < t.dim(); ++d) spec << (d ? "," : "") << t.size(d);
    spec << '\n';
    if (victim.empty() && t.dim() == 2 && p.key().find(".0.") != std::string::npos)
      victim = p.key();
  }
  REQUIRE_FALSE(victim.empty());
  write_bytes(tmp / "spec.txt", spec.str());
  write_bytes(tmp / "write.py", kScript);
  const std::string python = FLATSHARD_PYTHON_EXE;
  INFO("python: " << python);
  const std::string cmd = python + " -W ignore " + (tmp / "write.py") + " " + (tmp / "spec.txt") +
                          " " + (tmp / "files") + " " + victim + " 2> " + (tmp / "err.txt");
  const int rc = std::system(cmd.c_str());
  INFO("stderr:\n" << read_bytes(tmp / "err.txt")
                   << "\n(safetensors missing? tools/setup_deps.sh installs it into the venv)");
  REQUIRE(rc == 0);
  return victim;
}

// Every tensor of an fp32 safetensors file, whole (the reference side: no ranges, no dtypes).
std::map<std::string, at::Tensor> read_f32(const std::string& path) {
  InputFile f(path);
  const SafetensorsHeader h = SafetensorsHeader::read(f);
  std::map<std::string, at::Tensor> out;
  for (const auto& e : h.tensors()) {
    REQUIRE(e.dtype == at::kFloat);
    at::Tensor t = at::empty(e.shape, at::kFloat);
    f.read(h.data_start() + e.begin, t.data_ptr(), static_cast<size_t>(e.nbytes()));
    out[e.name] = t;
  }
  return out;
}

// The plain (unsharded) model with `ref` copied into its parameters: its parameters by name.
std::map<std::string, at::Tensor> plain_loaded(const ModelConfig& c,
                                               const std::map<std::string, at::Tensor>& ref) {
  auto model = c.build(kSeed);
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) {
    p.value().copy_(ref.at(p.key()));
    out[p.key()] = p.value().detach();
  }
  return out;
}

struct Loaded {
  std::map<std::string, at::Tensor> params;   // rank 0's gather_full_params()
  std::map<std::string, at::Tensor> buffers;  // rank 0's buffers after setup
  std::vector<int64_t> bytes;                 // data bytes each rank's loader read
  std::vector<std::string> errors;            // each rank's c10::Error, "" if none
};

Loaded load_sharded(const ModelConfig& c, int world, const std::string& path, NameMap map = {},
                    bool eager = false) {
  Loaded out;
  out.bytes.assign(static_cast<size_t>(world), 0);
  out.errors.assign(static_cast<size_t>(world), "");
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    const size_t r = static_cast<size_t>(comm.rank());
    auto stats = std::make_shared<LoadStats>();
    ShardingOptions options;
    options.load = safetensors_loader(path, map, stats);
    try {
      auto model = eager ? c.build(kSeed) : build_meta(c);
      auto fsdp = fully_shard(model, policy(&c.family()), comm, options);
      auto gathered = fsdp->gather_full_params();
      std::lock_guard<std::mutex> lock(mu);
      out.bytes[r] = stats->bytes;
      if (r == 0) {
        for (auto& [name, t] : gathered) out.params[name] = t;
        for (const auto& b : model->named_buffers()) out.buffers[b.key()] = b.value().clone();
      }
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      out.errors[r] = e.what_without_backtrace();
    }
  });
  return out;
}

void require_equal(const std::map<std::string, at::Tensor>& got,
                   const std::map<std::string, at::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    INFO(name);
    REQUIRE(got.count(name) == 1);
    REQUIRE(got.at(name).sizes() == t.sizes());
    REQUIRE(at::equal(got.at(name), t));
  }
}

int64_t total_bytes(const std::map<std::string, at::Tensor>& ref, int64_t elem) {
  int64_t n = 0;
  for (const auto& [name, t] : ref) n += t.numel() * elem;
  return n;
}

}  // namespace

TEST_CASE("safetensors files load into shards equal to the plain model, world 1..4",
          "[load]") {
  for (Family f : {kGpt, kLlama}) {
    const ModelConfig c = config(f);
    TempDir tmp;
    write_files(c, tmp);
    const std::string files = tmp / "files";
    const auto ref = read_f32(files + "/single/model.safetensors");
    const auto ref_bf16 = read_f32(files + "/bf16_ref.safetensors");
    const auto plain = plain_loaded(c, ref);
    const auto plain_bf16 = plain_loaded(c, ref_bf16);
    // Buffers (LLaMA's rotary inv_freq) are not in the files: the model's own init gives them.
    std::map<std::string, at::Tensor> eager_buffers;
    for (const auto& b : c.build(kSeed)->named_buffers()) eager_buffers[b.key()] = b.value();
    for (int world = 1; world <= 4; ++world) {
      INFO(c.to_string() << " world " << world);
      const Loaded single = load_sharded(c, world, files + "/single/model.safetensors");
      for (const auto& e : single.errors) REQUIRE(e == "");
      require_equal(single.params, ref);
      require_equal(single.params, plain);
      require_equal(single.buffers, eager_buffers);
      // Each rank reads its own part: together every byte exactly once.
      int64_t sum = 0;
      for (int64_t b : single.bytes) sum += b;
      REQUIRE(sum == total_bytes(ref, 4));
      if (world == 4)
        for (int64_t b : single.bytes) REQUIRE(b < total_bytes(ref, 4) * 3 / 10);

      // A directory: the index.json split over two files.
      const Loaded split = load_sharded(c, world, files + "/split");
      for (const auto& e : split.errors) REQUIRE(e == "");
      require_equal(split.params, plain);

      // bf16 in the file, fp32 masters: torch's conversion, bit for bit.
      const Loaded bf16 = load_sharded(c, world, files + "/bf16");
      for (const auto& e : bf16.errors) REQUIRE(e == "");
      require_equal(bf16.params, plain_bf16);
      sum = 0;
      for (int64_t b : bf16.bytes) sum += b;
      REQUIRE(sum == total_bytes(ref, 2));

      // Names as a hub checkpoint spells them, through the name map.
      const Loaded renamed = load_sharded(c, world, files + "/renamed",
                                          [](const std::string& n) { return "model." + n; });
      for (const auto& e : renamed.errors) REQUIRE(e == "");
      require_equal(renamed.params, plain);
    }
  }
}

TEST_CASE("loading errors name the tensor on every rank", "[load]") {
  const ModelConfig c = config(kLlama);
  TempDir tmp;
  const std::string victim = write_files(c, tmp);
  const std::string files = tmp / "files";
  {
    // A truncated copy of the single file.
    std::string bytes = read_bytes(files + "/single/model.safetensors");
    bytes.resize(bytes.size() - 100);
    make_dirs(files + "/truncated");
    write_bytes(files + "/truncated/model.safetensors", bytes);
  }
  struct Case {
    std::string what, path;
    NameMap map;
    std::vector<std::string> parts;  // each rank's message contains all of them
    bool eager = false;
  };
  const std::vector<Case> cases = {
      {"missing tensor", files + "/missing/model.safetensors", {}, {victim, "is not in"}},
      {"shape mismatch", files + "/shape", {}, {victim, "has shape", "in the model"}},
      {"integer dtype", files + "/int", {}, {victim, "I32", "only F32, BF16 and F16"}},
      {"truncated file", files + "/truncated", {}, {"safetensors_loader: parameter", "truncated/model.safetensors"}},
      {"index names a missing file", files + "/split/absent.index.json", {},
       {victim, "absent.safetensors"}},
      {"name map gives an unknown name", files + "/single",
       [victim](const std::string& n) { return n == victim ? std::string("no.such") : n; },
       {victim, "'no.such'", "is not in"}},
      {"loader on an eager model", files + "/single", {}, {"ShardingOptions::load"}, true},
  };
  for (const auto& k : cases) {
    INFO(k.what);
    const Loaded out = load_sharded(c, 2, k.path, k.map, k.eager);
    for (const auto& e : out.errors) {
      INFO(e);
      REQUIRE(e != "");
      for (const auto& part : k.parts) REQUIRE(e.find(part) != std::string::npos);
    }
  }
}

TEST_CASE("one rank that cannot load fails every rank, at the check and at a read", "[load]") {
  const ModelConfig c = config(kGpt);
  TempDir tmp;
  const std::string victim = write_files(c, tmp);
  const std::string files = tmp / "files";
  // check: rank 1 alone is given a file without the victim.
  // read: rank 0's read of the victim (which starts in rank 0's shard of its layer) throws
  // after every check passed: the unit's agree point.
  for (const std::string when : {"check", "read"}) {
    INFO(when);
    std::vector<std::string> errors(2);
    std::mutex mu;
    run_ranks(2, [&](Communicator& comm) {
      const bool bad = comm.rank() == (when == "check" ? 1 : 0);
      ShardingOptions options;
      options.load = safetensors_loader(files + (bad && when == "check" ? "/missing" : "/single"));
      if (bad && when == "read") {
        auto read = options.load.read;
        options.load.read = [read, &victim](const std::string& name, int64_t b, int64_t e,
                                            const at::Tensor& dst) {
          TORCH_CHECK(name != victim, "injected read failure of '", name, "'");
          read(name, b, e, dst);
        };
      }
      try {
        auto model = build_meta(c);
        fully_shard(model, policy(&c.family()), comm, options);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors[static_cast<size_t>(comm.rank())] = e.what_without_backtrace();
      }
    });
    for (const auto& e : errors) {
      INFO(e);
      REQUIRE(e.find(when == "check" ? "rank 1" : "rank 0") != std::string::npos);
      REQUIRE(e.find(victim) != std::string::npos);
      if (when == "read") REQUIRE(e.find("fully_shard: loading unit") != std::string::npos);
    }
  }
}

TEST_CASE("a flatshard checkpoint, full or sharded, loads into shards at another world size", "[load]") {
  const ModelConfig c = config(kLlama);
  TempDir tmp;
  std::map<std::string, at::Tensor> saved;
  std::mutex mu;
  for (const auto kind : {CheckpointKind::kFull, CheckpointKind::kSharded}) {
    const std::string dir = tmp / (kind == CheckpointKind::kFull ? "full" : "sharded");
    run_ranks(2, [&](Communicator& comm) {
      auto model = c.build(kSeed + 1);  // other values than the meta model's own init
      auto fsdp = fully_shard(model, policy(&c.family()), comm);
      CheckpointOptions options;
      options.kind = kind;
      options.durable = false;
      save_checkpoint(*fsdp, nullptr, dir, options);
      auto gathered = fsdp->gather_full_params();
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0)
        for (auto& [name, t] : gathered) saved[name] = t;
    });
  }
  for (int world : {1, 3}) {
    INFO("world " << world);
    const Loaded out = load_sharded(c, world, tmp / "full");
    for (const auto& e : out.errors) REQUIRE(e == "");
    require_equal(out.params, saved);
  }
  // A sharded one is read through its manifest, each rank only the pieces its shard overlaps,
  // at the world size it was saved with and at others.
  for (int world : {1, 2, 3}) {
    INFO("sharded, world " << world);
    const Loaded out = load_sharded(c, world, tmp / "sharded");
    for (const auto& e : out.errors) REQUIRE(e == "");
    require_equal(out.params, saved);
    int64_t want = 0, read = 0;  // every element read exactly once across the ranks
    for (const auto& [name, t] : saved) want += t.numel() * 4;
    for (int64_t b : out.bytes) read += b;
    REQUIRE(read == want);
  }
  // Tensors no parameter reads are reported (issue 49: they were dropped without a word), but
  // not a full checkpoint's own buffers, which its manifest lists: the same file read by its
  // path names the rotary table; read as the checkpoint directory, nothing is said.
  struct Warnings : c10::WarningHandler {
    void process(const c10::Warning& w) override { all += w.msg() + "\n"; }
    std::string all;
  };
  std::vector<PlannedParam> planned;
  {
    std::vector<const void*> seen;
    for (const auto& p : build_meta(c)->named_parameters()) {
      const void* impl = p.value().unsafeGetTensorImpl();
      if (std::find(seen.begin(), seen.end(), impl) != seen.end()) continue;
      seen.push_back(impl);
      planned.push_back({p.key(), p.value().sizes().vec()});
    }
  }
  auto warnings_of = [&](const std::string& path) {
    Warnings w;
    c10::WarningUtils::WarningHandlerGuard guard(&w);
    safetensors_loader(path).check(planned);
    return w.all;
  };
  const std::string file = warnings_of(tmp / "full/model.safetensors");
  CHECK_THAT(file,
             Catch::Contains("is read by no parameter") && Catch::Contains("'rope.inv_freq'"));
  CHECK(warnings_of(tmp / "full") == "");
}

TEST_CASE("HSDP: every replica loads its own shards", "[load][hsdp]") {
  const ModelConfig c = config(kGpt);
  TempDir tmp;
  write_files(c, tmp);
  const std::string path = tmp / "files/split";
  const auto plain = plain_loaded(c, read_f32(tmp / "files/single/model.safetensors"));
  std::vector<std::map<std::string, at::Tensor>> replicas(2);
  std::vector<int64_t> bytes(4, 0);
  std::mutex mu;
  run_ranks_2d(2, 2, [&](Communicator& shard, Communicator& replicate) {
    auto stats = std::make_shared<LoadStats>();
    ShardingOptions options;
    options.load = safetensors_loader(path, {}, stats);
    auto model = build_meta(c);
    auto fsdp = fully_shard(model, policy(&c.family()), ShardingMesh(shard, &replicate), options);
    auto gathered = fsdp->gather_full_params();
    std::lock_guard<std::mutex> lock(mu);
    bytes[static_cast<size_t>(replicate.rank() * 2 + shard.rank())] = stats->bytes;
    if (shard.rank() == 0)
      for (auto& [name, t] : gathered) replicas[static_cast<size_t>(replicate.rank())][name] = t;
  });
  for (const auto& r : replicas) require_equal(r, plain);
  // Each shard group reads the whole file once.
  REQUIRE(bytes[0] + bytes[1] == total_bytes(plain, 4));
  REQUIRE(bytes[2] + bytes[3] == total_bytes(plain, 4));
}
