"""Every benchmark, one table, one JSON results file: what ``make bench`` runs.

    .venv/bin/python bench/run.py [--only NAME ...] [--quick] [--threads 1] [--output build/bench-results.json]

``quantized`` (the Llama decode at fp32, 8w, 8da8w, 4w and 8da4w through every engine, at ``--threads``:
tokens/s, file size, resident memory) takes half an hour or more on a 2-core machine, so it runs only
when named: ``--only quantized`` (``make bench BENCH_ARGS="--only quantized"``).

Each benchmark is a function of ``Settings`` returning named ``Figure``s (a value, its baseline measured
in the same run, their ratio, a target and pass or miss). The whole run uses private compile caches
(aotstack's and Inductor's) in a temporary directory, so results do not depend on the user's caches;
the compile benchmarks make their own fresh ones. Speed is reported as ratios against baselines
measured in this run; nothing is asserted. The exit status is 1 only where a benchmark failed to run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import aotstack
from boundary import boundary
from common import (
    FIGURE_HEADERS,
    REPO,
    Figures,
    Settings,
    figure_rows,
    print_table,
    quiet_known_warnings,
    use_private_caches,
)
from compile_time import auto_times, compile_times, dry_run_times, parallel_jobs
from decode import decode_rates
from draw import draw_times
from large import large_model
from latency import latency
from load import load_times
from peers import peers, quantized_decode
from stacked import stacked
from vision_language import vision_language

DEFAULT_OUTPUT = os.path.join(REPO, "build", "bench-results.json")

# Name -> (what it measures, the function). Run in this order.
BENCHMARKS: dict[str, tuple[str, Callable[[Settings], Figures]]] = {
    "latency": ("per call: aotstack vs plain AOTI package and eager (demo, BERT, Llama)", latency),
    "boundary": ("overhead per delegate boundary (1, 2, 4 delegates)", boundary),
    "compile": ("cold and warm compile vs aoti_compile_and_package, fresh processes", compile_times),
    "jobs": ("4 partitions compiled cold with jobs=1 and jobs=2", parallel_jobs),
    "explain": ("the dry run of 4 partitions vs their cold lower, fresh processes", dry_run_times),
    "auto": ("lower(program, 'auto') cold vs AOTInductor alone, and warm, on BERT, fresh processes", auto_times),
    "large": ("500 MB model: load + first call, peak memory, file size", large_model),
    "load": ("demo: load + first call in a fresh process vs aoti_load_package", load_times),
    "stacked": ("AOTInductor, ONNX Runtime and both stacked, per call", stacked),
    "decode": ("greedy decoding tokens/s vs plain AOTI, eager, torch.compile; memory", decode_rates),
    "vision-language": ("a prompt about an image (Qwen2.5-VL-style): first token and decode vs plain AOTI",
                        vision_language),
    "draw": ("graph picture: SVG of a 500- and a 2000-node method, median of 5 draws", draw_times),
    "peers": ("BERT, ResNet-50, Llama decode: aotstack vs plain AOTI, ONNX Runtime, OpenVINO, ExecuTorch, eager; "
              "1 and 2 threads, fp32 and bf16", peers),
    "quantized": ("Llama decode quantized (8w, 8da8w, 4w, 8da4w) vs fp32, every engine: tokens/s, file size, memory",
                  quantized_decode),
}
OPT_IN = ("quantized",)  # run only when named with --only


def git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def package_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as lines:
            return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    except OSError:
        return None


def memory_total() -> int | None:
    try:
        with open("/proc/meminfo") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None


def machine(settings: Settings) -> dict[str, Any]:
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model(),
        "memory_bytes": memory_total(),
        "load_average_at_start": os.getloadavg(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "onnxruntime": package_version("onnxruntime"),
        "aotstack": aotstack.__version__,
        "aotstack_commit": git("rev-parse", "HEAD"),
        "aotstack_tree_modified": None if status is None else bool(status),
        "torch_threads": settings.threads,
        "quick": settings.quick,
    }


def run_one(name: str, settings: Settings) -> dict[str, Any]:
    description, benchmark = BENCHMARKS[name]
    load_before = os.getloadavg()  # other work on the machine skews every timing: noted per benchmark
    started = time.perf_counter()
    try:
        figures = benchmark(settings)
        outcome: dict[str, Any] = {"status": "ok", "figures": {k: f.as_json() for k, f in figures.items()}}
    except Exception as exc:  # one broken benchmark must not lose the others' results
        traceback.print_exc()
        figures = {}
        outcome = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "figures": {}}
    outcome["description"] = description
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    outcome["load_average_before"] = load_before
    outcome["_figures"] = figures
    return outcome


def summary_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows: list[list[str]] = []
    for name, outcome in results.items():
        if outcome["status"] != "ok":
            rows.append([f"{name}: FAILED", "", "", "", "", outcome["error"][:60]])
        rows += figure_rows(outcome["_figures"], prefix=f"{name} | ")
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), metavar="NAME",
                        help=f"run only these benchmarks: {', '.join(BENCHMARKS)} "
                             f"({', '.join(OPT_IN)}: only when named)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and calls, for a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, here and in every child")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="the JSON results file (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (packages, caches)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    quiet_known_warnings()
    torch.set_num_threads(args.threads)
    names = args.only or [name for name in BENCHMARKS if name not in OPT_IN]
    started = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="aotstack-bench-")
    use_private_caches(scratch)
    settings = Settings(scratch, args.threads, args.quick)
    facts = machine(settings)
    print(f"torch {facts['torch']}, aotstack {facts['aotstack']} ({facts['aotstack_commit']}), "
          f"{facts['cpu_count']} CPUs, torch threads {args.threads}{', quick' if args.quick else ''}")
    print(f"scratch and private compile caches: {scratch}")
    results: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(names, 1):
        print(f"\n== [{index}/{len(names)}] {name}: {BENCHMARKS[name][0]}", flush=True)
        results[name] = run_one(name, settings)
        print(f"== {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s "
              f"(total {time.perf_counter() - started:.0f} s)", flush=True)
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    total = time.perf_counter() - started
    facts["load_average_at_end"] = os.getloadavg()
    facts["total_seconds"] = round(total, 1)

    print(f"\n== results ({total / 60:.1f} min)")
    print_table(FIGURE_HEADERS, summary_rows(results))
    checked = [f for outcome in results.values() for f in outcome["_figures"].values() if f.result]
    missed = [f"{b} | {n}" for b, o in results.items() for n, f in o["_figures"].items() if f.result == "miss"]
    print(f"\ntargets: {len(checked) - len(missed)} of {len(checked)} met" + (": missed " if missed else ""))
    for name in missed:
        print(f"  {name}")
    notes = [(b, n, f.note) for b, o in results.items() for n, f in o["_figures"].items() if f.note]
    if notes:
        print("notes:")
        for bench_name, name, note in notes:
            print(f"  {bench_name} | {name}: {note}")

    for outcome in results.values():
        del outcome["_figures"]
    document = {"machine": facts, "benchmarks": results,
                "summary": {"targets": len(checked), "met": len(checked) - len(missed), "missed": missed}}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as file:
        json.dump(document, file, indent=2)
        file.write("\n")
    print(f"\nwrote {args.output}")
    return 0 if all(outcome["status"] == "ok" for outcome in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
