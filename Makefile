# trainpod: `make demo` runs the whole pipeline on CPU; `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for tests and the demo; the images install their own (docker/).
TORCH_SPEC ?= torch==2.13.0
# Where a plain PyPI torch is a CUDA build (GitHub runners), point this at the CPU wheels:
# TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: setup demo test test-all bench lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and alone: a later install sees it satisfied and never swaps it for a CUDA build.
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev,hub]'
	touch $@

demo: setup
	$(PY) -m trainpod.demo

test: setup
	$(PY) -m pytest -m "not container and not gpu" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/run_all.py

lint: setup
	$(VENV)/bin/ruff check src tests bench entrypoints
	$(VENV)/bin/ruff format --check src tests bench entrypoints

clean:
	rm -rf $(VENV) demo-volume bench-out .pytest_cache
