#!/usr/bin/env bash
# tools/gpu_check.sh — build and check flatshard on a GPU box, from the repository root:
#     bash tools/gpu_check.sh
# Steps (each a function below; add new ones to STEPS):
#   configure   cmake with torch's CMake prefix and NCCL from python3's torch wheel, the staged
#               .device-deps/ (Abseil, Catch2 v2, nlohmann-json; see ../shared/tools/stage-device-deps.sh;
#               zlib: tools/stage_device_zlib.sh) if present, -DFLATSHARD_GPU_TESTS=ON
#   build       the GPU targets (GPU_CHECK_BUILD_ALL=1: every target)
#   gpu_tests   ctest -L gpu -LE hsdp (each launches itself with torchrun on min(2, #GPUs) GPUs;
#               every test labelled gpu, e.g. gpu_quantized_gather_test: its target must be in
#               step_build's list too)
#   quant       opt-in (GPU_CHECK_QUANT=1, or name it in GPU_CHECK_STEPS; ~1 min, most of it
#               torch's JIT build): tests/quantize_kernel_check.py, flat_param/quantize_kernel.cu
#               alone against the CPU formulas bit for bit, edge cases included (needs ninja)
#   hsdp        gpu_hsdp_test: HSDP on 2 GPUs as 2x1 and 1x2 (replicate x shard; needs 2 GPUs);
#               gpu_tp_test: tp 2 x shard 1 over NCCL against one GPU (needs 2 GPUs)
#   bench       flatshard-collectives-bench via torchrun
#   bench_nowd  the same for all_gather:bf16 with the watchdog off (FLATSHARD_NCCL_WATCHDOG=0),
#               to show what the per-collective completion event costs
#   c10d        tools/c10d_reference.py via torchrun (same sizes and table)
#   compare     side-by-side table: size, flatshard us, c10d us, ratio
#   train       flatshard-bench on the 1B GPT, 4 and 1 sequences per GPU, every granularity and
#               the unsharded floor (`local`); tables printed in the summary
#               (GPU_CHECK_TRAIN_ARGS adds arguments, e.g. "--layers 4" for a quick look);
#               with --kernel-profile 2: after each row's measured steps, two more under the
#               PyTorch profiler give rank 0's device time per step by kernel category and
#               stream (the breakdown of the row's overhead; summary prints it)
#   train_fused the same at 4 sequences per GPU for local, layer and leaf with
#               --optimizer fused (flatshard::FusedAdamW, the floor included)
#   train_cli   flatshard-train on GPUs (a smoke run, seconds): tools/prepare_tokens.py
#               --byte-level on README.md, then a tiny LLaMA for 4 steps with --device cuda
#               --nproc 1 (self-launched: one process), 2 more with --resume under torchrun on
#               $NPROC GPUs (the launcher's variables); each must exit 0 and log finite losses
#   setup       flatshard-bench --init eager vs --init deferred (fsdp/deferred_init.h), per-layer
#               units: setup time and setup peak per run, and the process's max RSS (host
#               memory), on the 1B GPT and (GPU_CHECK_SETUP_LARGE=1) a 6.7B GPT at 1 sequence/GPU
#   trace       flatshard-bench, per-layer units, 4 sequences per GPU, with FLATSHARD_TRACE (host
#               and CUDA-event timestamps per unit) and NVTX ranges, then flatshard-trace's summary:
#               exposed communication per unit, GPU idle gaps and their cause, host issue time vs
#               GPU time per step
#   vs_torch    one table against PyTorch running the same model (issue 19): per batch (4 and 1
#               sequences per GPU, GPU_CHECK_VS_BATCHES), tools/torch_reference.py (plain single
#               GPU, pure bf16; amp single GPU, fp32 parameters + bf16 autocast; FSDP2 per block)
#               and flatshard-bench (local, layer, leaf, noshard; FusedAdamW like the reference's fused
#               AdamW) on the 1B GPT; step ms, x PyTorch plain, x PyTorch amp, host ms and peak
#               MiB per row (GPU_CHECK_VS_ARGS adds arguments to both, e.g. "--layers 4";
#               GPU_CHECK_VS_TORCH_MODES replaces plain,amp,fsdp2-block;
#               GPU_CHECK_VS_GRANULARITY replaces local,layer,leaf,noshard)
#   offload     the vs_torch table for CPU offload (issue 17): PyTorch plain, FSDP2 per block
#               with and without CPUOffloadPolicy(pin_memory=True), flatshard per-layer at
#               --offload 0,1,2 (GPU_CHECK_OFFLOAD_TORCH_MODES, _GRANULARITY, _LEVELS), then
#               levels 1,2 with --offload-step backward (GPU_CHECK_OFFLOAD_SECOND replaces those
#               bench arguments; empty: none), level 1 with --offload-step delayed
#               (GPU_CHECK_OFFLOAD_THIRD likewise), and the host's CPU AdamW floor
#               (cpu_adamw_probe)
#   advisor     tools/advisor_check.py: flatshard-bench on 1 GPU (world 1) for the 1B GPT and the
#               1B LLaMA at 4 and 1 sequences (GPU_CHECK_ADVISOR_BATCHES), every granularity x
#               recompute x offload level the bench supports, a machine profile written by the
#               first call per model (--write-profile), and one table of flatshard-explain's
#               predicted vs measured peak MiB and step ms (issue 20; GPU_CHECK_ADVISOR_ARGS adds
#               arguments to the script, e.g. "--bench-args '--layers 4'"; to split a long run
#               over calls keep GPU_CHECK_LOGDIR between them and pass "--models gpt --offloads
#               0", ..., then "--reuse" for the whole table); the overlapped CPU-offload optimizer
#               modes (issue 35) are opt-in, e.g. a short offload-only advisor run:
#               GPU_CHECK_ADVISOR_ARGS="--granularities layer --offloads 0 1 --offload-steps
#               after backward delayed" (rows '+offload1+bwdstep' / '+delayed', and a last line
#               counting those within 10% of the measured step)
#   ab          issue 54's A/B table (opt-in: name it in GPU_CHECK_STEPS): flatshard-bench variants
#               (GPU_CHECK_AB_VARIANTS; default base, --keep-compute-shard, --adamw-moments bf16,
#               both, and FLATSHARD_PRE_BACKWARD_HOOK=0) per-layer and per-leaf at 4 and 1
#               sequences, one process each, beside PyTorch plain (tools/ab_table.py)
#   graphs      issue 54 item 4, CUDA graph capture (opt-in: name it in GPU_CHECK_STEPS):
#               gpu_cuda_graph_test (a tiny GPT 5 steps eager vs 5 through flatshard::CudaGraphStep
#               at world 1, per-leaf and per-layer, fp32 and bf16; a changed shape is an error),
#               then the `ab` table with the variants eager and --cuda-graph
#               (GPU_CHECK_GRAPHS_VARIANTS replaces them) per-layer and per-leaf at 4 and 1
#               sequences, one line per run; printed again in the summary
#   sanitize    opt-in (GPU_CHECK_SANITIZE=1): compute-sanitizer memcheck, then racecheck, on
#               every rank of nccl_reliability_test's GPT memory case (100 steps) and
#               gpu_parity_test's per-layer counters case (the whole pipeline, 5 steps)
#               (NCCL's own kernels are excluded from racecheck: they synchronise through
#               memory flags the tool cannot see and are not ours to fix)
# A summary of every step is printed last; the exit status is non-zero if any step failed.
# Knobs: GPU_CHECK_BUILD (build dir, default /tmp/flatshard-gpu-build), GPU_CHECK_LOGDIR (logs,
# default $GPU_CHECK_BUILD/gpu_check), GPU_CHECK_NPROC (processes/GPUs, default min(2, #GPUs)),
# GPU_CHECK_BENCH_ARGS (extra arguments for both benchmarks), PYTHON (default python3),
# GPU_CHECK_SANITIZE=1 (add the compute-sanitizer step; slow: minutes per tool),
# GPU_CHECK_QUANT=1 (add the quant step after gpu_tests),
# GPU_CHECK_STEPS (space-separated subset of the steps, in order; e.g. "configure build gpu_tests"),
# GPU_CHECK_TEST_TIMEOUT (seconds per GPU ctest test, default 300: a hang fails, it does not stall).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PYTHON=${PYTHON:-python3}
BUILD=${GPU_CHECK_BUILD:-/tmp/flatshard-gpu-build}
LOGDIR=${GPU_CHECK_LOGDIR:-$BUILD/gpu_check}
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:-}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-300}
mkdir -p "$LOGDIR"

log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

# Abseil from .device-deps is linked dynamically.
if [ -d "$ROOT/.device-deps/absl-prefix/lib/x86_64-linux-gnu" ]; then
  export LD_LIBRARY_PATH="$ROOT/.device-deps/absl-prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
NPROC=${GPU_CHECK_NPROC:-$((NGPU < 2 ? NGPU : 2))}
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")

# ------------------------------------------------------------------------------------------------
step_configure() {
  local tp nr prefix
  tp=$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') || return 1
  nr=$("$PYTHON" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])') || return 1
  prefix="$tp"
  [ -d .device-deps/catch2-prefix ] && prefix="$ROOT/.device-deps/catch2-prefix;$prefix"
  [ -d .device-deps/absl-prefix ] && prefix="$prefix;$ROOT/.device-deps/absl-prefix"
  [ -d .device-deps/json-prefix ] && prefix="$prefix;$ROOT/.device-deps/json-prefix"
  # zlib's headers, where the GPU image has none (tools/stage_device_zlib.sh stages them).
  [ -d .device-deps/zlib-prefix ] && [ ! -f /usr/include/zlib.h ] &&
    prefix="$prefix;$ROOT/.device-deps/zlib-prefix"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  # A stale cache can keep a wrong NCCL (GPU.md): configure fresh.
  rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
  cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" -DNCCL_ROOT="$nr" -DFLATSHARD_PYTHON="$PYTHON" \
    -DFLATSHARD_WITH_CUDA=ON -DFLATSHARD_GPU_TESTS=ON -DFLATSHARD_GPU_TEST_NPROC="$NPROC" \
    -DFLATSHARD_GPU_TEST_TIMEOUT="$TEST_TIMEOUT"
}

step_build() {
  local targets=(--target nccl_collectives_test nccl_reliability_test gpu_parity_test
                 gpu_hsdp_test gpu_tp_test gpu_checkpoint_test gpu_quantized_gather_test gpu_cuda_graph_test
                 flatshard-collectives-bench flatshard-bench flatshard-trace
                 flatshard-explain flatshard-train)
  [ "${GPU_CHECK_BUILD_ALL:-0}" = 1 ] && targets=()
  cmake --build "$BUILD" -j "$(nproc)" "${targets[@]}"
}

step_gpu_tests() {
  log "(the timeout test logs one expected 'ERROR ... timed out' line from rank 0)"
  ctest --test-dir "$BUILD" -L gpu -LE hsdp --output-on-failure --timeout "$TEST_TIMEOUT"
}

step_quant() {
  "$PYTHON" tests/quantize_kernel_check.py
}

step_hsdp() {
  if [ "$NGPU" -lt 2 ]; then
    log "hsdp: needs 2 GPUs, $NGPU visible"
    return 1
  fi
  ctest --test-dir "$BUILD" -R '^gpu_(hsdp|tp)_test$' --output-on-failure -V --timeout "$TEST_TIMEOUT"
}

step_bench() {
  # shellcheck disable=SC2086
  "${TORCHRUN[@]}" --no-python "$BUILD/benchmarks/flatshard-collectives-bench" $BENCH_ARGS \
    | tee "$LOGDIR/flatshard.txt"
}

step_bench_nowd() {
  # shellcheck disable=SC2086
  FLATSHARD_NCCL_WATCHDOG=0 "${TORCHRUN[@]}" --no-python "$BUILD/benchmarks/flatshard-collectives-bench" \
    --ops all_gather:bf16 $BENCH_ARGS | tee "$LOGDIR/flatshard_nowd.txt"
}

step_c10d() {
  # shellcheck disable=SC2086
  "${TORCHRUN[@]}" tools/c10d_reference.py $BENCH_ARGS | tee "$LOGDIR/c10d.txt"
}

step_compare() {
  "$PYTHON" - "$LOGDIR/flatshard.txt" "$LOGDIR/c10d.txt" "$LOGDIR/flatshard_nowd.txt" <<'EOF' | tee "$LOGDIR/compare.txt"
import sys

def rows(path):
    out = {}
    try:
        lines = open(path).readlines()
    except OSError:
        return out
    for line in lines:
        f = line.split()
        if len(f) == 8 and not line.startswith("#"):
            out[(f[0], f[1], int(f[2]))] = (float(f[4]), float(f[6]), f[7])
    return out

ours, ref, nowd = rows(sys.argv[1]), rows(sys.argv[2]), rows(sys.argv[3])
if not ours or not ref:
    sys.exit("compare: no rows in one of the tables")
print("# side by side (ratio = flatshard time / c10d time; <= 1.00 means flatshard is as fast or faster)")
print(f"# {'op':>12} {'dtype':>5} {'size':>9} {'flatshard us':>12} {'c10d us':>10} {'ratio':>6} "
      f"{'fs busbw':>9} {'c10d busbw':>10} {'fs no-watchdog us':>17}")
slower = 0
for key in sorted(ours, key=lambda k: (k[0], k[1], k[2])):
    if key not in ref:
        continue
    (t, bw, ok), (tr, bwr, okr) = ours[key], ref[key]
    size = key[2]
    human = f"{size >> 30}G" if size >= 1 << 30 else f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
    ratio = t / tr
    note = "" if ratio <= 1.0 else "  slower"
    slower += ratio > 1.0
    if ok != "OK" or okr != "OK":
        note += "  WRONG"
    nw = f"{nowd[key][0]:17.2f}" if key in nowd else f"{'-':>17}"
    print(f"{key[0]:>14} {key[1]:>5} {human:>9} {t:12.2f} {tr:10.2f} {ratio:6.2f} {bw:9.2f} {bwr:10.2f} {nw}{note}")
beyond = sum(1 for k in ours if k in ref and ours[k][0] / ref[k][0] > 1.02)
print(f"# {slower} of {len([k for k in ours if k in ref])} rows slower than c10d; "
      f"{beyond} slower by more than 2% (run-to-run noise of separate processes is about 1-2%)")
EOF
}

step_train() {
  local b
  for b in 4 1; do
    # shellcheck disable=SC2086
    "$BUILD/benchmarks/flatshard-bench" --device cuda --world "$NPROC" --preset 1b --batch "$b" \
      --warmup 3 --steps 10 --policy local,layer,leaf,every-2,model,noshard \
      --kernel-profile 2 --json "$LOGDIR/train_b$b.json" ${GPU_CHECK_TRAIN_ARGS:-} | tee "$LOGDIR/train_b$b.txt" || return 1
  done
}

step_train_fused() {
  # shellcheck disable=SC2086
  "$BUILD/benchmarks/flatshard-bench" --device cuda --world "$NPROC" --preset 1b --batch 4 \
    --warmup 3 --steps 10 --policy local,layer,leaf --optimizer fused \
    --json "$LOGDIR/train_fused_b4.json" ${GPU_CHECK_TRAIN_ARGS:-} | tee "$LOGDIR/train_fused_b4.txt"
}

step_train_cli() {
  local dir="$LOGDIR/train_cli" args
  rm -rf "$dir"
  "$PYTHON" tools/prepare_tokens.py --byte-level README.md "$dir/data" || return 1
  args=(--device cuda --data "$dir/data/train.bin" --val "$dir/data/val.bin" --vocab 256
        --d-model 64 --heads 4 --seq 64 --global-batch 8 --micro-batch 2 --log-every 1
        --out "$dir/run")
  "$BUILD/tools/flatshard-train" "${args[@]}" --nproc 1 --steps 4 || return 1
  "${TORCHRUN[@]}" --no-python "$BUILD/tools/flatshard-train" "${args[@]}" --steps 6 \
    --resume || return 1
  # Every step's loss finite (null is what metrics.jsonl writes for NaN/inf).
  "$PYTHON" - "$dir/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
losses = [r["loss"] for r in rows if "loss" in r]
assert len(losses) == 6 and all(isinstance(x, float) for x in losses), losses
print("train_cli: losses", " ".join(f"{x:.4f}" for x in losses))
PY
}

step_setup() {
  local shapes=("1b:--preset 1b --batch 4")
  [ "${GPU_CHECK_SETUP_LARGE:-0}" = 1 ] &&
    shapes+=("6.7b:--preset 1b --d-model 4096 --heads 32 --layers 32 --batch 1")
  local entry name init timer
  for entry in "${shapes[@]}"; do
    name=${entry%%:*}
    for init in eager deferred; do
      log "setup: GPT $name, --init $init"
      # Host memory too (eager builds the model on the host), where GNU time is installed.
      timer=()
      [ -x /usr/bin/time ] && timer=(/usr/bin/time -f "setup $name $init: %e s wall, %M KiB max RSS")
      # shellcheck disable=SC2086
      "${timer[@]}" "$BUILD/benchmarks/flatshard-bench" --device cuda --world "$NPROC" ${entry#*:} \
        --warmup 1 --steps 2 --policy layer --init "$init" \
        --json "$LOGDIR/setup_${name}_$init.json" | tee "$LOGDIR/setup_${name}_$init.txt" || return 1
    done
  done
}

step_trace() {
  rm -f "$LOGDIR"/trace*.json "$LOGDIR/merged_trace.json"
  # shellcheck disable=SC2086
  FLATSHARD_TRACE="$LOGDIR/trace.json" FLATSHARD_TRACE_STEPS=4 \
    "$BUILD/benchmarks/flatshard-bench" --device cuda --world "$NPROC" --preset 1b --batch 4 \
      --warmup 2 --steps 3 --policy layer ${GPU_CHECK_TRAIN_ARGS:-} || return 1
  local files=("$LOGDIR"/trace*.json)
  [ -e "${files[0]}" ] || { log "trace: no trace files in $LOGDIR"; return 1; }
  "$BUILD/tools/flatshard-trace" --merge "$LOGDIR/merged_trace.json" "${files[@]}" \
    | tee "$LOGDIR/trace_summary.txt"
}

# One flatshard-bench run of the vs_torch table: batch $1, results as $2.json / $2.txt, the rest
# of the arguments added.
vs_bench() {
  local b=$1 out=$2
  shift 2
  # shellcheck disable=SC2086
  "$BUILD/benchmarks/flatshard-bench" --device cuda --world 1 --preset 1b --batch "$b" \
    --warmup 3 --steps 10 --optimizer fused \
    --policy "${GPU_CHECK_VS_GRANULARITY:-local,layer,leaf,noshard}" "$@" \
    --json "$LOGDIR/$out.json" ${GPU_CHECK_VS_ARGS:-} >"$LOGDIR/$out.txt"
}

step_vs_torch() {
  local b rc=0
  for b in ${GPU_CHECK_VS_BATCHES:-4 1}; do
    # shellcheck disable=SC2086
    "$PYTHON" tools/torch_reference.py --preset 1b --batch "$b" \
      --modes "${GPU_CHECK_VS_TORCH_MODES:-plain,amp,fsdp2-block}" \
      --json "$LOGDIR/torch_b$b.json" ${GPU_CHECK_VS_ARGS:-} >"$LOGDIR/torch_b$b.txt" || rc=1
    vs_bench "$b" "flatshard_b$b" --offload "${GPU_CHECK_VS_OFFLOAD:-0}" || rc=1
    if [ -n "${GPU_CHECK_VS_SECOND:-}" ]; then  # a second bench whose runs join the table
      # shellcheck disable=SC2086
      vs_bench "$b" "flatshard_b$b.second" $GPU_CHECK_VS_SECOND || rc=1
    fi
    if [ -n "${GPU_CHECK_VS_THIRD:-}" ]; then  # and a third
      # shellcheck disable=SC2086
      vs_bench "$b" "flatshard_b$b.third" $GPU_CHECK_VS_THIRD || rc=1
    fi
  done
  # shellcheck disable=SC2086
  "$PYTHON" - "$LOGDIR" ${GPU_CHECK_VS_BATCHES:-4 1} <<'EOF' | tee "$LOGDIR/${VS_TABLE:-vs_torch}.txt"
import json, os, sys
logdir, batches = sys.argv[1], sys.argv[2:]
print("# 1 GPU, world 1, same model, bf16 compute, fused AdamW; two PyTorch floors at the same batch: "
      "x PyTorch = step ms / PyTorch plain (pure bf16: bf16 parameters and AdamW state), "
      "x AMP = step ms / PyTorch amp (fp32 parameters and AdamW state, bf16 autocast) "
      "(tools/gpu_check.sh vs_torch, one call)")
print(f"{'batch':>5} {'program':<10} {'mode':<26} {'step ms':>8} {'x PyTorch':>9} {'x AMP':>6} "
      f"{'host ms':>8} {'fwd+bwd':>8} {'optim':>7} {'peak MiB':>9}")
for b in batches:
    try:
        t = json.load(open(os.path.join(logdir, f"torch_b{b}.json")))
        f = json.load(open(os.path.join(logdir, f"flatshard_b{b}.json")))
        for extra in ("second", "third"):
            path = os.path.join(logdir, f"flatshard_b{b}.{extra}.json")
            if os.path.exists(path):
                f["runs"] += json.load(open(path))["runs"]
    except (OSError, ValueError) as e:
        print(f"{b:>5} missing results: {e}")
        continue
    floor = {m: next((r["step_ms"] for r in t["rows"] if r["mode"] == m), None) for m in ("plain", "amp")}
    ratio = lambda ms: " ".join(f"{ms / floor[m]:{w}.3f}" if floor[m] else f"{'-':>{w}}"
                                for m, w in (("plain", 9), ("amp", 6)))
    for r in t["rows"]:
        print(f"{b:>5} {'PyTorch':<10} {r['mode']:<26} {r['step_ms']:8.1f} {ratio(r['step_ms'])} "
              f"{r['host_ms']:8.1f} {'-':>8} {'-':>7} {r['peak_mib']:9.0f}")
    for r in f["runs"]:
        ms = r["step_ms"]["median"]
        print(f"{b:>5} {'flatshard':<10} {r['granularity']:<26} {ms:8.1f} {ratio(ms)} "
              f"{r['host_issue_ms_median']:8.1f} {r['fwd_bwd_ms_median']:8.1f} "
              f"{r['optimizer_ms_median']:7.1f} {r['peak_memory_bytes'] / 2**20:9.0f}")
EOF
  return $rc
}

# Issue 54's A/B table: one flatshard-bench process per variant (GPU_CHECK_AB_VARIANTS, entries
# "name:arguments" separated by ";", an argument FLATSHARD_X=value sets the environment) at each
# batch (GPU_CHECK_AB_BATCHES, default 4 1), policies GPU_CHECK_AB_POLICY (default layer,leaf),
# fused AdamW, beside PyTorch plain (pure bf16) at the same batch in the same call; the table
# gives step ms, x PyTorch, host, fwd+bwd and optimizer ms, hook us per unit per step, peak MiB.
AB_DEFAULT="base:;kept:--keep-compute-shard;bf16m:--adamw-moments bf16;kept+bf16m:--keep-compute-shard --adamw-moments bf16;nodehook:FLATSHARD_PRE_BACKWARD_HOOK=0"
step_ab() {
  local b rc=0 entry name arg
  local -a entries env_args args
  IFS=';' read -r -a entries <<<"${GPU_CHECK_AB_VARIANTS:-$AB_DEFAULT}"
  for b in ${GPU_CHECK_AB_BATCHES:-4 1}; do
    "$PYTHON" tools/torch_reference.py --preset 1b --batch "$b" --modes plain \
      --json "$LOGDIR/ab_torch_b$b.json" >"$LOGDIR/ab_torch_b$b.txt" || rc=1
    for entry in "${entries[@]}"; do
      name=${entry%%:*}
      env_args=()
      args=()
      for arg in ${entry#*:}; do
        if [[ $arg == FLATSHARD_*=* ]]; then env_args+=("$arg"); else args+=("$arg"); fi
      done
      log "ab: batch $b, $name"
      env "${env_args[@]}" "$BUILD/benchmarks/flatshard-bench" --device cuda --world 1 \
        --preset 1b --batch "$b" --warmup 3 --steps 10 --optimizer fused \
        --policy "${GPU_CHECK_AB_POLICY:-layer,leaf}" "${args[@]}" \
        --json "$LOGDIR/ab_b${b}_$name.json" >"$LOGDIR/ab_b${b}_$name.txt" || rc=1
    done
  done
  # shellcheck disable=SC2086
  "$PYTHON" tools/ab_table.py "$LOGDIR" "${GPU_CHECK_AB_VARIANTS:-$AB_DEFAULT}" \
    ${GPU_CHECK_AB_BATCHES:-4 1} | tee "$LOGDIR/ab.txt"
  return $rc
}

# Issue 54 item 4: the CUDA graph step's GPU test, then the A/B table of step_ab with and without
# --cuda-graph (Note [CUDA graph step], fsdp/cuda_graph.h). The watchdog must be off for a
# capture; the bench turns it off itself with --cuda-graph, the variant says so explicitly.
GRAPHS_DEFAULT="eager:;graph:--cuda-graph FLATSHARD_NCCL_WATCHDOG=0"
step_graphs() {
  local rc=0
  log "graphs: gpu_cuda_graph_test (eager vs replayed steps, 1 GPU)"
  ctest --test-dir "$BUILD" -R '^gpu_cuda_graph_test$' --output-on-failure -V \
    --timeout "$TEST_TIMEOUT" || rc=1
  log "graphs: A/B, per-layer and per-leaf at ${GPU_CHECK_AB_BATCHES:-4 1} sequences, with and without --cuda-graph"
  GPU_CHECK_AB_VARIANTS=${GPU_CHECK_GRAPHS_VARIANTS:-$GRAPHS_DEFAULT} step_ab || rc=1
  cp "$LOGDIR/ab.txt" "$LOGDIR/graphs.txt" 2>/dev/null
  return $rc
}

# Issue 17's offload table: the vs_torch table with FSDP2's CPUOffloadPolicy beside flatshard's
# offload levels, per-layer units, 4 and 1 sequences per GPU.
# With the CPU step during backward (Note [Offload step in backward]) as a second bench, the
# one-step-delayed update (Note [Delayed offload step]) as a third, and
# the host's CPU AdamW floor (tools/cpu_adamw_probe.py) measured in the same call: issue 35's
# target is a ratio to max(fwd+bwd, that floor).
step_offload() {
  "$PYTHON" tools/cpu_adamw_probe.py floor | tee "$LOGDIR/cpu_adamw_floor.txt"
  GPU_CHECK_VS_TORCH_MODES=${GPU_CHECK_OFFLOAD_TORCH_MODES:-plain,fsdp2-block,fsdp2-block-offload} \
    GPU_CHECK_VS_GRANULARITY=${GPU_CHECK_OFFLOAD_GRANULARITY:-layer} \
    GPU_CHECK_VS_OFFLOAD=${GPU_CHECK_OFFLOAD_LEVELS:-0,1,2} \
    GPU_CHECK_VS_SECOND=${GPU_CHECK_OFFLOAD_SECOND---offload 1,2 --offload-step backward} \
    GPU_CHECK_VS_THIRD=${GPU_CHECK_OFFLOAD_THIRD---offload 1 --offload-step delayed} \
    VS_TABLE=offload step_vs_torch
}

step_advisor() {
  # shellcheck disable=SC2086
  "$PYTHON" tools/advisor_check.py --build "$BUILD" --device cuda --nproc 1 --preset 1b \
    --batches ${GPU_CHECK_ADVISOR_BATCHES:-4 1} --models gpt llama --logdir "$LOGDIR/advisor" \
    ${GPU_CHECK_ADVISOR_ARGS:-} | tee "$LOGDIR/advisor.txt"
}

step_sanitize() {
  local cs tool rc=0
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [ -x "$cs" ] || { log "compute-sanitizer not found"; return 1; }
  for tool in memcheck racecheck; do
    local extra=()
    [ "$tool" = racecheck ] && extra=(--kernel-name-exclude kns=nccl)
    # NCCL's init probes kernels for other architectures and handles the API errors
    # (cudaErrorNoKernelImageForDevice from cudaFuncGetAttributes in ncclInitKernelsForDevice);
    # memcheck would count them. Memory access errors are still reported.
    [ "$tool" = memcheck ] && extra=(--report-api-errors no)
    log "compute-sanitizer --tool $tool: nccl_reliability_test [memory]"
    FLATSHARD_TIMEOUT_MS=600000 "${TORCHRUN[@]}" --no-python "$cs" --tool "$tool" \
      --error-exitcode 99 "${extra[@]}" "$BUILD/tests/nccl_reliability_test" "[memory]" || rc=1
    log "compute-sanitizer --tool $tool: gpu_parity_test [counters] (per-layer FULL_SHARD, 5 steps)"
    FLATSHARD_TIMEOUT_MS=600000 "${TORCHRUN[@]}" --no-python "$cs" --tool "$tool" \
      --error-exitcode 99 "${extra[@]}" "$BUILD/tests/gpu_parity_test" "[counters]" || rc=1
  done
  return $rc
}

# ------------------------------------------------------------------------------------------------
STEPS=(configure build gpu_tests hsdp bench bench_nowd c10d compare train train_fused train_cli setup trace vs_torch offload advisor)
[ "${GPU_CHECK_QUANT:-0}" = 1 ] && STEPS=("${STEPS[@]:0:3}" quant "${STEPS[@]:3}")
[ "${GPU_CHECK_SANITIZE:-0}" = 1 ] && STEPS+=(sanitize)
if [ -n "${GPU_CHECK_STEPS:-}" ]; then
  read -r -a STEPS <<<"$GPU_CHECK_STEPS"
  for s in "${STEPS[@]}"; do
    declare -F "step_$s" >/dev/null || { log "GPU_CHECK_STEPS: no step '$s'"; exit 2; }
  done
fi
# A failed step in this list stops the run (later steps need its output).
FATAL=(configure build)
declare -A RESULT SECONDS_TAKEN

run_steps() {
  local stop=0 s t0 rc
  for s in "${STEPS[@]}"; do
    if [ "$stop" = 1 ]; then
      RESULT[$s]=SKIPPED
      continue
    fi
    log "=== step $s ==="
    t0=$(date +%s)
    "step_$s" 2>&1 | tee "$LOGDIR/$s.log"
    rc=${PIPESTATUS[0]}
    SECONDS_TAKEN[$s]=$(($(date +%s) - t0))
    if [ "$rc" = 0 ]; then RESULT[$s]=PASS; else RESULT[$s]="FAIL (exit $rc)"; fi
    if [ "$rc" != 0 ] && [[ " ${FATAL[*]} " == *" $s "* ]]; then stop=1; fi
  done
}

summary() {
  local s failed=0
  echo
  log "=== summary (logs in $LOGDIR; $NGPU GPUs visible, $NPROC used) ==="
  for s in "${STEPS[@]}"; do
    printf '  %-10s %-16s %ss\n' "$s" "${RESULT[$s]}" "${SECONDS_TAKEN[$s]:--}"
    [ "${RESULT[$s]}" = PASS ] || failed=1
  done
  if [ -f "$LOGDIR/advisor.txt" ]; then
    echo
    cat "$LOGDIR/advisor.txt"
  fi
  if [ -f "$LOGDIR/graphs.txt" ]; then
    echo
    cat "$LOGDIR/graphs.txt"
  fi
  if [ -f "$LOGDIR/compare.txt" ]; then
    echo
    cat "$LOGDIR/compare.txt"
  fi
  for s in "$LOGDIR"/train_b*.txt "$LOGDIR"/train_fused_b*.txt "$LOGDIR"/setup_*.txt; do
    [ -f "$s" ] || continue
    echo
    sed -n '/^granularity/,/^$/p' "$s"
    # The kernel profile without the per-kernel lines (those stay in the log).
    sed -n '/^kernel profile/,$p' "$s" | grep -v '^    .*x  '
  done
  return $failed
}

if [ "$NPROC" -lt 1 ]; then
  log "no CUDA device visible to $PYTHON (torch.cuda.device_count() = $NGPU)"
  exit 1
fi
run_steps
summary
