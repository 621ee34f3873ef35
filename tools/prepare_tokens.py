#!/usr/bin/env python3
"""Turn text or JSONL into token files for flatshard-train (docs/training.md).

    python tools/prepare_tokens.py --byte-level input.txt out/           # vocab 256, no tokenizer
    python tools/prepare_tokens.py --tokenizer ./my-model docs.jsonl out/  # a local HF tokenizer

Writes out/train.bin and out/val.bin (the last --val-fraction of the tokens) in nanoGPT's
layout: raw little-endian uint16 tokens, or uint32 when the vocabulary has more than 65536
entries, and out/meta.json ({"vocab_size", "dtype", "tokens": {"train", "val"}, "tokenizer"}),
which says which --vocab and --token-dtype flatshard-train needs.

Inputs: .jsonl files hold one JSON object per line; its --text-key field (default "text") is one
document. Anything else is read as UTF-8 text, one document per file. With a tokenizer each
document ends with its EOS token (when it has one); byte-level documents are the UTF-8 bytes.
The tokenizer directory is read locally only (no download).
"""
import argparse
import json
import os
import sys

import numpy as np


def fail(msg):
    print(f"prepare_tokens.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


def documents(path, text_key):
    if not os.path.isfile(path):
        fail(f"input {path!r}: not a regular file")
    with open(path, "r", encoding="utf-8", errors="strict") as f:
        if path.endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    fail(f"{path!r} line {n}: invalid JSON: {e}")
                if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                    fail(f"{path!r} line {n}: expected an object with a string {text_key!r}")
                yield obj[text_key]
        else:
            yield f.read()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text or .jsonl files, then the output directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--byte-level", action="store_true", help="tokens are UTF-8 bytes (vocab 256)")
    g.add_argument("--tokenizer", help="a local Hugging Face tokenizer directory")
    p.add_argument("--text-key", default="text", help="JSONL field holding the text")
    p.add_argument("--val-fraction", type=float, default=0.1, help="tail kept for val.bin")
    a = p.parse_args()
    if len(a.inputs) < 2:
        fail("expected one or more inputs and an output directory")
    *inputs, out = a.inputs
    if not 0 <= a.val_fraction < 1:
        fail(f"--val-fraction {a.val_fraction}: expected 0 <= fraction < 1")

    if a.byte_level:
        vocab, eos, name = 256, None, "byte-level"
        encode = lambda s: list(s.encode("utf-8"))
    else:
        if not os.path.isdir(a.tokenizer):
            fail(f"--tokenizer {a.tokenizer!r}: not a directory")
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
        vocab, eos, name = len(tok), tok.eos_token_id, os.path.abspath(a.tokenizer)
        encode = lambda s: tok.encode(s, add_special_tokens=False)

    tokens = []
    for path in inputs:
        for doc in documents(path, a.text_key):
            tokens.extend(encode(doc))
            if eos is not None:
                tokens.append(eos)
    if not tokens:
        fail("the inputs hold no tokens")
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= vocab:
        fail(f"token {int(arr.max())} is not below the vocabulary size {vocab}")
    split = len(arr) - int(len(arr) * a.val_fraction)
    os.makedirs(out, exist_ok=True)
    counts = {}
    for part, data in (("train", arr[:split]), ("val", arr[split:])):
        if len(data) == 0:
            continue
        tmp = os.path.join(out, f".{part}.bin.tmp")
        data.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp)
        os.replace(tmp, os.path.join(out, f"{part}.bin"))
        counts[part] = int(len(data))
    meta = {"vocab_size": vocab, "dtype": np.dtype(dtype).name, "tokens": counts, "tokenizer": name}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"prepare_tokens.py: {counts.get('train', 0)} train and {counts.get('val', 0)} val "
          f"tokens ({np.dtype(dtype).name}, vocab {vocab}) in {out}/")


if __name__ == "__main__":
    main()
