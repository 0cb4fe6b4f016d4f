"""The ``aotstack`` command, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT


def aotstack_command(
    *args: str, cwd=ROOT, columns: int | None = None, cache: Path | None = None
) -> subprocess.CompletedProcess[str]:
    # pytest-xdist gives its workers an 80-column COLUMNS; a user's pipe has none unless they set it.
    env = {name: value for name, value in os.environ.items() if name not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(ROOT)
    if cache is not None:
        env["AOTSTACK_CACHE_DIR"] = str(cache)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    command = [sys.executable, "-m", "aotstack", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, check=False)


def test_inspect_lists_methods_delegates_devices_ops_and_sizes(lowered_package):
    _, path = lowered_package("split", exclude_ops=("aten.sigmoid",))
    result = aotstack_command("inspect", path)

    assert result.returncode == 0, result.stderr
    assert "method forward(x: float32[4, 16])" in result.stdout
    rows = [line for line in result.stdout.splitlines() if " forward.0 " in line or " forward.1 " in line]
    assert len(rows) == 2 and all("aoti_cpu" in row and " cpu " in row for row in rows)
    assert "aten.sigmoid.default │ 1: sigmoid │ aoti_cpu: excluded: the user's exclude_ops names it" in result.stdout
    assert " kB" in result.stdout and "file size by part" in result.stdout


def test_run_reports_outputs_and_time(lowered_package):
    _, path = lowered_package("split", exclude_ops=("aten.sigmoid",))
    result = aotstack_command("run", path, "--method", "forward", "--calls", "5")

    assert result.returncode == 0, result.stderr
    assert "forward(float32[4, 16])" in result.stdout
    assert "[0]: float32[4, 8]" in result.stdout and "[1]: float32[4]" in result.stdout
    assert "µs per call over 5 calls" in result.stdout


def test_compile_writes_a_package_from_module_and_function(tmp_path):
    output = tmp_path / "demo.pt2"
    result = aotstack_command(
        "compile", "aotstack.demo:demo_model", "-o", output, "--exclude-op", "aten.gelu", "--check", "--atol", "1e-3"
    )

    assert result.returncode == 0, result.stderr
    assert "numerical check of outputs (atol 1e-03, rtol 1e-04): passed" in result.stdout
    for output_name in ("method 'forward'  output", "method 'embed'    output"):
        assert output_name in result.stdout
    assert "forward: compiling aoti_cpu_0 (aoti_cpu, " in result.stderr
    assert "embed: aoti_cpu_0 (aoti_cpu) same as forward/aoti_cpu_0, compiled once" in result.stderr
    assert f"wrote {output}: 2 method(s), 4 delegate(s)" in result.stdout
    listing = aotstack_command("inspect", output).stdout
    assert "method embed(image: float32[4, 3, 8, 8])" in listing
    assert " embed.0 " in listing and " embed.1 " in listing and " embed.2 " not in listing


def test_errors_are_one_line_naming_the_problem(tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_text("nope")
    result = aotstack_command("inspect", bad)
    assert result.returncode == 1
    assert result.stderr.startswith(f"aotstack: error: {bad}: not a PT2 archive")
    assert len(result.stderr.strip().splitlines()) == 1

    missing = aotstack_command("compile", "tests.models:no_such_function", "-o", tmp_path / "x.pt2")
    assert missing.returncode == 1
    assert "cannot find tests.models:no_such_function" in missing.stderr


def test_demo_runs_end_to_end_in_a_fresh_process(tmp_path):
    result = aotstack_command("demo", "--keep", tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "the package matches eager PyTorch" in result.stdout
    for method in ("forward", "embed"):
        assert f"delegate {method}.0: aoti_cpu on cpu" in result.stdout
        assert f"delegate {method}.1: aoti_cpu on cpu" in result.stdout
    assert (tmp_path / "demo.pt2").exists()


def test_compile_with_onnx_runtime_first(tmp_path):
    output = tmp_path / "demo-ort.pt2"
    # A cache of its own, so the ONNX export runs here (seconds: ONNX Runtime takes every op).
    result = aotstack_command("compile", "aotstack.demo:demo_model", "-o", output, "--ort", cache=tmp_path / "cache")

    assert result.returncode == 0, result.stderr
    assert "(onnxruntime," in result.stderr and "(aoti_cpu," not in result.stderr
    # aotstack's progress, not the notes of the engines' libraries (onnxscript's on each optimizer pass).
    assert "No unused functions" not in result.stderr and "constant folding" not in result.stderr
    listing = aotstack_command("inspect", output).stdout
    assert "onnxruntime" in next(line for line in listing.splitlines() if " forward.0 " in line)
    ran = aotstack_command("run", output, "--calls", "2")
    assert ran.returncode == 0, ran.stderr


def test_compile_chooses_engines_by_measuring_unless_told(tmp_path):
    output = tmp_path / "demo-auto.pt2"
    result = aotstack_command("compile", "aotstack.demo:demo_model", "-o", output)

    assert result.returncode == 0, result.stderr
    assert "forward: kept " in result.stdout and "embed: kept " in result.stdout
    listing = aotstack_command("inspect", output).stdout
    assert "engines chosen by measuring" in listing and "onnxruntime > aoti_cpu" in listing

    told = aotstack_command("compile", "aotstack.demo:demo_model", "-o", output, "--engines", "ort,aoti")
    assert told.returncode == 0, told.stderr
    assert "kept" not in told.stdout and "(onnxruntime," in told.stderr


def test_compile_names_an_unknown_engine(tmp_path):
    result = aotstack_command("compile", "aotstack.demo:demo_model", "-o", tmp_path / "x.pt2", "--engines", "tvm")

    assert result.returncode == 1
    assert "--engines names 'tvm'" in result.stderr and "Traceback" not in result.stderr


def test_compile_names_a_bad_option_without_a_traceback(tmp_path):
    result = aotstack_command("compile", "aotstack.demo:demo_model", "-o", tmp_path / "x.pt2", "--min-block-size", "0")

    assert result.returncode == 1
    assert "aotstack: error: min_block_size must be an int >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_compile_names_a_bad_device_without_a_traceback(tmp_path):
    result = aotstack_command("compile", "aotstack.demo:demo_model", "-o", tmp_path / "x.pt2", "--device", "tpu:0")

    assert result.returncode == 1
    assert "aotstack: error: unknown device type 'tpu' in 'tpu:0'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_compile_for_cuda_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    output = tmp_path / "x.pt2"

    result = aotstack_command("compile", "aotstack.demo:demo_model", "-o", output, "--device", "cuda:1")

    assert result.returncode == 1
    assert "compiles for cuda:1, which this machine lacks" in result.stderr
    assert not output.exists()


def test_explain_shows_the_quantized_layers_each_part_holds():
    result = aotstack_command("explain", "aotstack.demo:demo_model", "--engines", "ov", "--qlinear", "8da4w", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    quantized = [d["quantized"] for method in report["methods"] for d in method["delegates"]]
    assert {"linear 8da4w, group 32": 2} in quantized, quantized
    bad = aotstack_command("explain", "aotstack.demo:demo_model", "--qlinear", "8da4w", "--qgroup-size", "48")
    assert bad.returncode != 0
    assert "group_size 48 does not divide the input dimension of proj [64, 512]" in bad.stderr
