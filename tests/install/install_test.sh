#!/usr/bin/env bash
# ctest `install_test`: install the build tree into a temporary prefix, build the out-of-tree
# consumer against it with find_package(flatshard) alone, and run it.
#   install_test.sh <build dir> <python with torch> <source dir>
set -euo pipefail
build=$1 python=$2 src=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
log="$work/log"
# Quiet on success; the whole log on failure.
run() { "$@" >>"$log" 2>&1 || { cat "$log"; echo "install_test: failed: $*" >&2; exit 1; }; }
run cmake --install "$build" --prefix "$work/prefix"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
run cmake -S "$src/tests/install/consumer" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DFLATSHARD_PYTHON="$python" "${launcher[@]}"
run cmake --build "$work/build"
"$work/build/consumer" "$work/ckpt"
