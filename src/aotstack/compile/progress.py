"""What a person sees while partitions compile: a live table in a terminal, plain log lines elsewhere.

``lower`` reports each compile job to a :class:`Progress` as it is queued, started and finished.
In a terminal, :class:`LiveProgress` redraws one table (method, partition, engine, state, time,
where it ran) in place with ``rich``; anywhere else (a pipe, a file, a notebook's captured
stream) :class:`LogProgress` writes one ``logging`` line per start and finish, and nothing else.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from .jobs import CompileJob, CompileOutcome

logger = logging.getLogger("aotstack")

# A table taller than this shows its running and failed rows and counts the others.
MAX_ROWS = 24


class Progress:
    """Receives compile events; the base class shows nothing."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def queued(self, jobs: Sequence[CompileJob]) -> None:
        """``jobs`` will compile, in this order."""

    def started(self, job: CompileJob, worker: int | None) -> None:
        """``job`` began compiling, in worker process ``worker`` (None: in this process)."""

    def finished(self, outcome: CompileOutcome) -> None:
        """``outcome.job`` ended: compiled, taken from a cache or another job, failed or cancelled."""

    def close(self) -> None:
        """Compiling ended; leave the display as it finally was."""


def progress_for(option: bool | None | Progress) -> Progress:
    """The display ``lower(progress=...)`` asks for.

    None (the default) draws a live table when standard error is a terminal and writes log
    lines otherwise; True always draws it; False writes only log lines; a ``Progress`` is used
    as it is.
    """
    if isinstance(option, Progress):
        return option
    if option is None:
        option = stream_is_terminal(sys.stderr)
    return LiveProgress() if option else LogProgress()


def stream_is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class LogProgress(Progress):
    """One ``logging`` line (logger ``aotstack``, level INFO) per compile started and finished."""

    def started(self, job: CompileJob, worker: int | None) -> None:
        where = f" in worker {worker}" if worker is not None else ""
        logger.info("%s: compiling %s (%s, %d nodes)%s ...", job.title, job.tag, job.backend_id, job.nodes, where)

    def finished(self, outcome: CompileOutcome) -> None:
        job = outcome.job
        if outcome.state == "failed":
            # lower raises or warns with the cause; this line only marks the end.
            logger.info("%s: %s (%s) failed after %.1f s", job.title, job.tag, job.backend_id, outcome.seconds)
        elif outcome.state != "cancelled":
            logger.info("%s: %s (%s) %s", job.title, job.tag, job.backend_id, outcome_text(outcome))


def outcome_text(outcome: CompileOutcome) -> str:
    """``compiled in 12.3 s``, ``from the compile cache in 0.2 s``, ``same as forward/aoti_cpu_0``."""
    if outcome.same_as is not None:
        return f"same as {same_as(outcome.same_as)}, compiled once"
    source = "taken from the compile cache" if outcome.from_cache else "compiled"
    return f"{source} in {outcome.seconds:.1f} s"


def same_as(job: CompileJob) -> str:
    """``forward/aoti_cpu_0``, with its plan where several lower together: ``forward/aoti_cpu_0 (aoti_cpu)``."""
    return f"{job.method}/{job.tag}" + (f" ({job.plan})" if job.plan else "")


@dataclass
class Row:
    job: CompileJob
    state: str = "queued"
    started: float | None = None
    seconds: float | None = None
    where: str = ""


@dataclass
class LiveProgress(Progress):
    """A table redrawn in place, a few times a second, on standard error (``rich.live``)."""

    rows: list[Row] = field(default_factory=list)
    live: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def queued(self, jobs: Sequence[CompileJob]) -> None:
        with self.lock:
            self.rows.extend(Row(job) for job in jobs)
        if self.live is None:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(self, console=Console(stderr=True), refresh_per_second=4, transient=False)
            self.live.start()
        self.live.refresh()

    def started(self, job: CompileJob, worker: int | None) -> None:
        row = self.row(job)
        with self.lock:
            row.state, row.started = "compiling", time.perf_counter()
            row.where = f"worker {worker}" if worker is not None else "this process"
        self.refresh()

    def finished(self, outcome: CompileOutcome) -> None:
        row = self.row(outcome.job)
        with self.lock:
            row.state = outcome.state
            row.seconds = outcome.seconds
            if outcome.same_as is not None:
                row.where = f"same as {same_as(outcome.same_as)}"
        self.refresh()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def row(self, job: CompileJob) -> Row:
        return next(row for row in self.rows if row.job is job)

    def refresh(self) -> None:
        if self.live is not None:
            self.live.refresh()

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title="aotstack: compiling partitions", title_justify="left", expand=False)
        for column in ("method", "partition", "engine", "nodes", "state", "time", "where"):
            table.add_column(column, justify="right" if column in ("nodes", "time") else "left", no_wrap=True)
        with self.lock:
            rows = list(self.rows)
        shown = rows if len(rows) <= MAX_ROWS else [r for r in rows if r.state in ("compiling", "failed")]
        now = time.perf_counter()
        for row in shown:
            elapsed = row.seconds if row.seconds is not None else (now - row.started if row.started else None)
            table.add_row(
                row.job.title, row.job.tag, row.job.backend_id, str(row.job.nodes),
                STATE_STYLES.get(row.state, row.state),
                "" if elapsed is None else f"{elapsed:.1f} s",
                row.where,
            )
        if len(shown) < len(rows):
            counts = {state: sum(1 for r in rows if r.state == state) for state in ("queued", "compiled", "cached")}
            table.caption = (
                f"{len(rows)} partitions: {counts['compiled'] + counts['cached']} done "
                f"({counts['cached']} from a cache), {counts['queued']} queued"
            )
        return table


STATE_STYLES = {
    "queued": "[dim]queued[/dim]",
    "compiling": "[yellow]compiling[/yellow]",
    "compiled": "[green]compiled[/green]",
    "cached": "[green]cached[/green]",
    "failed": "[red]failed[/red]",
    "cancelled": "[dim]cancelled[/dim]",
}
