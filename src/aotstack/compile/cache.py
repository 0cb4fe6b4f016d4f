"""Where aotstack keeps what it can reuse between lowerings: compiled libraries, engines' results, measurements."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import tempfile

import torch
from torch.export import ExportedProgram

from .. import __version__
from ..engine.interface import Backend
from ..engine.processor import processor_fingerprint
from ..engine.source import code_version
from ..format.specs import CompileSpec, PreprocessResult
from ..format.tensor_data import WEIGHT_PREFIX, content_key, weights_as_named_data
from .program_parts import Structure, program_fingerprint, program_weights


def cache_dir(kind: str) -> str | None:
    """The folder for one kind of cached entry; ``AOTSTACK_CACHE_DIR=off`` turns every cache off.

    ``AOTSTACK_CACHE_DIR=DIR`` keeps compiled libraries in ``DIR`` itself, as it always has, and
    other kinds in folders beside it.
    """
    configured = os.environ.get("AOTSTACK_CACHE_DIR")
    if configured is not None:
        if configured.lower() in ("", "0", "off", "none"):
            return None
        return configured if kind == "aoti" else os.path.join(configured, f".{kind}")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aotstack", kind)


def read_entry(kind: str, name: str) -> bytes | None:
    directory = cache_dir(kind)
    if directory is None:
        return None
    try:
        with open(os.path.join(directory, name), "rb") as file:
            return file.read()
    except OSError:
        return None


def write_entry(kind: str, name: str, data: bytes) -> None:
    """Add an entry; it appears whole (written aside, then renamed) or not at all."""
    directory = cache_dir(kind)
    if directory is None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".partial-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, os.path.join(directory, name))
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass  # a cache that cannot be written only costs the work again next time


# The kind of entry that keeps an engine's preprocess results (``kept_preprocess``).
PREPROCESS_KIND = "preprocess"


def preprocess_key(backend: Backend, program: ExportedProgram, compile_specs: list[CompileSpec]) -> str | None:
    """What a partition's compile depends on: its program (weights' values included), its specs, the versions
    (the backend's code too: ``code_version``) and the processor (an engine may compile for its instructions).

    None where ``backend`` asks for no cache of its results (``Backend.cached_by_packages``).
    """
    return backend_key(backend, compile_specs, program_fingerprint(program))


def structure_key(backend: Backend, structure: Structure, compile_specs: list[CompileSpec]) -> str | None:
    """Like ``preprocess_key``, for what a backend compiled for a partition's structure (``program_structure``)
    and reuses for every partition of it, whatever their weights."""
    return backend_key(backend, compile_specs, f"structure {structure.digest}")


def backend_key(backend: Backend, compile_specs: list[CompileSpec], program: str) -> str | None:
    """A hash of ``program`` (a digest) with the specs, versions and processor ``backend``'s results depend on."""
    if backend.cached_by_packages is None:
        return None
    parts = [backend.backend_id, type(backend).__qualname__, torch.__version__, __version__,
             str(torch.get_num_threads()), code_version(type(backend)), processor_fingerprint()]
    parts += [f"{spec.key}={spec.value.hex()}" for spec in compile_specs if spec.key not in backend.run_side_specs]
    parts += [f"{name}={package_version(name)}" for name in backend.cached_by_packages]
    digest = hashlib.sha256("\0".join(parts).encode())
    digest.update(program.encode())
    return digest.hexdigest()


def package_version(module: str) -> str:
    """The installed version of ``module``'s distribution, or ``?``."""
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def keep_preprocess(key: str, result: PreprocessResult) -> None:
    """Cache what a backend made for a partition, except its weights, which the partition holds anyway.

    Weights are the named data ``weight:<fqn>`` that ``weights_as_named_data`` makes; each other
    blob is stored with its hash, which a later read checks.
    """
    blobs = {name: bytes(data) for name, data in result.named_data.items() if not name.startswith(WEIGHT_PREFIX)}
    header = {
        "processed": result.processed_bytes.hex(),
        # Each weight's hash, so a backend that stored a weight changed (cast, packed) is compiled again, not misread.
        "weights": {
            name.removeprefix(WEIGHT_PREFIX): content_key(data)
            for name, data in result.named_data.items()
            if name.startswith(WEIGHT_PREFIX)
        },
        "blobs": {name: content_key(data) for name, data in blobs.items()},
    }
    for data in blobs.values():
        write_entry(PREPROCESS_KIND, content_key(data), data)
    write_entry(PREPROCESS_KIND, key + ".json", json.dumps(header).encode())


def forget_preprocess(key: str) -> None:
    """Drop what ``keep_preprocess`` cached under ``key`` (a result its engine then failed to open)."""
    directory = cache_dir(PREPROCESS_KIND)
    if directory is not None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, key + ".json"))


def kept_preprocess(key: str, program: ExportedProgram) -> PreprocessResult | None:
    """What ``keep_preprocess`` cached under ``key``, weights taken from ``program``; None if absent or damaged."""
    data = read_entry(PREPROCESS_KIND, key + ".json")
    if data is None:
        return None
    try:
        header = json.loads(data)
        weights = program_weights(program)
        named_data, _ = weights_as_named_data({fqn: weights[fqn].detach().contiguous() for fqn in header["weights"]})
        for fqn, weight_key in header["weights"].items():
            if content_key(named_data[WEIGHT_PREFIX + fqn]) != weight_key:
                return None
        for name, blob_key in header["blobs"].items():
            blob = read_entry(PREPROCESS_KIND, blob_key)
            if blob is None or content_key(blob) != blob_key:
                return None
            named_data[name] = blob
        return PreprocessResult(bytes.fromhex(header["processed"]), named_data, from_cache=True)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
