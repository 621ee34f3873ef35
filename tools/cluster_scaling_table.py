#!/usr/bin/env python3
"""Predicted scaling on a cluster (issue 52): flatshard-explain's cost model over 8 -> 1,024 GPUs.

Prints the markdown tables of docs/advisor.md "Scaling on a cluster" and benchmarks/RESULTS.md
"Cluster predictions": for the 1B GPT (--preset 1b) and Llama-3 8B / 70B (their config.json
values, below; the checkpoints are header-only sparse safetensors written here, so explain reads
them as it reads a real download), per-layer FULL_SHARD over all GPUs against HSDP with one shard
group per node, the predicted tokens/s per GPU, MFU and peak memory per GPU. With --honesty, the
2x H200 runs of benchmarks/history.md predicted by the same model, the error beside each.

Nothing here measures: every number is flatshard-explain's prediction from the named profile
(planner/profiles/*.json, each number with its source). Usage:
  tools/cluster_scaling_table.py [--explain build/tools/flatshard-explain] [--profile h100-ib400]
                                 [--honesty]
"""
import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

# config.json of meta-llama/Meta-Llama-3-8B and Meta-Llama-3-70B (Hugging Face hub).
LLAMA3 = {
    "8B": dict(vocab_size=128256, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=32, intermediate_size=14336),
    "70B": dict(vocab_size=128256, hidden_size=8192, num_attention_heads=64,
                num_key_value_heads=8, num_hidden_layers=80, intermediate_size=28672),
}
COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=8192,
              rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
              torch_dtype="bfloat16", rope_scaling=None)


def write_checkpoint(d, c):
    """A header-only model.safetensors (sparse: no weight bytes written) and its config.json."""
    V, D, H, KV, L, F = (c["vocab_size"], c["hidden_size"], c["num_attention_heads"],
                         c["num_key_value_heads"], c["num_hidden_layers"], c["intermediate_size"])
    hd = D // H
    shapes = [("model.embed_tokens.weight", [V, D]), ("model.norm.weight", [D]),
              ("lm_head.weight", [V, D])]
    for i in range(L):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", [D]), (p + "post_attention_layernorm.weight", [D]),
                   (p + "self_attn.q_proj.weight", [H * hd, D]),
                   (p + "self_attn.k_proj.weight", [KV * hd, D]),
                   (p + "self_attn.v_proj.weight", [KV * hd, D]),
                   (p + "self_attn.o_proj.weight", [D, H * hd]),
                   (p + "mlp.gate_proj.weight", [F, D]), (p + "mlp.up_proj.weight", [F, D]),
                   (p + "mlp.down_proj.weight", [D, F])]
    header, at = {}, 0
    for name, shape in shapes:
        n = 2
        for s in shape:
            n *= s
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + at)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**COMMON, **c}, f, indent=2)


def predict(exe, model_args, world, replicate, profile, extra):
    args = [exe, *model_args, "--world", str(world), "--replicate", str(replicate),
            "--profile", profile, "--param-dtype", "bf16", *extra]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)}: exit {out.returncode}\n{out.stderr}")
    pred = dict(re.findall(r"(\w+)=([-\d.e+]+)", out.stdout))
    return {k: float(v) for k, v in pred.items()}


def scaling(exe, profile, models, budget_bytes):
    print(f"Profile {profile}; bf16 parameters and reduction, fp32 master and AdamW, prefetch 1; "
          "FS = per-layer FULL_SHARD over all N GPUs, HSDP = the same plan with shard groups of S "
          "GPUs and N/S replicas. A peak marked * exceeds the profile's memory less the advisor's "
          f"5% margin ({budget_bytes / 2**30:.1f} GiB): that row does not fit.\n")
    for name, margs, policy, batch, seq, shard in models:
        print(f"{name}: --policy '{policy}', batch {batch} x seq {seq} per GPU, HSDP S = {shard}\n")
        print("| GPUs | FS tok/s/GPU | FS MFU | FS peak GiB | HSDP tok/s/GPU | HSDP MFU | HSDP peak GiB |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        n = 8
        while n <= 1024:
            extra = ["--policy", policy, "--batch", str(batch), "--seq", str(seq)]
            row = [str(n)]
            meshes = [(n, 1)] + ([(shard, n // shard)] if n > shard else [])
            for world, replicate in meshes:
                p = predict(exe, margs, world, replicate, profile, extra)
                star = "*" if p["peak_bytes"] > budget_bytes else ""
                row += [f"{p['tokens_per_s_per_gpu']:.0f}", f"{100 * p['mfu']:.1f}%",
                        f"{p['peak_bytes'] / 2**30:.1f}{star}"]
            row += ["–"] * (7 - len(row))
            print("| " + " | ".join(row) + " |")
            n *= 2
        print()


# The multi-GPU runs flatshard has measured (benchmarks/history.md): 2x H200, 1B GPT, bf16
# parameters and reduction, fp32 master, prefetch 1, median step ms.
MEASURED = [
    ("2026-11-29 22:35", "layer", 4, 115.0), ("2026-11-29 22:35", "leaf", 4, 119.9),
    ("2026-11-29 22:35", "every-2", 4, 114.2), ("2026-11-29 22:35", "model", 4, 114.9),
    ("2026-11-29 22:35", "noshard", 4, 123.3),
    ("2026-11-29 22:35", "layer", 1, 44.6), ("2026-11-29 22:35", "leaf", 1, 97.3),
    ("2026-11-29 22:35", "every-2", 1, 43.9), ("2026-11-29 22:35", "model", 1, 45.3),
    ("2026-11-29 22:35", "noshard", 1, 54.1),
    ("2026-11-29 18:35", "layer", 4, 116.3), ("2026-11-29 18:35", "leaf", 4, 119.2),
    ("2026-11-29 18:35", "layer", 1, 46.9),
]


# That run's own floor (history.md "Issue 4 closing run"): `local` fwd+bwd 96.0 ms for 4 x 2048
# tokens x 6.04 GFLOP = 515 TFLOP/s; host per unit (leaf 95.0 ms - layer 30.7 ms host) / 83
# more units = 0.77 ms per unit per step, split 40/60 forward/backward as the profile's 60/90 us;
# torch's AdamW then (its `opt ms` column, layer: 10.2 ms over 944.15 M / 2 fp32 master elements
# at the profile's 4000 GB/s) = 86 bytes per parameter. None of the three is a step time.
REFIT = {"compute_tflops": 8192 * 6.04e9 / 96.0e-3 / 1e12, "host_us_per_unit_forward": 310.0,
         "host_us_per_unit_backward": 465.0,
         "optimizer_bytes_per_param": 10.2e-3 * 4000e9 / (944.15e6 / 2)}


def honesty(exe, profile, tmp):
    named = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "planner", "profiles",
                         profile + ".json")
    with open(named) as f:
        doc = json.load(f)
    doc["source"] = f"{profile} with compute and host per unit refit to the 2026-11-29 22:35 run"
    for k, v in REFIT.items():
        doc[k] = v
        doc["sources"][k] = "measured: the 2x H200 run of 2026-11-29 22:35 (history.md)"
    refit = os.path.join(tmp, "refit.json")
    with open(refit, "w") as f:
        json.dump(doc, f)
    print(f"2x H200 (world 2, one node), 1B GPT, bf16, prefetch 1: benchmarks/history.md's medians "
          f"against the prediction with --profile {profile} (A) and with that profile's compute rate, "
          f"host cost per unit and optimizer refit to the 2026-11-29 22:35 run's own columns "
          f"other than the step (B: compute_tflops {REFIT['compute_tflops']:.0f} from local's "
          f"fwd+bwd, host 310 + 465 us per unit from leaf - layer host ms, AdamW "
          f"{REFIT['optimizer_bytes_per_param']:.0f} B per parameter from layer's opt ms):\n")
    print("| run (UTC) | plan | seq/GPU | measured ms | predicted A | error A | predicted B | error B |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for when, plan, batch, ms in MEASURED:
        row = [when, plan, str(batch), f"{ms:.1f}"]
        for prof in (profile, refit):
            p = predict(exe, ["--preset", "1b"], 2, 1, prof, ["--policy", plan, "--batch", str(batch)])
            row += [f"{p['step_ms']:.1f}", f"{100 * (p['step_ms'] - ms) / ms:+.1f}%"]
        print("| " + " | ".join(row) + " |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--explain", default="build/tools/flatshard-explain")
    ap.add_argument("--profile", default="h100-ib400")
    ap.add_argument("--honesty", action="store_true", help="also the 2x H200 runs, predicted")
    ap.add_argument("--honesty-profile", default="h200-ib400")
    ap.add_argument("--honesty-only", action="store_true", help="only the 2x H200 table")
    ap.add_argument("--budget-gb", type=float, default=80, help="device memory (H100: 80 GB)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # HSDP's S: one node for the 1B; for the Llama-3 models the smallest whole number of
        # nodes whose shard group fits 80 GB at 8192 tokens (8B: 64 GPUs; 70B with recompute: 32).
        models = [("1B GPT (--preset 1b)", ["--preset", "1b"], "layer", 2, 2048, 8)]
        for size, layer_policy, shard in (("8B", "type=LlamaDecoderLayer", 64),
                                          ("70B", "recompute:type=LlamaDecoderLayer", 32)):
            d = os.path.join(tmp, size)
            os.makedirs(d)
            write_checkpoint(d, LLAMA3[size])
            models.append((f"Llama-3 {size} (config.json)", ["--weights", d], layer_policy, 1, 8192,
                           shard))
        if not a.honesty_only:
            scaling(a.explain, a.profile, models, a.budget_gb * 1e9 * 0.95)
        if a.honesty or a.honesty_only:
            honesty(a.explain, a.honesty_profile, tmp)


if __name__ == "__main__":
    main()
