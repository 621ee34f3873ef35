# Two commands do everything on a fresh Debian 12 machine (each installs what it needs):
#   make test    build flatshard and run the whole CPU test suite (ctest)
#   make bench   run flatshard-bench on a small model on CPU (ranks as threads)
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CTEST_ARGS ?=
BENCH_ARGS ?=

# ccache across fresh clones of the same machine (CI clones into a new folder every time).
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime,locale

.PHONY: all setup configure build test bench clean test-asan test-tsan

all: build

# Idempotent: checks Debian packages and the cached torch==2.11.0 virtualenv, installs what is
# missing, and records the venv's python for CMake.
setup:
	@mkdir -p $(BUILD_DIR)
	@bash tools/setup_deps.sh > $(BUILD_DIR)/.python.tmp
	@tail -n1 $(BUILD_DIR)/.python.tmp > $(BUILD_DIR)/.python && rm -f $(BUILD_DIR)/.python.tmp

configure: setup
	@if [ ! -f $(BUILD_DIR)/build.ninja ] || [ "$$(cat $(BUILD_DIR)/.python)" != "$$(cat $(BUILD_DIR)/.python.configured 2>/dev/null)" ]; then \
	  cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	    -DFLATSHARD_PYTHON="$$(cat $(BUILD_DIR)/.python)" && \
	  cp $(BUILD_DIR)/.python $(BUILD_DIR)/.python.configured; \
	fi

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure --timeout 900 -j $(JOBS) $(CTEST_ARGS)

# Builds only the benchmark (not the test suite), then runs it; e.g. make bench BENCH_ARGS="--help".
bench: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target flatshard-bench
	$(BUILD_DIR)/benchmarks/flatshard-bench $(BENCH_ARGS)

# Sanitizer runs of the CPU suite (docs/reliability.md "Sanitizers"): separate build folders, LibTorch itself
# uninstrumented; tools/sanitizers/ holds the options and suppressions, each with its reason.
# Narrow with SAN_TARGETS (default: every target) and SAN_CTEST_ARGS (e.g. -L reliability).
SAN_TARGETS ?= all
SAN_CTEST_ARGS ?=
SAN_CMAKE = cmake -S . -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATSHARD_WITH_CUDA=OFF \
	  -DFLATSHARD_BUILD_BENCHMARKS=ON -DFLATSHARD_PYTHON="$$(cat $(BUILD_DIR)/.python)"

test-asan: setup
	@[ -f build-asan/build.ninja ] || $(SAN_CMAKE) -B build-asan -DFLATSHARD_SANITIZE=address,undefined
	cmake --build build-asan -j $(JOBS) --target $(SAN_TARGETS)
	cd build-asan && . ../tools/sanitizers/asan.env && \
	  ctest --output-on-failure --timeout 1800 -j $(JOBS) -LE install $(SAN_CTEST_ARGS)

test-tsan: setup
	@[ -f build-tsan/build.ninja ] || $(SAN_CMAKE) -B build-tsan -DFLATSHARD_SANITIZE=thread
	cmake --build build-tsan -j $(JOBS) --target $(SAN_TARGETS)
	cd build-tsan && . ../tools/sanitizers/tsan.env && \
	  ctest --output-on-failure --timeout 1800 -j $(JOBS) -LE install $(SAN_CTEST_ARGS)

clean:
	rm -rf $(BUILD_DIR)
