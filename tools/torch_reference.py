#!/usr/bin/env python3
"""PyTorch running the same model as flatshard-bench: the reference every speed ratio is taken against.

--model llama: flatshard's LLaMA-style decoder (models/llama.h) written again in PyTorch, same
presets (LLAMA_PRESETS), init and synthetic data; fsdp2-block shards per DecoderLayer, fsdp2-leaf
per Linear / RMSNorm / Embedding. tests/llama_test.cpp checks its logits against the C++ model.

The default model is flatshard's reference GPT (models/gpt.h) written again in PyTorch: pre-LayerNorm
GPT-2 blocks (qkv and proj Linear with bias, causal scaled_dot_product_attention, GELU-tanh MLP
of width 4d), learned position embedding, untied lm_head without bias; init N(0, 0.02), the two
residual projections N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorm 1/0. Batches are the same
synthetic language (arithmetic progressions mod vocab), built on the device before timing.
Loss: cross-entropy in fp32 (as GPTImpl::loss). Optimizer: AdamW(lr 1e-3, weight decay 0.1),
fused (default, as flatshard-bench --optimizer fused) or foreach.

Modes (comma list, --modes):
  plain        single GPU, parameters in --param-dtype (bf16), no wrapper: the floor (pure bf16:
               bf16 parameters and bf16 AdamW state). Run as rank 0 only when launched with
               several processes.
  amp          single GPU, the usual PyTorch mixed precision: fp32 parameters, forward and loss
               under torch.autocast(dtype --param-dtype, bf16), backward outside it, AdamW
               (fused) over the fp32 parameters and fp32 state: the single-GPU floor with an
               fp32 master. Rank 0 only, as plain.
  ddp          DistributedDataParallel over all ranks, bf16 parameters.
  fsdp2-block  fully_shard per Block, then the root; fp32 master, MixedPrecisionPolicy(bf16,
               reduce --reduce-dtype), reshard_after_forward=True (FSDP2's default).
  fsdp2-leaf   fully_shard per Linear / LayerNorm / Embedding (the ZeRO-3 shape), then the root.
  fsdp2-block-offload, fsdp2-leaf-offload
               the same with CPUOffloadPolicy(pin_memory=True): sharded fp32 parameters,
               gradients and optimizer state on the host, the optimizer stepping on the CPU
               (flatshard-bench --offload 1 is the counterpart).

--device cpu runs plain and amp on the host (timed with the host clock, no peak memory): a check
of the script itself, e.g. --device cpu --preset tiny --warmup 1 --steps 2, not a floor.

World 1 needs no launcher (the script makes a one-rank process group); for more ranks use
  python3 -m torch.distributed.run --standalone --nproc-per-node N tools/torch_reference.py ...

Each mode: --warmup untimed steps, then --steps timed steps (CUDA events around each whole step,
synchronised per step, like flatshard-bench; the host clock on --device cpu); the median step
ms, host issue ms, peak memory (torch.cuda.max_memory_allocated after reset), tokens/s per GPU
and MFU are printed as a table and, with --json, written for tools/gpu_check.sh to join with
flatshard-bench's table.
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: vocab, d_model, n_heads, n_layers, seq_len (models/gpt.h GPTConfig::preset)
    "tiny": (512, 64, 4, 2, 32),
    "small": (4096, 256, 8, 4, 256),
    "1b": (32768, 2048, 16, 16, 2048),
}


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def llama_hidden(d, multiple_of=256):
    """SwiGLU width, the LLaMA rule of models/llama.h: multiple_of * ceil(floor(8d/3) / multiple_of)."""
    return multiple_of * -(-(8 * d // 3) // multiple_of)


LLAMA_PRESETS = {
    # models/llama.h LlamaConfig::preset: vocab, d, heads, kv_heads, layers, seq, hidden
    "tiny": dict(vocab=512, d=64, heads=4, kv_heads=2, layers=2, seq=32, hidden=llama_hidden(64, 32)),
    "small": dict(vocab=4096, d=256, heads=8, kv_heads=4, layers=4, seq=256, hidden=llama_hidden(256)),
    "1b": dict(vocab=32000, d=2048, heads=16, kv_heads=16, layers=16, seq=2048, hidden=llama_hidden(2048)),
    "7b": dict(vocab=32000, d=4096, heads=32, kv_heads=32, layers=32, seq=4096, hidden=llama_hidden(4096)),
}


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    """RoPE, rotate-half layout: pairs (x[i], x[i + hd/2]) turned by angle p * inv_freq[i]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, d, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, heads * self.hd, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        g = self.heads // self.kv_heads
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.hd))


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, d, heads, kv_heads, hidden, eps):
        super().__init__()
        self.input_norm = RMSNorm(d, eps)
        self.attn = LlamaAttention(d, heads, kv_heads)
        self.post_attn_norm = RMSNorm(d, eps)
        self.mlp = SwiGLU(d, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nn.Module):
    """models/llama.h: RMSNorm, RoPE (inv_freq fp32), grouped-query attention, SwiGLU, no biases."""

    def __init__(self, vocab, d, heads, kv_heads, layers, seq, hidden, norm_eps=1e-5,
                 rope_theta=10000.0, tied=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, kv_heads, hidden, norm_eps) for _ in range(layers))
        self.norm = RMSNorm(d, norm_eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.hd, self.rope_theta = d // heads, rope_theta
        self.register_buffer("rope_inv_freq", self._inv_freq(None), persistent=False)
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith("attn.o.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, std)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def _inv_freq(self, device):
        i2 = torch.arange(0, self.hd, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.rope_theta ** (i2 / self.hd))

    def _apply(self, fn, recurse=True):
        # inv_freq stays fp32 under .to(bf16), as RotaryEmbeddingImpl::to in models/llama.cpp:
        # recomputed in fp32 on whatever device the buffer went to.
        out = super()._apply(fn, recurse)
        self.rope_inv_freq = self._inv_freq(self.rope_inv_freq.device)
        return out

    def logits(self, idx):
        t = idx.shape[1]
        angles = torch.outer(torch.arange(t, device=idx.device, dtype=torch.float32), self.rope_inv_freq)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def forward(self, idx, targets):
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def llama_num_parameters(vocab, d, heads, kv_heads, layers, seq, hidden, tied=False):
    kv = kv_heads * (d // heads)
    return vocab * d * (1 if tied else 2) + layers * (2 * d + 2 * d * d + 2 * d * kv + 3 * d * hidden) + d


def llama_flops_per_token(vocab, d, heads, kv_heads, layers, seq, hidden):
    kv = kv_heads * (d // heads)
    return 6 * (layers * (2 * d * d + 2 * d * kv + 3 * d * hidden) + vocab * d) + 12 * layers * d * seq


def num_parameters(vocab, d, layers, seq):
    return 2 * vocab * d + seq * d + layers * (12 * d * d + 13 * d) + 2 * d


def flops_per_token(vocab, d, layers, seq):
    n = layers * 12 * d * d + vocab * d
    return 6 * n + 12 * layers * d * seq


def synthetic_batch(vocab, seq, batch, gen, device):
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 17, (batch, 1), generator=gen)
    s = (start + stride * torch.arange(seq + 1)) % vocab
    return s[:, :seq].contiguous().to(device), s[:, 1:].contiguous().to(device)


def dtype_of(name):
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


# Modes on one device without a wrapper: rank 0 runs them alone while the other ranks wait.
SINGLE_DEVICE_MODES = ("plain", "amp")


def autocast_for(mode, args, device):
    """amp's forward context (fp32 parameters, compute in --param-dtype); nothing for the others."""
    compute = dtype_of(args.param_dtype)
    if mode != "amp" or compute == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute)


class StepTimer:
    """One step's device time: CUDA events around it on a GPU, the host clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def begin(self):
        if self.cuda:
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self):
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def elapsed_ms(self):  # after sync()
        return self.start.elapsed_time(self.end) if self.cuda else (self.t1 - self.t0) * 1e3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(mode, args, cfg, device, world):
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Llama(**cfg) if args.model == "llama" else GPT(*cfg)
    if mode == "plain":
        return model.to(dtype_of(args.param_dtype))
    if mode == "amp":
        return model  # fp32 parameters; autocast_for() casts in the forward
    if mode == "ddp":
        model = model.to(dtype_of(args.param_dtype))
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype_of(args.param_dtype),
                              reduce_dtype=dtype_of(args.reduce_dtype or args.param_dtype))
    offload = OffloadPolicy()
    if mode.endswith("-offload"):
        offload = CPUOffloadPolicy(pin_memory=True)
        mode = mode[: -len("-offload")]
    if mode == "fsdp2-block":
        units = list(model.layers if args.model == "llama" else model.blocks)
    elif mode == "fsdp2-leaf":
        units = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.LayerNorm, RMSNorm, nn.Embedding))]
    else:
        raise SystemExit(f"torch_reference: unknown mode '{mode}' (plain, amp, ddp, fsdp2-block, fsdp2-leaf, "
                         "each fsdp2 mode also with -offload)")
    for m in units:
        fully_shard(m, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def sizes(args, cfg):
    """(vocab, seq, params, flops_per_token, description) of either family's config."""
    if args.model == "llama":
        return (cfg["vocab"], cfg["seq"], llama_num_parameters(**cfg), llama_flops_per_token(**cfg),
                "LLaMA " + " ".join(f"{k}={v}" for k, v in cfg.items()))
    vocab, d, heads, layers, seq = cfg
    return (vocab, seq, num_parameters(vocab, d, layers, seq), flops_per_token(vocab, d, layers, seq),
            f"GPT vocab={vocab} d={d} heads={heads} layers={layers} seq={seq}")


def run(mode, args, cfg, device, rank, world):
    vocab, seq, _, fpt, _ = sizes(args, cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    model = build(mode, args, cfg, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                            fused=args.optimizer == "fused", foreach=args.optimizer != "fused" or None)
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    total = args.warmup + args.steps
    batches = [synthetic_batch(vocab, seq, args.batch, gen, device) for _ in range(total)]
    sync(device)
    if world > 1 and mode not in SINGLE_DEVICE_MODES:
        dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timer = StepTimer(device)
    step_ms, issue_ms, loss0 = [], [], None
    for s in range(total):
        t0 = time.perf_counter()
        timer.begin()
        opt.zero_grad(set_to_none=True)
        with autocast_for(mode, args, device):
            loss = model(*batches[s])
        loss.backward()
        opt.step()
        timer.stop()
        t_issue = (time.perf_counter() - t0) * 1e3
        sync(device)
        if s == 0:
            loss0 = loss.item()
        if s >= args.warmup:
            step_ms.append(timer.elapsed_ms())
            issue_ms.append(t_issue)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    ms = statistics.median(step_ms)
    tok = args.batch * seq / (ms * 1e-3)
    row = {
        "mode": mode, "world_size": 1 if mode in SINGLE_DEVICE_MODES else world, "batch": args.batch,
        "step_ms": ms, "host_ms": statistics.median(issue_ms),
        "peak_mib": None if peak is None else peak / 2**20,
        "tokens_per_s_per_gpu": tok,
        "mfu": tok * fpt / (args.peak_tflops * 1e12),
        "loss_step0": loss0, "optimizer": args.optimizer,
    }
    del model, opt, batches
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama"],
                    help="model family: the GPT of models/gpt.h or the LLaMA of models/llama.h")
    ap.add_argument("--preset", default="1b", choices=sorted(set(PRESETS) | set(LLAMA_PRESETS)))
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    ap.add_argument("--modes", default="plain,fsdp2-block,fsdp2-leaf",
                    help="comma list of plain (pure bf16 floor), amp (fp32 parameters + bf16 autocast, "
                         "fused AdamW over fp32), ddp, fsdp2-block, fsdp2-leaf, fsdp2-{block,leaf}-offload")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: plain and amp only, host-clock timing; checks the script, not a floor")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"],
                    help="parameter dtype of plain and ddp, compute dtype of fsdp2 and of amp's autocast "
                         "(fp32: amp runs without autocast)")
    ap.add_argument("--reduce-dtype", choices=["bf16", "fp32"], help="default: the param dtype")
    ap.add_argument("--optimizer", default="fused", choices=["fused", "adamw"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, for MFU (H100/H200 bf16 dense)")
    ap.add_argument("--json", help="write the rows (rank 0) as JSON to this path")
    args = ap.parse_args()
    if args.warmup < 0 or args.steps < 1 or args.batch < 1:
        ap.error(f"need --warmup >= 0, --steps >= 1, --batch >= 1 (got {args.warmup}, {args.steps}, {args.batch})")
    presets = LLAMA_PRESETS if args.model == "llama" else PRESETS
    if args.preset not in presets:
        ap.error(f"--preset {args.preset} is not a {args.model} preset ({', '.join(sorted(presets))})")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.model == "llama":
        cfg = dict(LLAMA_PRESETS[args.preset])
        if args.layers is not None:
            cfg["layers"] = args.layers
    else:
        cfg = list(PRESETS[args.preset])
        if args.layers is not None:
            cfg[3] = args.layers
        cfg = tuple(cfg)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.device == "cpu":
        other = [m for m in modes if m not in SINGLE_DEVICE_MODES]
        if other:
            ap.error(f"--device cpu runs {', '.join(SINGLE_DEVICE_MODES)} only, got {', '.join(other)}")
    elif not torch.cuda.is_available():
        sys.exit("torch_reference: needs a CUDA GPU (it is the GPU floor flatshard-bench is compared with; "
                 "--device cpu checks the script on the host)")

    if "RANK" not in os.environ:  # world 1 without a launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        torch.backends.cuda.matmul.allow_tf32 = True

    rows = []
    for mode in modes:
        if mode in SINGLE_DEVICE_MODES and rank != 0:
            dist.barrier()
            continue
        row = run(mode, args, cfg, device, rank, world)
        if mode in SINGLE_DEVICE_MODES and world > 1:
            dist.barrier()
        rows.append(row)
        if rank == 0:
            print(f"[torch_reference] {mode}: {row['step_ms']:.1f} ms/step", file=sys.stderr, flush=True)
    if rank == 0:
        _, _, params, _, desc = sizes(args, cfg)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (host clock)"
        print(f"# PyTorch {torch.__version__}, {name}, world {world}, "
              f"{desc} ({params / 1e9:.2f} B params), batch {args.batch}/GPU, "
              f"optimizer {args.optimizer}")
        base = next((r["step_ms"] for r in rows if r["mode"] == "plain"), None)
        print(f"{'mode':<20} {'step ms':>8} {'x plain':>8} {'host ms':>8} {'peak MiB':>9} {'tok/s/GPU':>10} {'MFU':>6} {'loss0':>7}")
        for r in rows:
            ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            print(f"{r['mode']:<20} {r['step_ms']:8.1f} {ratio:>8} {r['host_ms']:8.1f} {peak:>9} "
                  f"{r['tokens_per_s_per_gpu']:10.0f} {100 * r['mfu']:5.1f}% {r['loss_step0']:7.3f}")
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"torch": torch.__version__, "world_size": world, "rows": rows}, f, indent=1)
            os.replace(tmp, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
