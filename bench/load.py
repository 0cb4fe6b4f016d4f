"""Time from load to first result in a fresh process: aotstack beside raw AOTInductor, demo model.

The parent compiles both packages once; each child imports what it needs, builds its input, then
times only ``load`` plus the first ``forward`` call and prints ``<import ms> <load+first call ms>``.
Nothing is asserted.

    .venv/bin/python bench/load.py [--runs 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

import aotstack
from aotstack.demo import DEMO_EXCLUDED_OPS, demo_model
from common import (
    build_aotstack,
    build_raw_aoti,
    median,
    print_table,
    quiet_known_warnings,
    use_private_aotstack_cache,
    verdict,
)

TARGET_MS = 100.0

# argv: package path, thread count. Prints "<import ms> <load + first call ms>".
CHILD = """
import sys, time
started = time.perf_counter_ns()
import torch
{imports}
imported = time.perf_counter_ns()
from aotstack.demo import demo_model
torch.set_num_threads(int(sys.argv[2]))
image = demo_model()[1]["forward"][0]
begin = time.perf_counter_ns()
result = {load_and_call}
end = time.perf_counter_ns()
print((imported - started) / 1e6, (end - begin) / 1e6)
"""
# Each child imports, untimed, what its load needs: aotstack's runtime on one side, torch._inductor on the other.
AOTSTACK_CHILD = CHILD.format(imports="from aotstack import load", load_and_call="load(sys.argv[1]).forward(image)")
RAW_AOTI_CHILD = CHILD.format(
    imports="import aotstack, torch._inductor", load_and_call="torch._inductor.aoti_load_package(sys.argv[1])(image)"
)


def build_packages(directory: str) -> tuple[str, str, int]:
    model, inputs = demo_model()
    split, raw = os.path.join(directory, "demo.pt2"), os.path.join(directory, "demo-raw.pt2")
    started = time.perf_counter()
    delegates = build_aotstack(model, inputs["forward"], split, DEMO_EXCLUDED_OPS)
    build_raw_aoti(model, inputs["forward"], raw)
    print(f"compiled both packages in {time.perf_counter() - started:.1f} s", flush=True)
    return split, raw, delegates


def child_times(code: str, path: str, threads: int) -> tuple[float, float]:
    """One fresh process: (import ms, load + first call ms) from its last line."""
    done = subprocess.run([sys.executable, "-c", code, path, str(threads)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr}")
    import_ms, load_ms = done.stdout.strip().splitlines()[-1].split()
    return float(import_ms), float(load_ms)


def measure(split: str, raw: str, runs: int, threads: int) -> dict[str, list[tuple[float, float]]]:
    """Children alternate between the variants, so slow drift hits both alike."""
    variants = {"aotstack.load": (AOTSTACK_CHILD, split), "aoti_load_package": (RAW_AOTI_CHILD, raw)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, (code, path) in variants.items():
            times[name].append(child_times(code, path, threads))
    return times


def report(times: dict[str, list[tuple[float, float]]], delegates: int) -> None:
    load_ms = {name: [load for _, load in samples] for name, samples in times.items()}
    baseline = median(load_ms["aoti_load_package"])
    rows = [
        [
            name,
            str(len(samples)),
            f"{median([imp for imp, _ in samples]):.0f}",
            f"{median(load_ms[name]):.1f}",
            f"{min(load_ms[name]):.1f}",
            f"{max(load_ms[name]):.1f}",
            f"{median(load_ms[name]) / baseline:.2f}x",
        ]
        for name, samples in times.items()
    ]
    headers = ["variant", "runs", "import ms", "load+1st call ms", "min", "max", "/ raw AOTI"]
    print_table(headers, rows)
    ours = median(load_ms["aotstack.load"])
    print(f"\naotstack package: {delegates} delegates ({', '.join(DEMO_EXCLUDED_OPS)} between them in ATen)")
    print(f"aotstack load + first call = {ours:.1f} ms (target <= {TARGET_MS:g} ms: {verdict(ours, TARGET_MS)})")
    print("'import ms' (import torch + aotstack [+ torch._inductor]) is not part of the measured figure")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, for compiling and running")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet_known_warnings()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, aotstack {aotstack.__version__}, torch.get_num_threads() = {args.threads}")
    with tempfile.TemporaryDirectory(prefix="aotstack-bench-") as directory:
        use_private_aotstack_cache(directory)
        split, raw, delegates = build_packages(directory)
        report(measure(split, raw, args.runs, args.threads), delegates)


if __name__ == "__main__":
    main()
