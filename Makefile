# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
# Test files run in this many processes at once (pytest-xdist), each file whole in one of them.
TEST_WORKERS ?= 2
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
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The benchmarks' extra engines (ExecuTorch), torch pinned on the same command line so it is not upgraded.
$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -e ".[test,bench]"
	touch $@

# Every benchmark; one table, and the figures in build/bench-results.json. BENCH_ARGS="--quick --only latency"
bench: $(VENV)/.installed-bench
	$(BIN)/python bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info

# On a GPU machine, with its image's own python3 (torch with CUDA; aotstack not installed, so PYTHONPATH=src:.):
# the probe, the CUDA tests, the corpus on the GPU and a speed table, under 10 minutes (README: "On a GPU machine").
# Wheels carried in .whl/ are installed into GPU_SITE first and put on the path. GPU_ARGS="--quick --only bert"
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/site
GPU_WHEELS := $(wildcard .whl/*.whl)

.PHONY: gpu-check
gpu-check:
ifneq ($(GPU_WHEELS),)
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) $(GPU_WHEELS)
endif
	PYTHONUNBUFFERED=1 PYTHONPATH=$(if $(GPU_WHEELS),$(GPU_SITE):)src:.$${PYTHONPATH:+:$$PYTHONPATH} \
		$(GPU_PYTHON) bench/gpu.py $(GPU_ARGS)
