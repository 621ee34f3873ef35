"""Host<->device copy bandwidth of this machine (pinned memory, 1 GiB, 5 copies each way).

CPU offload (flat_param/offload.h) moves 8 B per parameter per step over this link at level 1;
benchmarks/RESULTS.md compares its exposed copy time with these numbers. Needs a CUDA GPU.
"""
import sys
import time

import torch


def main():
    if not torch.cuda.is_available():
        sys.exit("pcie_probe: needs a CUDA GPU")
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for name, copy in (("H2D", lambda: dev.copy_(host, non_blocking=True)),
                       ("D2H", lambda: host.copy_(dev, non_blocking=True))):
        copy()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            copy()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / 5
        print(f"pcie {name} pinned 1 GiB: {n / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
