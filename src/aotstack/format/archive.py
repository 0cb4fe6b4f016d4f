"""The ``.pt2`` file: a zip of uncompressed, aligned entries, every one covered by a sealed manifest.

Layout inside the archive (all under one root folder, as in torch's PT2 archives)::

    archive_format, archive_version, byteorder, .data/version    what torch's own readers expect
    models/<method>.json            the lowered ExportedProgram (stock torch.export schema, for tools)
    data/aotstack/<sha256>          named data and weights, stored once under their content hash
    extra/aotstack_manifest.json    versions, methods (with their run plans), delegates, weights,
                                    each blob's size and each other entry's SHA-256
    extra/aotstack_seal.json        the manifest's SHA-256, and any signatures of it

Reading trusts nothing before it is checked: the zip directory is read by its own bounded rules
(entries stored, not compressed, inside the file, not overlapping, each named once), the seal
before the manifest, any signature before the manifest is parsed, and every entry against its
hash before a loader sees it. Nothing is unpickled. This module depends on nothing of aotstack
above the format layer.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import json
import mmap
import os
import struct
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import AotstackError, PackageError, SaveError
from .manifest import Manifest
from .seal import Seal, TrustedKeys, key_id, public_keys, seal_from_bytes, seal_to_bytes, signed, verified_signer
from .seal import private_key as seal_private_key
from .tensor_data import BytesLike, content_key

ROOT = "package/"
MANIFEST_PATH = "extra/aotstack_manifest.json"
SEAL_PATH = "extra/aotstack_seal.json"
BLOB_DIR = "data/aotstack/"
PROGRAM_PATH = "models/{}.json"
ARCHIVE_FORMAT_RECORD = "archive_format"
# The records torch's PT2 readers look for; written with fixed values so a package is reproducible.
TORCH_RECORDS = {
    ARCHIVE_FORMAT_RECORD: b"pt2",
    "archive_version": b"0",
    "byteorder": sys.byteorder.encode(),
    ".data/version": b"6\n",
}

# Bounds a hostile file cannot push reading past: the manifest and seal are read into memory.
MAX_MANIFEST_BYTES = 64 << 20
MAX_SEAL_BYTES = 64 << 10
# Data starts on a 64-byte boundary, so weights mapped from the file are aligned for every dtype.
ALIGNMENT = 64
# A fixed timestamp: the same program saved twice gives the same bytes, and the same signature.
ENTRY_TIME = (1980, 1, 1, 0, 0, 0)


# Writing -------------------------------------------------------------------------------------


def write_package(
    path: str | os.PathLike[str], manifest: Manifest, programs: Mapping[str, bytes], blobs: Mapping[str, BytesLike]
) -> None:
    """Write a sealed package atomically: a failed write leaves no file behind.

    ``programs`` maps each method to its stock ``ExportedProgram`` JSON; ``blobs`` maps each
    content key the manifest names to its bytes. Blobs are streamed to the file: each is read
    from ``blobs`` only when it is written, and written from the memory it is in, so a mapping
    that views its data (or makes it on demand) is never copied whole into memory.
    """
    records = {**TORCH_RECORDS, **{PROGRAM_PATH.format(name): data for name, data in programs.items()}}
    manifest = replace(manifest, records={name: content_key(data) for name, data in records.items()})
    manifest_bytes = json.dumps(manifest.to_json(), indent=1).encode()
    seal = Seal(content_key(manifest_bytes), [])
    entries = itertools.chain(
        records.items(),
        ((BLOB_DIR + key, blobs[key]) for key in blobs),
        [(MANIFEST_PATH, manifest_bytes), (SEAL_PATH, seal_to_bytes(seal))],
    )
    write_archive(path, entries)


def write_archive(path: str | os.PathLike[str], entries: Iterable[tuple[str, BytesLike]]) -> None:
    """Write ``entries`` (name, bytes) as a zip of stored, aligned entries, atomically.

    ``entries`` is consumed one at a time, so an iterator that makes each entry's data as it
    goes holds one entry in memory at once.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, temporary = tempfile.mkstemp(prefix=".aotstack-", suffix=".pt2", dir=folder)
    except OSError as exc:
        raise SaveError(f"cannot write {path}: {exc.strerror or exc} (folder {folder})") from exc
    try:
        with os.fdopen(fd, "wb") as file, zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, data in entries:
                write_entry(archive, file.tell(), ROOT + name, data)
        os.replace(temporary, path)
    except BaseException as exc:
        os.unlink(temporary)
        if isinstance(exc, OSError) and not isinstance(exc, AotstackError):
            # The temporary file's name means nothing to the caller: name the path they gave.
            raise SaveError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise


def write_entry(archive: zipfile.ZipFile, position: int, name: str, data: BytesLike) -> None:
    info = zipfile.ZipInfo(name, date_time=ENTRY_TIME)
    info.compress_type = zipfile.ZIP_STORED
    size = memoryview(data).nbytes
    # zipfile adds a 20-byte zip64 field to the local header of an entry this large.
    zip64 = 20 if size * 1.05 > zipfile.ZIP64_LIMIT else 0
    header = 30 + len(name.encode()) + zip64
    padding = -(position + header) % ALIGNMENT
    if padding:
        padding += ALIGNMENT if padding < 4 else 0
        # An extra field of an id no reader knows, which readers skip: padding that moves the data.
        info.extra = struct.pack("<HH", 0xA11A, padding - 4) + bytes(padding - 4)
    with archive.open(info, "w", force_zip64=bool(zip64)) as entry:
        # zipfile checksums the view and hands it to the file as it is: no copy of the data.
        entry.write(data)


# Reading -------------------------------------------------------------------------------------


@dataclass
class PackageContents:
    """A package's manifest and its verified blobs.

    Each blob is a read-only view into the file, mapped, not copied: weights built over it cost
    no memory beyond the file's own pages. The file must not be changed in place while loaded
    (``save`` and ``sign`` replace a file, which is safe).
    """

    path: str
    manifest: Manifest
    blobs: dict[str, memoryview]
    # The id of the trusted key whose signature was verified; None for an unsigned load.
    signer: str | None = None
    # The mapping the blobs view, to drop its pages that nothing reads any more; None: never dropped.
    pages: MappedPages | None = None


@dataclass
class Archive:
    """A package's entries as views into the mapped file, by name below the root folder."""

    path: str
    mapped: memoryview
    entries: dict[str, memoryview]
    # Where each entry's bytes lie in the file: (start, end), by the same names.
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)

    def entry(self, name: str, what: str) -> memoryview:
        if name not in self.entries:
            raise PackageError(f"{self.path}: {what} ({name}) is missing")
        return self.entries[name]


class MappedPages:
    """The package's read-only mapping, and which of its pages this process may drop from memory.

    Verifying a package reads every page of it, and each stays resident, though most are not read
    again: an engine that copied or packed its weights into memory of its own leaves the file's
    copy unread. ``release`` drops such pages with ``madvise(MADV_DONTNEED)``. The file is mapped
    shared and read-only (``mmap.ACCESS_READ``), so its pages are clean page-cache pages: dropped,
    they leave this process's resident memory, and a page read again is read back from the page
    cache (or the file), the same bytes; dropping one that is still read costs a page fault, never
    a wrong value. Where the platform has no ``madvise`` it drops nothing.
    """

    def __init__(self, mapped: memoryview, spans: Mapping[str, tuple[int, int]]) -> None:
        self.mapped = mapped
        self.spans = dict(spans)

    def release(self, blobs: Iterable[str] | None, keep: Iterable[str]) -> None:
        """Drop the pages of ``blobs`` (the whole file's where None), but any page holding part of a ``keep`` blob."""
        size = len(self.mapped)
        dropped = [(0, size)] if blobs is None else [self.spans[key] for key in blobs]
        kept = [self.spans[key] for key in keep]
        for start, end in page_ranges(dropped, kept, mmap.PAGESIZE, size):
            advise_dont_need(self.mapped.obj, start, end - start)


def page_ranges(
    dropped: Iterable[tuple[int, int]], kept: Iterable[tuple[int, int]], page: int, size: int
) -> list[tuple[int, int]]:
    """The page-aligned ranges covering ``dropped`` that hold no byte of ``kept``, in order, within ``size``."""
    kept_pages = merged(page_span(span, page, size) for span in kept if span[1] > span[0])
    ranges = []
    for start, end in merged(page_span(span, page, size) for span in dropped if span[1] > span[0]):
        # Both lists are sorted and disjoint: cut each dropped range around the kept ones inside it.
        for low, high in kept_pages[max(0, bisect.bisect_right(kept_pages, (start, size)) - 1):]:
            if low >= end:
                break
            if high > start:
                if low > start:
                    ranges.append((start, low))
                start = high
        if start < end:
            ranges.append((start, end))
    return ranges


def page_span(span: tuple[int, int], page: int, size: int) -> tuple[int, int]:
    """The pages ``span`` touches, as a byte range."""
    return span[0] // page * page, min(-(-span[1] // page) * page, size)


def merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, overlapping or touching ones joined."""
    joined: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], end))
        else:
            joined.append((start, end))
    return joined


def advise_dont_need(mapping: object, start: int, length: int) -> None:
    """``madvise(MADV_DONTNEED)`` on a page-aligned range of ``mapping`` (an ``mmap.mmap``), where the platform has it.

    Dropping pages only saves memory, so a range the kernel will not drop stays as it is: a
    process that locked its memory (``mlockall``, as latency-bound servers do) gets EINVAL for
    every locked page, and keeps them resident, as it asked.
    """
    if isinstance(mapping, mmap.mmap) and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mapping.madvise(mmap.MADV_DONTNEED, start, length)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the package at ``path``, checked against its seal (its blobs are not read)."""
    return sealed_manifest(opened_archive(path), None)[0]


def read_package(path: str | os.PathLike[str], trusted_keys: TrustedKeys | None = None) -> PackageContents:
    """Map the package at ``path`` and verify its seal, its signature if keys are given, and every entry.

    With ``trusted_keys``, a package not signed by one of them is refused before its manifest is parsed.
    """
    return verified_package(opened_archive(path), trusted_keys)


def verified_package(archive: Archive, trusted_keys: TrustedKeys | None) -> PackageContents:
    manifest, signer = sealed_manifest(archive, trusted_keys)
    check_entries(archive, manifest)
    blobs = verified_blobs(archive, manifest)
    pages = MappedPages(archive.mapped, {key: archive.spans[BLOB_DIR + key] for key in blobs})
    return PackageContents(archive.path, manifest, blobs, signer, pages)


def opened_archive(path: str | os.PathLike[str]) -> Archive:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PackageError(f"{path}: no such file")
    with open(path, "rb") as file:
        try:
            mapped = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
        except (ValueError, OSError) as exc:
            raise PackageError(f"{path}: not a PT2 archive ({first_line(exc)})") from None
        try:
            infos = zipfile.ZipFile(file).infolist()
        except Exception as exc:
            # zipfile raises many types for a damaged directory; each means the same here.
            raise PackageError(f"{path}: not a PT2 archive ({first_line(exc)})") from None
    spans = archive_spans(path, mapped, infos)
    entries = {name: mapped[start:end] for name, (start, end) in spans.items()}
    if entries.get(ARCHIVE_FORMAT_RECORD) != b"pt2":
        raise PackageError(f"{path}: not a PT2 archive (its archive_format record is not 'pt2')")
    if MANIFEST_PATH not in entries:
        raise PackageError(f"{path}: a PT2 archive, but not one written by aotstack (no {MANIFEST_PATH})")
    return Archive(path, mapped, entries, spans)


def archive_spans(path: str, mapped: memoryview, infos: Sequence[zipfile.ZipInfo]) -> dict[str, tuple[int, int]]:
    """Where each entry's data lies in the file, (start, end), by name below the archive's one root folder."""
    if not infos:
        raise PackageError(f"{path}: not a PT2 archive (an empty zip)")
    root = infos[0].filename.partition("/")[0] + "/"
    entries: dict[str, tuple[int, int]] = {}
    for info in infos:
        name = info.filename
        if not name.startswith(root) or name == root:
            raise PackageError(f"{path}: entry {name!r} is outside the archive's root folder {root!r}")
        relative = name[len(root) :]
        if relative in entries:
            raise PackageError(f"{path}: entry {relative!r} appears twice; the file is damaged or was altered")
        start = data_offset(path, mapped, info)
        entries[relative] = (start, start + info.file_size)
    spans = sorted((start, end, name) for name, (start, end) in entries.items())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise PackageError(f"{path}: entries {first!r} and {second!r} overlap; the file is damaged or was altered")
    return entries


def data_offset(path: str, mapped: memoryview, info: zipfile.ZipInfo) -> int:
    """Where ``info``'s bytes start, checked: stored, not encrypted, and inside the file."""
    where = f"{path}: entry {info.filename!r}"
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1 or info.compress_size != info.file_size:
        raise PackageError(f"{where} is compressed or encrypted; aotstack stores every entry as is")
    header = bytes(mapped[info.header_offset : info.header_offset + 30])
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise PackageError(f"{where} has no local header where the directory says; the file is damaged")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30
    try:
        # zipfile decodes a name as utf-8 where the entry says so, else as cp437.
        name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
    except UnicodeEncodeError:
        name = b""
    if bytes(mapped[start : start + name_length]) != name:
        raise PackageError(f"{where}: its local header names another entry; the file is damaged")
    start += name_length + extra_length
    if start + info.file_size > len(mapped):
        raise PackageError(f"{where} claims {info.file_size} bytes past the end of the file; it is truncated")
    return start


def sealed_manifest(archive: Archive, trusted_keys: TrustedKeys | None) -> tuple[Manifest, str | None]:
    """The manifest, parsed only after it matched its seal and, with keys, a trusted signature."""
    path = archive.path
    if SEAL_PATH not in archive.entries:
        raise PackageError(
            f"{path}: no seal ({SEAL_PATH}); it was written by an aotstack older than format 4, or damaged"
        )
    seal_bytes = archive.entries[SEAL_PATH]
    if len(seal_bytes) > MAX_SEAL_BYTES:
        raise PackageError(f"{path}: the seal is {len(seal_bytes)} bytes, more than the {MAX_SEAL_BYTES} allowed")
    try:
        seal = seal_from_bytes(bytes(seal_bytes))
    except PackageError as exc:
        raise PackageError(f"{path}: {exc}") from None
    signer = verified_signer(seal, trusted_keys, path) if trusted_keys is not None else None
    manifest_bytes = archive.entries[MANIFEST_PATH]
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise PackageError(
            f"{path}: the manifest is {len(manifest_bytes)} bytes, more than the {MAX_MANIFEST_BYTES} allowed"
        )
    if content_key(manifest_bytes) != seal.manifest_sha256:
        raise PackageError(f"{path}: the manifest does not match its seal; the file is damaged or was altered")
    try:
        data = json.loads(bytes(manifest_bytes))
    except (ValueError, RecursionError) as exc:
        raise PackageError(f"{path}: unreadable manifest ({first_line(exc)})") from None
    try:
        return Manifest.from_json(data), signer
    except PackageError as exc:
        raise PackageError(f"{path}: {exc}") from None


def check_entries(archive: Archive, manifest: Manifest) -> None:
    """Every entry is one the manifest covers, and every record matches its recorded hash."""
    covered = {MANIFEST_PATH, SEAL_PATH, *manifest.records, *(BLOB_DIR + key for key in manifest.blobs)}
    unexpected = sorted(set(archive.entries) - covered)
    if unexpected:
        raise PackageError(f"{archive.path}: entries the manifest does not cover: {unexpected[:5]}; it was altered")
    for name, key in manifest.records.items():
        if content_key(archive.entry(name, "a record")) != key:
            raise PackageError(f"{archive.path}: entry {name!r} does not match its SHA-256; the file is damaged")


def verified_blobs(archive: Archive, manifest: Manifest) -> dict[str, memoryview]:
    owners = manifest.blob_owners()
    blobs = {}
    for key, size in manifest.blobs.items():
        what = owners.get(key, "unreferenced")
        data = archive.entry(BLOB_DIR + key, what)
        if len(data) != size:
            raise PackageError(f"{archive.path}: {what} is {len(data)} bytes, but the manifest says {size}")
        blobs[key] = data
    for key, actual in zip(blobs, hashes(list(blobs.values()))):
        if actual != key:
            raise PackageError(
                f"{archive.path}: blob {key[:16]}… ({owners.get(key, 'unreferenced')}) does not match its SHA-256; "
                "the file is corrupt or was altered"
            )
    return blobs


# Blobs are hashed on every core this process may use: hashlib releases the GIL while it hashes.
PARALLEL_HASH_BYTES = 4 << 20


def hashes(blobs: Sequence[memoryview]) -> list[str]:
    """Each blob's content key, in order, hashed in parallel where that pays.

    One blob's SHA-256 is a sequential chain, so a single blob is hashed on one core whatever
    the machine: a format that hashed fixed-size chunks (a hash tree) would let one large weight
    use every core, at the price of a new format version. Within this format the wall time is
    bounded below by the largest blob, and by the total over the cores; hashing the largest
    blobs first keeps every core busy until the end instead of leaving one on a large blob
    picked up last. Hashing the mapping is what reads the file, once, with no copy into a
    buffer; the kernel maps the pages around each fault, so 500 MB costs a few thousand faults
    (measured no slower than read() and hash, page cache warm or cold; madvise hints made no
    measurable difference, so none is given).
    """
    workers = usable_cores()
    if workers == 1 or len(blobs) < 2 or sum(blob.nbytes for blob in blobs) < PARALLEL_HASH_BYTES:
        return [content_key(blob) for blob in blobs]
    largest_first = sorted(range(len(blobs)), key=lambda index: blobs[index].nbytes, reverse=True)
    with ThreadPoolExecutor(max_workers=min(workers, len(blobs))) as pool:
        keys = dict(zip(largest_first, pool.map(content_key, [blobs[index] for index in largest_first])))
    return [keys[index] for index in range(len(blobs))]


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


# Signing -------------------------------------------------------------------------------------


def resealed(path: str | os.PathLike[str], change: Any) -> None:
    """Rewrite the package at ``path`` with ``change(seal)`` as its seal; every other entry is copied as is.

    The package is checked first (seal and every entry), so a damaged file is never signed.
    """
    archive = opened_archive(path)
    verified_package(archive, None)
    seal = change(seal_from_bytes(bytes(archive.entries[SEAL_PATH])))
    entries = [(name, data) for name, data in archive.entries.items() if name != SEAL_PATH]
    write_archive(path, [*entries, (SEAL_PATH, seal_to_bytes(seal))])


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def sign(path: str | os.PathLike[str], private_key: Any) -> str:
    """Sign the package at ``path`` in place with an Ed25519 key; returns the key's id.

    ``private_key`` is a key, PEM bytes or a PEM file's path (see ``aotstack keygen``).
    Example::

        aotstack.sign("model.pt2", "release.key")
        aotstack.load("model.pt2", public_key="release.key.pub")
    """
    key = seal_private_key(private_key)
    resealed(path, lambda seal: signed(seal, key))
    return key_id(key.public_key())


def verify(path: str | os.PathLike[str], public_key: Any) -> str:
    """Check that ``path`` is intact and signed by one of ``public_key``; returns the signer's key id.

    Raises ``SignatureError`` (unsigned, untrusted or bad signature) or ``PackageError`` (damaged).
    """
    signer = read_package(path, public_keys(public_key)).signer
    assert signer is not None
    return signer
