// flatshard-collectives-bench — nccl-tests-style bandwidth of the NCCL backend's collectives.
//
// Launch one process per GPU:
//   python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python
//       build/benchmarks/flatshard-collectives-bench [options]
//
// For each collective and size it (1) fills the inputs with a closed form, runs the collective
// once and verifies the whole output on every rank (the verdict is all-reduced, so "OK" means
// every rank agreed), then (2) times `iters` back-to-back launches after `warmup` untimed ones
// with CUDA events on one stream (median of `repeat` such runs). Rank 0 prints one row per measurement:
//   op dtype size(B) count time(us) algbw(GB/s) busbw(GB/s) check
// with nccl-tests' definitions: size is the total payload (all_gather: the gathered output,
// reduce_scatter: the full input, all_reduce: the buffer), algbw = size / time (GB = 1e9 B),
// busbw = algbw * (n-1)/n for all_gather and reduce_scatter, algbw * 2(n-1)/n for all_reduce.
// tools/c10d_reference.py prints the same table for PyTorch c10d, so the two can be joined.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/nccl_check.h"
#include "collectives/nccl_communicator.h"

namespace {

using flatshard::NcclCommunicator;
using flatshard::ReduceOp;

struct Options {
  int64_t min_bytes = int64_t{1} << 20;
  int64_t max_bytes = int64_t{1} << 30;
  int64_t factor = 4;
  int warmup = 10;
  int iters = 50;
  int repeat = 3;
  std::vector<std::string> ops = {"all_gather:bf16", "reduce_scatter:fp32", "reduce_scatter:bf16",
                                  "all_reduce:fp32", "all_reduce:bf16"};
};

void usage() {
  std::printf(
      "usage: flatshard-collectives-bench [--min-bytes N] [--max-bytes N] [--factor F]\n"
      "                                   [--warmup N] [--iters N] [--repeat R]\n"
      "                                   [--ops op:dtype,...]\n"
      "  sizes: min..max bytes, multiplied by F (default 1M..1G, x4; suffixes K M G)\n"
      "  time: median over R (default 3) timed runs of N (default 50) back-to-back calls\n"
      "  ops: all_gather, reduce_scatter, all_reduce with fp32 or bf16\n"
      "       (default all_gather:bf16,reduce_scatter:fp32,reduce_scatter:bf16,\n"
      "                all_reduce:fp32,all_reduce:bf16)\n");
}

int64_t parse_bytes(const char* flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  TORCH_CHECK(end != v.c_str() && x > 0, flag, ": '", v, "' is not a positive size");
  const std::string unit(end);
  const int64_t mult = unit.empty() ? 1
                       : unit == "K" ? int64_t{1} << 10
                       : unit == "M" ? int64_t{1} << 20
                       : unit == "G" ? int64_t{1} << 30
                                     : 0;
  TORCH_CHECK(mult > 0, flag, ": unknown unit '", unit, "' in '", v, "' (use K, M or G)");
  return x * mult;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      TORCH_CHECK(i + 1 < argc, a, " needs a value");
      return argv[++i];
    };
    if (a == "--min-bytes") {
      o.min_bytes = parse_bytes("--min-bytes", value());
    } else if (a == "--max-bytes") {
      o.max_bytes = parse_bytes("--max-bytes", value());
    } else if (a == "--factor") {
      o.factor = parse_bytes("--factor", value());
      TORCH_CHECK(o.factor >= 2, "--factor must be >= 2, got ", o.factor);
    } else if (a == "--warmup") {
      o.warmup = static_cast<int>(parse_bytes("--warmup", value()));
    } else if (a == "--iters") {
      o.iters = static_cast<int>(parse_bytes("--iters", value()));
    } else if (a == "--repeat") {
      o.repeat = static_cast<int>(parse_bytes("--repeat", value()));
    } else if (a == "--ops") {
      o.ops.clear();
      std::stringstream ss(value());
      for (std::string op; std::getline(ss, op, ',');) o.ops.push_back(op);
    } else if (a == "-h" || a == "--help") {
      usage();
      std::exit(0);
    } else {
      usage();
      TORCH_CHECK(false, "unknown argument '", a, "'");
    }
  }
  TORCH_CHECK(o.min_bytes <= o.max_bytes, "--min-bytes ", o.min_bytes, " > --max-bytes ",
              o.max_bytes);
  return o;
}

// Rank r's element i is (r + 1) + (i % 7): exact in bf16 and in sums over up to 16 ranks.
at::Tensor rank_values(int r, int64_t begin, int64_t n, at::ScalarType dt, c10::Device dev) {
  auto idx = at::arange(begin, begin + n, at::TensorOptions().dtype(at::kLong).device(dev));
  return (idx.remainder(7) + (r + 1)).to(dt);
}

// Sum (or avg) over ranks of rank_values(q, begin, n), computed in double.
at::Tensor reduced_values(int world, int64_t begin, int64_t n, ReduceOp op, c10::Device dev) {
  auto idx = at::arange(begin, begin + n, at::TensorOptions().dtype(at::kLong).device(dev));
  auto s = idx.remainder(7).to(at::kDouble) * world + world * (world + 1) / 2.0;
  return op == ReduceOp::kAvg ? s / world : s;
}

struct Case {
  std::string op;
  at::ScalarType dtype;
  const char* dtype_name;
};

Case parse_case(const std::string& spec) {
  const auto colon = spec.find(':');
  TORCH_CHECK(colon != std::string::npos, "--ops entry '", spec, "' must be op:dtype");
  Case c{spec.substr(0, colon), at::kFloat, "fp32"};
  const std::string dt = spec.substr(colon + 1);
  TORCH_CHECK(c.op == "all_gather" || c.op == "reduce_scatter" || c.op == "all_reduce",
              "--ops entry '", spec, "': unknown collective '", c.op, "'");
  TORCH_CHECK(dt == "fp32" || dt == "bf16", "--ops entry '", spec, "': unknown dtype '", dt,
              "' (fp32 or bf16)");
  if (dt == "bf16") c = Case{c.op, at::kBFloat16, "bf16"};
  return c;
}

// Runs one (collective, dtype, size): verify, then time. Returns false on a wrong result.
bool run_case(NcclCommunicator& comm, const Case& c, int64_t bytes, const Options& o,
              c10::cuda::CUDAStream stream) {
  const int world = comm.world_size(), r = comm.rank();
  const c10::Device dev = comm.device();
  const int64_t es = c10::elementSize(c.dtype);
  const bool is_ar = c.op == "all_reduce";
  const int64_t n = is_ar ? bytes / es : bytes / es / world;  // per-rank count (AG, RS)
  const int64_t total = is_ar ? n : n * world;
  const int64_t size = total * es;  // the payload nccl-tests calls "size"
  const auto opts = at::TensorOptions().dtype(c.dtype).device(dev);

  at::Tensor in, out;
  std::function<void()> launch;
  {
    c10::cuda::CUDAStreamGuard guard(stream);  // allocate and fill on the timing stream
    if (c.op == "all_gather") {
      in = rank_values(r, 0, n, c.dtype, dev);
      out = at::empty({total}, opts);
      launch = [&] { comm.all_gather(in, out, stream.unwrap()); };
    } else if (c.op == "reduce_scatter") {
      in = rank_values(r, 0, total, c.dtype, dev);
      out = at::empty({n}, opts);
      launch = [&] { comm.reduce_scatter(in, out, ReduceOp::kSum, stream.unwrap()); };
    } else {
      in = rank_values(r, 0, n, c.dtype, dev);
      out = in;  // in place
      launch = [&] { comm.all_reduce(in, ReduceOp::kSum, stream.unwrap()); };
    }
  }

  // 1. Verify once, on every rank, before timing.
  launch();
  int64_t bad = 0;
  {
    c10::cuda::CUDAStreamGuard guard(stream);
    at::Tensor expect;
    if (c.op == "all_gather") {
      std::vector<at::Tensor> parts;
      for (int q = 0; q < world; ++q) parts.push_back(rank_values(q, 0, n, c.dtype, dev));
      expect = at::cat(parts);
    } else {
      expect = reduced_values(world, c.op == "reduce_scatter" ? r * n : 0, n, ReduceOp::kSum, dev)
                   .to(c.dtype);
    }
    bad = out.ne(expect).sum().item<int64_t>();  // syncs `stream`
    auto verdict = at::full({1}, static_cast<double>(bad), at::TensorOptions().dtype(at::kFloat).device(dev));
    comm.all_reduce(verdict, ReduceOp::kSum, stream.unwrap());
    bad = static_cast<int64_t>(verdict.item<float>());
  }

  // 2. Time: warmup, then `repeat` runs of `iters` launches back to back on one stream; the
  //    median run's average.
  comm.barrier();
  for (int i = 0; i < o.warmup; ++i) launch();
  std::vector<double> runs;
  for (int rep = 0; rep < o.repeat; ++rep) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record(stream);
    for (int i = 0; i < o.iters; ++i) launch();
    stop.record(stream);
    stop.synchronize();
    runs.push_back(1000.0 * start.elapsed_time(stop) / o.iters);
  }
  std::sort(runs.begin(), runs.end());
  const double us = runs[runs.size() / 2];
  const double algbw = static_cast<double>(size) / (us * 1e-6) / 1e9;
  const double factor = is_ar ? 2.0 * (world - 1) / world : static_cast<double>(world - 1) / world;
  if (r == 0)
    std::printf("%14s %5s %12lld %11lld %10.2f %11.2f %11.2f %6s\n", c.op.c_str(), c.dtype_name,
                static_cast<long long>(size), static_cast<long long>(total), us, algbw,
                algbw * factor, bad == 0 ? "OK" : "WRONG");
  std::fflush(stdout);
  comm.barrier();
  return bad == 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<NcclCommunicator> comm;
  try {
    const Options o = parse(argc, argv);
    std::vector<Case> cases;
    for (const auto& s : o.ops) cases.push_back(parse_case(s));
    comm = NcclCommunicator::from_env("collectives_bench");
    c10::cuda::CUDAGuard device_guard(comm->device());
    // A non-blocking pool stream, as a training runtime would use (not the legacy default
    // stream, which synchronises with other streams).
    auto stream = c10::cuda::getStreamFromPool(false, comm->device().index());
    if (comm->rank() == 0) {
      cudaDeviceProp prop{};
      (void)cudaGetDeviceProperties(&prop, comm->device().index());
      std::printf("# flatshard-collectives-bench: backend nccl (NCCL %s), world %d, %s, warmup %d, "
                  "iters %d x %d (median), watchdog %s\n",
                  flatshard::detail::nccl_version_string().c_str(), comm->world_size(), prop.name,
                  o.warmup, o.iters, o.repeat, comm->options().watchdog ? "on" : "off");
      std::printf("# %12s %5s %12s %11s %10s %11s %11s %6s\n", "op", "dtype", "size(B)", "count",
                  "time(us)", "algbw(GB/s)", "busbw(GB/s)", "check");
    }
    bool ok = true;
    for (const Case& c : cases)
      for (int64_t b = o.min_bytes; b <= o.max_bytes; b *= o.factor)
        ok = run_case(*comm, c, b, o, stream) && ok;
    comm->barrier();
    comm->shutdown();
    if (!ok && comm->rank() == 0) std::fprintf(stderr, "flatshard-collectives-bench: WRONG results\n");
    return ok ? 0 : 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "flatshard-collectives-bench: %s\n", e.what_without_backtrace());
    return 2;
  }
}
