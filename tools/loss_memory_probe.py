#!/usr/bin/env python3
"""The device memory of the models' loss, measured alone in PyTorch (issue 20, cost model check).

Runs, on one CUDA device, what models/gpt.cpp and models/llama.cpp do at the head:
    loss = cross_entropy(linear(h, W).reshape(-1, V).float(), targets)
and prints, per vocabulary size, the bytes per logit alive after forward, at the forward peak
and at the backward peak (relative to before the forward). planner/cost_model.h counts 4 after
forward (the fp32 log-softmax output), 10 at the forward peak (bf16 logits, their fp32 copy,
the log-softmax output) and 12 in backward (two more fp32 [tokens, V] gradients). Also prints
which SDPA kernel runs and whether its output's transpose is contiguous (if it is, the
projection's input needs no copy, which the closed form counts).

Standard library + torch. Usage: python3 tools/loss_memory_probe.py [--tokens 8192] [--d 2048]
"""
import argparse

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 32000])
    a = ap.parse_args()
    if a.tokens < 1 or a.d < 1 or any(v < 1 for v in a.vocab):
        ap.error(f"--tokens, --d and --vocab must be >= 1, got {a.tokens}, {a.d}, {a.vocab}")
    if not torch.cuda.is_available():
        raise SystemExit("loss_memory_probe: needs a CUDA device")
    dev, mib = "cuda", 2**20
    q = torch.randn(4, 16, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = F.scaled_dot_product_attention(q, q.detach().clone(), q.detach().clone(), is_causal=True)
    print("sdpa", y.grad_fn.name(), "transpose(1,2) contiguous:", y.transpose(1, 2).is_contiguous())
    del q, y
    for V in a.vocab:
        T, d = a.tokens, a.d
        h = torch.randn(T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        W = torch.randn(V, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        tgt = torch.randint(0, V, (T,), device=dev)
        torch.cuda.synchronize()
        m0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

        def loss_fn():
            logits = F.linear(h, W)
            return F.cross_entropy(logits.reshape(-1, V).float(), tgt.reshape(-1))

        loss = loss_fn()
        torch.cuda.synchronize()
        m1, pf = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        pb = torch.cuda.max_memory_allocated()
        n = T * V
        print(f"V {V}: after forward {(m1 - m0) / mib:.0f} MiB ({(m1 - m0) / n:.2f} B/logit), "
              f"forward peak {(pf - m0) / mib:.0f} ({(pf - m0) / n:.2f}), "
              f"backward peak {(pb - m0) / mib:.0f} ({(pb - m0) / n:.2f})")
        del h, W, tgt, loss


if __name__ == "__main__":
    main()
