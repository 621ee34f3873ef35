#!/usr/bin/env python3
"""Catch2 macros on rank threads: the tests' own rule (tests/rank_require.h), checked.

Catch2 v2 is not thread-safe. A CAPTURE, INFO or bare REQUIRE/CHECK inside a lambda that
run_ranks (or run_ranks_2d, run_mesh) runs on several threads races on the runner's state; that shows up as heap
corruption in a later, unrelated allocation, in a fraction of runs (offload_test did this).
Inside such lambdas only the RANK_* wrappers may assert. run_ranks(1, ...) runs one thread
and is left alone; a function passed by name is not seen (keep those on the RANK_* macros).

Usage: rank_thread_lint.py TESTS_DIR  (exit 1 and one line per use when any is found)
"""
import pathlib
import re
import sys

from cpp_text import blank_comments_and_strings

MACRO = re.compile(r"(?<![A-Za-z0-9_])(CAPTURE|INFO|UNSCOPED_INFO|WARN|FAIL|SUCCEED|"
                   r"(?:REQUIRE|CHECK)(?:_[A-Z_]+)?)\s*\(")
CALL = re.compile(r"(?:run_ranks|run_ranks_2d|run_mesh)\s*\(\s*([^,]+),")


def lambda_body(src: str, start: int):
    """The braces of the first lambda body after start: (begin, end), or None."""
    i = src.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(src)):
        if src[j] == "{":
            depth += 1
        elif src[j] == "}":
            depth -= 1
            if depth == 0:
                return i, j
    return None


def findings(path: pathlib.Path):
    src = blank_comments_and_strings(path.read_text())
    for call in CALL.finditer(src):
        if call.group(1).strip() == "1":
            continue
        head_end = src.find("[", call.end())
        semi = src.find(";", call.end())
        if head_end < 0 or (0 <= semi < head_end):
            continue  # a function passed by name, not a lambda
        body = lambda_body(src, head_end)
        if body is None:
            continue
        for m in MACRO.finditer(src, body[0], body[1]):
            line = src.count("\n", 0, m.start()) + 1
            yield f"{path}:{line}: {m.group(1)} inside a rank-thread lambda (use RANK_*)"


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent)
    found = [f for p in sorted(root.glob("*.cpp")) for f in findings(p)]
    for f in found:
        print(f)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
