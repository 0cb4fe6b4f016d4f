"""The partition report as data: built from a manifest, so a saved file and a lowered program read alike.

``program_report`` reads what lowering recorded (the delegates, the run plan, the ``Placement``
of every op) and sums it up per method; ``file_report`` does the same for a ``.pt2`` and adds
its real size. A ``Report`` prints as tables, turns into JSON (``to_json``, described by
``report.schema.REPORT_SCHEMA``), shows as HTML in a notebook and draws its graph as SVG.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..format.archive import read_manifest
from ..format.custom_ops import custom_op_to_json
from ..format.manifest import DelegateRecord, Manifest, MethodRecord, record_text
from ..format.placement import PLAIN_ATEN, Placement, Reason, selection_to_json
from ..format.plan import OpStep, Ref
from ..format.tensor_data import WEIGHT_PREFIX
from .graph import D2H_COPY, H2D_COPY, program_svg
from .html import report_html
from .summary import Copy, DelegateSummary, EngineShare, MethodSummary, SizePart, Summary, UnclaimedGroup
from .text import print_report, report_text

SCHEMA_NAME = "aotstack-report"
SCHEMA_VERSION = 1


@dataclass(frozen=True, repr=False)
class Report(Summary):
    """The summary, and the ways to show it: tables, JSON, HTML in a notebook, an SVG of the graph."""

    manifest: Manifest | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The report as plain data, following ``aotstack.report.schema.REPORT_SCHEMA``."""
        return report_to_json(self)

    def text(self, width: int = 120, color: bool = False) -> str:
        """The report as tables, ``width`` characters wide; with ANSI colour where ``color``."""
        return report_text(self, width=width, color=color)

    def print(self) -> None:
        """Print the report to the terminal, in colour where it is one."""
        print_report(self)

    def svg(self) -> str:
        """Every method's graph drawn as one SVG document."""
        if self.manifest is None:
            raise ValueError("this report was built without its manifest, so it cannot draw the graph")
        counts = {d.id: d.op_count for m in self.methods for d in m.delegates if d.op_count is not None}
        return program_svg(self.manifest.methods, delegate_op_counts=counts, title=self.source or "")

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return report_html(self)


def file_report(path: str | os.PathLike[str]) -> Report:
    """The report of a saved ``.pt2``: read from its manifest alone (nothing is loaded or run).

    Example::

        print(aotstack.file_report("model.pt2"))
    """
    return program_report(read_manifest(path), source=os.fspath(path), file_bytes=os.path.getsize(path))


def program_report(
    manifest: Manifest,
    *,
    source: str | None = None,
    file_bytes: int | None = None,
    planned: bool = False,
    check: dict[str, Any] | None = None,
) -> Report:
    """The report of the program ``manifest`` describes; ``file_bytes`` where it was saved."""
    return Report(
        source=source,
        aotstack_version=manifest.aotstack_version,
        torch_version=manifest.torch_version,
        format_version=manifest.format_version,
        planned=planned,
        methods=[method_summary(name, record, manifest.blobs, planned) for name, record in manifest.methods.items()],
        size_parts=size_parts(manifest, file_bytes),
        file_bytes=file_bytes,
        check=check,
        custom_ops=list(manifest.custom_ops),
        manifest=manifest,
    )


def method_summary(name: str, record: MethodRecord, blobs: Mapping[str, int], planned: bool) -> MethodSummary:
    placement = record.placement
    delegates = [delegate_summary(d, placement, blobs, planned) for d in record.delegates]
    unclaimed = unclaimed_groups(placement)
    ops = None
    if placement is not None:
        ops = sum(d.op_count for d in placement.delegates.values()) + len(placement.unclaimed)
    return MethodSummary(
        name=name,
        inputs=[record_text(r) for r in record.inputs],
        ops=ops,
        engines=engine_shares(delegates, placement),
        delegates=delegates,
        unclaimed=unclaimed,
        copies=copies(record),
        weight_count=len(record.weights),
        weight_bytes=sum(blobs.get(w.blob, 0) for w in record.weights.values()),
        selection=placement.selection if placement is not None else None,
        guards=list(record.guards),
    )


def delegate_summary(
    record: DelegateRecord, placement: Placement | None, blobs: Mapping[str, int], planned: bool
) -> DelegateSummary:
    placed = placement.delegates.get(record.id) if placement is not None else None
    return DelegateSummary(
        id=record.id,
        engine=record.backend_id,
        device=record.target_device,
        op_counts=dict(placed.op_counts) if placed is not None else {},
        distinct_ops=list(record.ops),
        inputs=list(record.inputs),
        outputs=list(record.outputs),
        code_bytes=None if planned else sum(blobs.get(key, 0) for key in code_blobs(record)),
        weight_bytes=sum(blobs.get(key, 0) for name, key in record.named_data.items() if is_weight(name)),
        compile_state=placed.compile_state if placed is not None else None,
        compile_seconds=placed.compile_seconds if placed is not None else None,
        run_seconds=placed.run_seconds if placed is not None else None,
        quantized=dict(record.quantized),
        state=list(record.updates),
    )


def engine_shares(delegates: list[DelegateSummary], placement: Placement | None) -> list[EngineShare]:
    """Each engine's ops, most first, then plain ATen's; empty where ops were not recorded."""
    if placement is None:
        return []
    ops: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for delegate in delegates:
        ops[delegate.engine] += delegate.op_count or 0
        count[delegate.engine] += 1
    total = sum(ops.values()) + len(placement.unclaimed)
    shares = [
        EngineShare(engine, n, n / total if total else 0.0, count[engine])
        for engine, n in sorted(ops.items(), key=lambda item: -item[1])
    ]
    left = len(placement.unclaimed)
    shares.append(EngineShare(PLAIN_ATEN, left, left / total if total else 0.0, 0))
    return shares


def unclaimed_groups(placement: Placement | None) -> list[UnclaimedGroup]:
    """The ops left to plain ATen, one group per op and set of reasons, in graph order."""
    if placement is None:
        return []
    groups: dict[tuple[str, tuple[Reason, ...]], list[str]] = {}
    for op in placement.unclaimed:
        groups.setdefault((op.op, tuple(op.reasons)), []).append(op.node)
    return [UnclaimedGroup(op, nodes, list(reasons)) for (op, reasons), nodes in groups.items()]


def copies(record: MethodRecord) -> list[Copy]:
    """The host-device copies in ``record``'s plan, in run order."""
    found = []
    for step in record.plan.steps:
        if not isinstance(step, OpStep) or step.target not in (H2D_COPY, D2H_COPY):
            continue
        source = step.args[0].name if step.args and isinstance(step.args[0], Ref) else "?"
        found.append(Copy(step.name, source, str(step.args[1]) if step.target == H2D_COPY else "cpu"))
    return found


def size_parts(manifest: Manifest, file_bytes: int | None) -> list[SizePart]:
    """The file's bytes by what they hold, each blob counted once, under its first use."""
    kinds: dict[str, str] = {}
    for record in manifest.methods.values():
        for delegate in record.delegates:
            for key in code_blobs(delegate):
                kinds.setdefault(key, "delegate code")
            for name, key in delegate.named_data.items():
                if is_weight(name):
                    kinds.setdefault(key, "delegate weights")
        for weight in record.weights.values():
            kinds.setdefault(weight.blob, "method weights")
    sizes: dict[str, int] = {"delegate code": 0, "delegate weights": 0, "method weights": 0}
    for key, kind in kinds.items():
        sizes[kind] += manifest.blobs.get(key, 0)
    parts = [SizePart(part, size) for part, size in sizes.items()]
    if file_bytes is not None:
        parts.append(SizePart("programs, manifest and archive", max(0, file_bytes - sum(sizes.values()))))
    return parts


def code_blobs(record: DelegateRecord) -> list[str]:
    """A delegate's compiled code: its processed bytes and each named blob not a weight (a library, a model)."""
    return [record.processed, *(key for name, key in record.named_data.items() if not is_weight(name))]


def is_weight(name: str) -> bool:
    return name.startswith(WEIGHT_PREFIX)


def report_to_json(report: Report) -> dict[str, Any]:
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "source": report.source,
        "planned": report.planned,
        "aotstack_version": report.aotstack_version,
        "torch_version": report.torch_version,
        "format_version": report.format_version,
        "methods": [method_to_json(method) for method in report.methods],
        "sizes": {
            "total": report.total_bytes,
            "saved": report.file_bytes is not None,
            "parts": [{"part": part.part, "bytes": part.bytes} for part in report.size_parts],
        },
        "check": report.check,
        "custom_ops": [custom_op_to_json(record) for record in report.custom_ops],
    }


def method_to_json(method: MethodSummary) -> dict[str, Any]:
    return {
        "name": method.name,
        "inputs": list(method.inputs),
        "ops": method.ops,
        "engines": [vars(share).copy() for share in method.engines],
        "delegates": [delegate_to_json(delegate) for delegate in method.delegates],
        "unclaimed": [
            {"op": group.op, "nodes": list(group.nodes), "reasons": [vars(r).copy() for r in group.reasons]}
            for group in method.unclaimed
        ],
        "copies": [vars(copy).copy() for copy in method.copies],
        "weights": {"count": method.weight_count, "bytes": method.weight_bytes},
        "selection": None if method.selection is None else selection_to_json(method.selection),
        "guards": list(method.guards),
    }


def delegate_to_json(delegate: DelegateSummary) -> dict[str, Any]:
    return {
        "id": delegate.id,
        "engine": delegate.engine,
        "device": delegate.device,
        "ops": delegate.op_count,
        "op_counts": dict(delegate.op_counts),
        "distinct_ops": list(delegate.distinct_ops),
        "inputs": [vars(spec).copy() for spec in delegate.inputs],
        "outputs": [vars(spec).copy() for spec in delegate.outputs],
        "code_bytes": delegate.code_bytes,
        "weight_bytes": delegate.weight_bytes,
        "compile_state": delegate.compile_state,
        "compile_seconds": delegate.compile_seconds,
        "run_seconds": delegate.run_seconds,
        "quantized": dict(delegate.quantized),
        "state": list(delegate.state),
    }
