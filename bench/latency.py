"""Per-call latency of a loaded aotstack package beside raw AOTInductor and eager PyTorch.

Every variant is timed call by call (``time.perf_counter_ns``), round-robin (one call of each per
round, in a shuffled order) in one process, so the ratios compare like with like; the absolute figures
depend on the machine. Nothing is asserted.

    .venv/bin/python bench/latency.py [--calls 2000] [--warmup 100] [--threads 1] [--device cpu|cuda]

On ``--device cuda`` the package is lowered with ``CudaPartitioner`` (autotuning off, as for the raw
AOTInductor baseline) and takes and returns GPU tensors; each timed call ends with
``torch.cuda.synchronize()``, so a figure is a call's latency, not its launch time.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import aotstack
from aotstack.demo import DEMO_EXCLUDED_OPS, demo_model
from common import (
    build_aotstack,
    build_lowered,
    build_raw_aoti,
    median,
    parsed_round_robin_args,
    percentile,
    print_table,
    quiet_known_warnings,
    round_robin_parser,
    use_private_aotstack_cache,
    verdict,
)

RATIO_TARGET = 1.05  # all-supported model: aotstack / raw AOTI
BOUNDARY_TARGET_US = 15.0  # overhead per delegate boundary

AOTSTACK = "aotstack"
UNSPLIT = "aotstack, nothing excluded"
RAW = "raw AOTI"
RAW_RUNNER = "raw AOTI loader.run"
EAGER = "eager (no_grad)"


@dataclass
class Variant:
    name: str
    call: Callable[[], Any]
    delegates: int | None = None  # None: not an aotstack package
    samples_ns: list[int] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return median(self.samples_ns) / 1e3


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    return model.eval(), (torch.randn(8, 64),)


def demo() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = demo_model()
    return model, inputs["forward"]


def eager_call(model: torch.nn.Module, args: tuple[Any, ...]) -> Callable[[], Any]:
    def call() -> Any:
        with torch.no_grad():
            return model(*args)

    return call


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
    name: str, model: torch.nn.Module, args: tuple[Any, ...], path: str, exclude_ops: list[str], device: str
) -> Variant:
    if device == "cpu":
        delegates = build_aotstack(model, args, path, exclude_ops)
    else:
        # Exported on the host as usual; the package takes and returns GPU tensors.
        quick = aotstack.CompileSpec("autotune", b"OFF")
        partitioner = aotstack.CudaPartitioner(exclude_ops, [quick])
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
    label: str, model: torch.nn.Module, args: tuple[Any, ...], exclude_ops: list[str], directory: str, device: str
) -> dict[str, Variant]:
    """aotstack as asked, aotstack unsplit (where ops are excluded), raw AOTI (two ways), eager."""
    started = time.perf_counter()
    path = os.path.join(directory, f"{label}.pt2")
    variants = [aotstack_variant(AOTSTACK, model, args, path, exclude_ops, device)]
    if exclude_ops:
        path = os.path.join(directory, f"{label}-unsplit.pt2")
        variants.append(aotstack_variant(UNSPLIT, model, args, path, [], device))
    variants += raw_aoti_variants(model, args, os.path.join(directory, f"{label}-raw.pt2"), device)
    packages = len(variants) - 1  # the two raw AOTI variants share one package
    print(f"  compiled {packages} packages in {time.perf_counter() - started:.1f} s", flush=True)
    on_device = tuple(arg.to(device) for arg in args)
    variants.append(Variant(EAGER, synchronized(eager_call(model.to(device), on_device), device)))
    return {v.name: v for v in variants}


def check_outputs(variants: dict[str, Variant]) -> float:
    """The worst difference from eager over the other variants."""
    expected = first_output(variants[EAGER].call())
    return max((first_output(v.call()) - expected).abs().max().item() for v in variants.values())


def first_output(result: Any) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result[0]


def measure(variants: list[Variant], calls: int, warmup: int, seed: int = 0) -> None:
    """One call of each variant per round, in a shuffled order (seeded); warm-up rounds are dropped.

    Shuffling keeps a variant from always following the same neighbour, whose caches it would inherit.
    """
    order = list(variants)
    shuffle = random.Random(seed).shuffle
    gc.collect()
    gc.disable()
    try:
        for round_index in range(warmup + calls):
            shuffle(order)
            for variant in order:
                started = time.perf_counter_ns()
                variant.call()
                elapsed = time.perf_counter_ns() - started
                if round_index >= warmup:
                    variant.samples_ns.append(elapsed)
    finally:
        gc.enable()


def report(variants: list[Variant], raw: Variant, runner: Variant, eager: Variant) -> None:
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
    headers = ["variant", "delegates", "median µs", "p10 µs", "p90 µs", "/ raw AOTI", "/ loader.run", "/ eager"]
    print_table(headers, rows)


def ratio_line(label: str, value: float, target: float | None = None) -> None:
    goal = "" if target is None else f"  (target <= {target:g}x: {verdict(value, target)})"
    print(f"  {label} = {value:.3f}x{goal}")


def boundary_line(label: str, value: float) -> None:
    print(f"  {label} = {value:.1f} µs  (target <= {BOUNDARY_TARGET_US:g} µs: {verdict(value, BOUNDARY_TARGET_US)})")


def summarize_all_supported(variants: dict[str, Variant]) -> None:
    package, raw, runner = variants[AOTSTACK], variants[RAW], variants[RAW_RUNNER]
    n = package.delegates
    ratio_line("aotstack / raw AOTI", package.median_us / raw.median_us, RATIO_TARGET)
    ratio_line("aotstack / raw AOTI loader.run (stricter)", package.median_us / runner.median_us, RATIO_TARGET)
    ratio_line("aotstack / eager", package.median_us / variants[EAGER].median_us)
    boundary_line(
        f"overhead per delegate boundary = (aotstack - raw AOTI) / {n}", (package.median_us - raw.median_us) / n
    )
    boundary_line(f"  stricter, (aotstack - raw AOTI loader.run) / {n}", (package.median_us - runner.median_us) / n)


def summarize_split(variants: dict[str, Variant], excluded_op: Variant) -> None:
    package, unsplit = variants[AOTSTACK], variants[UNSPLIT]
    raw, runner = variants[RAW], variants[RAW_RUNNER]
    n, extra = package.delegates, package.delegates - unsplit.delegates
    ratio_line("aotstack / raw AOTI", package.median_us / raw.median_us)
    ratio_line("aotstack / eager", package.median_us / variants[EAGER].median_us)
    print(
        f"  (aotstack - raw AOTI) / {n} delegates = {(package.median_us - raw.median_us) / n:.1f} µs"
        "  (includes the excluded op, run eagerly here, compiled in by raw AOTI)"
    )
    split_cost = package.median_us - unsplit.median_us
    boundary_line(f"overhead per delegate boundary = (aotstack - unsplit) / {extra} extra", split_cost / extra)
    boundary_line(
        f"  less the excluded op timed alone ({excluded_op.median_us:.1f} µs)",
        (split_cost - excluded_op.median_us) / extra,
    )
    single = unsplit.delegates
    boundary_line(f"unsplit: (aotstack - raw AOTI) / {single}", (unsplit.median_us - raw.median_us) / single)
    boundary_line(
        f"unsplit: (aotstack - raw AOTI loader.run) / {single}", (unsplit.median_us - runner.median_us) / single
    )


def run_mlp(directory: str, calls: int, warmup: int, device: str) -> None:
    print(f"\n(a) all-supported MLP 64-256-256-10, batch 8, {partitioner_name(device)}()", flush=True)
    model, args = mlp()
    variants = build_variants("mlp", model, args, [], directory, device)
    print(f"  worst |variant - eager| = {check_outputs(variants):.2e}")
    measure(list(variants.values()), calls, warmup)
    report(list(variants.values()), variants[RAW], variants[RAW_RUNNER], variants[EAGER])
    summarize_all_supported(variants)


def run_demo(directory: str, calls: int, warmup: int, device: str) -> None:
    print(f"\n(b) demo model forward, {partitioner_name(device)}(exclude_ops={DEMO_EXCLUDED_OPS})", flush=True)
    if device != "cpu":
        print("  the excluded op runs as plain ATen on the host, so its input and output cross to it and back")
    model, args = demo()
    variants = build_variants("demo", model, args, DEMO_EXCLUDED_OPS, directory, device)
    print(f"  worst |variant - eager| = {check_outputs(variants):.2e}")
    # What the split package runs between its delegates, timed on its own in the same rounds.
    gelu_input = torch.randn(args[0].shape[0], model.proj.out_features)  # on the host, where it runs
    excluded_op = Variant("aten.gelu alone (4x64)", lambda: torch.ops.aten.gelu.default(gelu_input))
    timed = [*variants.values(), excluded_op]
    measure(timed, calls, warmup)
    report(timed, variants[RAW], variants[RAW_RUNNER], variants[EAGER])
    summarize_split(variants, excluded_op)


def parse_args() -> argparse.Namespace:
    parser = round_robin_parser(__doc__)
    parser.add_argument("--model", choices=["mlp", "demo", "both"], default="both")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parsed_round_robin_args(parser)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and this machine has none")
    return args


def partitioner_name(device: str) -> str:
    return "AotiCpuPartitioner" if device == "cpu" else "CudaPartitioner"


def main() -> None:
    args = parse_args()
    quiet_known_warnings()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, aotstack {aotstack.__version__}, torch.get_num_threads() = {args.threads}")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}")
    print(f"{args.calls} timed rounds after {args.warmup} warm-up rounds; one call per variant per round, shuffled")
    with tempfile.TemporaryDirectory(prefix="aotstack-bench-") as directory:
        use_private_aotstack_cache(directory)
        if args.model in ("mlp", "both"):
            run_mlp(directory, args.calls, args.warmup, args.device)
        if args.model in ("demo", "both"):
            run_demo(directory, args.calls, args.warmup, args.device)


if __name__ == "__main__":
    main()
