"""Per-call latency of a loaded aotstack package beside raw AOTInductor and eager PyTorch.

Every variant is timed call by call (``time.perf_counter_ns``), round-robin (one call of each per
round, in a shuffled order) in one process, so the ratios compare like with like; the absolute figures
depend on the machine. Nothing is asserted.

    .venv/bin/python bench/latency.py [--calls 2000] [--warmup 100] [--threads 1]
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


def aotstack_variant(
    name: str, model: torch.nn.Module, args: tuple[Any, ...], path: str, exclude_ops: list[str]
) -> Variant:
    delegates = build_aotstack(model, args, path, exclude_ops)
    loaded = aotstack.load(path)
    return Variant(name, lambda: loaded.forward(*args), delegates)


def raw_aoti_variants(model: torch.nn.Module, args: tuple[Any, ...], path: str) -> list[Variant]:
    """The package as loaded, and its loader's bare ``run`` (no per-call treespec parsing, no pytree)."""
    build_raw_aoti(model, args, path)
    compiled = torch._inductor.aoti_load_package(path)
    flat = list(args)
    return [
        Variant(RAW, lambda: compiled(*args)),
        Variant(RAW_RUNNER, lambda: compiled.loader.run(flat)[0]),
    ]


def build_variants(
    label: str, model: torch.nn.Module, args: tuple[Any, ...], exclude_ops: list[str], directory: str
) -> dict[str, Variant]:
    """aotstack as asked, aotstack unsplit (where ops are excluded), raw AOTI (two ways), eager."""
    started = time.perf_counter()
    variants = [aotstack_variant(AOTSTACK, model, args, os.path.join(directory, f"{label}.pt2"), exclude_ops)]
    if exclude_ops:
        variants.append(aotstack_variant(UNSPLIT, model, args, os.path.join(directory, f"{label}-unsplit.pt2"), []))
    variants += raw_aoti_variants(model, args, os.path.join(directory, f"{label}-raw.pt2"))
    packages = len(variants) - 1  # the two raw AOTI variants share one package
    print(f"  compiled {packages} packages in {time.perf_counter() - started:.1f} s", flush=True)
    variants.append(Variant(EAGER, eager_call(model, args)))
    return {v.name: v for v in variants}


def check_outputs(variants: dict[str, Variant]) -> float:
    """The worst difference from eager over the other variants."""
    expected = variants[EAGER].call()
    return max((v.call() - expected).abs().max().item() for v in variants.values())


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


def run_mlp(directory: str, calls: int, warmup: int) -> None:
    print("\n(a) all-supported MLP 64-256-256-10, batch 8, AotiCpuPartitioner()", flush=True)
    model, args = mlp()
    variants = build_variants("mlp", model, args, [], directory)
    print(f"  worst |variant - eager| = {check_outputs(variants):.2e}")
    measure(list(variants.values()), calls, warmup)
    report(list(variants.values()), variants[RAW], variants[RAW_RUNNER], variants[EAGER])
    summarize_all_supported(variants)


def run_demo(directory: str, calls: int, warmup: int) -> None:
    print(f"\n(b) demo model forward, AotiCpuPartitioner(exclude_ops={DEMO_EXCLUDED_OPS})", flush=True)
    model, args = demo()
    variants = build_variants("demo", model, args, DEMO_EXCLUDED_OPS, directory)
    print(f"  worst |variant - eager| = {check_outputs(variants):.2e}")
    # What the split package runs between its delegates, timed on its own in the same rounds.
    gelu_input = torch.randn(args[0].shape[0], model.proj.out_features)
    excluded_op = Variant("aten.gelu alone (4x64)", lambda: torch.ops.aten.gelu.default(gelu_input))
    timed = [*variants.values(), excluded_op]
    measure(timed, calls, warmup)
    report(timed, variants[RAW], variants[RAW_RUNNER], variants[EAGER])
    summarize_split(variants, excluded_op)


def parse_args() -> argparse.Namespace:
    parser = round_robin_parser(__doc__)
    parser.add_argument("--model", choices=["mlp", "demo", "both"], default="both")
    return parsed_round_robin_args(parser)


def main() -> None:
    args = parse_args()
    quiet_known_warnings()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, aotstack {aotstack.__version__}, torch.get_num_threads() = {args.threads}")
    print(f"{args.calls} timed rounds after {args.warmup} warm-up rounds; one call per variant per round, shuffled")
    with tempfile.TemporaryDirectory(prefix="aotstack-bench-") as directory:
        use_private_aotstack_cache(directory)
        if args.model in ("mlp", "both"):
            run_mlp(directory, args.calls, args.warmup)
        if args.model in ("demo", "both"):
            run_demo(directory, args.calls, args.warmup)


if __name__ == "__main__":
    main()
