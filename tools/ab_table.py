#!/usr/bin/env python3
"""Issue 54's A/B table from tools/gpu_check.sh's `ab` step: LOGDIR VARIANTS BATCH...

Reads LOGDIR/ab_torch_b<B>.json (tools/torch_reference.py, PyTorch plain) and
LOGDIR/ab_b<B>_<variant>.json (flatshard-bench --json) and prints one row per run:
step ms, x PyTorch (step / PyTorch plain at the same batch, same call), host issue ms,
fwd+bwd ms, optimizer ms, hook us per unit per step ((hook_forward + hook_backward median)
/ units) and peak MiB."""
import json
import os
import sys


def main(argv):
    logdir, variants, batches = argv[1], argv[2], argv[3:]
    names = [v.split(":", 1)[0] for v in variants.split(";") if v]
    print("# issue 54 A/B, 1 GPU, world 1, 1B GPT, fused AdamW, one process per variant; "
          "x PyTorch = step ms / PyTorch plain (pure bf16) in the same call")
    print(f"{'batch':>5} {'variant':<12} {'policy':<24} {'step ms':>8} {'x PyTorch':>9} "
          f"{'host ms':>8} {'fwd+bwd':>8} {'optim':>7} {'hook us':>8} {'peak MiB':>9}")
    for b in batches:
        plain = None
        try:
            t = json.load(open(os.path.join(logdir, f"ab_torch_b{b}.json")))
            plain = next(r["step_ms"] for r in t["rows"] if r["mode"] == "plain")
            print(f"{b:>5} {'PyTorch':<12} {'plain':<24} {plain:8.1f} {1.0:9.3f}")
        except (OSError, ValueError, StopIteration) as e:
            print(f"{b:>5} PyTorch missing: {e}")
        for n in names:
            try:
                f = json.load(open(os.path.join(logdir, f"ab_b{b}_{n}.json")))
            except (OSError, ValueError) as e:
                print(f"{b:>5} {n:<12} missing: {e}")
                continue
            for r in f["runs"]:
                ms = r["step_ms"]["median"]
                hook = "-"
                if r.get("hook_forward_ms_median") is not None and r.get("units"):
                    us = 1000 * (r["hook_forward_ms_median"] + r["hook_backward_ms_median"])
                    hook = f"{us / r['units']:.1f}"
                x = f"{ms / plain:9.3f}" if plain else f"{'-':>9}"
                print(f"{b:>5} {n:<12} {r['granularity']:<24} {ms:8.1f} {x} "
                      f"{r['host_issue_ms_median']:8.1f} {r['fwd_bwd_ms_median']:8.1f} "
                      f"{r['optimizer_ms_median']:7.1f} {hook:>8} "
                      f"{r['peak_memory_bytes'] / 2**20:9.0f}")


if __name__ == "__main__":
    main(sys.argv)
