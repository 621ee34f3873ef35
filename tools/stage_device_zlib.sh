#!/usr/bin/env bash
# Stages Debian's zlib (headers and the shared library) into .device-deps/zlib-prefix of this
# checkout, beside what ../shared/tools/stage-device-deps.sh stages, for GPU machines whose image
# has no zlib headers (checkpoint CRC-32s call zlib). tools/gpu_check.sh uses it only when
# /usr/include/zlib.h is missing there.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dpkg -s zlib1g-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq zlib1g-dev >/dev/null; }
z=.device-deps/zlib-prefix
rm -rf "$z"
mkdir -p "$z/include" "$z/lib"
cp /usr/include/zlib.h "$z/include/"
cp "$(ls /usr/include/zconf.h /usr/include/x86_64-linux-gnu/zconf.h 2>/dev/null | head -1)" "$z/include/"
real=$(readlink -f /usr/lib/x86_64-linux-gnu/libz.so)
cp "$real" "$z/lib/"
ln -sf "$(basename "$real")" "$z/lib/libz.so"
grep -qx '/.device-deps/' .git/info/exclude 2>/dev/null || echo '/.device-deps/' >> .git/info/exclude
echo "staged $z"
