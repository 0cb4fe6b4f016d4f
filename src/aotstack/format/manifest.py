"""The manifest of a package: typed records for its methods, delegates, weights and inputs.

The manifest is the one JSON document in a package that aotstack reads; every other entry is a
blob it names by content hash. ``Manifest.to_json`` and ``Manifest.from_json`` are its codec;
reading checks each field's type, so a damaged manifest is a ``PackageError`` naming the field,
never a ``KeyError`` from deep inside the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PackageError
from .plan import MethodPlan, expect, method_plan_from_json, method_plan_to_json
from .records import TensorSpec
from .specs import CompileSpec

FORMAT_NAME = "aotstack"
FORMAT_VERSION = 3


@dataclass(frozen=True)
class Dim:
    """A symbolic size and the range it was exported for (``max`` None: unbounded)."""

    symbol: str
    min: int
    max: int | None


@dataclass(frozen=True)
class InputRecord:
    """What one user input of a method must be.

    ``kind`` is ``tensor`` (with ``dtype`` and ``shape``: ints, ``Dim`` for a symbol, None for an
    expression of symbols), ``int``, ``float`` or ``bool`` (``value`` when specialised, else
    None, with ``dim`` for a symbolic int), or ``none``.
    """

    name: str
    kind: str
    dtype: str | None = None
    shape: list[int | Dim | None] | None = None
    value: Any = None
    dim: Dim | None = None


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


@dataclass(frozen=True)
class Manifest:
    aotstack_version: str
    torch_version: str
    methods: dict[str, MethodRecord]
    # Blob key -> size in bytes.
    blobs: dict[str, int]
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "aotstack_version": self.aotstack_version,
            "torch_version": self.torch_version,
            "methods": {name: method_to_json(method) for name, method in self.methods.items()},
            "blobs": dict(self.blobs),
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        data = expect(data, dict, "the manifest")
        if data.get("format") != FORMAT_NAME or data.get("format_version") != FORMAT_VERSION:
            raise PackageError(
                f"package format {data.get('format')!r} version {data.get('format_version')!r}; "
                f"this aotstack reads {FORMAT_NAME!r} version {FORMAT_VERSION}"
            )
        methods = expect(data.get("methods"), dict, "the manifest's methods")
        blobs = expect(data.get("blobs"), dict, "the manifest's blobs")
        for key, size in blobs.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise PackageError(f"blob {key!r} has size {size!r}; expected a non-negative int")
        return cls(
            aotstack_version=str(data.get("aotstack_version")),
            torch_version=str(data.get("torch_version")),
            methods={name: within(f"method {name!r}", method_from_json, method) for name, method in methods.items()},
            blobs=blobs,
        )

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
    }


def method_from_json(data: Any) -> MethodRecord:
    data = expect(data, dict, "a method")
    weights = expect(data.get("weights"), dict, "weights")
    return MethodRecord(
        program=expect(data.get("program"), str, "program"),
        inputs=[input_from_json(record) for record in expect(data.get("inputs"), list, "inputs")],
        plan=within("plan", method_plan_from_json, data.get("plan")),
        in_spec=expect(data.get("in_spec"), str, "in_spec"),
        out_spec=expect(data.get("out_spec"), str, "out_spec"),
        weights={fqn: within(f"weight {fqn!r}", weight_from_json, weight) for fqn, weight in weights.items()},
        delegates=[delegate_from_json(delegate) for delegate in expect(data.get("delegates"), list, "delegates")],
    )


def weight_from_json(data: Any) -> WeightRecord:
    data = expect(data, dict, "a weight")
    return WeightRecord(
        blob=expect(data.get("blob"), str, "blob"),
        dtype=expect(data.get("dtype"), str, "dtype"),
        shape=sizes(data.get("shape"), "shape"),
    )


def sizes(value: Any, what: str) -> list[int]:
    value = expect(value, list, what)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise PackageError(f"{what} must list non-negative ints, got {value!r}")
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
    }


def delegate_from_json(data: Any) -> DelegateRecord:
    data = expect(data, dict, "a delegate")
    delegate_id = expect(data.get("id"), str, "a delegate's id")
    return within(f"delegate {delegate_id}", delegate_fields, data)


def delegate_fields(data: dict[str, Any]) -> DelegateRecord:
    named_data = expect(data.get("named_data"), dict, "named_data")
    if not all(isinstance(key, str) for key in named_data.values()):
        raise PackageError("named_data must map names to blob keys")
    return DelegateRecord(
        id=data["id"],
        backend_id=expect(data.get("backend_id"), str, "backend_id"),
        target_device=expect(data.get("target_device"), str, "target_device"),
        compile_specs=[compile_spec_from_json(s) for s in expect(data.get("compile_specs"), list, "compile_specs")],
        ops=[expect(op, str, "an op") for op in expect(data.get("ops"), list, "ops")],
        inputs=[tensor_spec_from_json(spec) for spec in expect(data.get("inputs"), list, "inputs")],
        outputs=[tensor_spec_from_json(spec) for spec in expect(data.get("outputs"), list, "outputs")],
        processed=expect(data.get("processed"), str, "processed"),
        named_data=named_data,
        updates=[expect(fqn, str, "an updated buffer") for fqn in expect(data.get("updates"), list, "updates")],
    )


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
    shape = expect(data.get("shape"), list, "a tensor spec's shape")
    if not all(d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in shape):
        raise PackageError(f"a tensor spec's shape must hold ints or null, got {shape!r}")
    return TensorSpec(expect(data.get("dtype"), str, "a tensor spec's dtype"), shape)


# Inputs ------------------------------------------------------------------------------------------

INPUT_KINDS = ("tensor", "int", "float", "bool", "none")


def input_to_json(record: InputRecord) -> dict[str, Any]:
    data: dict[str, Any] = {"name": record.name, "kind": record.kind}
    if record.kind == "tensor":
        data["dtype"] = record.dtype
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
        shape = expect(data.get("shape"), list, "shape")
        shape = [d if d is None or isinstance(d, int) else dim_from_json(d) for d in shape]
        return InputRecord(name, kind, dtype=expect(data.get("dtype"), str, "dtype"), shape=shape)
    dim = data.get("dim")
    return InputRecord(name, kind, value=data.get("value"), dim=None if dim is None else dim_from_json(dim))


def dim_from_json(data: Any) -> Dim:
    data = expect(data, dict, "a symbolic size")
    low, high = data.get("min"), data.get("max")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        raise PackageError(f"a symbolic size's range must be ints, got [{low!r}, {high!r}]")
    return Dim(expect(data.get("symbol"), str, "a symbol"), low, high)
