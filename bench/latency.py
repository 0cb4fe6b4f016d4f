"""Per-call latency of a loaded aotstack package beside the plain AOTInductor package and eager PyTorch.

Models: the demo's ``forward``, and two ``transformers`` models of the test corpus (``tests/hf_models.py``:
BERT, an encoder; Llama, a decoder LM; small configs, random weights). Variants of each:

- aotstack:            ``lower(..., [AotiCpuPartitioner()])`` (nothing excluded: one delegate), saved, ``load``
- aotstack, split:     the demo with ``aten.gelu`` excluded (two delegates, gelu in plain ATen); extra information
- plain AOTI:          ``aoti_compile_and_package`` + ``aoti_load_package``, called as a user calls it
                       (pytree in and out). **The target ratio (aotstack / plain AOTI <= 1.02) uses this one.**
- plain AOTI loader.run: that package's runner called with a flat list, no pytree: a stricter floor, reported
- eager (no_grad)

The per-call overhead figure is aotstack's median less the bare runner's (``loader.run``): what a call
pays for checking its inputs, the pytree, the plan's steps and the layout checks (target: at most 10 µs).
``--model mlp`` is the tiny model it is meant for.

Every variant is timed call by call (``time.perf_counter_ns``), round-robin (one call of each per
round, in a shuffled order) in one process, so the ratios compare like with like; the absolute figures
depend on the machine. Nothing is asserted.

    .venv/bin/python bench/latency.py [--model demo bert llama mlp] [--calls 2000] [--warmup 100] [--threads 1]
                                      [--device cpu|cuda]

On ``--device cuda`` the package is lowered with ``CudaPartitioner`` (autotuning off, as for the raw
AOTInductor baseline) and takes and returns GPU tensors; each timed call ends with
``torch.cuda.synchronize()``, so a figure is a call's latency, not its launch time.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import aotstack
from aotstack.demo import DEMO_EXCLUDED_OPS
from common import (
    EAGER,
    Figure,
    Figures,
    Settings,
    Variant,
    build_aotstack,
    build_lowered,
    build_raw_aoti,
    eager_call,
    measure,
    percentile,
    print_table,
    progress,
    run_standalone,
)
from workloads import WORKLOADS, weights_bytes

RATIO_TARGET = 1.02  # an all-supported model: aotstack / plain AOTI package, per call
# What one aotstack call adds to the library's own run (its runner called with a flat list), in µs.
OVERHEAD_TARGET_US = 10.0

AOTSTACK = "aotstack"
SPLIT = "aotstack, split"
RAW = "plain AOTI"
RAW_RUNNER = "plain AOTI loader.run"

MODELS = ("demo", "bert", "llama", "mlp")
SUITE_MODELS = ("demo", "bert", "llama", "mlp")
SPLITS = {"demo": DEMO_EXCLUDED_OPS}  # models also timed with these ops excluded


def synchronized(call: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``call``, finished on the GPU before it returns, where ``device`` is one."""
    if device == "cpu":
        return call

    def finished() -> Any:
        result = call()
        torch.cuda.synchronize()
        return result

    return finished


def aotstack_variant(
    name: str, model: torch.nn.Module, args: tuple[Any, ...], path: str, exclude_ops: Sequence[str], device: str
) -> Variant:
    if device == "cpu":
        delegates = build_aotstack(model, args, path, exclude_ops)
    else:
        # Exported on the host as usual; the package takes and returns GPU tensors.
        quick = aotstack.CompileSpec("autotune", b"OFF")
        partitioner = aotstack.CudaPartitioner(list(exclude_ops), [quick])
        delegates = len(build_lowered(model, args, path, [partitioner], keep_on_device=True))
    loaded = aotstack.load(path)
    on_device = tuple(arg.to(device) for arg in args)
    return Variant(name, synchronized(lambda: loaded.forward(*on_device), device), delegates)


def raw_aoti_variants(model: torch.nn.Module, args: tuple[Any, ...], path: str, device: str) -> list[Variant]:
    """The package as loaded, and its loader's bare ``run`` (no per-call treespec parsing, no pytree)."""
    model, args = model.to(device), tuple(arg.to(device) for arg in args)
    build_raw_aoti(model, args, path)
    compiled = torch._inductor.aoti_load_package(path)
    flat = list(args)
    return [
        Variant(RAW, synchronized(lambda: compiled(*args), device)),
        Variant(RAW_RUNNER, synchronized(lambda: compiled.loader.run(flat)[0], device)),
    ]


def build_variants(
    label: str, model: torch.nn.Module, args: tuple[Any, ...], directory: str, device: str
) -> dict[str, Variant]:
    """aotstack with nothing excluded, aotstack split (where the model has a split), plain AOTI two ways, eager."""
    started = time.perf_counter()
    variants = [aotstack_variant(AOTSTACK, model, args, os.path.join(directory, f"{label}.pt2"), [], device)]
    if label in SPLITS:
        path = os.path.join(directory, f"{label}-split.pt2")
        variants.append(aotstack_variant(SPLIT, model, args, path, SPLITS[label], device))
    variants += raw_aoti_variants(model, args, os.path.join(directory, f"{label}-raw.pt2"), device)
    packages = len(variants) - 1  # the two raw AOTI variants share one package
    progress(f"{label}: compiled {packages} packages in {time.perf_counter() - started:.1f} s")
    on_device = tuple(arg.to(device) for arg in args)
    variants.append(Variant(EAGER, synchronized(eager_call(model.to(device), on_device), device)))
    return {v.name: v for v in variants}


def check_outputs(variants: dict[str, Variant]) -> float:
    """The worst difference from eager over the other variants."""
    expected = first_output(variants[EAGER].call())
    return max((first_output(v.call()) - expected).abs().max().item() for v in variants.values())


def first_output(result: Any) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result[0]


def report(variants: Sequence[Variant], raw: Variant, runner: Variant, eager: Variant) -> None:
    rows = [
        [
            v.name,
            "-" if v.delegates is None else str(v.delegates),
            f"{v.median_us:.1f}",
            f"{percentile(v.samples_ns, 0.1) / 1e3:.1f}",
            f"{percentile(v.samples_ns, 0.9) / 1e3:.1f}",
            f"{v.median_us / raw.median_us:.3f}x",
            f"{v.median_us / runner.median_us:.3f}x",
            f"{v.median_us / eager.median_us:.3f}x",
        ]
        for v in variants
    ]
    headers = ["variant", "delegates", "median µs", "p10 µs", "p90 µs", "/ plain AOTI", "/ loader.run", "/ eager"]
    print_table(headers, rows)


def model_latency(label: str, settings: Settings, device: str = "cpu") -> Figures:
    """One model's variants, built, checked against eager, timed round-robin; its figures."""
    model, args = WORKLOADS[label]()
    progress(f"{label}: compiling aotstack and plain AOTI packages ...")
    variants = build_variants(label, model, args, settings.workdir, device)
    progress(f"{label}: worst |variant - eager| = {check_outputs(variants):.2e}; timing ...")
    calls, warmup = settings.rounds()
    measure(list(variants.values()), calls, warmup)
    report(list(variants.values()), variants[RAW], variants[RAW_RUNNER], variants[EAGER])
    ours, raw = variants[AOTSTACK].median_us, variants[RAW].median_us
    figures = {
        f"{label}: aotstack / plain AOTI, per call": Figure(ours, "µs", raw, RATIO_TARGET),
        f"{label}: aotstack / plain AOTI loader.run": Figure(
            ours, "µs", variants[RAW_RUNNER].median_us, note="the runner with a flat list, no pytree: stricter"
        ),
        f"{label}: aotstack / eager": Figure(ours, "µs", variants[EAGER].median_us),
        f"{label}: per-call overhead over loader.run": Figure(
            ours - variants[RAW_RUNNER].median_us,
            "µs",
            target=OVERHEAD_TARGET_US,
            note="input checks, pytree, plan steps, layout checks: what aotstack adds to the library's run",
        ),
    }
    if SPLIT in variants:
        split = variants[SPLIT]
        figures[f"{label}: aotstack split ({split.delegates} delegates) / plain AOTI"] = Figure(
            split.median_us, "µs", raw, note=f"{', '.join(SPLITS[label])} excluded, run as plain ATen; information"
        )
    if label == "demo":
        figures[f"{label}: file size / weights"] = Figure(
            os.path.getsize(os.path.join(settings.workdir, f"{label}.pt2")) / 1e6,
            "MB",
            weights_bytes(model) / 1e6,
            note="all-supported demo forward; a small model's file is mostly its compiled library",
        )
    return figures


def latency(settings: Settings, model: Sequence[str] = SUITE_MODELS, device: str = "cpu") -> Figures:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU, and this machine has none")
    if device == "cuda":
        print(f"  device: {torch.cuda.get_device_name()}")
    calls, warmup = settings.rounds()
    print(f"  {calls} timed rounds after {warmup} warm-up rounds; one call per variant per round, shuffled")
    figures: Figures = {}
    for label in model:
        figures.update(model_latency(label, settings, device))
    return figures


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", nargs="+", choices=MODELS, default=list(SUITE_MODELS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")


def main() -> None:
    run_standalone(__doc__, latency, round_robin=True, extra=options)


if __name__ == "__main__":
    main()
