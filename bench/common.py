"""Helpers shared by the benchmarks: building the packages, a few statistics, a plain-text table."""

from __future__ import annotations

import argparse
import os
import statistics
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import aotstack


def quiet_known_warnings() -> None:
    """torch warns about its own deprecated LeafSpec while AOTInductor deep-copies a program."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)


def use_private_aotstack_cache(directory: str) -> None:
    """Send aotstack's compile cache to ``directory``.

    Inductor specialises CPU kernels on ``torch.get_num_threads()``, but aotstack's own library cache
    is keyed without it, so a library compiled earlier under another thread count could come back.
    """
    os.environ["AOTSTACK_CACHE_DIR"] = os.path.join(directory, "aotstack-cache")


def build_aotstack(model: torch.nn.Module, args: tuple[Any, ...], path: str, exclude_ops: Sequence[str] = ()) -> int:
    """Lower ``model.forward`` with the AOTI CPU partitioner, save it to ``path``; the delegate count."""
    return len(build_lowered(model, args, path, [aotstack.AotiCpuPartitioner(exclude_ops=list(exclude_ops))]))


def build_lowered(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    path: str,
    partitioners: Sequence[aotstack.Partitioner],
    keep_on_device: bool = False,
) -> list[aotstack.Delegate]:
    """Lower ``model.forward`` with ``partitioners`` in order, save it to ``path``; its delegates.

    ``keep_on_device``: the method takes and returns tensors on its delegates' device.
    """
    program = aotstack.export(model, {"forward": args})
    lowered = aotstack.lower(
        program,
        list(partitioners),
        skip_h2d_for_method_inputs=keep_on_device,
        skip_d2h_for_method_outputs=keep_on_device,
    )
    lowered.save(path)
    return lowered.delegates("forward")


def build_raw_aoti(model: torch.nn.Module, args: tuple[Any, ...], path: str) -> None:
    """The baseline: the whole model through stock ``aoti_compile_and_package``."""
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(torch.export.export(model, args), package_path=path)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-align the first column, right-align the others."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        return "  ".join([first, *(str(c).rjust(w) for c, w in zip(cells[1:], widths[1:]))])

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def verdict(value: float, limit: float) -> str:
    return "met" if value <= limit else "NOT met"


def round_robin_parser(description: str | None) -> argparse.ArgumentParser:
    """The options every round-robin benchmark takes: --calls, --warmup, --threads."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="timed rounds (one call per variant each)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, for compiling and running")
    return parser


def parsed_round_robin_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if args.calls < 200:
        parser.error("--calls must be at least 200")
    return args
