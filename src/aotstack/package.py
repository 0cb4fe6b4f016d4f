"""The ``.pt2`` file: a PT2 archive holding every method, every blob once, and a manifest.

Layout inside the archive::

    models/<method>.json            the lowered ExportedProgram (stock torch.export schema, for tools)
    data/aotstack/<sha256>          named data and weights, stored once under their content hash
    extra/aotstack_manifest.json    versions, methods (with their run plans), delegates, weights,
                                    and every blob's size

Nothing here is pickled, and reading verifies every blob against its hash before returning it.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from . import __version__
from .errors import LoweringError, PackageError
from .lower import Delegate, LoweredProgram
from .partitioner import program_weights
from .plan import method_plan
from .tensor_data import content_key, dtype_name, tensor_bytes

FORMAT_VERSION = 2
MANIFEST_PATH = "extra/aotstack_manifest.json"
BLOB_DIR = "data/aotstack/"
PROGRAM_PATH = "models/{}.json"
ARCHIVE_FORMAT_RECORD = "archive_format"


class BlobStore:
    """Blobs keyed by their content hash: the same bytes twice are stored once."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        key = content_key(data)
        self.blobs.setdefault(key, data)
        return key


def save(lowered: LoweredProgram, path: str | os.PathLike[str]) -> None:
    """Write ``lowered`` to ``path`` atomically: a failed save leaves no file behind."""
    path = os.fspath(path)
    store = BlobStore()
    methods = {
        name: method_manifest(name, program, lowered.delegates(name), store)
        for name, program in lowered.methods.items()
    }
    manifest = {
        "format": "aotstack",
        "format_version": FORMAT_VERSION,
        "aotstack_version": __version__,
        "torch_version": torch.__version__,
        "methods": methods,
        "blobs": {key: len(data) for key, data in store.blobs.items()},
    }
    directory = os.path.dirname(os.path.abspath(path))
    # Imported here: torch.export.pt2_archive pulls in torch._export.serde (about 1.5 s), which
    # loading never needs.
    from torch.export.pt2_archive import PT2ArchiveWriter

    fd, temporary = tempfile.mkstemp(prefix=".aotstack-", suffix=".pt2", dir=directory)
    os.close(fd)
    try:
        with PT2ArchiveWriter(temporary) as archive:
            for name, program in lowered.methods.items():
                archive.write_bytes(PROGRAM_PATH.format(name), serialized_program(program))
            for key, data in store.blobs.items():
                archive.write_bytes(BLOB_DIR + key, data)
            archive.write_string(MANIFEST_PATH, json.dumps(manifest, indent=1))
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def serialized_program(program: ExportedProgram) -> bytes:
    """The program in torch's own schema, for stock tools; the runtime reads the run plan instead."""
    # Imported here: torch._export.serde takes about 1.5 s to import, and loading never needs it.
    from torch._export.serde.serialize import serialize

    # Weights go to content-keyed blobs; the schema JSON carries only the graph and signature.
    return serialize(program, serialize_state_dict=False, serialize_constants=False).exported_program


def method_manifest(
    name: str, program: ExportedProgram, delegates: list[Delegate], store: BlobStore
) -> dict[str, Any]:
    call_spec = program.call_spec
    return {
        "program": PROGRAM_PATH.format(name),
        "inputs": input_records(name, program),
        "plan": method_plan(program),
        "in_spec": pytree.treespec_dumps(call_spec.in_spec),
        "out_spec": pytree.treespec_dumps(call_spec.out_spec),
        "weights": weights_manifest(program_weights(program), store),
        "delegates": [delegate_manifest(delegate, store) for delegate in delegates],
    }


def input_records(method: str, program: ExportedProgram) -> list[dict[str, Any]]:
    """What each user input of ``program`` must be (see ``inputs.py`` for the records)."""
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    return [
        input_record(method, spec.arg.name, placeholders[spec.arg.name].meta.get("val"), program.range_constraints)
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.USER_INPUT
    ]


def input_record(method: str, name: str, value: Any, ranges: dict[Any, Any]) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        shape = [dimension_record(d, ranges) for d in value.shape]
        return {"name": name, "kind": "tensor", "dtype": dtype_name(value.dtype), "shape": shape}
    if value is None:
        return {"name": name, "kind": "none"}
    for kind, python_type, symbolic_type in SCALAR_TYPES:
        if isinstance(value, python_type):
            return {"name": name, "kind": kind, "value": value}
        if isinstance(value, symbolic_type):
            symbol = dimension_record(value, ranges) if kind == "int" else None
            return {"name": name, "kind": kind, "value": None, **(symbol or {})}
    raise LoweringError(
        f"method {method!r}: input {name!r} is a {type(value).__name__}; a package takes tensors, "
        "ints, floats, bools and None"
    )


# bool before int: a bool is an int in Python.
SCALAR_TYPES = (("bool", bool, torch.SymBool), ("int", int, torch.SymInt), ("float", float, torch.SymFloat))


def dimension_record(size: Any, ranges: dict[Any, Any]) -> int | dict[str, Any] | None:
    """A static size, a symbol with its range, or None for an expression of symbols."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if expr.is_number:
        return int(expr)
    if not expr.is_symbol or expr not in ranges:
        return None
    bounds = ranges[expr]
    return {"symbol": str(expr), "min": bound_or_none(bounds.lower) or 0, "max": bound_or_none(bounds.upper)}


def bound_or_none(bound: Any) -> int | None:
    """A range bound as an int; None where it is unbounded (sympy's integer infinities are not Integers)."""
    return int(bound) if getattr(bound, "is_Integer", False) else None


def weights_manifest(weights: dict[str, torch.Tensor], store: BlobStore) -> dict[str, dict[str, Any]]:
    return {
        fqn: {"blob": store.put(tensor_bytes(t)), "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        for fqn, t in weights.items()
    }


def delegate_manifest(delegate: Delegate, store: BlobStore) -> dict[str, Any]:
    return {
        "id": delegate.delegate_id,
        "backend_id": delegate.backend_id,
        "target_device": delegate.target_device,
        "compile_specs": [[spec.key, spec.value.hex()] for spec in delegate.compile_specs],
        "ops": delegate.ops,
        "inputs": [asdict(spec) for spec in delegate.inputs],
        "outputs": [asdict(spec) for spec in delegate.outputs],
        "processed": store.put(delegate.processed_bytes),
        "named_data": {name: store.put(data) for name, data in delegate.named_data.items()},
        "updates": list(delegate.updated_buffers),
    }


# Reading -------------------------------------------------------------------------------------


@dataclass
class PackageContents:
    """A package's manifest and its verified blobs.

    Each blob is a read-only view into the file, mapped, not copied: weights built over it cost
    no memory beyond the file's own pages. The file must not be changed in place while loaded
    (``save`` replaces a file, which is safe).
    """

    path: str
    manifest: dict[str, Any]
    blobs: dict[str, memoryview]


class ArchiveReader:
    """The records of a PT2 archive (the zip layout torch's PT2ArchiveReader reads)."""

    def __init__(self, path: str) -> None:
        self.file = torch._C.PyTorchFileReader(path)
        if self.file.get_record(ARCHIVE_FORMAT_RECORD) != b"pt2":
            raise ValueError("its archive_format record is not 'pt2'")

    def get_file_names(self) -> list[str]:
        return self.file.get_all_records()

    def read_bytes(self, name: str) -> bytes:
        return self.file.get_record(name)


def read_manifest(path: str | os.PathLike[str]) -> tuple[ArchiveReader, dict[str, Any]]:
    """Open ``path`` as an aotstack package and return its reader and manifest."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PackageError(f"{path}: no such file")
    try:
        reader = ArchiveReader(path)
    except Exception as exc:
        raise PackageError(f"{path}: not a PT2 archive ({first_line(exc)})") from exc
    if MANIFEST_PATH not in reader.get_file_names():
        raise PackageError(f"{path}: a PT2 archive, but not one written by aotstack (no {MANIFEST_PATH})")
    try:
        manifest = json.loads(reader.read_bytes(MANIFEST_PATH))
    except Exception as exc:
        raise PackageError(f"{path}: unreadable manifest ({first_line(exc)})") from exc
    if manifest.get("format") != "aotstack" or manifest.get("format_version") != FORMAT_VERSION:
        raise PackageError(
            f"{path}: package format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
            f"this aotstack reads 'aotstack' version {FORMAT_VERSION}"
        )
    return reader, manifest


def read_package(path: str | os.PathLike[str]) -> PackageContents:
    """Map the package at ``path`` and verify every blob against its hash."""
    path = os.fspath(path)
    reader, manifest = read_manifest(path)
    owners = blob_owners(manifest)
    with open(path, "rb") as file:
        mapped = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
    blobs = {}
    for key, size in manifest["blobs"].items():
        what = owners.get(key, "unreferenced")
        data = mapped_record(reader, mapped, path, BLOB_DIR + key, size, what)
        if content_key(data) != key:
            raise PackageError(
                f"{path}: blob {key[:16]}… ({what}) does not match its SHA-256; the file is corrupt or was altered"
            )
        blobs[key] = data
    return PackageContents(path, manifest, blobs)


def mapped_record(
    reader: ArchiveReader, mapped: memoryview, path: str, record: str, size: int, what: str
) -> memoryview:
    """The ``size`` bytes of ``record`` as a view into the mapped file (archives store records uncompressed)."""
    try:
        offset = reader.file.get_record_offset(record)
    except Exception as exc:
        raise PackageError(f"{path}: cannot read {what} ({record}): {first_line(exc)}") from exc
    if not isinstance(size, int) or size < 0 or offset + size > len(mapped):
        raise PackageError(f"{path}: {what} ({record}) claims {size!r} bytes past the end of the file")
    return mapped[offset : offset + size]


def blob_owners(manifest: dict[str, Any]) -> dict[str, str]:
    """Blob key -> a description of what uses it, for error messages."""
    owners: dict[str, str] = {}
    for name, method in manifest["methods"].items():
        for fqn, weight in method["weights"].items():
            owners.setdefault(weight["blob"], f"weight {fqn!r} of method {name!r}")
        for delegate in method["delegates"]:
            owners.setdefault(delegate["processed"], f"delegate {delegate['id']} processed bytes")
            for local, key in delegate["named_data"].items():
                owners.setdefault(key, f"{local!r} of delegate {delegate['id']}")
    return owners


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
