"""The report as terminal tables, drawn with ``rich``."""

from __future__ import annotations

import io
import os
import sys

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..format.custom_ops import PLAN, CustomOpRecord, qualified_name
from ..format.placement import PLAIN_ATEN, Selection
from ..format.records import TensorSpec
from .summary import DelegateSummary, MethodSummary, Summary

# rich style per engine; any other engine is drawn in the default colour.
ENGINE_STYLES = {
    "aoti_cpu": "bold blue",
    "aoti_cuda": "bold green",
    "aoti_metal": "bold magenta",
    "onnxruntime": "bold yellow",
    PLAIN_ATEN: "bold red",
}

# How a reason's kind reads in a table.
KIND_LABELS = {
    "excluded": "excluded",
    "unsupported": "unsupported",
    "min_block_size": "below min_block_size",
    "missing_kernels": "missing kernels",
    "compile_failed": "compile failed",
    "not_claimed": "not claimed",
    "not_runnable": "cannot run",
    "needs_allow_ops": "needs allow_ops",
}

# How many node names an unclaimed group lists before it says how many more.
NODES_SHOWN = 4


def report_text(report: Summary, width: int = 120, color: bool = False) -> str:
    """The report drawn as text ``width`` characters wide."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=color, color_system="standard" if color else None)
    console.print(report_renderable(report))
    return buffer.getvalue()


def print_report(report: Summary) -> None:
    """Print to standard output: at the terminal's width, or ``$COLUMNS`` (else 120) into a pipe or file."""
    console = Console(file=sys.stdout)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(file=sys.stdout, width=120)
    console.print(report_renderable(report))


def report_renderable(report: Summary) -> RenderableType:
    parts: list[RenderableType] = [heading(report)]
    for method in report.methods:
        parts.extend(method_parts(method, report.planned))
    if report.custom_ops:
        parts.append(custom_ops_table(report))
    parts.append(sizes_table(report))
    if report.check is not None:
        parts.append(check_text(report.check))
    return Group(*parts)


def custom_ops_table(report: Summary) -> Table:
    """The custom ops the file calls: where each runs and what registers it (see format/custom_ops.py)."""
    table = Table(title="custom ops (a loading process registers them first)", title_justify="left")
    for column in ("op", "runs in", "registered by"):
        table.add_column(column)
    for record in report.custom_ops:
        table.add_row(qualified_name(record.name), custom_op_uses(record), record.module or "unknown (not Python)")
    return table


def custom_op_uses(record: CustomOpRecord) -> str:
    """``delegate forward.0; the plan (load with allow_ops)``."""
    uses = [f"delegate {use}" for use in record.used_by if use != PLAN]
    if record.in_plan:
        uses.append(f"the plan (load with allow_ops=[{record.name.rsplit('.', 1)[0]!r}])")
    return "; ".join(uses)


def heading(report: Summary) -> Text:
    what = report.source or "lowered program (not saved)"
    if report.planned:
        what = "dry run: partitioned, nothing compiled"
    text = Text(what, style="bold")
    size = "" if report.file_bytes is None else f", {megabytes(report.file_bytes)}"
    text.append(
        f"{size} · aotstack {report.aotstack_version} · torch {report.torch_version} · format {report.format_version}"
    )
    return text


def method_parts(method: MethodSummary, planned: bool) -> list[RenderableType]:
    title = Text(f"\nmethod {method.name}", style="bold underline")
    title.append(f"({', '.join(method.inputs)})", style="dim")
    parts: list[RenderableType] = [title]
    if method.guards:
        parts.append(Text(f"exported for sizes where {'; '.join(method.guards)}", style="dim"))
    parts.append(shares_text(method))
    if method.selection is not None:
        parts.append(selection_table(method.selection))
    if method.delegates:
        parts.append(delegates_table(method.delegates, planned))
    if method.unclaimed:
        parts.append(unclaimed_table(method))
    if method.copies:
        copies = ", ".join(f"{c.source} → {c.to}" for c in method.copies)
        parts.append(Text(f"host-device copies ({len(method.copies)}): {copies}"))
    if method.weight_count:
        parts.append(Text(f"weights read outside delegates: {method.weight_count} ({megabytes(method.weight_bytes)})"))
    return parts


def shares_text(method: MethodSummary) -> Text:
    if method.ops is None:
        return Text("where each op went was not recorded in this file (written by an older aotstack)", style="dim")
    text = Text(f"{method.ops} ops: ")
    for index, share in enumerate(method.engines):
        if index:
            text.append(" · ")
        label = "plain ATen" if share.engine == PLAIN_ATEN else share.engine
        text.append(f"{label} {share.ops} ({share.share:.0%})", style=ENGINE_STYLES.get(share.engine, "bold"))
    return text


def selection_table(selection: Selection) -> Group:
    """The plans auto-lowering timed for a method, the one it kept marked, and why it won."""
    table = Table(title=f"engines chosen by measuring, {plural_threads(selection.threads)}", title_justify="left")
    for column in ("", "plan", "a call", "memory", "in each engine"):
        table.add_column(column, justify="right" if column in ("a call", "memory") else "left", overflow="fold")
    for index, candidate in enumerate(selection.candidates):
        spent = ", ".join(f"{engine} {duration(seconds)}" for engine, seconds in candidate.engine_seconds.items())
        table.add_row(
            "✓" if index == selection.chosen else "",
            " > ".join(candidate.engines),
            "failed" if candidate.seconds is None else duration(candidate.seconds),
            held_memory(candidate.resident_bytes),
            spent if candidate.error is None else candidate.error.splitlines()[0][:160],
        )
    return Group(table, Text(f"kept: {selection.reason}"))


def held_memory(count: int | None) -> str:
    """Memory a plan held once loaded and called, in MB; blank where it was not measured."""
    return "" if count is None else megabytes(count)


def plural_threads(threads: int) -> str:
    return f"{threads} thread" + ("" if threads == 1 else "s")


def duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"


def delegates_table(delegates: list[DelegateSummary], planned: bool) -> Table:
    table = Table(title="delegates", title_justify="left", expand=False)
    timed = any(delegate.run_seconds is not None for delegate in delegates)
    columns = ["id", "engine", "device", "ops", "inputs → outputs", "code", "weights", "compile"]
    columns += ["a call"] if timed else []
    for column in columns:
        table.add_column(
            column,
            justify="right" if column in ("code", "weights", "a call") else "left",
            no_wrap=column not in ("inputs → outputs", "ops"),
            overflow="fold",
            max_width=48 if column == "ops" else None,
        )
    for delegate in delegates:
        row = [
            delegate.id,
            Text(delegate.engine, style=ENGINE_STYLES.get(delegate.engine, "bold")),
            delegate.device,
            ops_text(delegate),
            f"{specs_text(delegate.inputs)}\n→ {specs_text(delegate.outputs)}",
            "—" if delegate.code_bytes is None else megabytes(delegate.code_bytes),
            megabytes(delegate.weight_bytes),
            compile_text(delegate, planned),
        ]
        if timed:
            row.append("—" if delegate.run_seconds is None else duration(delegate.run_seconds))
        table.add_row(*row)
    return table


def ops_text(delegate: DelegateSummary) -> str:
    """``12: linear ×4, gelu ×2, add ×6``: how many ops, then which, most first (or the kinds, where not counted).

    Quantized layers follow on their own lines: ``quantized: linear 8da4w, group 32 ×4``, then the
    buffers it updates and keeps on its device: ``state (cpu): key_cache_0, value_cache_0``.
    """
    quantized = "".join(f"\nquantized: {label} ×{count}" for label, count in delegate.quantized.items())
    state = f"\nstate ({delegate.device}): {', '.join(delegate.state)}" if delegate.state else ""
    return plain_ops_text(delegate) + quantized + state


def plain_ops_text(delegate: DelegateSummary) -> str:
    if delegate.op_counts:
        counted = sorted(delegate.op_counts.items(), key=lambda item: (-item[1], item[0]))
        return f"{delegate.op_count}: " + ", ".join(f"{short_op(op)} ×{count}" for op, count in counted)
    return f"{len(delegate.distinct_ops)} kinds: " + ", ".join(short_op(op) for op in delegate.distinct_ops)


def short_op(name: str) -> str:
    """``aten.linear.default`` -> ``linear``; another overload or namespace stays in the name."""
    return name.removeprefix("aten.").removesuffix(".default")


def compile_text(delegate: DelegateSummary, planned: bool) -> str:
    if planned or delegate.compile_state == "planned":
        return "dry run"
    if delegate.compile_state is None:
        return "not recorded"
    if delegate.compile_seconds is None:
        return delegate.compile_state
    return f"{delegate.compile_state} {delegate.compile_seconds:.1f} s"


def unclaimed_table(method: MethodSummary) -> Table:
    table = Table(title="left to plain ATen", title_justify="left")
    table.add_column("op")
    table.add_column("nodes", overflow="fold")
    table.add_column("why", overflow="fold")
    for group in method.unclaimed:
        shown = ", ".join(group.nodes[:NODES_SHOWN])
        if len(group.nodes) > NODES_SHOWN:
            shown += f" and {len(group.nodes) - NODES_SHOWN} more"
        why = "\n".join(f"{r.engine}: {KIND_LABELS.get(r.kind, r.kind)}: {r.detail}" for r in group.reasons)
        table.add_row(group.op, f"{len(group.nodes)}: {shown}", why or "no partitioner was given for this method")
    return table


def sizes_table(report: Summary) -> Table:
    title = "file size by part" if report.file_bytes is not None else "size by part, once saved"
    table = Table(title=title, title_justify="left")
    table.add_column("part")
    table.add_column("size", justify="right")
    table.add_column("share", justify="right")
    total = report.total_bytes
    for part in report.size_parts:
        table.add_row(part.part, megabytes(part.bytes), f"{part.bytes / total:.0%}" if total else "—")
    table.add_row(Text("total", style="bold"), Text(megabytes(total), style="bold"), "")
    return table


def check_text(check: dict) -> Text:
    """What ``lower(..., check=...)`` measured (``CheckResult.to_json()``), one line per output compared."""
    differences = [*check.get("outputs", []), *check.get("delegates", [])]
    passed = all(d.get("passed") for d in differences)
    text = Text("\nnumerical check: ", style="bold")
    text.append("passed" if passed else "failed", style="bold green" if passed else "bold red")
    for d in differences:
        where = f"delegate {d['delegate']}" if d.get("delegate") else f"method {d['method']}"
        amounts = d.get("mismatch") or f"max abs {number(d['max_abs'])}, max rel {number(d['max_rel'])}"
        text.append(f"\n  {where}: {d['output']}: {amounts}" + ("" if d.get("passed") else "  ← past the tolerance"))
    return text


def number(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.3g}"


def specs_text(specs: list[TensorSpec]) -> str:
    shown = [f"{spec.dtype}[{', '.join('*' if d is None else str(d) for d in spec.shape)}]" for spec in specs[:3]]
    if len(specs) > 3:
        shown.append(f"+{len(specs) - 3}")
    return ", ".join(shown) or "none"


def megabytes(size: int) -> str:
    if size < 1000:
        return f"{size} B"
    if size < 1_000_000:
        return f"{size / 1e3:.1f} kB"
    return f"{size / 1e6:.2f} MB"
