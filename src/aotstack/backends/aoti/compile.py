"""The AOTInductor compile steps, shared by every AOTI backend."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import __version__
from ...compile.cache import read_entry, write_entry
from ...compile.program_parts import program_fingerprint, program_weights
from ...errors import LoweringError
from ...format.devices import HOST, Device, DeviceType
from ...format.tensor_data import content_key
from .kernels import recorded_fallback_kernels
from .passes import GraphPass

logger = logging.getLogger("aotstack")

# The compile cache's folder for libraries (``compile/cache.py``).
CACHE_KIND = "aoti"

KernelCheck = Callable[[frozenset[str]], None]


@dataclass(frozen=True)
class CompileSteps:
    """What an AOTI backend does to a partition: move it to its device, rewrite it, compile it."""

    device: Device
    passes: list[GraphPass]
    decompositions: dict[Any, Callable[..., Any]]
    options: dict[str, Any]
    # None: Inductor picks attention kernels as plain AOTInductor does.
    attention_kernels: list[SDPBackend] | None = None


@dataclass
class CompiledPartition:
    """A shared library with its weights kept apart, keyed by their FQN in the partition."""

    library: bytes
    constants: dict[str, torch.Tensor]
    # Taken from aotstack's compile cache rather than compiled.
    from_cache: bool = False


def compile_partition(
    exported_program: ExportedProgram,
    steps: CompileSteps,
    *,
    label: str,
    kernel_check: KernelCheck | None = None,
    cache_only: bool = False,
) -> CompiledPartition | None:
    """Compile one partition with AOTInductor, weights outside the library.

    ``kernel_check`` is handed the fallback kernels the generated code calls, before the
    library is cached; it raises to refuse them. With ``cache_only``, a partition not in the
    compile cache gives None instead of a compile.
    """
    program = prepared_program(exported_program, steps)
    constants = program_weights(program)
    # Inductor's own cache skips code generation, where fallback kernels are recorded.
    options = steps.options if kernel_check is None else {**steps.options, "fx_graph_cache": False}
    key = cache_key(program, {**options, "aotstack.device": str(steps.device)})
    library = cached_library(key)
    if library is not None:
        logger.debug("%s: reusing the library from the compile cache", label)
        return CompiledPartition(library=library, constants=constants, from_cache=True)
    if cache_only:
        return None
    library = compiled_library(program, replace(steps, options=options), label, kernel_check)
    store_library(key, library)
    return CompiledPartition(library=library, constants=constants)


def compiled_library(
    program: ExportedProgram, steps: CompileSteps, label: str, kernel_check: KernelCheck | None
) -> bytes:
    with tempfile.TemporaryDirectory(prefix="aotstack-aoti-") as workdir:
        package_path = os.path.join(workdir, "partition.pt2")
        with recorded_fallback_kernels() as kernels:
            try:
                aoti_package(program, package_path, steps)
            except Exception as exc:
                raise LoweringError(f"AOTInductor failed to compile {label}: {exc}") from exc
        if kernel_check is not None:
            kernel_check(frozenset(kernels))
        return library_from_package(package_path, label)


def aoti_package(program: ExportedProgram, package_path: str, steps: CompileSteps) -> None:
    kernels = contextlib.nullcontext() if steps.attention_kernels is None else sdpa_kernel(steps.attention_kernels)
    with torch.no_grad(), kernels, on_device(steps.device):
        torch._inductor.aoti_compile_and_package(program, package_path=package_path, inductor_configs=steps.options)


def on_device(device: Device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current while compiling, so Inductor builds for that index."""
    if device.type is DeviceType.CUDA:
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


def prepared_program(exported_program: ExportedProgram, steps: CompileSteps) -> ExportedProgram:
    """The partition on the target device, after the backend's passes and decompositions."""
    from torch.export.passes import move_to_device_pass

    program = exported_program
    if steps.device != HOST:
        program = move_to_device_pass(program, str(steps.device))
    for graph_pass in steps.passes:
        if graph_pass(program.graph_module):
            program.graph_module.recompile()
    if steps.decompositions:
        program = program.run_decompositions(steps.decompositions)
    return program


def library_from_package(package_path: str, label: str) -> bytes:
    with zipfile.ZipFile(package_path) as archive:
        libraries = [name for name in archive.namelist() if name.endswith(".so")]
        if len(libraries) != 1:
            raise LoweringError(
                f"AOTInductor package for {label} holds {len(libraries)} shared libraries, expected 1"
            )
        return archive.read(libraries[0])


def cache_key(program: ExportedProgram, options: dict[str, Any]) -> str:
    """A hash of everything the library depends on: the program, its weights' values and the options.

    So is the thread count, which the generated OpenMP code bakes in.
    """
    parts = (torch.__version__, __version__, str(torch.get_num_threads()), repr(sorted(options.items())))
    digest = hashlib.sha256("\0".join(parts).encode())
    digest.update(program_fingerprint(program).encode())
    return digest.hexdigest()


def cached_library(key: str) -> bytes | None:
    library = read_entry(CACHE_KIND, key + ".so")
    # An entry is named by its key, and its content hash is kept beside it.
    expected = read_entry(CACHE_KIND, key + ".so.sha256")
    if library is None or expected is None:
        return None
    return library if content_key(library) == expected.decode().strip() else None


def store_library(key: str, library: bytes) -> None:
    """Add ``library`` to the cache, its hash first, so a library without its hash is never read."""
    write_entry(CACHE_KIND, key + ".so.sha256", content_key(library).encode())
    write_entry(CACHE_KIND, key + ".so", library)
