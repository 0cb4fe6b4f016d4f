"""Saving a lowered program: its manifest records, its blobs, and the stock program of each method."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from .. import __version__
from ..errors import LoweringError, PackageError
from ..format.archive import PROGRAM_PATH, hashes, write_package
from ..format.devices import Device
from ..format.manifest import DelegateRecord, Dim, InputRecord, Manifest, MethodRecord, WeightRecord
from ..format.placement import Placement
from ..format.records import Delegate
from ..format.state import state_devices
from ..format.tensor_data import BytesLike, content_key, dtype_name, tensor_buffer, tensor_is_viewable
from .custom_ops import custom_op_records
from .guards import size_guards
from .plan import method_plan
from .program_parts import program_weights, rebuilt


class BlobStore(Mapping[str, BytesLike]):
    """Blobs keyed by their content hash: the same bytes twice are stored once.

    Nothing is copied to be stored: a blob is the caller's bytes or a view of a weight's own
    memory, so saving holds no second copy of a program's weights. A weight that must be copied
    to be written (on a device, or not contiguous) is kept as the tensor and copied each time its
    blob is read: hashed from one copy, written from another, never held in memory together.
    """

    def __init__(self) -> None:
        self._blobs: dict[str, BytesLike | torch.Tensor] = {}

    def put(self, data: BytesLike) -> str:
        """Store ``data``; its content key."""
        return self.put_all([data])[0]

    def put_all(self, blobs: Sequence[BytesLike]) -> list[str]:
        """Store each of ``blobs``; their content keys, hashed on every core."""
        keys = self.keys_of([memoryview(blob) for blob in blobs])
        for key, data in zip(keys, blobs):
            self._blobs.setdefault(key, data)
        return keys

    def put_tensors(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Store each tensor's bytes (see :func:`tensor_buffer`); their content keys."""
        viewable = [index for index, tensor in enumerate(tensors) if tensor_is_viewable(tensor)]
        keys = dict(zip(viewable, self.put_all([tensor_buffer(tensors[index]) for index in viewable])))
        for index, tensor in enumerate(tensors):
            if index not in keys:
                # One copy at a time, dropped once hashed; __getitem__ makes it again to write it.
                keys[index] = self.keys_of([tensor_buffer(tensor)])[0]
                self._blobs.setdefault(keys[index], tensor)
        return [keys[index] for index in range(len(tensors))]

    def keys_of(self, views: Sequence[memoryview]) -> list[str]:
        """The key each blob is stored under: its content hash."""
        return hashes(views)

    def __getitem__(self, key: str) -> BytesLike:
        data = self._blobs[key]
        return tensor_buffer(data) if isinstance(data, torch.Tensor) else data

    def __iter__(self) -> Iterator[str]:
        return iter(self._blobs)

    def __len__(self) -> int:
        return len(self._blobs)

    def sizes(self) -> dict[str, int]:
        """Each blob's size in bytes, by key, without copying any."""
        return {
            key: data.numel() * data.element_size() if isinstance(data, torch.Tensor) else memoryview(data).nbytes
            for key, data in self._blobs.items()
        }


class SizingStore(BlobStore):
    """A store that keys a large blob by a sample of its bytes instead of hashing all of them.

    For a manifest that is only read, never written (the report of a program not yet saved):
    the same weight is still counted once, and a 500 MB model is not hashed to be described.
    """

    def keys_of(self, views: Sequence[memoryview]) -> list[str]:
        return [sampled_key(view.cast("B")) for view in views]


SAMPLE = 1 << 16


def sampled_key(view: memoryview) -> str:
    """A stand-in blob key: a small blob's content hash; for a large one, its size and three samples."""
    if view.nbytes <= 3 * SAMPLE:
        return content_key(view)
    middle = view.nbytes // 2
    digest = hashlib.sha256(str(view.nbytes).encode())
    for part in (view[:SAMPLE], view[middle : middle + SAMPLE], view[-SAMPLE:]):
        digest.update(part)
    return digest.hexdigest()


def save(
    methods: Mapping[str, ExportedProgram],
    delegates: Mapping[str, list[Delegate]],
    path: str | os.PathLike[str],
    placements: Mapping[str, Placement] | None = None,
) -> None:
    """Write lowered ``methods`` and their ``delegates`` to ``path`` atomically: a failed save leaves no file."""
    store = BlobStore()
    manifest = manifest_of(methods, delegates, placements or {}, store)
    programs = {name: serialized_program(program) for name, program in methods.items()}
    # The store reads each blob as it is written, so a copied weight lives only while it is written.
    write_package(path, manifest, programs, store)


def unsaved_manifest(
    methods: Mapping[str, ExportedProgram], delegates: Mapping[str, list[Delegate]], placements: Mapping[str, Placement]
) -> Manifest:
    """The manifest ``save`` would write, built without hashing the weights: for reading, not writing."""
    # A plan that is only described may call an op no package could run: the report says so, save refuses it.
    return manifest_of(methods, delegates, placements, SizingStore(), runnable_only=False)


def manifest_of(
    methods: Mapping[str, ExportedProgram],
    delegates: Mapping[str, list[Delegate]],
    placements: Mapping[str, Placement],
    store: BlobStore,
    *,
    runnable_only: bool = True,
) -> Manifest:
    records = {
        name: method_record(name, program, delegates[name], store, placements.get(name), runnable_only)
        for name, program in methods.items()
    }
    if runnable_only:
        try:
            state_devices(records)
        except PackageError as exc:
            raise LoweringError(f"cannot save: {exc}") from None
    return Manifest(
        aotstack_version=__version__,
        torch_version=torch.__version__,
        methods=records,
        blobs=store.sizes(),
        custom_ops=custom_op_records(records),
    )


def serialized_program(program: ExportedProgram) -> bytes:
    """The program in torch's own schema, for stock tools; the runtime reads the run plan instead."""
    # Imported here: torch._export.serde takes about 1.5 s to import.
    from torch._export.serde.serialize import serialize

    # Weights go to content-keyed blobs; the schema JSON carries only the graph and signature.
    skip_weights = {"serialize_state_dict": False, "serialize_constants": False}
    if not set(skip_weights) <= set(inspect.signature(serialize).parameters):
        # Older torch (2.11) cannot leave them out: it pickles them, a copy of every weight in
        # memory, only to have it dropped here. Given weights without data, it pickles none.
        return serialize(weightless(program)).exported_program
    return serialize(program, **skip_weights).exported_program


def weightless(program: ExportedProgram) -> ExportedProgram:
    """``program`` with each weight replaced by a ``meta`` tensor of its dtype and shape (no data)."""

    def meta(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        empty = value.detach().to("meta")
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(empty, requires_grad=value.requires_grad)
        return empty

    # The guards the serializer writes are the original's.
    return rebuilt(
        program,
        program.graph_module,
        program.graph_signature,
        state_dict={name: meta(value) for name, value in program.state_dict.items()},
        constants={name: meta(value) for name, value in program.constants.items()},
    )


def method_record(
    name: str,
    program: ExportedProgram,
    delegates: list[Delegate],
    store: BlobStore,
    placement: Placement | None = None,
    runnable_only: bool = True,
) -> MethodRecord:
    call_spec = program.call_spec
    inputs = input_records(name, program)
    return MethodRecord(
        program=PROGRAM_PATH.format(name),
        inputs=inputs,
        plan=method_plan(program, runnable_only=runnable_only),
        in_spec=pytree.treespec_dumps(call_spec.in_spec),
        out_spec=pytree.treespec_dumps(call_spec.out_spec),
        weights=weight_records(program_weights(program), store),
        delegates=[delegate_record(delegate, store) for delegate in delegates],
        placement=placement,
        guards=size_guards(program, inputs),
    )


def input_records(method: str, program: ExportedProgram) -> list[InputRecord]:
    """What each user input of ``program`` must be."""
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    records = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            node = placeholders[spec.arg.name]
            record = input_record(method, spec.arg.name, node.meta.get("val"), program.range_constraints)
            # Where the device pass left the input (on a delegate's device, with skip_h2d_for_method_inputs).
            placed = node.meta.get("device")
            if record.kind == "tensor" and isinstance(placed, Device):
                record = dataclasses.replace(record, device=placed.type.value)
            records.append(record)
    return records


# bool before int: a bool is an int in Python.
SCALAR_TYPES = (("bool", bool, torch.SymBool), ("int", int, torch.SymInt), ("float", float, torch.SymFloat))


def input_record(method: str, name: str, value: Any, ranges: dict[Any, Any]) -> InputRecord:
    if isinstance(value, torch.Tensor):
        shape = [dimension(d, ranges) for d in value.shape]
        return InputRecord(name, "tensor", dtype=dtype_name(value.dtype), shape=shape, device=value.device.type)
    if value is None:
        return InputRecord(name, "none")
    for kind, python_type, symbolic_type in SCALAR_TYPES:
        if isinstance(value, python_type):
            return InputRecord(name, kind, value=value)
        if isinstance(value, symbolic_type):
            dim = dimension(value, ranges) if kind == "int" else None
            return InputRecord(name, kind, dim=dim if isinstance(dim, Dim) else None)
    raise LoweringError(
        f"method {method!r}: input {name!r} is a {type(value).__name__}; a package takes tensors, "
        "ints, floats, bools and None"
    )


def dimension(size: Any, ranges: dict[Any, Any]) -> int | Dim | None:
    """A static size, a symbol with its range, or None for an expression of symbols."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if expr.is_number:
        return int(expr)
    if not expr.is_symbol or expr not in ranges:
        return None
    bounds = ranges[expr]
    return Dim(str(expr), bound_or_none(bounds.lower) or 0, bound_or_none(bounds.upper))


def bound_or_none(bound: Any) -> int | None:
    """A range bound as an int; None where it is unbounded (sympy's integer infinities are not Integers)."""
    return int(bound) if getattr(bound, "is_Integer", False) else None


def weight_records(weights: dict[str, torch.Tensor], store: BlobStore) -> dict[str, WeightRecord]:
    keys = store.put_tensors(list(weights.values()))
    return {
        fqn: WeightRecord(key, dtype_name(t.dtype), list(t.shape)) for (fqn, t), key in zip(weights.items(), keys)
    }


def delegate_record(delegate: Delegate, store: BlobStore) -> DelegateRecord:
    processed, *named_keys = store.put_all([delegate.processed_bytes, *delegate.named_data.values()])
    return DelegateRecord(
        id=delegate.delegate_id,
        backend_id=delegate.backend_id,
        target_device=delegate.target_device,
        compile_specs=list(delegate.compile_specs),
        ops=list(delegate.ops),
        inputs=list(delegate.inputs),
        outputs=list(delegate.outputs),
        processed=processed,
        named_data=dict(zip(delegate.named_data, named_keys)),
        updates=list(delegate.updated_buffers),
        calls=list(delegate.calls),
        quantized=dict(delegate.quantized),
    )
