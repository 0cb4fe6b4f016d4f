"""The AOTInductor compile steps, shared by every AOTI backend."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import __version__
from ...errors import LoweringError
from ...partitioner import program_weights
from ...tensor_data import content_key, tensor_bytes

logger = logging.getLogger("aotstack")

GraphPass = Callable[[GraphModule], None]


@dataclass
class CompiledPartition:
    """A shared library with its weights kept apart, keyed by their FQN in the partition."""

    library: bytes
    constants: dict[str, torch.Tensor]


def compile_partition(
    exported_program: ExportedProgram,
    *,
    label: str,
    decompositions: dict[Any, Callable[..., Any]] | None,
    passes: list[GraphPass],
    inductor_options: dict[str, Any],
) -> CompiledPartition:
    """Compile one partition with AOTInductor, weights outside the library."""
    program = prepared_program(exported_program, decompositions, passes)
    options = {**inductor_options, "aot_inductor.package_constants_in_so": False}
    constants = program_weights(program)
    key = cache_key(program, constants, options)
    library = cached_library(key)
    if library is not None:
        logger.info("  %s: reusing the library from the compile cache", label)
    else:
        library = compiled_library(program, options, label)
        store_library(key, library)
    return CompiledPartition(library=library, constants=constants)


def compiled_library(program: ExportedProgram, options: dict[str, Any], label: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="aotstack-aoti-") as workdir:
        package_path = os.path.join(workdir, "partition.pt2")
        try:
            # Inductor's SDPA lowering needs the math backend to trace a decomposable graph.
            with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
                torch._inductor.aoti_compile_and_package(
                    program, package_path=package_path, inductor_configs=options
                )
        except Exception as exc:
            raise LoweringError(f"AOTInductor failed to compile {label}: {exc}") from exc
        return library_from_package(package_path, label)


def prepared_program(
    exported_program: ExportedProgram,
    decompositions: dict[Any, Callable[..., Any]] | None,
    passes: list[GraphPass],
) -> ExportedProgram:
    program = exported_program
    if decompositions:
        program = program.run_decompositions(decompositions)
    for graph_pass in passes:
        graph_pass(program.graph_module)
        program.graph_module.recompile()
    return program


def library_from_package(package_path: str, label: str) -> bytes:
    with zipfile.ZipFile(package_path) as archive:
        libraries = [name for name in archive.namelist() if name.endswith(".so")]
        if len(libraries) != 1:
            raise LoweringError(
                f"AOTInductor package for {label} holds {len(libraries)} shared libraries, expected 1"
            )
        return archive.read(libraries[0])


def cache_key(program: ExportedProgram, constants: dict[str, torch.Tensor], options: dict[str, Any]) -> str:
    """A hash of everything the library depends on.

    Weight values are part of it: Inductor inlines small constants into the generated code.
    So is the thread count, which the generated OpenMP code bakes in.
    """
    digest = hashlib.sha256()
    threads = str(torch.get_num_threads())
    for part in (torch.__version__, __version__, threads, repr(sorted(options.items())), program.graph_module.code):
        digest.update(part.encode())
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            digest.update(f"{node.name}:{value.dtype}:{tuple(value.shape)}:{value.stride()}".encode())
    digest.update(str(program.graph_signature).encode())
    for fqn in sorted(constants):
        digest.update(fqn.encode() + content_key(tensor_bytes(constants[fqn])).encode())
    return digest.hexdigest()


def cache_dir() -> str | None:
    """Where compiled libraries are kept; ``AOTSTACK_CACHE_DIR=off`` turns the cache off."""
    configured = os.environ.get("AOTSTACK_CACHE_DIR")
    if configured is not None:
        return None if configured.lower() in ("", "0", "off", "none") else configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aotstack", "aoti")


def cached_library(key: str) -> bytes | None:
    directory = cache_dir()
    if directory is None:
        return None
    path = os.path.join(directory, key + ".so")
    try:
        with open(path, "rb") as file:
            library = file.read()
    except OSError:
        return None
    # An entry is named by its key, and its content hash is kept beside it.
    try:
        with open(path + ".sha256") as file:
            expected = file.read().strip()
    except OSError:
        return None
    return library if content_key(library) == expected else None


def store_library(key: str, library: bytes) -> None:
    directory = cache_dir()
    if directory is None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        for suffix, data in ((".so.sha256", content_key(library).encode()), (".so", library)):
            fd, temporary = tempfile.mkstemp(dir=directory)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, os.path.join(directory, key + suffix))
    except OSError:
        pass  # a cache that cannot be written only costs a recompile next time
