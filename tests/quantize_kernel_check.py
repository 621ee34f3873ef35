"""GPU check of flat_param/quantize_kernel.cu (not registered with ctest: it needs a GPU).

Builds the kernels as a torch extension, runs them on CUDA and compares every output bit for
bit with the formulas of flat_param/quantized_gather.h computed by torch on the CPU (the path
the plans take today, which tests/quantized_gather_test.cpp checks the same way). Usage, from
the repository root on a GPU machine:  python3 tests/quantize_kernel_check.py
"""
import math
import os
import sys

import torch
from torch.utils.cpp_extension import load_inline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "flat_param/quantize_kernel.h"
namespace k = flatshard::kernels;
static k::KernelDtype kd(at::ScalarType t) {
  return t == at::kFloat ? k::KernelDtype::kFloat32
         : t == at::kBFloat16 ? k::KernelDtype::kBFloat16 : k::KernelDtype::kFloat16;
}
// Returns this rank's wire slot: [scales | data | pad to 4].
at::Tensor int8_wire(at::Tensor x) {
  const int64_t n = x.numel(), nb = (n + 255) / 256, w = 4 * nb + (n + 3) / 4 * 4;
  auto wire = at::zeros({w}, x.options().dtype(at::kByte));
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  TORCH_CHECK(k::int8_quantize(x.data_ptr<float>(), n, reinterpret_cast<float*>(wire.data_ptr<uint8_t>()),
                               reinterpret_cast<int8_t*>(wire.data_ptr<uint8_t>() + 4 * nb), st) == cudaSuccess);
  return wire;
}
at::Tensor int8_out(at::Tensor wire, int64_t w, int64_t n, int64_t world, at::ScalarType dt) {
  auto out = at::empty({n * world}, wire.options().dtype(dt));
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  TORCH_CHECK(k::int8_dequantize(wire.data_ptr<uint8_t>(), w, n, static_cast<int>(world),
                                 out.data_ptr(), kd(dt), st) == cudaSuccess);
  return out;
}
at::Tensor fp8_q(at::Tensor x, at::Tensor s) {
  auto q = at::empty({x.numel()}, x.options().dtype(at::kByte));
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  TORCH_CHECK(k::fp8_quantize(x.data_ptr<float>(), x.numel(), s.data_ptr<float>(), q.data_ptr<uint8_t>(), st) == cudaSuccess);
  return q;
}
at::Tensor fp8_dq(at::Tensor q, at::Tensor s, at::ScalarType dt) {
  auto out = at::empty({q.numel()}, q.options().dtype(dt));
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  TORCH_CHECK(k::fp8_dequantize(q.data_ptr<uint8_t>(), q.numel(), s.data_ptr<float>(), out.data_ptr(), kd(dt), st) == cudaSuccess);
  return out;
}
"""
ext = load_inline(
    name="flatshard_quantize_check", cpp_sources=[BINDING],
    functions=["int8_wire", "int8_out", "fp8_q", "fp8_dq"],
    extra_include_paths=[ROOT], extra_cuda_cflags=["-arch=sm_90"],
    cuda_sources=[open(os.path.join(ROOT, "flat_param/quantize_kernel.cu")).read()
                  .replace('#include "flat_param/quantize_kernel.h"',
                           '#include "' + os.path.join(ROOT, "flat_param/quantize_kernel.h") + '"')],
    verbose=False)

TINY = torch.finfo(torch.float32).tiny


def scale(amax, qmax):
    s = amax / qmax
    s = torch.where(s < TINY, torch.full_like(s, TINY), s)
    return torch.where(amax == 0, torch.ones_like(s), s)


def cases():
    g = torch.Generator().manual_seed(53)
    ties = (torch.arange(256) % 9 - 4 + 0.5).float()
    ties[0] = 127
    den = torch.arange(1, 257).float() * 3e-42
    den[:128] *= -1
    mags = torch.pow(10.0, torch.rand(256, generator=g) * 40 - 20)
    x = torch.cat([torch.randn(256, generator=g) * 3, torch.zeros(256), torch.full((256,), 0.7),
                   ties, den, torch.randn(256, generator=g) * mags,
                   torch.randn(37, generator=g) * 1000])
    yield "wire_input", x
    yield "odd", torch.randn(1001, generator=g)
    yield "one", torch.tensor([-0.3])


def same(a, b):
    return a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


bad = 0
for name, x in cases():
    xd = x.cuda()
    n = x.numel()
    nb = math.ceil(n / 256)
    # int8 reference (CPU, per block)
    s_ref, q_ref = [], []
    for b in range(nb):
        v = x[b * 256:(b + 1) * 256]
        s = scale(v.abs().max().reshape(1), 127.0)
        s_ref.append(s)
        q_ref.append(torch.clamp(torch.round(v / s), -127, 127).to(torch.int8))
    s_ref, q_ref = torch.cat(s_ref), torch.cat(q_ref)
    wire = ext.int8_wire(xd).cpu()
    ok = same(wire[:4 * nb].view(torch.float32), s_ref) and same(wire[4 * nb:4 * nb + n].view(torch.int8), q_ref)
    w = wire.numel()
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        two = torch.cat([wire, wire]).cuda()  # two "ranks" with the same part
        out = ext.int8_out(two, w, n, 2, dt).cpu()
        ref = (q_ref.float().view(-1) * s_ref.repeat_interleave(256)[:n]).to(dt)
        ok = ok and same(out[:n], ref) and same(out[n:], ref)
    # fp8 reference: the whole case as one parameter
    s8 = scale(x.abs().max().reshape(1), 448.0)
    q8 = torch.clamp(x / s8, -448.0, 448.0).to(torch.float8_e4m3fn)
    q8d = ext.fp8_q(xd, s8.cuda()).cpu()
    ok8 = same(q8d, q8.view(torch.uint8))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        ok8 = ok8 and same(ext.fp8_dq(q8d.cuda(), s8.cuda(), dt).cpu(), (q8.float() * s8).to(dt))
    print(f"{name:12s} n={n:5d} int8 {'ok' if ok else 'DIFFERS'}  fp8 {'ok' if ok8 else 'DIFFERS'}")
    bad += (not ok) + (not ok8)
print("quantize kernels vs CPU formulas:", "all bit for bit" if bad == 0 else f"{bad} mismatches")
sys.exit(1 if bad else 0)
