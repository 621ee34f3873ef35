#!/usr/bin/env python3
"""tools/prepare_tokens.py's Hugging Face tokenizer path, offline, and flatshard-train reading it.

A tokenizer is built in the test (the `tokenizers` package: a WordLevel model over the words of
a license text, with [UNK] and an EOS token [EOS]) and saved with transformers'
save_pretrained into a temporary directory, as a real model directory holds it. Then:
- JSONL documents (one paragraph per line) and a plain text file (one document) through the
  script: train.bin + val.bin equal, token for token, the tokenizer's own encode of each
  document (tokenizers.Tokenizer.from_file on the saved tokenizer.json, not the AutoTokenizer
  the script loads), each document followed by the EOS id, split at the script's documented
  --val-fraction; meta.json gives len(tokenizer) and uint16;
- a vocabulary above 65536 (70000 words) gives uint32 files with the same check;
- flatshard-train trains 2 steps on the uint16 files with --vocab = meta.json's vocab_size, on
  the uint32 ones with --token-dtype uint32, and refuses --vocab 256 (the byte-level size; the
  tokenizer's ids go past it) with one line naming the file and the vocabulary.
Usage: prepare_tokens_test.py PYTHON SOURCE_DIR TRAIN_EXE
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

py, src, train_exe = sys.argv[1:4]
script = os.path.join(src, "tools", "prepare_tokens.py")
TEXT = "/usr/share/common-licenses/GPL-3"
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAILED: " + what, flush=True)


# [EOS] is not a word: save_pretrained adds it as a special token after the words (the last id).
def make_tokenizer(words, path):
    vocab = {w: i for i, w in enumerate(["[UNK]"] + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(path)
    return len(fast)


def reference(tok_dir, docs):
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eos = tok.token_to_id("[EOS]")
    ids = []
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False).ids + [eos]
    return np.asarray(ids, dtype=np.int64), eos


def prepare(tok_dir, inputs, out):
    r = subprocess.run([py, script, "--tokenizer", tok_dir, *inputs, out],
                       capture_output=True, text=True)
    check(r.returncode == 0, f"prepare_tokens.py exit {r.returncode}: {r.stderr}")
    return r


def check_files(out, ref, vocab, dtype, what):
    meta = json.load(open(os.path.join(out, "meta.json")))
    check(meta["vocab_size"] == vocab, f"{what}: meta vocab_size {meta['vocab_size']} != {vocab}")
    check(meta["dtype"] == dtype, f"{what}: meta dtype {meta['dtype']} != {dtype}")
    split = len(ref) - int(len(ref) * 0.1)  # the script's default --val-fraction 0.1
    for part, want in (("train", ref[:split]), ("val", ref[split:])):
        got = np.fromfile(os.path.join(out, f"{part}.bin"), dtype=np.dtype(dtype).newbyteorder("<"))
        check(len(got) == len(want) and bool((got.astype(np.int64) == want).all()),
              f"{what}: {part}.bin differs from the tokenizer's encode "
              f"({len(got)} vs {len(want)} tokens)")
        check(meta["tokens"][part] == len(want), f"{what}: meta tokens[{part}]")


def train(data, vocab, out, extra=()):
    args = [train_exe, "--data", data, "--out", out, "--vocab", str(vocab), "--world", "1",
            "--d-model", "32", "--heads", "2", "--seq", "16", "--global-batch", "2",
            "--micro-batch", "2", "--steps", "2", *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


text = open(TEXT, encoding="utf-8").read()
paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
words = set(w for p in paragraphs for w in re.findall(r"\w+|[^\w\s]+", p))
words -= {"[UNK]", "[EOS]"}

with tempfile.TemporaryDirectory() as tmp:
    # 1. A WordLevel tokenizer over the text's words: uint16; JSONL and plain text.
    tok_dir = os.path.join(tmp, "tok")
    vocab = make_tokenizer(words, tok_dir)
    check(vocab < 65536, f"small vocabulary {vocab}")
    jsonl = os.path.join(tmp, "docs.jsonl")
    with open(jsonl, "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p}) + "\n")
    ref, eos = reference(tok_dir, paragraphs)
    check(eos == vocab - 1, f"EOS id {eos}, expected the last id {vocab - 1}")
    check(int(ref.max()) > 255, "the tokens go past the byte range")
    prepare(tok_dir, [jsonl], os.path.join(tmp, "d1"))
    check_files(os.path.join(tmp, "d1"), ref, vocab, "uint16", "jsonl")

    plain = os.path.join(tmp, "plain.txt")
    with open(plain, "w") as f:
        f.write(text)
    ref_plain, _ = reference(tok_dir, [text])
    prepare(tok_dir, [plain], os.path.join(tmp, "d2"))
    check_files(os.path.join(tmp, "d2"), ref_plain, vocab, "uint16", "text")

    # flatshard-train reads the files with the vocabulary meta.json gives, and refuses one less.
    r = train(os.path.join(tmp, "d1", "train.bin"), vocab, os.path.join(tmp, "run1"))
    check(r.returncode == 0, f"flatshard-train on the jsonl tokens: exit {r.returncode}: {r.stderr}")
    if r.returncode == 0:
        rows = [json.loads(l) for l in open(os.path.join(tmp, "run1", "metrics.jsonl"))]
        check(len([x for x in rows if "loss" in x]) == 2, "two steps logged")
    # The byte-level vocabulary by mistake: the tokenizer's ids past 255 are refused as read.
    r = train(os.path.join(tmp, "d1", "train.bin"), 256, os.path.join(tmp, "run2"))
    want = "not below the model's vocabulary size 256"
    check(r.returncode == 1 and want in r.stderr and r.stderr.count("\n") == 1
          and os.path.join(tmp, "d1", "train.bin") in r.stderr,
          f"--vocab 256: exit {r.returncode}, stderr {r.stderr!r}")

    # 2. More than 65536 entries: uint32 files, read with --token-dtype uint32.
    big_dir = os.path.join(tmp, "big")
    big_words = words | {f"w{i}" for i in range(70000)}
    big_vocab = make_tokenizer(big_words, big_dir)
    check(big_vocab > 65536, f"large vocabulary {big_vocab}")
    ref_big, _ = reference(big_dir, paragraphs)
    prepare(big_dir, [jsonl], os.path.join(tmp, "d3"))
    check_files(os.path.join(tmp, "d3"), ref_big, big_vocab, "uint32", "uint32")
    r = train(os.path.join(tmp, "d3", "train.bin"), big_vocab, os.path.join(tmp, "run3"),
              ["--token-dtype", "uint32"])
    check(r.returncode == 0, f"flatshard-train on uint32 tokens: exit {r.returncode}: {r.stderr}")

if failures:
    print(f"{len(failures)} check(s) failed", file=sys.stderr)
    sys.exit(1)
print("prepare_tokens_test: ok")
