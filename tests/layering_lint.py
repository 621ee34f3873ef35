#!/usr/bin/env python3
"""Issue 48's layering rules, checked: no include loop inside a folder, no long function.

1. Include loops. Inside each library folder, a file pair (a.h/a.cpp, the "component" a) that
   includes another component's header while that component includes a's is a loop, whether
   the includes sit in headers or in .cpp files (collective_plan.cpp including
   quantized_gather.h while quantized_gather.cpp includes collective_plan.h is one). Found as
   strongly connected components of the folder's component graph.
2. Function length. No function body over 150 lines in the library, tools or benchmarks
   (CONTRIBUTING.md), unless the line above the function's first line says why
   ("// long: <reason>"). Bodies are found by brace matching at namespace level, comments and
   string literals blanked.

Usage: layering_lint.py REPO_ROOT  (exit 1 with one line per finding)
"""
import pathlib
import re
import sys

from cpp_text import blank_comments_and_strings

FOLDERS = ["checkpoint", "cli", "collectives", "data", "flat_param", "fsdp", "models", "optim",
           "planner", "profiling", "support", "wrap_policies", "benchmarks", "tools"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
MAX_LINES = 150


def include_loops(root: pathlib.Path):
    found = []
    for folder in FOLDERS:
        d = root / folder
        if not d.is_dir():
            continue
        graph = {}
        for f in sorted(d.iterdir()):
            if f.suffix not in (".h", ".cpp", ".cu"):
                continue
            a = f"{folder}/{f.stem}"
            edges = graph.setdefault(a, set())
            for inc in INCLUDE.findall(f.read_text(errors="replace")):
                p = pathlib.PurePosixPath(inc)
                b = f"{p.parent}/{p.stem}"
                if str(p.parent) == folder and b != a:
                    edges.add(b)
        # Tarjan's strongly connected components.
        index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

        def visit(v):
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on.add(v)
            for w in sorted(graph.get(v, ())):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

        for v in sorted(graph):
            if v not in index:
                visit(v)
        for comp in comps:
            found.append(f"include loop in {folder}/: " + " <-> ".join(comp))
    return found


def long_functions(root: pathlib.Path):
    found = []
    for folder in FOLDERS:
        d = root / folder
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.cpp")):
            raw = f.read_text(errors="replace")
            src = blank_comments_and_strings(raw)
            lines = raw.split("\n")
            depth, start, ns_depths = 0, None, []
            i = 0
            while i < len(src):
                c = src[i]
                if c == "{":
                    head = src[max(0, src.rfind("\n", 0, max(0, i - 200)) ):i]
                    is_ns = re.search(r"\bnamespace\b[^;{}()]*$", head) is not None
                    is_type = re.search(r"\b(class|struct|union|enum)\b[^;{}()]*$", head) is not None
                    if is_ns or is_type or (depth in ns_depths and re.search(r"extern\s*$", head)):
                        ns_depths.append(depth + 1)
                    elif depth in ns_depths or depth == 0:
                        if start is None and (depth == 0 or depth in ns_depths):
                            start = (i, depth)
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if ns_depths and ns_depths[-1] == depth + 1:
                        ns_depths.pop()
                    elif start is not None and depth == start[1]:
                        first = src.count("\n", 0, start[0])
                        last = src.count("\n", 0, i)
                        if last - first > MAX_LINES:
                            above = lines[first - 1] if first > 0 else ""
                            sig = lines[first].strip()
                            if "// long:" not in above and "// long:" not in lines[max(0, first - 2)]:
                                found.append(f"{f.relative_to(root)}:{first + 1}: function of "
                                             f"{last - first} lines (> {MAX_LINES}): {sig[:80]}")
                        start = None
                i += 1
    return found


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    findings = include_loops(root) + long_functions(root)
    for line in findings:
        print(line)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
