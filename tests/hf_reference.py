#!/usr/bin/env python3
"""Writes small random Hugging Face models with transformers (the PyPI package setup installs
into the venv) for tests/hf_parity_test.cpp: per architecture a directory with config.json,
model.safetensors, and the reference: idx.bin (int64 [2, T]) and logits.bin (fp32 [2, T, V]),
transformers' own forward in fp32.

    hf_reference.py OUT_DIR     -> OUT_DIR/{llama2,llama31,qwen2,mistral}/
"""
import os
import sys

import torch
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
        idx.numpy().tofile(os.path.join(d, "idx.bin"))
        logits.contiguous().numpy().tofile(os.path.join(d, "logits.bin"))
        with open(os.path.join(d, "seq.txt"), "w") as f:
            f.write(f"{seq} {config.vocab_size}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
