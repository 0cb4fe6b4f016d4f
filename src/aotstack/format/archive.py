"""The ``.pt2`` file: a PT2 archive holding every method, every blob once, and a manifest.

Layout inside the archive::

    models/<method>.json            the lowered ExportedProgram (stock torch.export schema, for tools)
    data/aotstack/<sha256>          named data and weights, stored once under their content hash
    extra/aotstack_manifest.json    versions, methods (with their run plans), delegates, weights,
                                    and every blob's size

Nothing here is pickled, and reading verifies every blob against its hash before returning it.
This module and the manifest it writes depend on nothing of aotstack above the format layer.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import PackageError
from .manifest import Manifest
from .tensor_data import content_key

MANIFEST_PATH = "extra/aotstack_manifest.json"
BLOB_DIR = "data/aotstack/"
PROGRAM_PATH = "models/{}.json"
ARCHIVE_FORMAT_RECORD = "archive_format"


def write_package(
    path: str | os.PathLike[str], manifest: Manifest, programs: Mapping[str, bytes], blobs: Mapping[str, bytes]
) -> None:
    """Write a package atomically: a failed write leaves no file behind.

    ``programs`` maps each method to its stock ``ExportedProgram`` JSON; ``blobs`` maps each
    content key the manifest names to its bytes.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # Imported here: torch.export.pt2_archive pulls in torch._export.serde (about 1.5 s), which
    # loading never needs.
    from torch.export.pt2_archive import PT2ArchiveWriter

    fd, temporary = tempfile.mkstemp(prefix=".aotstack-", suffix=".pt2", dir=directory)
    os.close(fd)
    try:
        with PT2ArchiveWriter(temporary) as archive:
            for name, program in programs.items():
                archive.write_bytes(PROGRAM_PATH.format(name), program)
            for key, data in blobs.items():
                archive.write_bytes(BLOB_DIR + key, data)
            archive.write_string(MANIFEST_PATH, json.dumps(manifest.to_json(), indent=1))
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


# Reading -------------------------------------------------------------------------------------


@dataclass
class PackageContents:
    """A package's manifest and its verified blobs.

    Each blob is a read-only view into the file, mapped, not copied: weights built over it cost
    no memory beyond the file's own pages. The file must not be changed in place while loaded
    (``save`` replaces a file, which is safe).
    """

    path: str
    manifest: Manifest
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


def read_manifest(path: str | os.PathLike[str]) -> tuple[ArchiveReader, Manifest]:
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
        data = json.loads(reader.read_bytes(MANIFEST_PATH))
    except Exception as exc:
        raise PackageError(f"{path}: unreadable manifest ({first_line(exc)})") from exc
    try:
        return reader, Manifest.from_json(data)
    except PackageError as exc:
        raise PackageError(f"{path}: {exc}") from None


def read_package(path: str | os.PathLike[str]) -> PackageContents:
    """Map the package at ``path`` and verify every blob against its hash."""
    path = os.fspath(path)
    reader, manifest = read_manifest(path)
    owners = manifest.blob_owners()
    with open(path, "rb") as file:
        mapped = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
    blobs = {}
    for key, size in manifest.blobs.items():
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
