"""The models the benchmarks time, each a function giving ``(model, forward args)``, seeded.

Child processes rebuild a workload by its name in ``WORKLOADS`` (``bench/`` and the repository root
are on their path), so a parent and its children compile the same model.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aotstack.demo import demo_model

Workload = tuple[torch.nn.Module, tuple[Any, ...]]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The four blocks of the parallel-compile benchmark: widths differ, so every partition is its own compile.
JOBS_WIDTHS = (64, 96, 128, 160, 192)
# The boundary benchmark's chain: silu, gelu, silu between four equal blocks. Excluding gelu splits it in two,
# gelu and silu in four, while the arithmetic stays the same.
BOUNDARY_SEPARATORS = ("silu", "gelu", "silu")
LARGE_WIDTH, LARGE_LAYERS = 5000, 5  # 5 x Linear(5000, 5000): 500.1 MB of float32


def mlp() -> Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    return model.eval(), (torch.randn(8, 64),)


def demo() -> Workload:
    """The bundled demo's ``forward``."""
    model, inputs = demo_model()
    return model, inputs["forward"]


def corpus(name: str) -> Workload:
    """A model of the test suite's ``transformers`` corpus (small config, random weights, no download)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tests import hf_models

    return hf_models.build(name), hf_models.example_inputs(name)


class Chain(torch.nn.Module):
    """``Linear`` blocks with an activation between each two: the activations are where a package splits."""

    def __init__(self, widths: Sequence[int], separators: Sequence[str]) -> None:
        super().__init__()
        assert len(separators) == len(widths) - 2
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.separators = list(separators)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index < len(self.separators):
                x = getattr(torch.nn.functional, self.separators[index])(x)
        return x


def chain(widths: Sequence[int], separators: Sequence[str], batch: int = 8) -> Workload:
    torch.manual_seed(0)
    return Chain(widths, separators).eval(), (torch.randn(batch, widths[0]),)


def jobs_chain() -> Workload:
    """Four blocks of different widths between gelus: four distinct partitions once gelu is excluded."""
    return chain(JOBS_WIDTHS, ["gelu"] * (len(JOBS_WIDTHS) - 2))


def boundary_chain() -> Workload:
    return chain([64] * (len(BOUNDARY_SEPARATORS) + 2), BOUNDARY_SEPARATORS)


def large() -> Workload:
    """A few large ``Linear`` layers, all supported: about 500 MB of float32 weights."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for index in range(LARGE_LAYERS):
        layers.append(torch.nn.Linear(LARGE_WIDTH, LARGE_WIDTH))
        if index < LARGE_LAYERS - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).eval(), (torch.randn(1, LARGE_WIDTH),)


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp": mlp,
    "demo": demo,
    "bert": lambda: corpus("bert"),
    "llama": lambda: corpus("llama"),
    "jobs_chain": jobs_chain,
    "boundary_chain": boundary_chain,
    "large": large,
}
