"""Where each op of a method went: the delegate that took it, or why every engine that looked left it.

Lowering writes one ``Placement`` per method into the manifest, so a saved file answers the
same questions as the lowered program it came from: what ran where, how many ops each part
holds, how long each compile took, and why an op stayed plain ATen. It is optional in the
manifest: a file written before it existed simply has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PackageError
from .plan import bounded, expect

# Why an engine left an op:
# - ``excluded``: the user said so (``exclude_ops``, or an ``ops`` list that does not name it);
# - ``unsupported``: the engine cannot run it;
# - ``min_block_size``: it is in a part smaller than the partitioner's ``min_block_size``;
# - ``missing_kernels``: it needs fallback kernels the target's runtime lacks;
# - ``compile_failed``: its part failed to compile, and ``on_compile_error="fallback"`` kept it;
# - ``not_claimed``: the partitioner left it without saying why;
# - ``not_runnable`` (engine ``aotstack``): nor can the runtime call it as a plain op, so saving fails;
# - ``needs_allow_ops`` (engine ``aotstack``): a custom op, run in the plan where the loader allows it.
REASON_KINDS = (
    "excluded", "unsupported", "min_block_size", "missing_kernels", "compile_failed", "not_claimed", "not_runnable",
    "needs_allow_ops",
)  # fmt: skip

# The engine named for ops no delegate took: they run as plain ATen calls.
PLAIN_ATEN = "aten"

# Compile states of a delegate; ``planned`` is a dry run's, which compiles nothing.
COMPILE_STATES = ("compiled", "cached", "planned")

MAX_ENTRIES = 1 << 20
MAX_TEXT = 4096


@dataclass(frozen=True)
class Reason:
    """Why ``engine`` (a backend id) left an op: one of ``REASON_KINDS`` and a sentence."""

    engine: str
    kind: str
    detail: str


@dataclass(frozen=True)
class UnclaimedOp:
    """An op no engine took, run as plain ATen: its node, its op, and each engine's reason in lowering order."""

    node: str
    op: str
    reasons: list[Reason] = field(default_factory=list)


@dataclass(frozen=True)
class DelegatePlacement:
    """What one delegate took and what its compile cost: op name -> how many of its nodes call it."""

    op_counts: dict[str, int]
    compile_state: str
    # None where nothing was compiled (a dry run).
    compile_seconds: float | None = None
    # Median seconds per call, measured by ``lower(..., "auto")`` on the example inputs; None where not measured.
    run_seconds: float | None = None

    @property
    def op_count(self) -> int:
        return sum(self.op_counts.values())


@dataclass(frozen=True)
class Candidate:
    """One plan ``lower(..., "auto")`` measured for a method: its engines in order, and what a call cost."""

    engines: list[str]
    # Median seconds per call on the example inputs; None where the plan could not be lowered or run.
    seconds: float | None
    # Median seconds per call spent in each engine's delegates; plain ATen and the method's own steps are the rest.
    engine_seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    # Bytes of resident memory the plan's file held once loaded and called (weights an engine packed, its runtime,
    # the file's pages read); None where it failed or memory could not be read.
    resident_bytes: int | None = None


@dataclass(frozen=True)
class Selection:
    """How ``lower(..., "auto")`` chose a method's engines: every plan it measured, the one it kept, and why."""

    candidates: list[Candidate]
    chosen: int
    threads: int
    reason: str


@dataclass(frozen=True)
class Placement:
    """One method's ops: by delegate id, and those left to plain ATen in graph order."""

    delegates: dict[str, DelegatePlacement]
    unclaimed: list[UnclaimedOp]
    # Where auto-lowering chose this method's engines by measuring them; None otherwise.
    selection: Selection | None = None


def placement_to_json(placement: Placement) -> dict[str, Any]:
    return {
        "delegates": {
            delegate_id: {
                "op_counts": dict(delegate.op_counts),
                "compile_state": delegate.compile_state,
                "compile_seconds": delegate.compile_seconds,
                **({} if delegate.run_seconds is None else {"run_seconds": delegate.run_seconds}),
            }
            for delegate_id, delegate in placement.delegates.items()
        },
        "unclaimed": [
            {"node": op.node, "op": op.op, "reasons": [reason_to_json(reason) for reason in op.reasons]}
            for op in placement.unclaimed
        ],
        **({} if placement.selection is None else {"selection": selection_to_json(placement.selection)}),
    }


def reason_to_json(reason: Reason) -> dict[str, Any]:
    return {"engine": reason.engine, "kind": reason.kind, "detail": readable_text(reason.detail)}


def selection_to_json(selection: Selection) -> dict[str, Any]:
    return {
        "candidates": [
            {**vars(candidate), "error": None if candidate.error is None else readable_text(candidate.error)}
            for candidate in selection.candidates
        ],
        "chosen": selection.chosen,
        "threads": selection.threads,
        "reason": readable_text(selection.reason),
    }


def readable_text(value: str) -> str:
    """``value`` cut to the ``MAX_TEXT`` characters a reader takes, marked where cut: an engine's error (a compiler's
    message with its traceback) may run to pages, and a file must load whatever it explains."""
    if len(value) <= MAX_TEXT:
        return value
    mark = f" ... (cut from {len(value)} characters)"
    return value[: MAX_TEXT - len(mark)] + mark


def placement_from_json(data: Any) -> Placement:
    data = expect(data, dict, "placement")
    delegates = bounded(data.get("delegates"), dict, "placement's delegates", MAX_ENTRIES)
    unclaimed = bounded(data.get("unclaimed"), list, "placement's unclaimed ops", MAX_ENTRIES)
    selection = data.get("selection")
    return Placement(
        delegates={text(key, "a delegate id"): delegate_placement(value) for key, value in delegates.items()},
        unclaimed=[unclaimed_op(value) for value in unclaimed],
        selection=None if selection is None else selection_from_json(selection),
    )


def selection_from_json(data: Any) -> Selection:
    data = expect(data, dict, "a selection")
    candidates = [candidate(value) for value in bounded(data.get("candidates"), list, "candidates", 64)]
    chosen = data.get("chosen")
    if not isinstance(chosen, int) or isinstance(chosen, bool) or not 0 <= chosen < len(candidates):
        raise PackageError(f"a selection's chosen plan is {chosen!r}; expected an index into its candidates")
    threads = data.get("threads")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise PackageError(f"a selection's threads is {threads!r}; expected a positive int")
    return Selection(candidates, chosen, threads, text(data.get("reason"), "a selection's reason"))


def candidate(data: Any) -> Candidate:
    data = expect(data, dict, "a candidate")
    engines = [text(engine, "an engine") for engine in bounded(data.get("engines"), list, "engines", 64)]
    spent = bounded(data.get("engine_seconds"), dict, "engine_seconds", 64)
    error = data.get("error")
    return Candidate(
        engines,
        seconds_or_none(data.get("seconds"), "a candidate's seconds"),
        {text(engine, "an engine"): seconds(value, "engine_seconds") for engine, value in spent.items()},
        None if error is None else text(error, "a candidate's error"),
        count_or_none(data.get("resident_bytes"), "a candidate's resident_bytes"),
    )


def seconds(value: Any, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < float("inf"):
        raise PackageError(f"{what} is {value!r}; expected a non-negative number")
    return float(value)


def seconds_or_none(value: Any, what: str) -> float | None:
    return None if value is None else seconds(value, what)


def count_or_none(value: Any, what: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise PackageError(f"{what} is {value!r}; expected a non-negative int or null")
    return value


def delegate_placement(data: Any) -> DelegatePlacement:
    data = expect(data, dict, "a delegate's placement")
    counts = bounded(data.get("op_counts"), dict, "op_counts", MAX_ENTRIES)
    for op, count in counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise PackageError(f"op_counts[{op[:80]!r}] is {count!r}; expected a non-negative int")
    state = data.get("compile_state")
    if state not in COMPILE_STATES:
        raise PackageError(f"compile_state is {state!r}; expected one of {', '.join(COMPILE_STATES)}")
    return DelegatePlacement(
        dict(counts),
        state,
        seconds_or_none(data.get("compile_seconds"), "compile_seconds"),
        seconds_or_none(data.get("run_seconds"), "run_seconds"),
    )


def unclaimed_op(data: Any) -> UnclaimedOp:
    data = expect(data, dict, "an unclaimed op")
    reasons = bounded(data.get("reasons"), list, "an unclaimed op's reasons", 64)
    return UnclaimedOp(text(data.get("node"), "node"), text(data.get("op"), "op"), [reason(r) for r in reasons])


def reason(data: Any) -> Reason:
    data = expect(data, dict, "a reason")
    kind = data.get("kind")
    if kind not in REASON_KINDS:
        raise PackageError(f"a reason's kind is {kind!r}; expected one of {', '.join(REASON_KINDS)}")
    return Reason(text(data.get("engine"), "engine"), kind, text(data.get("detail"), "detail"))


def text(value: Any, what: str) -> str:
    value = expect(value, str, what)
    if len(value) > MAX_TEXT:
        raise PackageError(f"{what} is {len(value)} characters long; at most {MAX_TEXT} are read")
    return value
