// checkpoint/safetensors.cpp against the reference implementation, the PyPI safetensors package
// (tools/setup_deps.sh pins it in the venv the build records): files flatshard writes load with
// safetensors.torch.load_file with the same bytes, dtypes, shapes and metadata, and files
// safetensors.torch.save_file writes load in flatshard with the values both sides build from
// the same literals. A missing python or package fails the test; it never skips.
#include <ATen/ATen.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_file.h"
#include "temp_dir.h"

#ifndef FLATSHARD_PYTHON_EXE
#error "FLATSHARD_PYTHON_EXE (the venv's python) must be defined by CMake"
#endif

using namespace flatshard;
using flatshard_test::read_bytes;
using flatshard_test::TempDir;
using flatshard_test::write_bytes;

namespace {

// `read IN OUT`: load IN with safetensors and describe it in OUT, one line per tensor (sorted by
// name) after a line of metadata. `write OUT`: save_file the tensors the second test expects.
constexpr const char* kScript = R"PY(
import json, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

def read(path, out):
    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    with open(out, "w") as o:
        o.write(json.dumps(meta, sort_keys=True) + "\n")
        for name in sorted(tensors):
            t = tensors[name]
            raw = bytes(t.reshape(-1).view(torch.uint8).tolist())
            o.write(f"{name} {t.dtype} {list(t.shape)} {raw.hex()}\n")

def write(path):
    tensors = {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4,
        "bf16": torch.tensor([1.5, -2.0, 0.0078125, 65280.0], dtype=torch.bfloat16),
        "i64": torch.tensor([-2**63, -1, 0, 2**53 + 1, 2**63 - 1], dtype=torch.int64),
        "f16": torch.tensor([0.5, -65504.0, 2.0**-14], dtype=torch.float16),
        "f64": torch.tensor([1 / 3, -1e300], dtype=torch.float64),
        "i32": torch.tensor([[1, -2], [3, 2**31 - 1]], dtype=torch.int32),
        "u8": torch.tensor([0, 7, 255], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0),
        "empty2d": torch.zeros(2, 0, dtype=torch.int64),
    }
    # Many tensors, empty ones among them: empty tensors share their offset with a neighbour,
    # and a header this long is past the sizes where std::sort happens to be stable.
    dtypes = [torch.float32, torch.int64, torch.bfloat16]
    for i in range(20):
        tensors[f"z{i:02d}"] = torch.zeros(0, dtype=dtypes[i % 3])
        tensors[f"n{i:02d}"] = torch.full((i + 1,), i, dtype=dtypes[i % 3])
    save_file(tensors, path, metadata={"producer": "python", "note": "\u00e9 \"q\""})

if sys.argv[1] == "read":
    read(sys.argv[2], sys.argv[3])
else:
    write(sys.argv[2])
)PY";

// Runs the script; fails the test (with python's stderr) unless it exits 0.
void run_python(const TempDir& tmp, const std::string& args) {
  const std::string python = FLATSHARD_PYTHON_EXE;
  INFO("python: " << python);
  if (python.find('/') != std::string::npos) REQUIRE(path_exists(python));
  write_bytes(tmp / "interop.py", kScript);
  const std::string cmd =
      python + " -W ignore " + (tmp / "interop.py") + " " + args + " 2> " + (tmp / "err.txt");
  const int rc = std::system(cmd.c_str());
  INFO("stderr:\n"
       << read_bytes(tmp / "err.txt")
       << "\n(safetensors missing? tools/setup_deps.sh installs it into the venv)");
  REQUIRE(rc == 0);
}

// The reference's names for dtypes, written out here rather than derived from flatshard's.
const char* torch_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kHalf:
      return "torch.float16";
    case at::kDouble:
      return "torch.float64";
    case at::kLong:
      return "torch.int64";
    case at::kInt:
      return "torch.int32";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    default:
      return "?";
  }
}

std::string hex(const at::Tensor& t) {
  static const char* digits = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(t.data_ptr());
  std::string s;
  for (int64_t i = 0; i < t.nbytes(); ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

std::string shape(const at::Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t d = 0; d < t.dim(); ++d) os << (d ? ", " : "") << t.size(d);
  return os.str() + "]";
}

}  // namespace

TEST_CASE("safetensors: files flatshard writes load with safetensors.torch.load_file",
          "[checkpoint][python][safetensors]") {
  TempDir tmp;
  at::manual_seed(7);
  const std::map<std::string, at::Tensor> values = {
      {"w", at::randn({3, 5})},
      {"b16", at::randn({4, 2}).to(at::kBFloat16)},
      {"idx", at::tensor({std::numeric_limits<int64_t>::min(), int64_t{-1}, int64_t{0},
                          (int64_t{1} << 53) + 1, std::numeric_limits<int64_t>::max()})},
      {"h", at::tensor({0.5, -65504.0, 1.0 / 3}).to(at::kHalf)},
      {"d", at::tensor({1.0 / 3, -1e300})},
      {"i32", at::tensor({1, -2, 3, std::numeric_limits<int32_t>::max()}).view({2, 2})},
      {"u8", at::tensor({0, 7, 255}).to(at::kByte)},
      {"mask", at::arange(3) % 2 == 0},
      {"scalar", at::scalar_tensor(2.5, at::kFloat)},
      {"empty", at::zeros({0})},
      {"blocks.0.attn \"q\"", at::arange(4, at::kFloat)},  // dots, a space and quotes in a name
  };
  std::vector<TensorEntry> entries;
  for (const auto& [name, t] : values) {
    TensorEntry e;
    e.name = name;
    e.dtype = t.scalar_type();
    e.shape = t.sizes().vec();
    entries.push_back(e);
  }
  std::reverse(entries.begin(), entries.end());  // file order need not be name order
  TensorFileWriter w(tmp.path(), "f.safetensors", entries,
                     {{"format", "pt"}, {"note", "q\"uote \xc3\xa9"}}, 16, nullptr, false);
  for (const auto& [name, t] : values) w.write(name, t.contiguous());
  w.finish();

  run_python(tmp, "read " + (tmp / "f.safetensors") + " " + (tmp / "out.txt"));
  std::string want = "{\"format\": \"pt\", \"note\": \"q\\\"uote \\u00e9\"}\n";
  for (const auto& [name, t] : values)  // std::map: sorted by name, as Python's sorted()
    want += name + " " + torch_name(t.scalar_type()) + " " + shape(t) + " " + hex(t.contiguous()) +
            "\n";
  CHECK(read_bytes(tmp / "out.txt") == want);
}

TEST_CASE("safetensors: files safetensors.torch.save_file writes load in flatshard",
          "[checkpoint][python][safetensors]") {
  TempDir tmp;
  run_python(tmp, "write " + (tmp / "py.safetensors"));
  // The same literals as the script's, built here.
  std::map<std::string, at::Tensor> want = {
      {"f32", at::arange(6, at::kFloat).view({2, 3}) / 4},
      {"bf16", at::tensor({1.5f, -2.0f, 0.0078125f, 65280.0f}).to(at::kBFloat16)},
      {"i64", at::tensor({std::numeric_limits<int64_t>::min(), int64_t{-1}, int64_t{0},
                          (int64_t{1} << 53) + 1, std::numeric_limits<int64_t>::max()})},
      {"f16", at::tensor({0.5, -65504.0, 1.0 / 16384}).to(at::kHalf)},
      {"f64", at::tensor({1.0 / 3, -1e300})},
      {"i32", at::tensor({1, -2, 3, std::numeric_limits<int32_t>::max()}).view({2, 2})},
      {"u8", at::tensor({0, 7, 255}).to(at::kByte)},
      {"mask", at::tensor({1, 0, 1}).to(at::kBool)},
      {"scalar", at::scalar_tensor(2.5, at::kFloat)},
      {"empty", at::zeros({0})},
      {"empty2d", at::zeros({2, 0}, at::kLong)},
  };
  const at::ScalarType dtypes[] = {at::kFloat, at::kLong, at::kBFloat16};
  for (int i = 0; i < 20; ++i) {
    const std::string k = (i < 10 ? "0" : "") + std::to_string(i);
    want["z" + k] = at::zeros({0}, dtypes[i % 3]);
    want["n" + k] = at::full({i + 1}, i, dtypes[i % 3]);
  }
  InputFile f(tmp / "py.safetensors");
  const SafetensorsHeader h = SafetensorsHeader::read(f);
  Metadata meta = h.metadata();
  std::sort(meta.begin(), meta.end());  // a map on the writer's side: no order to keep
  CHECK(meta == Metadata{{"note", "\xc3\xa9 \"q\""}, {"producer", "python"}});
  REQUIRE(h.tensors().size() == want.size());
  for (const auto& [name, expected] : want) {
    CAPTURE(name);
    const TensorEntry* e = h.find(name);
    REQUIRE(e != nullptr);
    CHECK(e->dtype == expected.scalar_type());
    CHECK(e->shape == expected.sizes().vec());
    REQUIRE(e->nbytes() == static_cast<int64_t>(expected.nbytes()));
    at::Tensor got = at::empty(expected.sizes(), expected.options());
    if (e->nbytes() > 0) f.read(h.data_start() + e->begin, got.data_ptr(), e->nbytes());
    CHECK(at::equal(got, expected));
  }
}
