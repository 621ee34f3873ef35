#!/usr/bin/env python3
"""PyTorch c10d (torch.distributed, NCCL) reference for flatshard-collectives-bench.

Same collectives, sizes, closed-form verification, timing method and table as
benchmarks/collectives_bench.cpp, so one run compares flatshard's NCCL backend with c10d:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/c10d_reference.py

Rows (rank 0): op dtype size(B) count time(us) algbw(GB/s) busbw(GB/s) check, with nccl-tests'
definitions (size = total payload; algbw = size/time in 1e9 B/s; busbw = algbw * (n-1)/n for
all_gather / reduce_scatter, * 2(n-1)/n for all_reduce). Timing: CUDA events on one stream around
`iters` back-to-back calls, median of `repeat` runs (all_gather_into_tensor / reduce_scatter_tensor / all_reduce, which
c10d runs on its internal NCCL stream ordered after the current one), after `warmup` calls.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_OPS = "all_gather:bf16,reduce_scatter:fp32,reduce_scatter:bf16,all_reduce:fp32,all_reduce:bf16"


def parse_bytes(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    num = text.rstrip("KMG")
    unit = text[len(num):]
    if not num.isdigit() or unit not in units or int(num) <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive size (suffixes K, M, G)")
    return int(num) * units[unit]


def rank_values(r, begin, n, dtype, dev):
    # Rank r's element i is (r + 1) + (i % 7): exact in bf16 and in sums over up to 16 ranks.
    return (torch.arange(begin, begin + n, device=dev) % 7 + (r + 1)).to(dtype)


def reduced_values(world, begin, n, dev):
    idx = torch.arange(begin, begin + n, device=dev)
    return (idx % 7).double() * world + world * (world + 1) / 2.0


def run_case(op, dtype_name, nbytes, args, rank, world, dev, stream):
    dtype = DTYPES[dtype_name]
    es = torch.empty((), dtype=dtype).element_size()
    is_ar = op == "all_reduce"
    n = nbytes // es if is_ar else nbytes // es // world
    total = n if is_ar else n * world
    size = total * es
    if op == "all_gather":
        inp = rank_values(rank, 0, n, dtype, dev)
        out = torch.empty(total, dtype=dtype, device=dev)
        launch = lambda: dist.all_gather_into_tensor(out, inp)
        expect = lambda: torch.cat([rank_values(q, 0, n, dtype, dev) for q in range(world)])
    elif op == "reduce_scatter":
        inp = rank_values(rank, 0, total, dtype, dev)
        out = torch.empty(n, dtype=dtype, device=dev)
        launch = lambda: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
        expect = lambda: reduced_values(world, rank * n, n, dev).to(dtype)
    else:
        inp = rank_values(rank, 0, n, dtype, dev)
        out = inp
        launch = lambda: dist.all_reduce(inp, op=dist.ReduceOp.SUM)
        expect = lambda: reduced_values(world, 0, n, dev).to(dtype)

    # 1. Verify once on every rank before timing; the verdict is summed over ranks.
    launch()
    bad = torch.tensor([float((out != expect()).sum().item())], device=dev)
    dist.all_reduce(bad)
    bad = int(bad.item())

    # 2. Time.
    dist.barrier()
    for _ in range(args.warmup):
        launch()
    runs = []
    for _ in range(args.repeat):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(args.iters):
            launch()
        stop.record(stream)
        stop.synchronize()
        runs.append(1000.0 * start.elapsed_time(stop) / args.iters)
    us = sorted(runs)[len(runs) // 2]
    algbw = size / (us * 1e-6) / 1e9
    factor = 2.0 * (world - 1) / world if is_ar else (world - 1) / world
    if rank == 0:
        print(f"{op:>14} {dtype_name:>5} {size:12d} {total:11d} {us:10.2f} {algbw:11.2f} "
              f"{algbw * factor:11.2f} {'OK' if bad == 0 else 'WRONG':>6}", flush=True)
    dist.barrier()
    return bad == 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=parse_bytes, default=1 << 20)
    p.add_argument("--max-bytes", type=parse_bytes, default=1 << 30)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeat", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--ops", default=DEFAULT_OPS, help="comma-separated op:dtype (default: %(default)s)")
    args = p.parse_args()
    cases = []
    for spec in args.ops.split(","):
        op, _, dt = spec.partition(":")
        if op not in ("all_gather", "reduce_scatter", "all_reduce") or dt not in DTYPES:
            p.error(f"--ops entry '{spec}' must be all_gather|reduce_scatter|all_reduce:fp32|bf16")
        cases.append((op, dt))

    local_rank = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    # A side stream, like the flatshard benchmark's pool stream.
    stream = torch.cuda.Stream(device=dev)
    ok = True
    with torch.cuda.stream(stream):
        if rank == 0:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
            print(f"# c10d-reference: backend nccl (NCCL {nccl}), torch {torch.__version__}, world {world}, "
                  f"{torch.cuda.get_device_name(dev)}, warmup {args.warmup}, iters {args.iters} x {args.repeat} (median)")
            print(f"# {'op':>12} {'dtype':>5} {'size(B)':>12} {'count':>11} {'time(us)':>10} "
                  f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'check':>6}", flush=True)
        for op, dt in cases:
            nbytes = args.min_bytes
            while nbytes <= args.max_bytes:
                ok = run_case(op, dt, nbytes, args, rank, world, dev, stream) and ok
                nbytes *= args.factor
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        print("c10d_reference: WRONG results", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
