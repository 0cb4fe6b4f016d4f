"""The manifest of a package: typed records for its methods, delegates, weights and inputs.

The manifest is the one JSON document in a package that aotstack reads; every other entry is a
blob it names by content hash, or a record whose hash it holds. ``Manifest.to_json`` and
``Manifest.from_json`` are its codec. Reading checks every field before anything uses it: its
type, its range, the blobs, weights, delegates and steps it refers to, and bounds on sizes and
counts; a bad manifest is a ``PackageError`` naming the field, never a ``KeyError`` from deep
inside the runtime, and never a reason to allocate more than the file holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import PackageError
from .custom_ops import PLAN, CustomOpRecord, custom_op_from_json, custom_op_to_json, is_custom_op_name
from .guards import MAX_GUARDS, size_guard
from .placement import Placement, placement_from_json, placement_to_json
from .plan import (
    DelegateStep,
    InputStep,
    MethodPlan,
    WeightStep,
    bounded,
    check_reads,
    checked_names,
    custom_op_names,
    expect,
    method_plan_from_json,
    method_plan_to_json,
    refs,
)
from .records import TensorSpec
from .seal import is_hex
from .specs import CompileSpec
from .tensor_data import WEIGHT_PREFIX, dtype_from_name

FORMAT_NAME = "aotstack"
FORMAT_VERSION = 4

# Bounds on counts and sizes; each is far past any real model.
MAX_METHODS = 1024
MAX_ITEMS = 1 << 20
MAX_RANK = 64
MAX_SIZE = 1 << 48


@dataclass(frozen=True)
class Dim:
    """A symbolic size and the range it was exported for (``max`` None: unbounded)."""

    symbol: str
    min: int
    max: int | None


@dataclass(frozen=True)
class InputRecord:
    """What one user input of a method must be.

    ``kind`` is ``tensor`` (with ``dtype``, ``shape``: ints, ``Dim`` for a symbol, None for an
    expression of symbols, and ``device``, its type such as ``cpu``), ``int``, ``float`` or
    ``bool`` (``value`` when specialised, else None, with ``dim`` for a symbolic int), or ``none``.
    """

    name: str
    kind: str
    dtype: str | None = None
    shape: list[int | Dim | None] | None = None
    value: Any = None
    dim: Dim | None = None
    device: str | None = None


def record_text(record: InputRecord) -> str:
    """``x: float32[4, s0 in [1, 64]]``, ``n: int = 3``: one input as messages and reports show it."""
    if record.kind == "tensor":
        return f"{record.name}: {record.dtype}{shape_text(record.shape or [])}"
    if record.kind == "none":
        return f"{record.name}: None"
    if record.value is not None:
        return f"{record.name}: {record.kind} = {record.value!r}"
    return f"{record.name}: {record.kind}" + (f" in {range_text(record.dim)}" if record.dim else "")


def range_text(dim: Dim) -> str:
    return f"[{dim.min}, {'∞' if dim.max is None else dim.max}]"


def shape_text(shape: Sequence[int | Dim | None]) -> str:
    """``[4, s0 in [1, 64], *]``: a symbol with its range, a star for an unchecked expression."""
    parts = []
    for d in shape:
        if isinstance(d, Dim):
            parts.append(f"{d.symbol} in {range_text(d)}")
        else:
            parts.append("*" if d is None else str(d))
    return "[" + ", ".join(parts) + "]"


@dataclass(frozen=True)
class WeightRecord:
    blob: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True)
class DelegateRecord:
    """A delegate as stored: its backend, its compiled bytes and named data by blob key."""

    id: str
    backend_id: str
    target_device: str
    compile_specs: list[CompileSpec]
    ops: list[str]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    processed: str
    named_data: dict[str, str]
    # Buffers the delegate updates in place; their state is its named data ``weight:<fqn>``.
    updates: list[str] = field(default_factory=list)
    # Custom ops its compiled code calls back through torch; a subset of ``ops``'s custom ones.
    calls: list[str] = field(default_factory=list)
    # Its quantized layers, counted by kind and scheme: ``{"linear 8da4w, group 32": 28}``.
    quantized: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MethodRecord:
    """One method: where its stock program is, its inputs, run plan, pytree specs, weights and delegates."""

    program: str
    inputs: list[InputRecord]
    plan: MethodPlan
    in_spec: str
    out_spec: str
    weights: dict[str, WeightRecord]
    delegates: list[DelegateRecord]
    # Where each op went and why; None in a file written before aotstack recorded it.
    placement: Placement | None = None
    # Conditions on the input sizes, beyond their ranges, that the export holds under (``format/guards.py``).
    guards: list[str] = field(default_factory=list)


def symbolic_sizes(inputs: Sequence[InputRecord]) -> list[tuple[InputRecord, int | None, Dim]]:
    """Each symbolic size ``inputs`` take, in order: its input, its dimension (None for a symbolic int) and ``Dim``."""
    found: list[tuple[InputRecord, int | None, Dim]] = []
    for record in inputs:
        if record.dim is not None:
            found.append((record, None, record.dim))
        found.extend((record, axis, d) for axis, d in enumerate(record.shape or []) if isinstance(d, Dim))
    return found


def size_symbols(inputs: Sequence[InputRecord]) -> set[str]:
    """The symbols of the sizes ``inputs`` bind: a tensor's symbolic dimensions and symbolic ints."""
    return {dim.symbol for _, _, dim in symbolic_sizes(inputs)}


@dataclass(frozen=True)
class Manifest:
    aotstack_version: str
    torch_version: str
    methods: dict[str, MethodRecord]
    # Blob key -> size in bytes.
    blobs: dict[str, int]
    # Every other entry the archive holds (programs, torch's records) -> its SHA-256.
    records: dict[str, str] = field(default_factory=dict)
    # Ops outside ATen that the methods call, in their libraries or plans (format/custom_ops.py).
    custom_ops: list[CustomOpRecord] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "aotstack_version": self.aotstack_version,
            "torch_version": self.torch_version,
            "methods": {name: method_to_json(method) for name, method in self.methods.items()},
            "blobs": dict(self.blobs),
            "records": dict(self.records),
            "custom_ops": [custom_op_to_json(record) for record in self.custom_ops],
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        data = expect(data, dict, "the manifest")
        if data.get("format") != FORMAT_NAME or data.get("format_version") != FORMAT_VERSION:
            raise PackageError(
                f"package format {data.get('format')!r} version {data.get('format_version')!r}; "
                f"this aotstack reads {FORMAT_NAME!r} version {FORMAT_VERSION}"
            )
        methods = bounded(data.get("methods"), dict, "the manifest's methods", MAX_METHODS)
        blobs = bounded(data.get("blobs"), dict, "the manifest's blobs", MAX_ITEMS)
        for key, size in blobs.items():
            if not is_sha256(key):
                raise PackageError(f"blob key {key[:80]!r} is not a SHA-256 in hex")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise PackageError(f"blob {key!r} has size {size!r}; expected a non-negative int")
        records = bounded(data.get("records"), dict, "the manifest's records", MAX_ITEMS)
        for name, key in records.items():
            if not is_sha256(key):
                raise PackageError(f"record {name[:80]!r} has hash {str(key)[:80]!r}; expected a SHA-256 in hex")
        custom_ops = bounded(data.get("custom_ops", []), list, "the manifest's custom ops", MAX_ITEMS)
        manifest = cls(
            aotstack_version=str(data.get("aotstack_version")),
            torch_version=str(data.get("torch_version")),
            methods={name: within(f"method {name!r}", method_from_json, method) for name, method in methods.items()},
            blobs=blobs,
            records=records,
            custom_ops=[custom_op_from_json(record) for record in custom_ops],
        )
        for name, method in manifest.methods.items():
            within(f"method {name!r}", lambda m: check_method(m, manifest.blobs), method)
        check_custom_ops_listed(manifest)
        return manifest

    def blob_owners(self) -> dict[str, str]:
        """Blob key -> what uses it, for messages."""
        owners: dict[str, str] = {}
        for name, method in self.methods.items():
            for fqn, weight in method.weights.items():
                owners.setdefault(weight.blob, f"weight {fqn!r} of method {name!r}")
            for delegate in method.delegates:
                owners.setdefault(delegate.processed, f"delegate {delegate.id} processed bytes")
                for local, key in delegate.named_data.items():
                    owners.setdefault(key, f"{local!r} of delegate {delegate.id}")
        return owners


def check_custom_ops_listed(manifest: Manifest) -> None:
    """Every custom op a plan or delegate calls is in the manifest's list, where the loader checks it."""
    listed = {record.name: record for record in manifest.custom_ops}
    if len(listed) != len(manifest.custom_ops):
        raise PackageError("the manifest lists a custom op twice")
    for name, method in manifest.methods.items():
        for op in sorted(custom_op_names(method.plan.steps)):
            if op not in listed or PLAN not in listed[op].used_by:
                raise PackageError(f"method {name!r}: its plan calls custom op {op!r}, which the manifest omits")
        for delegate in method.delegates:
            for op in delegate.calls:
                if op not in listed or delegate.id not in listed[op].used_by:
                    raise PackageError(
                        f"method {name!r}: delegate {delegate.id} calls custom op {op!r}, which the manifest omits"
                    )


def is_sha256(key: Any) -> bool:
    return is_hex(key, 64)


def within(where: str, read: Any, data: Any) -> Any:
    """``read(data)``, with ``where`` put in front of the message of any ``PackageError``."""
    try:
        return read(data)
    except PackageError as exc:
        raise PackageError(f"{where}: {exc}") from None


# Methods -----------------------------------------------------------------------------------------


def method_to_json(method: MethodRecord) -> dict[str, Any]:
    return {
        "program": method.program,
        "inputs": [input_to_json(record) for record in method.inputs],
        "plan": method_plan_to_json(method.plan),
        "in_spec": method.in_spec,
        "out_spec": method.out_spec,
        "weights": {fqn: vars(weight).copy() for fqn, weight in method.weights.items()},
        "delegates": [delegate_to_json(delegate) for delegate in method.delegates],
        **({} if method.placement is None else {"placement": placement_to_json(method.placement)}),
        **({"guards": list(method.guards)} if method.guards else {}),
    }


def method_from_json(data: Any) -> MethodRecord:
    data = expect(data, dict, "a method")
    weights = bounded(data.get("weights"), dict, "weights", MAX_ITEMS)
    placement = data.get("placement")
    return MethodRecord(
        program=expect(data.get("program"), str, "program"),
        inputs=[input_from_json(record) for record in bounded(data.get("inputs"), list, "inputs", MAX_ITEMS)],
        plan=within("plan", method_plan_from_json, data.get("plan")),
        in_spec=expect(data.get("in_spec"), str, "in_spec"),
        out_spec=expect(data.get("out_spec"), str, "out_spec"),
        weights={fqn: within(f"weight {fqn!r}", weight_from_json, weight) for fqn, weight in weights.items()},
        delegates=[delegate_from_json(d) for d in bounded(data.get("delegates"), list, "delegates", MAX_ITEMS)],
        placement=None if placement is None else within("placement", placement_from_json, placement),
        guards=bounded(data.get("guards", []), list, "guards", MAX_GUARDS),
    )


def weight_from_json(data: Any) -> WeightRecord:
    data = expect(data, dict, "a weight")
    return WeightRecord(
        blob=expect(data.get("blob"), str, "blob"),
        dtype=dtype_text(data.get("dtype"), "dtype"),
        shape=sizes(data.get("shape"), "shape"),
    )


def sizes(value: Any, what: str) -> list[int]:
    value = bounded(value, list, what, MAX_RANK)
    if not all(is_size(d) for d in value):
        raise PackageError(f"{what} must list ints in [0, 2**48], got {value!r}")
    return value


def is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SIZE


def dtype_text(value: Any, what: str) -> str:
    """A dtype's name, checked to be one of torch's."""
    value = expect(value, str, what)
    try:
        dtype_from_name(value)
    except ValueError:
        raise PackageError(f"{what} {value[:40]!r} is not a torch dtype") from None
    return value


# Delegates ---------------------------------------------------------------------------------------


def delegate_to_json(delegate: DelegateRecord) -> dict[str, Any]:
    return {
        "id": delegate.id,
        "backend_id": delegate.backend_id,
        "target_device": delegate.target_device,
        "compile_specs": [[spec.key, spec.value.hex()] for spec in delegate.compile_specs],
        "ops": list(delegate.ops),
        "inputs": [vars(spec).copy() for spec in delegate.inputs],
        "outputs": [vars(spec).copy() for spec in delegate.outputs],
        "processed": delegate.processed,
        "named_data": dict(delegate.named_data),
        "updates": list(delegate.updates),
        "calls": list(delegate.calls),
        "quantized": dict(delegate.quantized),
    }


def delegate_from_json(data: Any) -> DelegateRecord:
    data = expect(data, dict, "a delegate")
    delegate_id = expect(data.get("id"), str, "a delegate's id")
    return within(f"delegate {delegate_id}", delegate_fields, data)


def delegate_fields(data: dict[str, Any]) -> DelegateRecord:
    named_data = bounded(data.get("named_data"), dict, "named_data", MAX_ITEMS)
    if not all(is_sha256(key) for key in named_data.values()):
        raise PackageError("named_data must map names to blob keys")
    ops = [expect(op, str, "an op") for op in bounded(data.get("ops"), list, "ops", MAX_ITEMS)]
    # A file written before delegates listed their calls: every custom op claimed was called.
    calls = data["calls"] if "calls" in data else [op for op in ops if is_custom_op_name(op)]
    calls = [expect(op, str, "a call") for op in bounded(calls, list, "calls", MAX_ITEMS)]
    return DelegateRecord(
        id=data["id"],
        backend_id=expect(data.get("backend_id"), str, "backend_id"),
        target_device=expect(data.get("target_device"), str, "target_device"),
        compile_specs=[compile_spec_from_json(s) for s in bounded(data.get("compile_specs"), list, "specs", 256)],
        ops=ops,
        inputs=[tensor_spec_from_json(spec) for spec in bounded(data.get("inputs"), list, "inputs", MAX_ITEMS)],
        outputs=[tensor_spec_from_json(spec) for spec in bounded(data.get("outputs"), list, "outputs", MAX_ITEMS)],
        processed=blob_key(data.get("processed"), "processed"),
        named_data=named_data,
        updates=[expect(fqn, str, "an update") for fqn in bounded(data.get("updates"), list, "updates", MAX_ITEMS)],
        calls=calls,
        quantized=quantized_counts(data.get("quantized", {})),
    )


def quantized_counts(data: Any) -> dict[str, int]:
    counts = bounded(data, dict, "quantized", MAX_ITEMS)
    if not all(isinstance(count, int) and not isinstance(count, bool) and count > 0 for count in counts.values()):
        raise PackageError("quantized must map layer kinds to positive counts")
    return dict(counts)


def blob_key(value: Any, what: str) -> str:
    if not is_sha256(value):
        raise PackageError(f"{what} must be a blob key (a SHA-256 in hex)")
    return value


def compile_spec_from_json(data: Any) -> CompileSpec:
    data = expect(data, list, "a compile spec")
    if len(data) != 2 or not all(isinstance(item, str) for item in data):
        raise PackageError(f"a compile spec must be [key, hex value], got {data!r}")
    try:
        return CompileSpec(data[0], bytes.fromhex(data[1]))
    except ValueError:
        raise PackageError(f"compile spec {data[0]!r} has a value that is not hex") from None


def tensor_spec_from_json(data: Any) -> TensorSpec:
    data = expect(data, dict, "a tensor spec")
    shape = bounded(data.get("shape"), list, "a tensor spec's shape", MAX_RANK)
    if not all(d is None or is_size(d) for d in shape):
        raise PackageError(f"a tensor spec's shape must hold sizes or null, got {shape!r}")
    return TensorSpec(dtype_text(data.get("dtype"), "a tensor spec's dtype"), shape)


# Inputs ------------------------------------------------------------------------------------------

INPUT_KINDS = ("tensor", "int", "float", "bool", "none")


def input_to_json(record: InputRecord) -> dict[str, Any]:
    data: dict[str, Any] = {"name": record.name, "kind": record.kind}
    if record.kind == "tensor":
        data["dtype"] = record.dtype
        data["device"] = record.device
        data["shape"] = [vars(d).copy() if isinstance(d, Dim) else d for d in record.shape or []]
    elif record.kind != "none":
        data["value"] = record.value
        if record.dim is not None:
            data["dim"] = vars(record.dim).copy()
    return data


def input_from_json(data: Any) -> InputRecord:
    data = expect(data, dict, "an input")
    name = expect(data.get("name"), str, "an input's name")
    kind = data.get("kind")
    if kind not in INPUT_KINDS:
        raise PackageError(f"input {name!r} has kind {kind!r}; expected one of {', '.join(INPUT_KINDS)}")
    if kind == "none":
        return InputRecord(name, kind)
    if kind == "tensor":
        shape = bounded(data.get("shape"), list, "shape", MAX_RANK)
        shape = [d if d is None or is_size(d) else dim_from_json(d) for d in shape]
        dtype, device = dtype_text(data.get("dtype"), "dtype"), expect(data.get("device"), str, "device")
        return InputRecord(name, kind, dtype=dtype, shape=shape, device=device)
    value, dim = data.get("value"), data.get("dim")
    if value is not None and not scalar_fits(kind, value):
        raise PackageError(f"input {name!r} is a {kind} with value {value!r}")
    return InputRecord(name, kind, value=value, dim=None if dim is None else dim_from_json(dim))


def scalar_fits(kind: str, value: Any) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (kind == "float" and isinstance(value, float))


def dim_from_json(data: Any) -> Dim:
    data = expect(data, dict, "a symbolic size")
    low, high = data.get("min"), data.get("max")
    if not is_size(low) or not (high is None or (is_size(high) and high >= low)):
        raise PackageError(f"a symbolic size's range must be sizes with min <= max, got [{low!r}, {high!r}]")
    return Dim(expect(data.get("symbol"), str, "a symbol"), low, high)


# References --------------------------------------------------------------------------------------


def check_method(method: MethodRecord, blobs: dict[str, int]) -> None:
    """Every blob, weight, delegate and step ``method`` refers to exists, with sizes that agree."""
    for fqn, weight in method.weights.items():
        check_weight(fqn, weight, blobs)
    delegates = {}
    for delegate in method.delegates:
        if delegate.id in delegates:
            raise PackageError(f"two delegates have the id {delegate.id!r}")
        delegates[delegate.id] = within(f"delegate {delegate.id}", lambda d: check_delegate(d, blobs), delegate)
    plan = method.plan
    names = within("plan", lambda steps: checked_names(steps, "plan"), plan.steps)
    check_reads(refs(plan.outputs), names, "the plan's outputs")
    inputs = [step for step in plan.steps if isinstance(step, InputStep)]
    if len(inputs) != len(method.inputs):
        raise PackageError(f"the plan reads {len(inputs)} input(s), but the method records {len(method.inputs)}")
    for step in plan.steps:
        if isinstance(step, WeightStep) and step.fqn not in method.weights:
            raise PackageError(f"plan step {step.name!r} reads weight {step.fqn!r}, which the method lacks")
        if isinstance(step, DelegateStep):
            check_delegate_step(step, delegates)
    for fqn, name in plan.mutations:
        if fqn not in method.weights or name not in names:
            raise PackageError(f"the plan updates {fqn!r} from {name!r}, but the method lacks one of them")
    symbols = size_symbols(method.inputs)
    for guard in method.guards:
        size_guard(guard, symbols)


def check_weight(fqn: str, weight: WeightRecord, blobs: dict[str, int]) -> None:
    if weight.blob not in blobs:
        raise PackageError(f"weight {fqn!r} names blob {weight.blob[:16]}…, which the package lacks")
    count = 1
    for size in weight.shape:
        count *= size
    expected = count * dtype_from_name(weight.dtype).itemsize
    if expected != blobs[weight.blob]:
        raise PackageError(
            f"weight {fqn!r} is {weight.dtype}{weight.shape}, {expected} bytes, but its blob holds {blobs[weight.blob]}"
        )


def check_delegate(delegate: DelegateRecord, blobs: dict[str, int]) -> DelegateRecord:
    for name, key in [("processed", delegate.processed), *delegate.named_data.items()]:
        if key not in blobs:
            raise PackageError(f"{name!r} names blob {key[:16]}…, which the package lacks")
    for fqn in delegate.updates:
        if WEIGHT_PREFIX + fqn not in delegate.named_data:
            raise PackageError(f"it updates buffer {fqn!r}, but its named data lacks {WEIGHT_PREFIX + fqn!r}")
    return delegate


def check_delegate_step(step: DelegateStep, delegates: dict[str, DelegateRecord]) -> None:
    delegate = delegates.get(step.delegate)
    if delegate is None:
        raise PackageError(f"the plan calls delegate {step.delegate!r}, which the method lacks")
    if len(step.inputs) != len(delegate.inputs):
        raise PackageError(
            f"the plan passes {len(step.inputs)} input(s) to delegate {step.delegate}, "
            f"which takes {len(delegate.inputs)}"
        )
    for index, name in step.outputs:
        if not 0 <= index < len(delegate.outputs):
            raise PackageError(
                f"step {name!r} reads output {index} of delegate {step.delegate}, which has {len(delegate.outputs)}"
            )
