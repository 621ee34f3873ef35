#!/usr/bin/env python3
"""Communication per training step: FULL_SHARD over all N GPUs vs HSDP (shard group = node).

Prints the table of docs/hsdp.md "Scaling: FULL_SHARD vs HSDP". Model (bandwidth only; see there):
  ring collectives; a ring over N ranks moves (N-1)/N of the buffer through every GPU's link for
  all-gather and reduce-scatter, 2(N-1)/N for all-reduce (nccl-tests' busbw definitions), so
  time = bytes x factor / busbw. A ring that leaves the node runs at the inter-node bandwidth per
  GPU (B_inter, one NIC per GPU, rail-aligned rings); inside a node at B_intra.
  Compute: forward = 1/3, backward = 2/3 of the measured step. Forward all-gathers hide behind
  forward compute, backward all-gathers and reductions behind backward compute; the last unit's
  reductions (1/U of them) always trail the backward. HSDP: the replicate all-reduce runs after
  each reduce-scatter on the same stream (serial with it), beside the all-gathers.
Usage: tools/scaling_table.py [--params 944.15e6] [--compute-ms 108] [--gpus-per-node 8]
       [--inter-GBps 50] [--intra-GBps 270] [--units 17] [--reduce-bytes 4]
"""
import argparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=944.15e6)  # 1B GPT preset (models/gpt.cpp)
    ap.add_argument("--compute-ms", type=float, default=108.0)  # RESULTS.md, 4 seq/GPU, H200
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--inter-GBps", type=float, default=50.0)   # 400 Gb/s per GPU
    ap.add_argument("--intra-GBps", type=float, default=270.0)  # NVLink busbw measured (docs/design.md)
    ap.add_argument("--units", type=int, default=17)            # per-layer plan: 16 blocks + root
    ap.add_argument("--param-bytes", type=int, default=2)       # bf16 all-gather
    ap.add_argument("--reduce-bytes", type=int, nargs="+", default=[4, 2])  # fp32, bf16 reduce
    a = ap.parse_args()
    P, G, U = a.params, a.gpus_per_node, a.units
    bi, bn = a.inter_GBps * 1e9, a.intra_GBps * 1e9
    t_fwd, t_bwd = a.compute_ms / 3, 2 * a.compute_ms / 3
    ms = lambda nbytes, bw: nbytes / bw * 1e3
    for br in a.reduce_bytes:
        bp = a.param_bytes
        print(f"\n# P = {P / 1e6:.0f}M, all-gather {bp} B/elem, reduce {br} B/elem, {G} GPUs/node, "
              f"B_inter {a.inter_GBps:g} GB/s/GPU, B_intra {a.intra_GBps:g} GB/s, compute "
              f"{a.compute_ms:g} ms (fwd {t_fwd:.0f} + bwd {t_bwd:.0f}), {U} units")
        print("| GPUs | FS inter GB/GPU | FS comm ms | FS exposed ms | HSDP inter GB/GPU "
              "| HSDP intra ms | HSDP inter ms | HSDP exposed ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        n = G
        while n <= 1024:
            f = (n - 1) / n
            bw = bn if n <= G else bi
            # FULL_SHARD: one ring over all N GPUs.
            fs_inter_bytes = f * P * (2 * bp + br) if n > G else 0.0
            ag, rs = ms(f * P * bp, bw), ms(f * P * br, bw)
            fs_exposed = max(0, ag - t_fwd) + max(0, ag + rs - t_bwd) + rs / U
            # HSDP: shard group = node (S = G), R = N / G replicas.
            r, fg = n // G, (G - 1) / G
            h_inter_bytes = 2 * (r - 1) / r * P * br / G
            h_ag, h_rs = ms(fg * P * bp, bn), ms(fg * P * br, bn)
            h_ar = ms(h_inter_bytes, bi)
            # Backward: all-gathers and reduce-scatters share NVLink; each replicate all-reduce
            # follows its reduce-scatter on the one reduce-scatter stream, so those two add.
            h_exposed = (max(0, h_ag - t_fwd) + max(0, max(h_ag + h_rs, h_rs + h_ar) - t_bwd)
                         + (h_rs + h_ar) / U)
            print(f"| {n} | {fs_inter_bytes / 1e9:.2f} | {2 * ag + rs:.1f} | {fs_exposed:.1f} "
                  f"| {h_inter_bytes / 1e9:.2f} | {2 * h_ag + h_rs:.1f} | {h_ar:.1f} "
                  f"| {h_exposed:.1f} |")
            n *= 2


if __name__ == "__main__":
    main()
