# The README's two commands call these targets; .ci/run calls `make test`.
# torch is pinned to the CPU wheel here so set-up never pulls a multi-GB CUDA build
# (see README: a GPU user installs the torch for their CUDA first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-extended test-gpu

$(BIN)/memkit: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on "$(TORCH_SPEC)"
	$(BIN)/pip install --progress-bar on -e '.[dev]'
	touch $(BIN)/memkit

setup: $(BIN)/memkit

demo: setup
	$(BIN)/memkit demo

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The 4-process checks (`extended` marker) that `make test` skips to stay within 10 minutes on 2 cores.
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
