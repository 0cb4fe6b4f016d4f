"""Saving a lowered program: its manifest records, its blobs, and the stock program of each method."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from .. import __version__
from ..errors import LoweringError
from ..format.archive import PROGRAM_PATH, write_package
from ..format.devices import Device
from ..format.manifest import DelegateRecord, Dim, InputRecord, Manifest, MethodRecord, WeightRecord
from ..format.records import Delegate
from ..format.tensor_data import content_key, dtype_name, tensor_bytes
from .plan import method_plan
from .program_parts import program_weights


class BlobStore:
    """Blobs keyed by their content hash: the same bytes twice are stored once."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        key = content_key(data)
        self.blobs.setdefault(key, data)
        return key


def save(
    methods: Mapping[str, ExportedProgram], delegates: Mapping[str, list[Delegate]], path: str | os.PathLike[str]
) -> None:
    """Write lowered ``methods`` and their ``delegates`` to ``path`` atomically: a failed save leaves no file."""
    store = BlobStore()
    records = {name: method_record(name, program, delegates[name], store) for name, program in methods.items()}
    manifest = Manifest(
        aotstack_version=__version__,
        torch_version=torch.__version__,
        methods=records,
        blobs={key: len(data) for key, data in store.blobs.items()},
    )
    programs = {name: serialized_program(program) for name, program in methods.items()}
    write_package(path, manifest, programs, store.blobs)


def serialized_program(program: ExportedProgram) -> bytes:
    """The program in torch's own schema, for stock tools; the runtime reads the run plan instead."""
    # Imported here: torch._export.serde takes about 1.5 s to import.
    from torch._export.serde.serialize import serialize

    # Weights go to content-keyed blobs; the schema JSON carries only the graph and signature.
    # Older torch (2.11) cannot leave them out: it pickles them, and they are dropped here.
    skip_weights = {"serialize_state_dict": False, "serialize_constants": False}
    if not set(skip_weights) <= set(inspect.signature(serialize).parameters):
        skip_weights = {}
    return serialize(program, **skip_weights).exported_program


def method_record(name: str, program: ExportedProgram, delegates: list[Delegate], store: BlobStore) -> MethodRecord:
    call_spec = program.call_spec
    return MethodRecord(
        program=PROGRAM_PATH.format(name),
        inputs=input_records(name, program),
        plan=method_plan(program),
        in_spec=pytree.treespec_dumps(call_spec.in_spec),
        out_spec=pytree.treespec_dumps(call_spec.out_spec),
        weights=weight_records(program_weights(program), store),
        delegates=[delegate_record(delegate, store) for delegate in delegates],
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
    return {
        fqn: WeightRecord(store.put(tensor_bytes(t)), dtype_name(t.dtype), list(t.shape))
        for fqn, t in weights.items()
    }


def delegate_record(delegate: Delegate, store: BlobStore) -> DelegateRecord:
    return DelegateRecord(
        id=delegate.delegate_id,
        backend_id=delegate.backend_id,
        target_device=delegate.target_device,
        compile_specs=list(delegate.compile_specs),
        ops=list(delegate.ops),
        inputs=list(delegate.inputs),
        outputs=list(delegate.outputs),
        processed=store.put(delegate.processed_bytes),
        named_data={name: store.put(data) for name, data in delegate.named_data.items()},
        updates=list(delegate.updated_buffers),
    )
