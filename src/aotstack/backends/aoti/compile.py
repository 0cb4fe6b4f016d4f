"""The AOTInductor compile steps, shared by every AOTI backend."""

from __future__ import annotations

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

from ...errors import LoweringError

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
        library = library_from_package(package_path, label)
    return CompiledPartition(library=library, constants=partition_constants(program))


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


def partition_constants(program: ExportedProgram) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and lifted constant of the partition, by FQN."""
    constants = {name: tensor for name, tensor in program.state_dict.items()}
    constants.update(
        (name, value) for name, value in program.constants.items() if isinstance(value, torch.Tensor)
    )
    return constants
