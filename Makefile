# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Torch is installed first and pinned, so the package's looser `torch>=2.11` finds it satisfied
# instead of pulling the newest build with its CUDA packages.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/aotstack demo

test: $(VENV)/.installed
	$(BIN)/ruff check src tests bench examples
	$(BIN)/python -m pytest tests

# The benchmarks' extra engines (ExecuTorch), torch pinned on the same command line so it is not upgraded.
$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -e ".[test,bench]"
	touch $@

# Every benchmark; one table, and the figures in build/bench-results.json. BENCH_ARGS="--quick --only latency"
bench: $(VENV)/.installed-bench
	$(BIN)/python bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info
