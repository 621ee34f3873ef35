#!/usr/bin/env python3
"""Writes small random Hugging Face models with transformers (the PyPI package setup installs
into the venv) for tests/hf_parity_test.cpp: per architecture a directory with config.json,
model.safetensors, and the reference: idx.bin and targets.bin (int64 [2, T]), logits.bin (fp32
[2, T, V], transformers' own forward in fp32) and losses.bin (fp64 [STEPS]: the cross-entropy
of the model against targets before each of STEPS torch.optim.AdamW steps, lr LR, on that one
batch).

    hf_reference.py OUT_DIR              -> OUT_DIR/{llama2,llama31,qwen2,mistral}/
    hf_reference.py --variants OUT_DIR   -> OUT_DIR/<variant>/ for each of VARIANTS (issue 49):
                                            a directory where the files say more than one thing,
                                            its idx.bin, seq.txt and logits.bin from
                                            from_pretrained(that directory): what transformers
                                            makes of it
    hf_reference.py --logits DIR IDX OUT [DIR IDX OUT ...]
                                         -> from_pretrained(DIR)'s fp32 logits on IDX (an int64
                                            [2, T] file) into OUT; prints each loaded dtype
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)

# name: (model class, config, sequence length)
CASES = {
    # Llama-2 style: plain RoPE, GQA.
    "llama2": (LlamaForCausalLM, LlamaConfig(**COMMON, max_position_embeddings=64), 24),
    # Llama-3.1 style: llama3 RoPE scaling, a sequence longer than the original context, and an
    # explicit head_dim other than hidden_size / heads.
    "llama31": (LlamaForCausalLM, LlamaConfig(
        **COMMON, head_dim=24, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0), 40),
    # Qwen2: q/k/v biases implied by the architecture, tied embeddings.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=True,
                                            max_position_embeddings=64), 24),
    # Mistral: a sliding window shorter than the sequence.
    "mistral": (MistralForCausalLM, MistralConfig(**COMMON, sliding_window=8,
                                                  max_position_embeddings=64), 24),
}

STEPS = 3
LR = 1e-2  # large enough that the losses move by more than the tolerance


def loss_of(model, idx, targets):
    logits = model(input_ids=idx).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main(out):
    for name, (cls, config, seq) in CASES.items():
        torch.manual_seed(0)
        config._attn_implementation = "eager"
        model = cls(config).float().eval()
        with torch.no_grad():  # non-trivial norms and biases, so a mix-up shows
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                if n.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        d = os.path.join(out, name)
        model.save_pretrained(d, safe_serialization=True)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, config.vocab_size, (2, seq), generator=g, dtype=torch.int64)
        with torch.no_grad():
            logits = model(input_ids=idx).logits.float()
        targets = torch.randint(0, config.vocab_size, (2, seq), generator=g, dtype=torch.int64)
        idx.numpy().tofile(os.path.join(d, "idx.bin"))
        targets.numpy().tofile(os.path.join(d, "targets.bin"))
        logits.contiguous().numpy().tofile(os.path.join(d, "logits.bin"))
        # AdamW steps on the model as saved (its defaults: betas, eps, weight_decay 0.01).
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = loss_of(model, idx, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.tensor(losses, dtype=torch.float64).numpy().tofile(os.path.join(d, "losses.bin"))
        with open(os.path.join(d, "seq.txt"), "w") as f:
            f.write(f"{seq} {config.vocab_size}\n")
    return 0


def write_variant(d, model, edit_config=None, tensors=None, index=None):
    """`model` saved to `d`; its config.json changed by edit_config(dict); model.safetensors
    replaced by `tensors` when given; `index`: (weight_map tensors, file name) written beside
    it as model.safetensors.index.json. Then transformers' own reading of `d`: its logits."""
    from safetensors.torch import save_file
    model.save_pretrained(d, safe_serialization=True)
    if edit_config:
        path = os.path.join(d, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    if tensors is not None:
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    if index is not None:
        other, name = index
        save_file(other, os.path.join(d, name), metadata={"format": "pt"})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {k: name for k in other}}, f)
    seq, vocab = 24, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (2, seq), generator=g, dtype=torch.int64)
    loaded = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
    with torch.no_grad():
        logits = loaded(input_ids=idx).logits.float()
    idx.numpy().tofile(os.path.join(d, "idx.bin"))
    logits.contiguous().numpy().tofile(os.path.join(d, "logits.bin"))
    with open(os.path.join(d, "seq.txt"), "w") as f:
        f.write(f"{seq} {vocab}\n")


def variants(out):
    def fresh(cls, config):
        torch.manual_seed(0)
        config._attn_implementation = "eager"
        model = cls(config).float().eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                if n.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        return model

    def llama():
        return fresh(LlamaForCausalLM, LlamaConfig(**COMMON, max_position_embeddings=64))

    def state(model):
        return {k: v.contiguous().clone() for k, v in model.state_dict().items()}

    def tie(config):
        config["tie_word_embeddings"] = True

    # tie_word_embeddings true, but the files hold an lm_head.weight of other values:
    # transformers keeps both, untied (and warns).
    write_variant(os.path.join(out, "tie_differs"), llama(), tie)
    # The same with lm_head.weight equal to the embedding: transformers ties them.
    m = llama()
    t = state(m)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    write_variant(os.path.join(out, "tie_equal"), m, tie, tensors=t)
    # model.safetensors and an index over another file of other values: transformers reads
    # model.safetensors.
    m = llama()
    write_variant(os.path.join(out, "both_files"), m,
                  index=({k: v * 2 for k, v in state(m).items()}, "model-00001-of-00001.safetensors"))
    # Qwen2 whose config says attention_bias false: transformers' Qwen2 has q/k/v biases anyway.
    q = fresh(Qwen2ForCausalLM, Qwen2Config(**COMMON, max_position_embeddings=64))
    write_variant(os.path.join(out, "qwen2_attention_bias_false"), q,
                  lambda c: c.update(attention_bias=False))
    # rope_parameters (plain) and rope_scaling (linear, factor 4) both: transformers takes
    # rope_scaling.
    write_variant(os.path.join(out, "rope_both"), llama(), lambda c: c.update(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_scaling={"rope_type": "linear", "factor": 4.0}))
    # Tensors no parameter reads: a stray one (transformers reports it as UNEXPECTED) and a
    # rotary inv_freq buffer older checkpoints saved (transformers ignores it silently).
    m = llama()
    t = state(m)
    t["model.extra.weight"] = torch.zeros(3)
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    write_variant(os.path.join(out, "extra_tensor"), m, tensors=t)
    return 0


def logits_of_saved(args):
    for d, idx_path, out_path in zip(args[0::3], args[1::3], args[2::3]):
        model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
        print(d, next(model.parameters()).dtype)
        seq = os.path.getsize(idx_path) // (2 * 8)
        idx = torch.from_file(idx_path, size=2 * seq, dtype=torch.int64).reshape(2, seq)
        with torch.no_grad():
            logits = model.float()(input_ids=idx).logits.float()
        logits.contiguous().numpy().tofile(out_path)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--logits":
        sys.exit(logits_of_saved(sys.argv[2:]))
    if sys.argv[1] == "--variants":
        sys.exit(variants(sys.argv[2]))
    sys.exit(main(sys.argv[1]))
