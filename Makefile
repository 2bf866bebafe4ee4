# The README's two commands call these targets; .ci/run calls `make test`.
# torch is pinned to the CPU wheel here so set-up never pulls a multi-GB CUDA build
# (see README: a GPU user installs the torch for their CUDA first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test

$(BIN)/memkit: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(BIN)/memkit

setup: $(BIN)/memkit

demo: setup
	$(BIN)/memkit demo

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider
