"""The report as HTML, for a notebook cell that ends with a lowered or loaded program."""

from __future__ import annotations

from html import escape

from ..format.custom_ops import qualified_name
from ..format.placement import PLAIN_ATEN, Selection
from .graph import engine_colour
from .summary import DelegateSummary, MethodSummary, Summary
from .text import (
    KIND_LABELS,
    NODES_SHOWN,
    check_text,
    compile_text,
    custom_op_uses,
    duration,
    held_memory,
    megabytes,
    ops_text,
    plural_threads,
    specs_text,
)

# Plain ATen's swatch; each engine's is the one the graph picture uses.
PLAIN_ATEN_COLOUR = "#c8c8c8"

STYLE = """
<style>
.aotstack-report table { border-collapse: collapse; margin: 4px 0 12px; font-size: 12px; }
.aotstack-report th, .aotstack-report td { border: 1px solid #ccc; padding: 2px 6px; text-align: left;
  vertical-align: top; }
.aotstack-report .bar { display: flex; height: 14px; width: 480px; border: 1px solid #999; }
.aotstack-report .swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
</style>
"""


def report_html(report: Summary) -> str:
    """The whole report as one HTML fragment."""
    parts = [STYLE, '<div class="aotstack-report">', f"<p><b>{escape(title(report))}</b></p>"]
    for method in report.methods:
        parts.append(method_html(method, report.planned))
    if report.custom_ops:
        rows = [
            f"<tr><td>{escape(qualified_name(r.name))}</td><td>{escape(custom_op_uses(r))}</td>"
            f"<td>{escape(r.module or 'unknown (not Python)')}</td></tr>"
            for r in report.custom_ops
        ]
        header = ["op", "runs in", "registered by"]
        parts.append(table("custom ops (a loading process registers them first)", header, rows))
    parts.append(sizes_html(report))
    if report.check is not None:
        parts.append(f"<pre>{escape(check_text(report.check).plain.strip())}</pre>")
    parts.append("</div>")
    return "\n".join(parts)


def title(report: Summary) -> str:
    what = "dry run: partitioned, nothing compiled" if report.planned else report.source or "lowered program"
    size = "" if report.file_bytes is None else f", {megabytes(report.file_bytes)}"
    return f"{what}{size} · aotstack {report.aotstack_version} · torch {report.torch_version}"


def method_html(method: MethodSummary, planned: bool) -> str:
    parts = [f"<h4>method {escape(method.name)}({escape(', '.join(method.inputs))})</h4>"]
    if method.guards:
        parts.append(f"<p><i>exported for sizes where {escape('; '.join(method.guards))}</i></p>")
    if method.ops is None:
        parts.append("<p><i>where each op went was not recorded in this file</i></p>")
    else:
        parts.append(share_bar(method))
    if method.selection is not None:
        parts.append(selection_html(method.selection))
    if method.delegates:
        parts.append(delegates_html(method.delegates, planned))
    if method.unclaimed:
        rows = []
        for group in method.unclaimed:
            nodes = ", ".join(group.nodes[:NODES_SHOWN]) + (
                f" and {len(group.nodes) - NODES_SHOWN} more" if len(group.nodes) > NODES_SHOWN else ""
            )
            why = "<br>".join(
                f"{swatch(r.engine)}{escape(r.engine)}: {escape(KIND_LABELS.get(r.kind, r.kind))}: {escape(r.detail)}"
                for r in group.reasons
            ) or "no partitioner was given for this method"
            cells = [escape(group.op), f"{len(group.nodes)}: {escape(nodes)}", why]
            rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
        parts.append(table("left to plain ATen", ["op", "nodes", "why"], rows))
    if method.copies:
        copies = ", ".join(f"{c.source} → {c.to}" for c in method.copies)
        parts.append(f"<p>host-device copies ({len(method.copies)}): {escape(copies)}</p>")
    return "\n".join(parts)


def share_bar(method: MethodSummary) -> str:
    """A stacked bar of each engine's share of the ops, with a legend."""
    cells, legend = [], []
    for share in method.engines:
        color = colour(share.engine)
        label = "plain ATen" if share.engine == PLAIN_ATEN else share.engine
        if share.ops:
            cells.append(
                f'<div title="{escape(label)}: {share.ops}" style="background:{color};width:{share.share * 100:.2f}%">'
                "</div>"
            )
        legend.append(f"{swatch(share.engine)}{escape(label)} {share.ops} ({share.share:.0%})")
    return f'<p>{method.ops} ops: {" · ".join(legend)}</p><div class="bar">{"".join(cells)}</div>'


def selection_html(selection: Selection) -> str:
    """The plans auto-lowering timed, the kept one marked, and why it won."""
    rows = []
    for index, candidate in enumerate(selection.candidates):
        spent = ", ".join(f"{swatch(engine)}{escape(engine)} {duration(seconds)}"
                          for engine, seconds in candidate.engine_seconds.items())
        cells = [
            "✓" if index == selection.chosen else "",
            " &gt; ".join(swatch(engine) + escape(engine) for engine in candidate.engines),
            "failed" if candidate.seconds is None else duration(candidate.seconds),
            held_memory(candidate.resident_bytes),
            spent if candidate.error is None else escape(candidate.error.splitlines()[0][:160]),
        ]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    caption = f"engines chosen by measuring, {plural_threads(selection.threads)}"
    columns = ["", "plan", "a call", "memory", "in each engine"]
    return table(caption, columns, rows) + f"<p>kept: {escape(selection.reason)}</p>"


def delegates_html(delegates: list[DelegateSummary], planned: bool) -> str:
    rows = []
    timed = any(d.run_seconds is not None for d in delegates)
    for d in delegates:
        code = "—" if d.code_bytes is None else megabytes(d.code_bytes)
        cells = [
            escape(d.id),
            swatch(d.engine) + escape(d.engine),
            escape(d.device),
            escape(ops_text(d)),
            escape(f"{specs_text(d.inputs)} → {specs_text(d.outputs)}"),
            code,
            megabytes(d.weight_bytes),
            escape(compile_text(d, planned)),
        ]
        if timed:
            cells.append("—" if d.run_seconds is None else duration(d.run_seconds))
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    header = ["id", "engine", "device", "ops", "inputs → outputs", "code", "weights", "compile"]
    return table("delegates", header + (["a call"] if timed else []), rows)


def sizes_html(report: Summary) -> str:
    total = report.total_bytes
    rows = [
        f"<tr><td>{escape(p.part)}</td><td>{megabytes(p.bytes)}</td>"
        f"<td>{p.bytes / total:.0%}</td></tr>" if total else f"<tr><td>{escape(p.part)}</td><td>0 B</td><td></td></tr>"
        for p in report.size_parts
    ]
    rows.append(f"<tr><td><b>total</b></td><td><b>{megabytes(total)}</b></td><td></td></tr>")
    what = "file size by part" if report.file_bytes is not None else "size by part, once saved"
    return table(what, ["part", "size", "share"], rows)


def table(caption: str, header: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{escape(column)}</th>" for column in header)
    return f"<table><caption>{escape(caption)}</caption><tr>{head}</tr>{''.join(rows)}</table>"


def swatch(engine: str) -> str:
    return f'<span class="swatch" style="background:{colour(engine)}"></span>'


def colour(engine: str) -> str:
    return PLAIN_ATEN_COLOUR if engine == PLAIN_ATEN else engine_colour(engine)
