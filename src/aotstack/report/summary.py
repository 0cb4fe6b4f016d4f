"""The report's data: per method, each engine's share, each delegate, each op left to plain ATen; sizes.

Plain records only: the renderers (``text``, ``html``) read them, and ``model.Report`` adds the
ways to show them, so nothing here imports a renderer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..format.custom_ops import CustomOpRecord
from ..format.placement import Reason, Selection
from ..format.records import TensorSpec


@dataclass(frozen=True)
class EngineShare:
    """How many of a method's ops one engine took (``aten``: left to plain ATen), and what fraction."""

    engine: str
    ops: int
    share: float
    delegates: int


@dataclass(frozen=True)
class DelegateSummary:
    id: str
    engine: str
    device: str
    # How many ops it replaced, by op name; empty where the file did not record it.
    op_counts: dict[str, int]
    distinct_ops: list[str]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # Its compiled code (processed bytes, libraries, engine models); None in a dry run, which compiles nothing.
    code_bytes: int | None
    weight_bytes: int
    compile_state: str | None
    compile_seconds: float | None
    # Median seconds a call, as auto-lowering measured it; None where it did not.
    run_seconds: float | None = None
    # Its quantized layers by kind and scheme, e.g. ``{"linear 8da4w, group 32": 28}``.
    quantized: dict[str, int] = field(default_factory=dict)
    # The buffers it owns (a KV cache): they live with it, on its device. Loading decides whether the engine keeps
    # them inside itself (OpenVINO's state variables) or updates them in place; the file cannot say which.
    state: list[str] = field(default_factory=list)

    @property
    def op_count(self) -> int | None:
        return sum(self.op_counts.values()) if self.op_counts else None


@dataclass(frozen=True)
class UnclaimedGroup:
    """Ops of one kind left to plain ATen for the same reasons: the nodes, and each engine's reason."""

    op: str
    nodes: list[str]
    reasons: list[Reason]


@dataclass(frozen=True)
class Copy:
    """A host-device copy the device pass put in: the value copied and where to."""

    step: str
    source: str
    to: str


@dataclass(frozen=True)
class MethodSummary:
    name: str
    inputs: list[str]
    # Ops counted (see lower.is_counted_op); None where the file did not record where ops went.
    ops: int | None
    engines: list[EngineShare]
    delegates: list[DelegateSummary]
    unclaimed: list[UnclaimedGroup]
    copies: list[Copy]
    weight_count: int
    weight_bytes: int
    # The plans auto-lowering measured for this method and the one it kept; None where it did not choose.
    selection: Selection | None = None
    # The conditions on its sizes, beyond their ranges, that a call must meet (``format/guards.py``).
    guards: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SizePart:
    part: str
    bytes: int


@dataclass(frozen=True, repr=False)
class Summary:
    """What went where and why, for every method of a lowered program or a saved file."""

    source: str | None
    aotstack_version: str
    torch_version: str
    format_version: int
    planned: bool
    methods: list[MethodSummary]
    size_parts: list[SizePart]
    # The file's size; None for a program not saved, whose parts are the blobs it would store.
    file_bytes: int | None
    check: dict[str, Any] | None = None
    # The custom ops the file calls, which the loading process must register (format/custom_ops.py).
    custom_ops: list[CustomOpRecord] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.file_bytes if self.file_bytes is not None else sum(part.bytes for part in self.size_parts)

    def method(self, name: str) -> MethodSummary:
        for method in self.methods:
            if method.name == name:
                return method
        raise KeyError(f"no method {name!r} in the report; methods: {[m.name for m in self.methods]}")
