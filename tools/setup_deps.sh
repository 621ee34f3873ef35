#!/usr/bin/env bash
# Installs everything flatshard needs to build on a fresh Debian 12 machine. Idempotent: a second
# run (or a fresh clone on the same machine) downloads nothing.
#   - Debian packages: cmake, ninja, ccache, Abseil, Catch2 (v2), CLI11, nlohmann-json, zlib.
#   - The PyPI torch wheel pinned to FLATSHARD_TORCH_VERSION in a virtualenv cached per user,
#     keyed by that version (LibTorch headers/libs and the NCCL of the same wheel set).
#   - In the same venv, the PyPI safetensors package pinned to FLATSHARD_SAFETENSORS_VERSION
#     (tests/safetensors_interop_test: files must load in the reference implementation) and
#     transformers pinned to FLATSHARD_TRANSFORMERS_VERSION (tests/hf_parity_test: Hugging Face
#     checkpoints against transformers' own logits). transformers 5.23 needs safetensors >= 0.8,
#     hence the safetensors pin.
# Prints the venv's python path on its last line (used by the Makefile).
set -euo pipefail

TORCH_VERSION="${FLATSHARD_TORCH_VERSION:-2.11.0}"
SAFETENSORS_VERSION="${FLATSHARD_SAFETENSORS_VERSION:-0.8.0}"
TRANSFORMERS_VERSION="${FLATSHARD_TRANSFORMERS_VERSION:-5.23.0}"
CACHE_ROOT="${FLATSHARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flatshard}"
VENV="$CACHE_ROOT/venv-torch-$TORCH_VERSION"

log() { echo "[setup] $*" >&2; }

# --- Debian packages -------------------------------------------------------------------------
need_pkgs=()
for p in cmake ninja-build ccache libabsl-dev catch2 libcli11-dev nlohmann-json3-dev zlib1g-dev \
         python3-venv; do
  dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    log "installing Debian packages: ${need_pkgs[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      "${need_pkgs[@]}" >/dev/null
  else
    log "warning: no apt-get; make sure these are installed: ${need_pkgs[*]}"
  fi
fi

# --- torch wheel in a cached virtualenv ------------------------------------------------------
stamp="$VENV/.flatshard-ok"
if [ ! -f "$stamp" ]; then
  log "creating $VENV with torch==$TORCH_VERSION (one-time download, several GB)"
  mkdir -p "$CACHE_ROOT"
  rm -rf "$VENV.tmp"
  PY="${FLATSHARD_PYTHON:-python3}"
  # Prefer the stdlib venv; fall back to virtualenv when ensurepip is missing.
  "$PY" -m venv "$VENV.tmp" 2>/dev/null || { "$PY" -m pip install -q virtualenv && "$PY" -m virtualenv -q "$VENV.tmp"; }
  "$VENV.tmp/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV.tmp/bin/python" -m pip install --progress-bar off "torch==$TORCH_VERSION" >&2
  "$VENV.tmp/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
  # venvs hard-code their path: rebuild scripts by moving, then re-pointing is not needed since
  # we only use bin/python and site-packages; python resolves its prefix from its own location.
  mv "$VENV.tmp" "$VENV"
  touch "$stamp"
fi
"$VENV/bin/python" -c "import torch" >/dev/null

# --- safetensors in the same venv (a fresh venv and an older one without it alike) ----------
# The [torch] extra brings what safetensors.torch imports (numpy, packaging; torch is already
# there). Checked by installed versions (no import of torch), so a present pin costs one python
# start and no pip call. A failed install does not stop the build: the interop test then fails
# (it never skips) and says why.
if ! "$VENV/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(m.version('safetensors') != '$SAFETENSORS_VERSION' or not (m.version('numpy') and m.version('packaging')))
" >/dev/null 2>&1; then
  log "installing safetensors[torch]==$SAFETENSORS_VERSION into $VENV"
  "$VENV/bin/python" -m pip install -q --progress-bar off "safetensors[torch]==$SAFETENSORS_VERSION" >&2 ||
    log "warning: could not install safetensors==$SAFETENSORS_VERSION; safetensors_interop_test will fail"
fi

# --- transformers in the same venv (test-only: tests/hf_parity_test), checked the same way ----
if ! "$VENV/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(m.version('transformers') != '$TRANSFORMERS_VERSION')
" >/dev/null 2>&1; then
  log "installing transformers==$TRANSFORMERS_VERSION into $VENV (one-time)"
  "$VENV/bin/python" -m pip install -q --progress-bar off "transformers==$TRANSFORMERS_VERSION" \
      "safetensors[torch]==$SAFETENSORS_VERSION" >&2 ||
    log "warning: could not install transformers==$TRANSFORMERS_VERSION; hf_parity_test will fail"
fi
echo "$VENV/bin/python"
