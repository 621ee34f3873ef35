# Two commands do everything on a fresh Debian 12 machine (each installs what it needs):
#   make test    build flatshard and run the whole CPU test suite (ctest)
#   make bench   run flatshard-bench on a small model on CPU (ranks as threads)
#   make train   train a tiny LLaMA on a shipped text on CPU with flatshard-train (~1 minute)
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CTEST_ARGS ?=
BENCH_ARGS ?=

# ccache across fresh clones of the same machine (CI clones into a new folder every time).
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime,locale

.PHONY: all setup configure build test bench train clean test-asan test-tsan

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

# Builds only flatshard-train, prepares a license text byte-level (tools/prepare_tokens.py) and
# trains a tiny LLaMA on it at world 2 (docs/training.md). Each run starts afresh in
# $(BUILD_DIR)/train-run unless TRAIN_ARGS has --resume (e.g. TRAIN_ARGS="--resume --steps 2000").
TRAIN_TEXT ?= /usr/share/common-licenses/GPL-3
TRAIN_ARGS ?=
train: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target flatshard-train
	$(if $(findstring --resume,$(TRAIN_ARGS)),,rm -rf $(BUILD_DIR)/train-run)
	"$$(cat $(BUILD_DIR)/.python)" tools/prepare_tokens.py --byte-level $(TRAIN_TEXT) $(BUILD_DIR)/train-data
	$(BUILD_DIR)/tools/flatshard-train --data $(BUILD_DIR)/train-data/train.bin \
	  --val $(BUILD_DIR)/train-data/val.bin --vocab 256 --seq 64 --global-batch 8 --micro-batch 2 \
	  --steps 1000 --warmup 50 --lr 3e-3 --min-lr 3e-4 --checkpoint-every 250 --eval-every 250 \
	  --log-every 50 --out $(BUILD_DIR)/train-run $(TRAIN_ARGS)

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
