#!/usr/bin/env python3
"""How fast, and how steadily, this host steps AdamW on the CPU: the offload-1 optimizer step.

ATen's fused CPU AdamW (torch._fused_adamw_, the kernel flatshard::FusedAdamW calls) over 25
fp32 tensors of 38 M elements (~0.95 G parameters: the 1B GPT / LLaMA masters), 1 warm-up and 6
timed steps; prints the median and every step. One line per process: run it several times,
interleaved with its variants, to see how much the host's speed changes between processes
(benchmarks/history.md, "Issue 20, fourth pass").

Environment:
  ALLOC = pin_memory (default: torch's pinned allocator) | register (mmap + cudaHostRegister,
          as flatshard's host_empty pins) | pageable
  THP   = 1: madvise(MADV_HUGEPAGE) before registering (ALLOC=register)
  MODE  = static (default: one call, ATen splits each tensor into one slice per thread) |
          chunked (os.cpu_count() threads pull 4 Mi-element chunks from a shared counter, the
          kernel single-threaded in each)
  N     = elements per tensor (default 38000000)
Run under `taskset -c 0-7` or OMP_NUM_THREADS=8 for the thread-count variants.
Example: for r in 1 2 3; do python3 tools/cpu_adamw_probe.py r$r; MODE=chunked python3 tools/cpu_adamw_probe.py r$r; done
"""
import ctypes
import os
import statistics
import sys
import threading
import time

import torch

if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0)
UNITS = 25
N = int(os.environ.get("N", "38000000"))
ALLOC = os.environ.get("ALLOC", "pin_memory")
THP = os.environ.get("THP", "0") == "1"
MODE = os.environ.get("MODE", "static")
CHUNK = 4 << 20
if ALLOC not in ("pin_memory", "register", "pageable") or MODE not in ("static", "chunked"):
    sys.exit(f"cpu_adamw_probe: ALLOC={ALLOC!r} MODE={MODE!r}: ALLOC is pin_memory | register | "
             "pageable, MODE static | chunked (--help)")
if N < 1:
    sys.exit(f"cpu_adamw_probe: N must be >= 1, got {N}")

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_keep = []  # the mmap'ed buffers outlive their tensors


def host():
    if ALLOC == "pin_memory":
        return torch.empty(N).pin_memory().zero_()
    if ALLOC == "pageable":
        return torch.zeros(N)
    nbytes = N * 4
    ptr = libc.mmap(None, nbytes, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|ANONYMOUS
    if ptr in (None, ctypes.c_void_p(-1).value):
        sys.exit(f"cpu_adamw_probe: mmap of {nbytes} B failed (errno {ctypes.get_errno()})")
    if THP and libc.madvise(ptr, nbytes, 14) != 0:  # MADV_HUGEPAGE
        sys.exit(f"cpu_adamw_probe: madvise failed (errno {ctypes.get_errno()})")
    buf = (ctypes.c_float * N).from_address(ptr)
    _keep.append(buf)
    t = torch.frombuffer(buf, dtype=torch.float32)
    t.zero_()
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if rc != 0:
        sys.exit(f"cpu_adamw_probe: cudaHostRegister failed ({rc})")
    return t


t0 = time.time()
p = [host() for _ in range(UNITS)]
g = [host().normal_() for _ in range(UNITS)]
m = [host() for _ in range(UNITS)]
v = [host() for _ in range(UNITS)]
steps = [torch.zeros(()) for _ in range(UNITS)]
setup_s = time.time() - t0
ARGS = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False,
            maximize=False)
work = [(i, s) for i in range(UNITS) for s in range(0, N, CHUNK)]


def step():
    if MODE == "static":
        torch._fused_adamw_(p, g, m, v, [], steps, **ARGS)
        return
    lock, nxt = threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                c = nxt[0]
                nxt[0] += 1
            if c >= len(work):
                return
            i, s = work[c]
            e = min(N, s + CHUNK)
            torch._fused_adamw_([p[i][s:e]], [g[i][s:e]], [m[i][s:e]], [v[i][s:e]], [],
                                [steps[i]], **ARGS)

    threads = [threading.Thread(target=worker) for _ in range(os.cpu_count())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if MODE == "chunked":
    torch.set_num_threads(1)
ms = []
for _ in range(7):
    for s in steps:
        s += 1
    a = time.perf_counter()
    step()
    ms.append((time.perf_counter() - a) * 1e3)
tag = sys.argv[1] if len(sys.argv) > 1 else "-"
print(f"{tag:10s} mode={MODE} alloc={ALLOC} thp={int(THP)} threads={torch.get_num_threads():2d} "
      f"cpus={len(os.sched_getaffinity(0)):2d} setup={setup_s:5.1f}s adamw ms: median "
      f"{statistics.median(ms[1:]):6.1f}  all " + " ".join(f"{t:.0f}" for t in ms), flush=True)
