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
# - ``not_runnable`` (engine ``aotstack``): nor can the runtime call it as a plain op, so saving fails.
REASON_KINDS = (
    "excluded", "unsupported", "min_block_size", "missing_kernels", "compile_failed", "not_claimed", "not_runnable"
)

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

    @property
    def op_count(self) -> int:
        return sum(self.op_counts.values())


@dataclass(frozen=True)
class Placement:
    """One method's ops: by delegate id, and those left to plain ATen in graph order."""

    delegates: dict[str, DelegatePlacement]
    unclaimed: list[UnclaimedOp]


def placement_to_json(placement: Placement) -> dict[str, Any]:
    return {
        "delegates": {
            delegate_id: {
                "op_counts": dict(delegate.op_counts),
                "compile_state": delegate.compile_state,
                "compile_seconds": delegate.compile_seconds,
            }
            for delegate_id, delegate in placement.delegates.items()
        },
        "unclaimed": [
            {"node": op.node, "op": op.op, "reasons": [vars(reason).copy() for reason in op.reasons]}
            for op in placement.unclaimed
        ],
    }


def placement_from_json(data: Any) -> Placement:
    data = expect(data, dict, "placement")
    delegates = bounded(data.get("delegates"), dict, "placement's delegates", MAX_ENTRIES)
    unclaimed = bounded(data.get("unclaimed"), list, "placement's unclaimed ops", MAX_ENTRIES)
    return Placement(
        delegates={text(key, "a delegate id"): delegate_placement(value) for key, value in delegates.items()},
        unclaimed=[unclaimed_op(value) for value in unclaimed],
    )


def delegate_placement(data: Any) -> DelegatePlacement:
    data = expect(data, dict, "a delegate's placement")
    counts = bounded(data.get("op_counts"), dict, "op_counts", MAX_ENTRIES)
    for op, count in counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise PackageError(f"op_counts[{op[:80]!r}] is {count!r}; expected a non-negative int")
    state = data.get("compile_state")
    if state not in COMPILE_STATES:
        raise PackageError(f"compile_state is {state!r}; expected one of {', '.join(COMPILE_STATES)}")
    seconds = data.get("compile_seconds")
    if seconds is not None and (not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0):
        raise PackageError(f"compile_seconds is {seconds!r}; expected a non-negative number or null")
    return DelegatePlacement(dict(counts), state, None if seconds is None else float(seconds))


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
