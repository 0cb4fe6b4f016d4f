"""The numerical check: a lowered program's answers against eager PyTorch's, per output and per delegate.

The lowered program is saved and loaded the way a user would load it, and every method runs on
its example inputs there and in eager PyTorch, each from the same initial state. Eager runs
update buffers in place (a KV cache), and those buffers are the user's model's own tensors:
lowering shares weights rather than copying them, so every buffer a run updates is put back
afterwards.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from ..engine.interface import BackendRuntime
from ..errors import LoweringError
from ..format.archive import read_manifest
from ..format.manifest import InputRecord
from ..format.records import Delegate

# The one place the compiler uses the runtime: the check runs what was packaged the way a user loads it.
from ..runtime.inputs import InputCheck
from ..runtime.interpreter import LoadedDelegate
from ..runtime.load import DelegateWrapper, LoadedProgram, loaded_program
from .guards import size_guards
from .package import input_records, save
from .parallel import quiet_torch_warnings
from .program_parts import program_weights

if TYPE_CHECKING:
    from .export import Program


# (atol, rtol) by the compared output's dtype, where Check leaves them unset. float32 and wider: sums reordered by
# fused kernels. bfloat16 and float16: a fused kernel keeps intermediates in float32 and rounds once
# (emulate_precision_casts OFF, plain AOTInductor's default), eager rounds after every op, so the two part by a few
# units of the last place per layer (a bf16 unit is 2**-7 of the value): a 4-layer bf16 block was 0.047 to 0.078
# off eager on outputs of magnitude 1 to 4, on the CPU and on an H100.
DEFAULT_TOLERANCE = (1e-4, 1e-4)
DTYPE_TOLERANCE = {torch.bfloat16: (1e-1, 5e-2), torch.float16: (1e-2, 1e-2)}


@dataclass(frozen=True)
class Check:
    """What ``lower(..., check=...)`` compares, and how far apart two answers may be.

    An element passes when ``|lowered - eager| <= atol + rtol * |eager|``. ``atol`` and ``rtol``
    left unset take the output's dtype's default (``DTYPE_TOLERANCE``; 1e-4 for float32), so a
    bf16 model is judged as bf16. With ``partition``, each delegate's outputs are also compared
    with the eager ops it replaced, run on the inputs the delegate got, so a wrong answer is
    traced to the delegate that produced it.

    >>> Check().tolerance(torch.bfloat16)
    (0.1, 0.05)
    """

    partition: bool = False
    atol: float | None = None
    rtol: float | None = None

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"Check's {name} must be a finite number >= 0, got {value!r}")

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        """``(atol, rtol)`` for an output of ``dtype``: the ones given, else the dtype's default."""
        atol, rtol = DTYPE_TOLERANCE.get(dtype, DEFAULT_TOLERANCE)
        return (atol if self.atol is None else self.atol), (rtol if self.rtol is None else self.rtol)

    def tolerance_text(self, *dtypes: torch.dtype | None) -> str:
        """``atol 1e-04, rtol 1e-04`` for outputs of ``dtypes`` (float32 when none is given), or, where their
        tolerances differ, each dtype's: ``float32: atol 1e-04, rtol 1e-04; bfloat16: atol 1e-01, rtol 5e-02``."""
        texts = {d: pair_text(self.tolerance(d)) for d in dtypes if d is not None} or {
            torch.float32: pair_text(self.tolerance(torch.float32))
        }
        if len(set(texts.values())) == 1:
            return next(iter(texts.values()))
        return "; ".join(f"{str(d).removeprefix('torch.')}: {text}" for d, text in texts.items())

    def to_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "atol": self.atol, "rtol": self.rtol}


def pair_text(tolerance: tuple[float, float]) -> str:
    return f"atol {tolerance_number(tolerance[0])}, rtol {tolerance_number(tolerance[1])}"


def tolerance_number(value: float) -> str:
    """``1e-04`` for a power of ten, more digits where one would round it."""
    short = f"{value:.0e}"
    return short if float(short) == value else f"{value:.3e}"


def check_option(value: object) -> Check | None:
    """``lower``'s ``check`` argument as a Check: False/None -> None, True or "outputs" -> Check(), "partition"."""
    if value is None or value is False:
        return None
    if value is True or value == "outputs":
        return Check()
    if value == "partition":
        return Check(partition=True)
    if isinstance(value, Check):
        return value
    raise ValueError(f"check must be True, False, 'outputs', 'partition' or an aotstack.Check, got {value!r}")


@dataclass(frozen=True)
class Difference:
    """How far one lowered output is from eager: ``output`` names it (``output``, ``[0]``, ``['logits']``).

    ``max_rel`` is the largest ``|lowered - eager| / |eager|`` where they differ; both are
    ``inf`` where a NaN or an infinity on one side has no match on the other, and where
    ``mismatch`` says the two cannot be compared element by element (a shape, a dtype, a
    non-tensor value).
    """

    method: str
    output: str
    max_abs: float
    max_rel: float
    passed: bool
    # The delegate whose output this is, in a partition check; None for a method output.
    delegate: str | None = None
    # The delegate's backend, in a partition check.
    backend_id: str | None = None
    # Why the two cannot be compared element by element, e.g. ``shape (2, 3), eager (3, 2)``.
    mismatch: str | None = None
    # The compared tensors' dtype, whose tolerance judged them; None for a value that is not a tensor.
    dtype: torch.dtype | None = None

    @property
    def where(self) -> str:
        """``method 'forward'``, or ``delegate forward.0 (test_add_one)`` in a partition check."""
        if self.delegate is None:
            return f"method {self.method!r}"
        return f"delegate {self.delegate} ({self.backend_id})" if self.backend_id else f"delegate {self.delegate}"

    def amounts(self, check: Check) -> str:
        """``max abs 1.000e+00, max rel 2.3e+00 (atol 1e-04, rtol 1e-04)``, or what does not match."""
        if self.mismatch is not None:
            return self.mismatch
        return f"max abs {self.max_abs:.3e}, max rel {self.max_rel:.1e} ({check.tolerance_text(self.dtype)})"

    def failure_line(self, check: Check) -> str:
        against = "eager" if self.delegate is None else "its eager ops"
        # A lone output is named ``output`` and a delegate's ``output 0``; the rest are paths like ``[0]``.
        subject = self.output if self.output.startswith("output") else f"output {self.output}"
        return f"{self.where}: {subject} differs from {against}: {self.amounts(check)}"

    def to_json(self) -> dict[str, Any]:
        """Plain values; an infinite difference is the string ``"inf"``, which strict JSON can hold."""
        return {
            "method": self.method,
            "delegate": self.delegate,
            "backend_id": self.backend_id,
            "output": self.output,
            "max_abs": json_number(self.max_abs),
            "max_rel": json_number(self.max_rel),
            "passed": self.passed,
            "mismatch": self.mismatch,
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
        }


def json_number(value: float) -> float | str:
    return value if math.isfinite(value) else "inf"


@dataclass(frozen=True)
class CheckResult:
    """Every difference the check measured: one per method output, and per delegate output in a partition check."""

    check: Check
    outputs: list[Difference] = field(default_factory=list)
    delegates: list[Difference] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(d.passed for d in (*self.outputs, *self.delegates))

    def tolerance_text(self) -> str:
        """The tolerances of the compared outputs' floating dtypes."""
        dtypes = (d.dtype for d in (*self.outputs, *self.delegates) if d.dtype is not None)
        return self.check.tolerance_text(*(dtype for dtype in dtypes if dtype.is_floating_point))

    def failing_delegates(self) -> list[str]:
        """The delegates, each named once with its backend, whose outputs differ from their eager ops."""
        return list(dict.fromkeys(d.where.removeprefix("delegate ") for d in self.delegates if not d.passed))

    def failure_message(self) -> str:
        """Which outputs (and, in a partition check, which delegates) are past the tolerance, and by how much."""
        failing = [d for d in (*self.outputs, *self.delegates) if not d.passed]
        if not failing:
            return f"every output is within the tolerance ({self.tolerance_text()})"
        lines = ["the lowered program's answers differ from eager PyTorch's:"]
        lines += [f"  {d.failure_line(self.check)}" for d in failing]
        if self.check.partition:
            lines.append(self.blame())
        return "\n".join(lines)

    def blame(self) -> str:
        """A sentence naming the delegates that produced a wrong answer, or saying none did."""
        culprits = self.failing_delegates()
        if not culprits:
            return (
                "no delegate differs from the eager ops it replaced on the inputs it got: the difference comes from "
                "the ops left to plain ATen, or from small differences of several delegates adding up"
            )
        # Each delegate ran its eager ops on the very inputs it got, so a failing one is wrong by itself.
        if len(culprits) == 1:
            return f"delegate {culprits[0]} produced the wrong answer: its outputs differ on the inputs it got"
        return (
            f"delegates {', '.join(culprits)} produced wrong answers: each one's outputs differ on the inputs it got"
        )

    def text(self) -> str:
        """A short table of every output compared, passing or not, for a person to read."""
        mode = "outputs and delegates" if self.check.partition else "outputs"
        verdict = "passed" if self.passed else "FAILED"
        rows = [("where", "output", "max abs", "max rel", "")]
        for d in (*self.outputs, *self.delegates):
            numbers = (f"{d.max_abs:.3e}", f"{d.max_rel:.1e}") if d.mismatch is None else (d.mismatch, "")
            rows.append((d.where, d.output, *numbers, "ok" if d.passed else "FAIL"))
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
        lines = [f"numerical check of {mode} ({self.tolerance_text()}): {verdict}"]
        lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The check's settings and every difference, as plain values (see ``Difference.to_json``)."""
        return {
            "check": self.check.to_json(),
            "passed": self.passed,
            "outputs": [d.to_json() for d in self.outputs],
            "delegates": [d.to_json() for d in self.delegates],
        }


def check_lowered(
    program: Program,
    methods: Mapping[str, ExportedProgram],
    delegates: Mapping[str, list[Delegate]],
    references: Mapping[str, Mapping[str, ExportedProgram]],
    check: Check,
) -> CheckResult:
    """Save the lowered ``methods`` to a temporary file, load it as a user would, and compare (see check_package)."""
    with tempfile.TemporaryDirectory(prefix="aotstack-check-") as folder:
        path = os.path.join(folder, "checked.pt2")
        save(methods, delegates, path)
        return check_package(program, path, check, references)


def check_package(
    program: Program, path: str, check: Check, references: Mapping[str, Mapping[str, ExportedProgram]]
) -> CheckResult:
    """Run every method of the package at ``path`` and of ``program`` eagerly on its example inputs, and compare.

    Methods run one at a time, in ``program``'s order, each from the state the package and
    the model start with; every buffer an eager run updates is put back. With
    ``check.partition``, each delegate with a program in ``references[method][delegate id]``
    (the eager ops it replaced) is also compared with that program run on the inputs the
    delegate got.
    """
    inputs = {name: example_inputs(name, exported) for name, exported in program.methods.items()}
    manifest = read_manifest(path)
    absent = [name for name in program.methods if name not in manifest.methods]
    if absent:
        raise LoweringError(f"the package {path} lacks method(s) {absent} to check")
    calls: dict[str, list[DelegateCall]] = {}
    loaded = loaded_program(path, allowed_ops=None, wrap_delegate=recording_into(calls) if check.partition else None)
    outputs: list[Difference] = []
    by_delegate: list[Difference] = []
    watched = [*program.methods.values(), *(ref for refs in references.values() for ref in refs.values())]
    with quiet_torch_warnings(), torch.no_grad(), buffers_restored(watched) as restore:
        for name, exported in program.methods.items():
            args, kwargs = inputs[name]
            record = manifest.methods[name]
            calls.clear()
            lowered = lowered_outputs(loaded, name, args, kwargs, record.inputs)
            eager = copied(exported.module()(*copied(args), **copied(kwargs)))
            restore()
            outputs += compared_outputs(name, lowered, eager, check)
            if not check.partition:
                continue
            backends = {delegate.id: delegate.backend_id for delegate in record.delegates}
            for delegate_id, reference in references.get(name, {}).items():
                backend_id, made = backends.get(delegate_id), calls.get(delegate_id, [])
                by_delegate += delegate_differences(name, delegate_id, backend_id, reference, made, check)
                restore()
    return CheckResult(check, outputs, by_delegate)


def example_inputs(method: str, exported: ExportedProgram) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example ``(args, kwargs)`` the method was exported with; a program built without them cannot be checked."""
    inputs = getattr(exported, "example_inputs", None)
    if inputs is None:
        raise LoweringError(
            f"method {method!r} has no example inputs to check with (its ExportedProgram.example_inputs is None); "
            "export it with torch.export.export or aotstack.export, or lower it without check"
        )
    args, kwargs = inputs
    return tuple(args), dict(kwargs)


def check_call_inputs(method: str, exported: ExportedProgram, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``InputError``, naming the argument and what it must be, unless the method takes ``args`` and
    ``kwargs``, as its loaded form would check them."""
    records = input_records(method, exported)
    guards = size_guards(exported, records)
    InputCheck(method, records, exported.call_spec.in_spec, guards).flat_arguments(args, kwargs)


def lowered_outputs(
    loaded: LoadedProgram, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], records: Sequence[InputRecord]
) -> Any:
    """The loaded method's outputs, copied, run from the package's initial state on the example inputs."""
    placed_args, placed_kwargs = placed_inputs((args, kwargs), records)
    loaded.reset()
    # Called through method(), not run(): a keyword argument may be called ``method``.
    return copied(loaded.method(method)(*placed_args, **placed_kwargs))


def placed_inputs(inputs: Any, records: Sequence[InputRecord]) -> Any:
    """Copies of ``inputs`` on the device type each one's record asks for.

    A method lowered with ``skip_h2d_for_method_inputs`` takes its inputs on a delegate's device.
    """
    leaves, spec = pytree.tree_flatten(inputs)
    if len(leaves) != len(records):
        return copied(inputs)
    placed = [
        leaf.detach().to(record.device, copy=True)
        if isinstance(leaf, torch.Tensor) and record.device is not None and leaf.device.type != record.device
        else copied(leaf)
        for leaf, record in zip(leaves, records)
    ]
    return pytree.tree_unflatten(placed, spec)


def copied(value: Any) -> Any:
    """``value`` with every tensor in it detached and cloned: a later run or a restored buffer cannot change it."""
    return pytree.tree_map(lambda leaf: leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf, value)


@contextmanager
def buffers_restored(programs: Iterable[ExportedProgram]) -> Iterator[Callable[[], None]]:
    """Copies of every buffer the ``programs`` update; yields a function that puts them back, also run on exit.

    ``ExportedProgram.module()`` updates a program's buffers in place, and those tensors are the
    model's own (and the lowered program's), so a check must leave them as it found them.
    """
    buffers = {id(tensor): tensor for exported in programs for tensor in updated_buffers(exported)}
    saved = {key: tensor.detach().clone() for key, tensor in buffers.items()}

    def restore() -> None:
        with torch.no_grad():
            for key, tensor in buffers.items():
                tensor.copy_(saved[key])

    try:
        yield restore
    finally:
        restore()


def updated_buffers(exported: ExportedProgram) -> list[torch.Tensor]:
    """The buffers (persistent or not) that running ``exported`` updates in place."""
    weights = program_weights(exported)
    names = set(exported.graph_signature.buffers_to_mutate.values())
    return [weights[name] for name in sorted(names) if name in weights]


@dataclass(frozen=True)
class DelegateCall:
    """What one delegate call was given and gave back, copied as it happened."""

    inputs: list[Any]
    outputs: list[Any]


class RecordingRuntime(BackendRuntime):
    """A delegate's run side that also records each call; no ``backend_id``, so it registers nothing."""

    def __init__(self, inner: BackendRuntime, delegate_id: str, calls: dict[str, list[DelegateCall]]) -> None:
        self.inner = inner
        self.delegate_id = delegate_id
        self.calls = calls

    def execute(self, handle: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        # Copied before the call too: a later step may update a tensor the delegate read.
        given = copied(list(inputs))
        results = self.inner.execute(handle, inputs)
        self.calls.setdefault(self.delegate_id, []).append(DelegateCall(given, copied(list(results))))
        return results


def recording_into(calls: dict[str, list[DelegateCall]]) -> DelegateWrapper:
    """A wrapper for ``loaded_program`` that makes every delegate record its calls in ``calls``, by delegate id."""

    def recording(delegate_id: str, delegate: LoadedDelegate) -> LoadedDelegate:
        return LoadedDelegate(RecordingRuntime(delegate.runtime, delegate_id, calls), delegate.handle)

    return recording


def delegate_differences(
    method: str,
    delegate_id: str,
    backend_id: str | None,
    reference: ExportedProgram,
    calls: Sequence[DelegateCall],
    check: Check,
) -> list[Difference]:
    """Each recorded call of the delegate against its eager ops run on the same inputs; ``output 0``, ``output 1``..."""
    differences: list[Difference] = []
    if not calls:
        return differences
    eager_ops, devices = reference.module(), placeholder_devices(reference)
    for number, call in enumerate(calls):
        expected = eager_ops(*on_devices(call.inputs, devices))
        expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
        # A delegate runs once per method call; were it called again, each call is named.
        suffix = f" (call {number})" if len(calls) > 1 else ""
        if len(expected) != len(call.outputs):
            differences.append(
                Difference(
                    method, f"outputs{suffix}", math.inf, math.inf, False, delegate_id, backend_id,
                    f"{len(call.outputs)} outputs, its eager ops {len(expected)}",
                )
            )
            continue
        for index, (got, want) in enumerate(zip(call.outputs, expected)):
            differences.append(
                leaf_difference(method, f"output {index}{suffix}", got, want, check, delegate_id, backend_id)
            )
    return differences


def placeholder_devices(exported: ExportedProgram) -> list[torch.device | None]:
    """The device of each user input of ``exported``, as traced; None where it is not a tensor."""
    user_inputs = set(exported.graph_signature.user_inputs)
    devices = []
    for node in exported.graph.nodes:
        if node.op == "placeholder" and node.name in user_inputs:
            value = node.meta.get("val")
            devices.append(value.device if isinstance(value, torch.Tensor) else None)
    return devices


def on_devices(values: Sequence[Any], devices: Sequence[torch.device | None]) -> list[Any]:
    """``values`` moved where the reference's inputs were traced (a CUDA delegate's inputs back to the host)."""
    return [
        value.to(device) if isinstance(value, torch.Tensor) and device is not None and value.device != device else value
        for value, device in zip(values, devices)
    ]


def compared_outputs(method: str, lowered: Any, eager: Any, check: Check) -> list[Difference]:
    """One Difference per output leaf of ``eager``, matched by pytree path, and one per leaf only ``lowered`` has."""
    got = dict(named_leaves(lowered))
    want = dict(named_leaves(eager))
    differences = []
    for name, value in want.items():
        if name in got:
            differences.append(leaf_difference(method, name, got[name], value, check))
        else:
            differences.append(unmatched(method, name, "missing from the lowered outputs"))
    differences += [unmatched(method, name, "not among eager's outputs") for name in got if name not in want]
    return differences


def unmatched(method: str, name: str, why: str) -> Difference:
    return Difference(method, name, math.inf, math.inf, False, mismatch=why)


def named_leaves(value: Any) -> list[tuple[str, Any]]:
    """Each leaf of ``value`` with its pytree path: ``[0]``, ``['logits']``, or ``output`` for a lone leaf."""
    leaves, _ = pytree.tree_flatten_with_path(value)
    return [(pytree.keystr(path) or "output", leaf) for path, leaf in leaves]


def leaf_difference(
    method: str,
    name: str,
    lowered: Any,
    eager: Any,
    check: Check,
    delegate: str | None = None,
    backend_id: str | None = None,
) -> Difference:
    """How far one lowered leaf is from eager's: tensors element by element, anything else by equality."""
    mismatch = leaf_mismatch(lowered, eager)
    if mismatch is not None:
        return Difference(method, name, math.inf, math.inf, False, delegate, backend_id, mismatch)
    if not isinstance(eager, torch.Tensor):
        return Difference(method, name, 0.0, 0.0, True, delegate, backend_id)
    max_abs, max_rel, passed = tensor_difference(lowered, eager, check)
    return Difference(method, name, max_abs, max_rel, passed, delegate, backend_id, dtype=eager.dtype)


def leaf_mismatch(lowered: Any, eager: Any) -> str | None:
    """Why two leaves cannot be compared element by element (or differ as plain values); None where they can."""
    if isinstance(lowered, torch.Tensor) != isinstance(eager, torch.Tensor):
        return f"a {type(lowered).__name__}, eager a {type(eager).__name__}"
    if not isinstance(eager, torch.Tensor):
        return None if lowered == eager else f"{lowered!r}, eager {eager!r}"
    if lowered.dtype != eager.dtype:
        return f"dtype {lowered.dtype}, eager {eager.dtype}"
    if tuple(lowered.shape) != tuple(eager.shape):
        return f"shape {tuple(lowered.shape)}, eager {tuple(eager.shape)}"
    return None


def tensor_difference(lowered: torch.Tensor, eager: torch.Tensor, check: Check) -> tuple[float, float, bool]:
    """``(max abs, max rel, passed)`` for two tensors of one shape and dtype, compared on the host in 64 bits.

    NaN against NaN and an infinity against the same infinity count as equal; any other NaN or
    infinity on one side only is an infinite difference. Integers and bools must match exactly.
    """
    if eager.numel() == 0:
        return 0.0, 0.0, True
    wide = torch.complex128 if lowered.is_complex() or eager.is_complex() else torch.float64
    a = lowered.detach().to("cpu", wide)
    b = eager.detach().to("cpu", wide)
    equal = (a == b) | (a.isnan() & b.isnan())
    diff = torch.where(equal, 0.0, (a - b).abs())
    # A NaN left here is on one side only, and counts as far off as possible.
    diff = torch.where(diff.isnan(), math.inf, diff)
    scale = b.abs()
    rel = torch.where(diff == 0, 0.0, diff / scale)
    rel = torch.where(rel.isnan(), math.inf, rel)
    if lowered.is_floating_point() or lowered.is_complex():
        # An infinite bound (eager inf) would otherwise let any finite answer through.
        atol, rtol = check.tolerance(eager.dtype)
        within = (diff == 0) | (diff.isfinite() & (diff <= atol + rtol * scale))
        passed = bool(within.all())
    else:
        passed = torch.equal(lowered.detach().cpu(), eager.detach().cpu())
    return float(diff.max()), float(rel.max()), passed
