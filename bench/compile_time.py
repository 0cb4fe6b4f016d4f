"""Compile time, each compile in a fresh process: cold and warm beside ``aoti_compile_and_package``, and jobs.

``compile``: the demo's ``forward``, all supported (one delegate).

- cold: a fresh Inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and a fresh aotstack cache
  (``AOTSTACK_CACHE_DIR``), new directories for each side and each repetition
- warm, "re-lowering unchanged": the same model again in a new process, with the caches the cold run filled

The figure compared is the step from an exported program to a file on disk: ``aotstack.lower`` plus
``save`` against ``aoti_compile_and_package`` (which writes its package). Export (``aotstack.export``
against ``torch.export.export``) is timed apart and reported. Each child imports torch, Inductor and
aotstack before its clock starts.

``explain``: the dry run (``aotstack.explain``) of the 4-partition ``jobs`` model against its cold
``lower`` with ``jobs=1``, each in a fresh process with fresh caches: how much sooner a user sees what a
compile would do.

``jobs``: a model of four ``Linear`` blocks of different widths with ``gelu`` between them, gelu excluded,
so four distinct AOTInductor partitions, lowered cold with ``lower(..., jobs=1)`` and ``jobs=2``. Where
``aotstack.lower`` takes no ``jobs`` keyword, that is recorded and only the default (sequential) lowering
is timed.

``auto``: ``lower(program, "auto")`` of the peers' BERT encoder cold, against a cold lower with AOTInductor
alone, and again with the caches it filled (its measurements are cached with the compiles).

    .venv/bin/python bench/compile_time.py [--quick] [--threads 1] [--only compile|jobs|explain|auto]
"""

from __future__ import annotations

import argparse
import inspect
import os
from typing import Any

import aotstack
from common import Figure, Figures, Settings, cache_env, median, progress, run_child, run_standalone
from workloads import JOBS_WIDTHS

COLD_TARGET = 1.10  # aotstack cold / aoti_compile_and_package cold
AUTO_COLD_TARGET = 2.0  # lower(program, "auto") cold / lower with AOTInductor alone, cold
RELOWER_TARGET = 0.05  # re-lowering unchanged / cold
JOBS_TARGET = 0.65  # jobs=2 / jobs=1


def compile_child(
    settings: Settings, kind: str, workload: str, caches: str, exclude: tuple[str, ...] = (), jobs: int | None = None
) -> dict[str, Any]:
    """One compile in a fresh process, with its compile caches under ``settings.path(caches)``."""
    package = settings.path(f"{caches}-{kind}.pt2")
    args = ["compile", kind, workload, package, str(settings.threads)]
    if exclude:
        args += ["--exclude", *exclude]
    if jobs is not None:
        args += ["--jobs", str(jobs)]
    result = run_child(args, env=cache_env(settings.path(caches)))
    result["to_file_s"] = result["compile_s"] + result["save_s"]
    result["total_s"] = result["export_s"] + result["to_file_s"]
    return result


def describe(label: str, result: dict[str, Any]) -> str:
    partitions = ""
    if len(result.get("partition_s", [])) > 1:
        each = ", ".join(f"{seconds:.0f}" for seconds in result["partition_s"])
        partitions = f" (partitions {each} s; {result['workers']} worker process(es))"
    return (
        f"{label}: export {result['export_s']:.1f} s, compile {result['compile_s']:.1f} s{partitions}, "
        f"save {result['save_s']:.2f} s, CPU {result['cpu_s']:.0f} s, load average {os.getloadavg()[0]:.1f}"
    )


def compile_times(settings: Settings) -> Figures:
    runs = settings.pick(2, 1)
    samples: dict[str, list[dict[str, Any]]] = {"aoti cold": [], "aoti warm": [], "aotstack cold": [],
                                                "aotstack warm": []}
    for run in range(runs):
        sides = ["aoti", "aotstack"] if run % 2 == 0 else ["aotstack", "aoti"]  # alternate who goes first
        for kind in sides:
            # warm: the same caches the cold run just filled; plain AOTI's warm time, for comparison, once
            for state in ("cold", "warm") if kind == "aotstack" or run == 0 else ("cold",):
                progress(f"run {run + 1}/{runs}: {kind} {state} compile of the demo in a fresh process ...")
                result = compile_child(settings, kind, "demo", f"compile-{kind}-{run}")
                samples[f"{kind} {state}"].append(result)
                progress(describe(f"{kind} {state}", result))

    def typical(name: str, key: str) -> float:
        return median([sample[key] for sample in samples[name]])

    cold, raw_cold = typical("aotstack cold", "to_file_s"), typical("aoti cold", "to_file_s")
    runs_note = f"median of {runs} fresh-process run(s)"
    return {
        "cold: aotstack lower+save / aoti_compile_and_package": Figure(
            cold, "s", raw_cold, COLD_TARGET, note=f"demo forward, fresh caches; {runs_note}"
        ),
        "re-lower unchanged (warm caches) / cold lower+save": Figure(
            typical("aotstack warm", "to_file_s"), "s", cold, RELOWER_TARGET, note="a fresh process, caches kept"
        ),
        "cold incl. export: aotstack / torch.export + aoti_compile_and_package": Figure(
            typical("aotstack cold", "total_s"), "s", typical("aoti cold", "total_s")
        ),
        "warm incl. export: aotstack / its cold": Figure(
            typical("aotstack warm", "total_s"), "s", typical("aotstack cold", "total_s"),
            note="re-export is the user's step and is not cached",
        ),
        "export: aotstack.export / torch.export.export": Figure(
            typical("aotstack cold", "export_s"), "s", typical("aoti cold", "export_s")
        ),
        "warm aoti_compile_and_package / its cold": Figure(
            typical("aoti warm", "to_file_s"), "s", raw_cold, note="Inductor's own caches warm; for comparison"
        ),
    }


def auto_times(settings: Settings) -> Figures:
    """Auto-lowering's cost: cold against AOTInductor alone, and warm against its own cold, fresh processes.

    The peers benchmark's BERT encoder (``--quick``: its small one), where the engines differ most.
    """
    workload = settings.pick("peer_bert", "peer_bert_quick")
    progress(f"{workload}: AOTInductor alone, cold caches ...")
    alone = compile_child(settings, "aotstack", workload, "auto-alone")
    progress(describe("AOTInductor alone, cold", alone))
    progress(f"{workload}: auto, cold caches ...")
    cold = compile_child(settings, "auto", workload, "auto")
    progress(describe("auto, cold", cold))
    progress(f"{workload}: auto again, the caches it filled ...")
    warm = compile_child(settings, "auto", workload, "auto")
    progress(describe("auto, warm", warm))
    return {
        "auto cold lower+save / AOTInductor alone cold": Figure(
            cold["to_file_s"], "s", alone["to_file_s"], AUTO_COLD_TARGET,
            note=f"{workload}; auto lowers and times one plan per installed engine",
        ),
        "auto re-lower unchanged / auto cold": Figure(
            warm["to_file_s"], "s", cold["to_file_s"], RELOWER_TARGET, note="measurements read from the cache"
        ),
    }


def jobs_supported() -> bool:
    return "jobs" in inspect.signature(aotstack.lower).parameters


def parallel_jobs(settings: Settings) -> Figures:
    exclude = ("aten.gelu",)
    partitions = len(JOBS_WIDTHS) - 1
    if not jobs_supported():
        progress("aotstack.lower takes no jobs= keyword: timing the default (sequential) lowering only")
        result = compile_child(settings, "aotstack", "jobs_chain", "jobs-default", exclude)
        progress(describe("default", result))
        return {
            f"{partitions} partitions cold, default lowering": Figure(result["compile_s"], "s"),
            "cold lower: jobs=2 / jobs=1": Figure(
                None, "s", target=JOBS_TARGET, note="jobs unsupported: aotstack.lower has no jobs= keyword here"
            ),
        }
    runs = 1  # a pair of cold four-partition lowerings costs minutes on two cores
    times: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    each: dict[int, str] = {}  # the last run's seconds per partition
    for run in range(runs):
        for jobs in (1, 2) if run % 2 == 0 else (2, 1):
            progress(f"run {run + 1}/{runs}: {partitions} partitions, cold caches, jobs={jobs} ...")
            result = compile_child(settings, "aotstack", "jobs_chain", f"jobs-{jobs}-{run}", exclude, jobs)
            if result["delegates"] != partitions:
                raise RuntimeError(f"expected {partitions} delegates, got {result['delegates']}")
            times[jobs].append(result["compile_s"])
            cpu[jobs].append(result["cpu_s"])
            each[jobs] = ", ".join(f"{seconds:.0f}" for seconds in result.get("partition_s", []))
            progress(describe(f"jobs={jobs}", result))
    return {
        "cold lower: jobs=2 / jobs=1": Figure(
            median(times[2]), "s", median(times[1]), JOBS_TARGET,
            note=f"{partitions} distinct partitions, fresh caches each run; median of {runs} run(s); seconds per "
            f"partition: jobs=1 {each[1]}, jobs=2 {each[2]}",
        ),
        "cold lower, CPU seconds: jobs=2 / jobs=1": Figure(
            median(cpu[2]), "s", median(cpu[1]), note="the child's CPU time, compile workers and compilers included"
        ),
    }


def dry_run_times(settings: Settings) -> Figures:
    """``aotstack.explain`` against a cold ``lower(jobs=1)`` of the same 4-partition model, fresh processes."""
    exclude = ("aten.gelu",)
    progress("the dry run of the 4-partition model, fresh caches ...")
    planned = compile_child(settings, "explain", "jobs_chain", "explain", exclude)
    progress(f"dry run: export {planned['export_s']:.1f} s, explain {planned['compile_s']:.2f} s")
    progress("a cold lower of the same model, jobs=1 ...")
    lowered = compile_child(settings, "aotstack", "jobs_chain", "explain-lower", exclude, 1)
    progress(describe("lower jobs=1", lowered))
    if planned["delegates"] != lowered["delegates"]:
        raise RuntimeError(f"the dry run planned {planned['delegates']} delegates, lower made {lowered['delegates']}")
    return {
        "dry run (explain) / cold lower": Figure(
            planned["compile_s"], "s", lowered["compile_s"],
            note=f"{lowered['delegates']} partitions, export excluded ({planned['export_s']:.1f} s); the dry run "
            "partitions as lower does and compiles nothing",
        ),
    }


def main() -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--only", choices=["compile", "jobs", "explain", "auto"], default=None)

    def both(settings: Settings, only: str | None) -> Figures:
        figures: Figures = {}
        if only in (None, "compile"):
            figures.update(compile_times(settings))
        if only in (None, "jobs"):
            figures.update(parallel_jobs(settings))
        if only in (None, "explain"):
            figures.update(dry_run_times(settings))
        if only in (None, "auto"):
            figures.update(auto_times(settings))
        return figures

    run_standalone(__doc__, both, extra=options)


if __name__ == "__main__":
    main()
