#!/usr/bin/env python3
"""tools/advisor_check.py end to end on the CPU: the issue-20 table and the advisor's check.

Runs the script on the tiny GPT at world 1 (every granularity x recompute x offload 0/1, and
--budget with one repeat), then checks what it printed against the bench JSONs it wrote. One
rank: the profile's calibration needs compute time left after the predicted communication,
and the tiny GPT's millisecond steps at world 2 under ctest -j2 left none (the bench refused
to write the profile).
- exit 0, and one table row per bench run (18);
- every row's predicted peak within 10% under / 20% over the measured: the script's own
  arithmetic (MiB, the host part an offloaded CPU rank adds) — a wrong unit or a missing part
  is off by far more; the model's accuracy is tests/advisor_test.cpp's (here at most 5.2%
  under, layer+recompute);
- the advisor's suggestion was measured and fit the budget in its repeat;
- the overlapped offload steps (issue 35), as a split run in the same folder: --offloads 1
  --offload-steps backward delayed on 'layer' (the profile from the first call, no plain run
  again) gives the rows layer[+recompute]+offload1+bwdstep / +delayed, each predicted (explain
  --offload-step) and counted in the last line; --reuse with every mode prints the first table's
  rows and those, and runs no bench;
- bad input: a budget that is not a size, a build without the binaries, exit non-zero with one
  line naming the value.
Usage: advisor_check_test.py PYTHON SOURCE_DIR BUILD_DIR
"""
import json
import os
import re
import subprocess
import sys
import tempfile

py, src, build = sys.argv[1:4]
script = os.path.join(src, "tools", "advisor_check.py")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAILED: " + what, flush=True)


with tempfile.TemporaryDirectory() as logdir:
    cmd = [py, script, "--build", build, "--device", "cpu", "--nproc", "1", "--preset", "tiny",
           "--batches", "2", "--models", "gpt", "--offloads", "0", "1", "--warmup", "1",
           "--steps", "2", "--budget", "4MiB", "--repeat", "1", "--logdir", logdir]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    out = p.stdout
    check(p.returncode == 0, f"advisor_check exit {p.returncode}: {p.stderr[-2000:]}")
    rows = [l.split() for l in out.splitlines() if l.startswith("gpt ")]
    runs = 0
    for name in os.listdir(logdir):
        if name.startswith("bench_") and name.endswith(".json"):
            runs += len(json.load(open(os.path.join(logdir, name)))["runs"])
    check(len(rows) == 18 and runs == 18, f"{len(rows)} table rows for {runs} bench runs, want 18")
    for r in rows:
        # model batch config pred_MiB meas_MiB err% ...
        err = float(r[5])
        check(-10.0 <= err <= 20.0, f"{r[2]}: predicted peak {err}% off the measured")
    check(any(r[2] == "layer" and "(calibration)" in " ".join(r) for r in rows),
          "the calibration row is not marked")
    m = re.search(r"suggested spec '([^']+)'", out)
    check(m is not None, "no suggestion printed:\n" + out[-2000:])
    check("repeat 0:" in out and "OVER BUDGET" not in out, "the suggestion's repeat:\n" + out[-2000:])
    check(re.search(r"medians over 1 repeats: chosen [0-9.]+ ms", out) is not None,
          "no verdict line")

    # The overlapped modes in the same folder: only their calls run, the profile is reused.
    steps = [py, script, "--build", build, "--device", "cpu", "--nproc", "1", "--preset", "tiny",
             "--batches", "2", "--models", "gpt", "--granularities", "layer", "--offloads", "1",
             "--warmup", "1", "--steps", "2", "--logdir", logdir]
    p = subprocess.run(steps + ["--offload-steps", "backward", "delayed"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=600)
    check(p.returncode == 0, f"advisor_check --offload-steps exit {p.returncode}: {p.stderr[-2000:]}")
    want = {"layer+offload1+bwdstep", "layer+offload1+delayed",
            "layer+recompute+offload1+bwdstep", "layer+recompute+offload1+delayed"}
    over = {l.split()[2]: l.split() for l in p.stdout.splitlines() if l.startswith("gpt ")}
    check(set(over) == want, f"overlapped rows {sorted(over)}, want {sorted(want)}")
    check("flatshard-bench --device cpu --world 1 --model gpt --preset tiny --batch 2 --warmup 1 "
          "--steps 2 --policy layer --optimizer fused" in p.stderr and "--write-profile" not in p.stderr,
          "the overlapped calls wrote a profile (or ran none)")
    check(p.stderr.count("--offload-step backward") == 4 and p.stderr.count("--offload-step delayed") == 4,
          "not one bench and one explain call per mode and recompute setting:\n" + p.stderr[-2000:])
    for name, r in over.items():
        check(float(r[6]) > 0 and -10.0 <= float(r[5]) <= 20.0,
              f"{name}: predicted step {r[6]} ms, peak {r[5]}% off the measured")
    summary = re.search(r"^# overlapped offload steps .*: (\d+) of (\d+) rows within 10%", p.stdout, re.M)
    check(summary is not None and summary.group(2) == "4", "no overlapped summary for 4 rows:\n"
          + p.stdout[-1500:])
    reuse = subprocess.run(steps[:steps.index("--granularities")] + steps[steps.index("--warmup"):]
                           + ["--offloads", "0", "1", "--offload-steps", "after", "backward",
                              "delayed", "--reuse"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    again = [l.split()[2:7] for l in reuse.stdout.splitlines() if l.startswith("gpt ")]
    # Predictions run again (the same numbers), measured columns from the JSONs.
    check(reuse.returncode == 0 and len(again) == 22 and
          {tuple(r[2:7]) for r in rows} | {tuple(r[2:7]) for r in over.values()} == set(map(tuple, again))
          and "--json" not in reuse.stderr,
          f"--reuse: exit {reuse.returncode}, {len(again)} rows (want 18 + 4, as before)")

    fresh = os.path.join(logdir, "bad")
    bad = subprocess.run(cmd[:-6] + ["--budget", "lots", "--repeat", "1", "--logdir", fresh],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    check(bad.returncode != 0 and "'lots' is not a size" in bad.stderr,
          f"bad budget: exit {bad.returncode}, stderr {bad.stderr[-500:]!r}")
    # Refused before the sweep: no bench ran.
    check(not any(n.endswith(".json") for n in os.listdir(fresh)) if os.path.isdir(fresh) else True,
          "a bad budget was found only after the bench runs")
    nob = subprocess.run([py, script, "--build", os.path.join(logdir, "nothing"), "--logdir", logdir],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    check(nob.returncode != 0 and "is not built" in nob.stderr,
          f"missing build: exit {nob.returncode}, stderr {nob.stderr[-500:]!r}")

print("advisor_check_test: " + ("ok" if not failures else f"{len(failures)} failed"))
sys.exit(1 if failures else 0)
