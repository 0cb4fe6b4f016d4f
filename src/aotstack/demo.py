"""The bundled demo: a small image model with two methods, one op left to plain ATen."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# GELU runs as a plain ATen op, so each method splits into two AOTInductor partitions.
DEMO_EXCLUDED_OPS = ["aten.gelu"]


class DemoModel(torch.nn.Module):
    """Conv features, a projection, GELU, a norm; ``forward`` adds a classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.proj = torch.nn.Linear(8 * 8 * 8, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 10)

    def embed(self, image: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(image)).flatten(1)
        return self.norm(torch.nn.functional.gelu(self.proj(features)))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(self.embed(image)), dim=-1)


def demo_model() -> tuple[torch.nn.Module, dict[str, tuple[Any, ...]]]:
    """The demo model (seeded, so every process builds the same one) and its example inputs."""
    torch.manual_seed(0)
    model = DemoModel().eval()
    image = torch.randn(4, 3, 8, 8)
    return model, {"forward": (image,), "embed": (image,)}


def compile_demo(path: str) -> None:
    import aotstack

    model, inputs = demo_model()
    program = aotstack.export(model, inputs)
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner(exclude_ops=DEMO_EXCLUDED_OPS)])
    lowered.save(path)


def check_package(path: str, calls: int = 200) -> float:
    """Load ``path``, run both methods, compare with eager, print what ran where; the worst difference."""
    import aotstack

    started = time.perf_counter()
    loaded = aotstack.load(path)
    print(f"loaded {path} in {(time.perf_counter() - started) * 1e3:.1f} ms")
    model, inputs = demo_model()
    worst = 0.0
    with torch.no_grad():
        for name in loaded.method_names:
            args = inputs[name]
            result = loaded.run(name, *args)
            difference = (result - getattr(model, name)(*args)).abs().max().item()
            worst = max(worst, difference)
            started = time.perf_counter()
            for _ in range(calls):
                loaded.run(name, *args)
            per_call = (time.perf_counter() - started) / calls * 1e6
            print(f"\n{name}: max |aotstack - eager| = {difference:.2e}, {per_call:.1f} µs per call")
            for line in describe_method(path, name):
                print("  " + line)
    return worst


def describe_method(path: str, method: str) -> list[str]:
    from .format.archive import read_manifest

    manifest = read_manifest(path)
    return [
        f"delegate {d.id}: {d.backend_id} on {d.target_device}, runs {', '.join(d.ops)}"
        for d in manifest.methods[method].delegates
    ]


def run_demo(directory: str | None = None) -> int:
    """Compile the demo, save it, and check it in a fresh Python process."""
    with tempfile.TemporaryDirectory(prefix="aotstack-demo-") as scratch:
        path = str(Path(directory or scratch) / "demo.pt2")
        print(f"compiling the demo model (excluding {', '.join(DEMO_EXCLUDED_OPS)}) ...", flush=True)
        started = time.perf_counter()
        compile_demo(path)
        print(f"compiled and saved {path} in {time.perf_counter() - started:.1f} s", flush=True)
        print("loading it in a fresh Python process ...", flush=True)
        child = subprocess.run([sys.executable, "-m", "aotstack.demo", path], check=False)
        return child.returncode


def main(argv: list[str]) -> int:
    worst = check_package(argv[0])
    tolerance = 1e-4
    verdict = "matches" if worst <= tolerance else "DOES NOT match"
    print(f"\nthe package {verdict} eager PyTorch (worst difference {worst:.2e}, tolerance {tolerance:g})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
