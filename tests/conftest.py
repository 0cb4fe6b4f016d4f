"""Shared fixtures: each model is compiled once per session, then loaded as often as needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aotstack
from tests import models

ROOT = Path(__file__).resolve().parent.parent

# One line per real model and lowering, which engines ran it, printed after the run. A test records its line
# among its report's properties (``report_corpus_line``), which reach this process from a worker's too.
CORPUS_PROPERTY = "corpus_line"
CORPUS_REPORT: list[str] = []


def report_corpus_line(node: pytest.Item, line: str) -> None:
    node.user_properties.append((CORPUS_PROPERTY, line))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        CORPUS_REPORT.extend(value for name, value in report.user_properties if name == CORPUS_PROPERTY)


def pytest_terminal_summary(terminalreporter) -> None:
    if CORPUS_REPORT:
        terminalreporter.section("real models: engines per lowering")
        for line in sorted(CORPUS_REPORT):
            terminalreporter.write_line(line)


# The test files that take longest, longest first (per-file sums of test times in a full run, stop 103).
# `make test` hands files to its processes in the order they are collected (`--no-loadscope-reorder`), so these
# start first and the processes finish together, rather than one running a slow file alone at the end.
LONGEST_FILES = (
    "test_real_models.py",
    "test_transformers_export.py",
    "test_quantized_models.py",
    "test_seq2seq_generation.py",
    "test_language_models.py",
    "test_image_text.py",
    "test_xnnpack.py",
    "test_xnnpack_lm.py",
    "test_openvino.py",
    "test_torchao_configs.py",
    "test_cli.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: each file's order kept


FRESH_PROCESS_RUN = """
import json, sys
import torch
import aotstack
from torch.utils._pytree import tree_leaves
from tests import models

path, method, name = sys.argv[1:4]
loaded = aotstack.load(path)
result = loaded.run(method, *models.example_inputs(name))
print(json.dumps([{"dtype": str(t.dtype), "shape": list(t.shape), "values": t.flatten().tolist()}
                  for t in tree_leaves(result)]))
"""


def run_child(script: str, *args: str, stdin: str | None = None) -> Any:
    """Run ``script`` in a new Python process at the repository root; the JSON its last line prints."""
    child = subprocess.run(
        [sys.executable, "-c", script, *args], input=stdin, capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
        check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def run_in_fresh_process(path: Path, method: str, model_name: str) -> list[torch.Tensor]:
    """Load ``path`` in a new Python process and run ``method`` on the model's example inputs."""
    leaves = run_child(FRESH_PROCESS_RUN, str(path), method, model_name)
    return [
        torch.tensor(leaf["values"], dtype=getattr(torch, leaf["dtype"].removeprefix("torch."))).reshape(leaf["shape"])
        for leaf in leaves
    ]


def assert_matches_eager(outputs: list[torch.Tensor], model_name: str, method: str = "forward") -> None:
    model = models.build(model_name)
    with torch.no_grad():
        expected = torch.utils._pytree.tree_leaves(getattr(model, method)(*models.example_inputs(model_name)))
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


Lowerer = Callable[..., tuple[aotstack.LoweredProgram, Path]]


@pytest.fixture(scope="session")
def lowered_with(tmp_path_factory: pytest.TempPathFactory) -> Lowerer:
    """``lowered_with(name, label, make_partitioners, methods=("forward",))``: lowered once per session, and saved.

    ``label`` names the partitioning, so tests asking for the same one share the compile.
    """
    built: dict[tuple, tuple[aotstack.LoweredProgram, Path]] = {}
    directory = tmp_path_factory.mktemp("packages")

    def lower(
        name: str,
        label: str,
        make_partitioners: Callable[[], list[aotstack.Partitioner]],
        methods: tuple[str, ...] = ("forward",),
    ):
        key = (name, label, methods)
        if key not in built:
            inputs = models.example_inputs(name)
            program = aotstack.export(models.build(name), {method: inputs for method in methods})
            lowered = aotstack.lower(program, make_partitioners())
            path = directory / f"{name}-{'-'.join(methods)}-{len(built)}.pt2"
            lowered.save(path)
            built[key] = (lowered, path)
        return built[key]

    return lower


@pytest.fixture(scope="session")
def lowered_package(lowered_with: Lowerer) -> Lowerer:
    """``lowered_package(name, methods=("forward",), exclude_ops=())``: AOTInductor CPU only."""

    def lower(name: str, methods: tuple[str, ...] = ("forward",), exclude_ops: tuple[str, ...] = ()):
        return lowered_with(
            name, f"aoti_cpu{exclude_ops}", lambda: [aotstack.AotiCpuPartitioner(exclude_ops=exclude_ops)], methods
        )

    return lower
