# The README's two commands call these targets; .ci/run calls `make test`.
# torch is pinned to the CPU wheel here so set-up never pulls a multi-GB CUDA build
# (see README: a GPU user installs the torch for their CUDA first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# more packages installed next to torch (quoted one by one), e.g. the torchvision built for that torch
EXTRA_SPEC ?=

.PHONY: setup setup-demo demo test style test-extended test-gpu test-newest

# What `make demo` needs: torch and memkit with its runtime dependencies, nothing more.
$(BIN)/memkit: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on "$(TORCH_SPEC)" $(foreach spec,$(EXTRA_SPEC),"$(spec)")
	$(BIN)/pip install --progress-bar on -e .
	touch $(BIN)/memkit

# What the tests need besides: the dev extra (pytest, mkdocs, transformers, ...), in the same venv. Its own stamp, so
# `make test` after `make demo` still installs it.
$(VENV)/.memkit-dev: $(BIN)/memkit
	$(BIN)/pip install --progress-bar on -e '.[dev]'
	touch $@

setup-demo: $(BIN)/memkit

setup: $(VENV)/.memkit-dev

demo: setup-demo
	$(BIN)/memkit demo

# The suite on both ends of the supported torch range: the CPU wheel above, then the newest torch pip gives
# (test-newest). NEWEST=0 skips the second (a quick local run).
NEWEST ?= 1

# The main lane runs on JOBS pytest-xdist workers: one per core, at most 4 (each holds torch, Lightning and a
# model or two; more would trade memory for little). JOBS=0 runs it in this process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: style
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist worksteal
	@if [ "$(NEWEST)" = "1" ]; then $(MAKE) --no-print-directory test-newest; fi

# Style and types (pyproject.toml's [tool.ruff] and [tool.mypy]): the layout is ruff format's (`ruff format .` fixes
# it), ruff's lint passes, and mypy finds no error in the package. First: ruff takes seconds, mypy about a minute
# from a clean clone and seconds once its cache (.mypy_cache) is warm.
style: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

# The newest torch pip gives here (2.14.1: on x86 a CUDA build, which runs on CPU) with its torchvision and
# timm, so the torchvision/timm tests run too; in its own venv (NEWEST_VENV), set up like .venv.
NEWEST_VENV ?= .venv-newest
NEWEST_TORCH ?= torch==2.14.1
NEWEST_EXTRA ?= torchvision==0.29.1 timm
# The newest end runs what depends on torch's internals and on the real libraries (torchvision/timm import only
# there); the whole suite ran on 2.14.1 by hand (docs/versions.md). NEWEST_TESTS= (empty) runs everything.
NEWEST_TESTS ?= tests/compat tests/accounting/test_accountant.py tests/doctor/test_doctor_compat.py \
	tests/probes/test_probes.py tests/estimate/fake/test_fake_values.py tests/estimate/test_hf_models.py \
	tests/estimate/test_vision_models.py tests/compiled/test_compile.py tests/estimate/test_estimate.py \
	tests/estimate/cuda/test_gpu_truth.py tests/trace/test_trace_callback.py

test-newest:
	$(MAKE) --no-print-directory setup VENV=$(NEWEST_VENV) TORCH_SPEC="$(NEWEST_TORCH)" EXTRA_SPEC="$(NEWEST_EXTRA)"
	$(NEWEST_VENV)/bin/python -c "import torch; print('test-newest: torch', torch.__version__)"
	$(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist worksteal $(NEWEST_TESTS)

# The 4-process checks, the 70B matrix, the 7B plan on 8 GPUs and a few slow variants (`extended` marker) that
# `make test` skips to stay near 10 minutes on 2 cores.
test-extended: setup
	MEMKIT_EXTENDED=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m extended -rs

# The GPU lane: only the tests marked `cuda`, in their own venv (GPU_VENV) set up the same way with the
# torch build for your CUDA, e.g.
#   make test-gpu TORCH_SPEC="torch==2.11.0" PIP_EXTRA_INDEX_URL=<your CUDA wheel index>
# It refuses to run without a TORCH_SPEC, and fails (rather than skipping everything) when that torch sees no GPU.
GPU_VENV ?= .venv-gpu

test-gpu:
	@if [ "$(origin TORCH_SPEC)" = "file" ]; then \
		echo "make test-gpu: give the torch build for your CUDA, e.g. make test-gpu TORCH_SPEC=\"torch==2.11.0\" PIP_EXTRA_INDEX_URL=<your CUDA wheel index>" >&2; \
		exit 2; fi
	$(MAKE) setup VENV=$(GPU_VENV) TORCH_SPEC="$(TORCH_SPEC)"
	@$(GPU_VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch ' + torch.__version__ + ' in $(GPU_VENV) sees no CUDA device; install a CUDA build (TORCH_SPEC, PIP_EXTRA_INDEX_URL) on a machine with a GPU')"
	$(GPU_VENV)/bin/python -m pytest -q -p no:cacheprovider -m cuda -rs
