"""The AOTInductor compile steps, shared by every AOTI backend."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import __version__
from ...compile.cache import read_entry, write_entry
from ...compile.program_parts import Structure, constant_placeholders, program_structure, program_weights
from ...compile.quantize import op_qualname
from ...engine.processor import features_of_flags, native_code_features, processor_fingerprint
from ...errors import LoweringError
from ...format.devices import HOST, Device, DeviceType
from ...format.tensor_data import content_key
from .experts import with_compiled_experts
from .index_analysis import bounded_index_simplification
from .kernels import recorded_fallback_kernels
from .passes import GraphPass

logger = logging.getLogger("aotstack")

# The compile cache's folder for libraries (``compile/cache.py``).
CACHE_KIND = "aoti"

KernelCheck = Callable[[frozenset[str]], None]
# A rewrite of a partition that may change its weights too; it returns a new program, the one given unchanged.
ProgramPass = Callable[[ExportedProgram], ExportedProgram]


@dataclass(frozen=True)
class CompileSteps:
    """What an AOTI backend does to a partition: move it to its device, rewrite it, compile it."""

    device: Device
    passes: list[GraphPass]
    decompositions: dict[Any, Callable[..., Any]]
    options: dict[str, Any]
    # None: Inductor picks attention kernels as plain AOTInductor does.
    attention_kernels: list[SDPBackend] | None = None
    # The backend's ``code_version``: a change to its passes keys its libraries apart in the cache.
    code: str = ""
    # Run before ``passes``.
    program_passes: list[ProgramPass] = field(default_factory=list)


@dataclass
class CompiledPartition:
    """A shared library with its weights kept apart, keyed by their FQN in the partition (none where it holds them)."""

    library: bytes
    constants: dict[str, torch.Tensor]
    # The library's name for each weight it asks for under another FQN than this partition's: a
    # library compiled for a partition of the same structure (``program_structure``) is reused.
    library_fqns: dict[str, str] = field(default_factory=dict)
    # The calls the library makes through AOTInductor's proxy executor (custom ops), as the JSON
    # it reads beside the library; None where it makes none.
    extern_nodes: bytes | None = None
    # Taken from aotstack's compile cache rather than compiled.
    from_cache: bool = False
    # The weights read only as embedding tables, a few rows a call (``gathered_weights``).
    gathered: list[str] = field(default_factory=list)
    # The CPU features (cpuinfo's names) the library's code may use; empty for a device's library.
    cpu_features: list[str] = field(default_factory=list)
    # Frozen into the library (``holds_weights``): it asks for no weight at load, and ``constants`` is empty.
    holds_weights: bool = False


@dataclass(frozen=True)
class CompiledFiles:
    """What a compile leaves: the library and, where it calls ops by proxy, their JSON."""

    library: bytes
    extern_nodes: bytes | None
    # The FQNs the library asks its weights by, in the order of its program's structure.
    weights: list[str]


def compile_partition(
    exported_program: ExportedProgram,
    steps: CompileSteps,
    *,
    label: str,
    kernel_check: KernelCheck | None = None,
    cache_only: bool = False,
) -> CompiledPartition | None:
    """Compile one partition with AOTInductor, weights outside the library unless frozen into it (``holds_weights``).

    ``kernel_check`` is handed the fallback kernels the generated code calls, before the
    library is cached; it raises to refuse them. With ``cache_only``, a partition not in the
    compile cache gives None instead of a compile.
    """
    program = prepared_program(exported_program, steps)
    held = holds_weights(steps.options)
    updated = sorted(program.graph_signature.buffers_to_mutate.values())
    if held and updated:
        # The library would update its own copy, not the buffer's one state that other parts, methods and reset() see.
        raise LoweringError(
            f"{label} updates buffers ({', '.join(updated)}), which cannot be frozen into its library; "
            "compile it without the freeze_weights compile spec"
        )
    constants = {} if held else program_weights(program)
    gathered = [] if held else gathered_weights(program)
    options = {**steps.options, **convolution_layout_options(program)}
    if kernel_check is not None:
        # Inductor's own cache skips code generation, where fallback kernels are recorded.
        options["fx_graph_cache"] = False
    structure = program_structure(program, every_value=folds_weights(options))
    asked = [] if held else structure.weights
    key = cache_key(structure, {**options, "aotstack.device": str(steps.device), "aotstack.code": steps.code})
    files = cached_files(key)
    if files is not None and len(files.weights) == len(asked):
        logger.debug("%s: reusing the library from the compile cache", label)
        renamed = {ours: theirs for ours, theirs in zip(files.weights, asked) if ours != theirs}
        # The cache is keyed by this processor, so a cached library needs what one compiled now would.
        return CompiledPartition(files.library, constants, renamed, files.extern_nodes, from_cache=True,
                                 gathered=gathered, cpu_features=host_cpu_features(options, steps), holds_weights=held)
    if cache_only:
        # Asked before any compile (a miss on a cold cache): probing the CPU here would compile Inductor's test
        # programs in the lowering process, seconds its other partitions would wait for.
        return None
    files = compiled_files(program, replace(steps, options=options), label, kernel_check, asked)
    store_files(key, files)
    return CompiledPartition(files.library, constants, extern_nodes=files.extern_nodes, gathered=gathered,
                             cpu_features=host_cpu_features(options, steps), holds_weights=held)


CONVOLUTIONS = frozenset({"aten::convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::_convolution"})


def convolution_layout_options(program: ExportedProgram) -> dict[str, Any]:
    """Inductor's options that keep ``program``'s convolutions in the layout they were exported in, where one takes
    an input of a size read from data (the images a model keeps of those it was given: SmolVLM's); else none.

    On a CPU, Inductor moves every convolution to channels-last. With a data-dependent size it does
    not convert such an input, while the code after the convolution reads the convolution's output
    as channels-last: wrong values, silently (torch 2.11-2.13; ``torch.compile`` trips its own
    stride assertion there). Inductor turns that layout off itself for any dynamic size on a GPU.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in program.graph.nodes:
        if node.op != "call_function" or op_qualname(node) not in CONVOLUTIONS:
            continue
        image = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(image, torch.Tensor) and free_unbacked_symbols(image):
            return {"layout_optimization": False}
    return {}


def host_cpu_features(options: dict[str, Any], steps: CompileSteps) -> list[str]:
    """The CPU features a library compiled under ``options`` needs: none for a device's library."""
    return library_cpu_features(options) if steps.device == HOST else []


def library_cpu_features(options: dict[str, Any]) -> list[str]:
    """The CPU features a library Inductor compiles here under ``options`` may use, by cpuinfo's names.

    Those of the vector code it writes (its ``pick_vec_isa``: AVX-512 and AMX where this CPU has
    them), and, under ``-march=native`` (Inductor's default; torch 2.13's ``cpp.march`` or
    ``TORCHINDUCTOR_CPP_MARCH`` names another target), every vector extension of this CPU.
    """
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    with config.patch({name: value for name, value in options.items() if name.startswith("cpp.")}):
        isa = pick_vec_isa()
        native = getattr(config.cpp, "march", None) is None
    needed = features_of_flags(isa.build_arch_flags().split()) if isa else []
    return sorted({*needed, *(native_code_features() if native else [])})


# What a table passes through between its stored form and the gather: elementwise ops, a slice of its
# columns, a view of its words' bits, its dequantization (``packed_weights.py`` unpacks packed tables so),
# reading each element once.
ELEMENTWISE_TO_GATHER = frozenset({
    "prims::convert_element_type", "aten::bitwise_and", "aten::bitwise_right_shift", "aten::sub", "aten::mul",
    "aten::add", "aten::slice", "aten::view", "torchao::dequantize_affine",
})


def gathered_weights(program: ExportedProgram) -> list[str]:
    """The FQNs of the weights every use of which ends, through elementwise ops, as an embedding's table.

    A call reads a few rows of such a weight, not all of it, so the run side may drop its pages
    from memory after the first call: the rows gathered later are read back from the file.
    """
    return sorted(fqn for node, fqn in constant_placeholders(program).items() if only_gathered(node))


def only_gathered(weight: torch.fx.Node) -> bool:
    derived, gathers, pending = {weight}, [], list(weight.users)
    while pending:
        user = pending.pop()
        if user in derived:
            continue
        name = op_qualname(user) if user.op == "call_function" else None
        if name == "aten::embedding":
            gathers.append(user)
        elif name in ELEMENTWISE_TO_GATHER:
            derived.add(user)
            pending.extend(user.users)
        else:
            return False
    # The table is what is gathered from, never the indices.
    return bool(gathers) and all(
        gather.args[0] in derived and not any(argument in derived for argument in gather.args[1:])
        for gather in gathers
    )


def compiled_files(
    program: ExportedProgram, steps: CompileSteps, label: str, kernel_check: KernelCheck | None, weights: list[str]
) -> CompiledFiles:
    with tempfile.TemporaryDirectory(prefix="aotstack-aoti-") as workdir:
        package_path = os.path.join(workdir, "partition.pt2")
        with recorded_fallback_kernels() as kernels:
            try:
                aoti_package(program, package_path, steps)
            except Exception as exc:
                raise LoweringError(f"AOTInductor failed to compile {label}: {exc}") from exc
        if kernel_check is not None:
            kernel_check(frozenset(kernels))
        return files_from_package(package_path, label, weights)


def aoti_package(program: ExportedProgram, package_path: str, steps: CompileSteps) -> None:
    kernels = contextlib.nullcontext() if steps.attention_kernels is None else sdpa_kernel(steps.attention_kernels)
    with torch.no_grad(), kernels, on_device(steps.device), bounded_index_simplification():
        torch._inductor.aoti_compile_and_package(program, package_path=package_path, inductor_configs=steps.options)


def on_device(device: Device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current while compiling, so Inductor builds for that index."""
    if device.type is DeviceType.CUDA:
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


def prepared_program(exported_program: ExportedProgram, steps: CompileSteps) -> ExportedProgram:
    """The partition on the target device, after the backend's passes and decompositions."""
    from torch.export.passes import move_to_device_pass

    program = with_compiled_experts(exported_program, on_host=steps.device == HOST)
    if steps.device != HOST:
        program = move_to_device_pass(program, str(steps.device))
    for program_pass in steps.program_passes:
        program = program_pass(program)
    for graph_pass in steps.passes:
        if graph_pass(program.graph_module):
            program.graph_module.recompile()
    if steps.decompositions:
        program = program.run_decompositions(steps.decompositions)
    return program


def files_from_package(package_path: str, label: str, weights: list[str]) -> CompiledFiles:
    """The library of an AOTInductor package, and the proxy executor's JSON AOTInductor writes beside it."""
    with zipfile.ZipFile(package_path) as archive:
        names = set(archive.namelist())
        libraries = [name for name in names if name.endswith(".so")]
        if len(libraries) != 1:
            raise LoweringError(
                f"AOTInductor package for {label} holds {len(libraries)} shared libraries, expected 1"
            )
        extern_nodes = libraries[0].removesuffix(".so") + ".json"
        return CompiledFiles(
            library=archive.read(libraries[0]),
            extern_nodes=archive.read(extern_nodes) if extern_nodes in names else None,
            weights=weights,
        )


def folds_weights(options: dict[str, Any]) -> bool:
    """Whether a compile with ``options`` may write any weight's values into the library's code."""
    from torch._inductor import config

    return bool(options.get("freezing", config.freezing)) or bool(
        options.get("aot_inductor.use_runtime_constant_folding", config.aot_inductor.use_runtime_constant_folding)
    )


def holds_weights(options: dict[str, Any]) -> bool:
    """Whether a compile with ``options`` writes every weight into the library, which asks for none at load.

    Frozen, Inductor folds weights into constants of its own (a convolution's, prepacked in
    oneDNN's layout), which only the library can hold.
    """
    return bool(options.get("freezing")) and bool(options.get("aot_inductor.package_constants_in_so"))


def cache_key(structure: Structure, options: dict[str, Any]) -> str:
    """A hash of everything the library depends on: the program's structure and the options.

    So are the thread count, which the generated OpenMP code bakes in (``cpp.threads``, torch's
    where unset), and the processor, whose instructions it is compiled for. Weights' names and (but
    for the ones the code may hold) values are not: partitions of repeated layers share a library.
    """
    # "structure": entries keyed by names and every weight's value, from before, are not reused.
    threads, options_text = str(options.get("cpp.threads") or torch.get_num_threads()), repr(sorted(options.items()))
    parts = (torch.__version__, __version__, threads, options_text, processor_fingerprint(), "structure")
    digest = hashlib.sha256("\0".join(parts).encode())
    digest.update(structure.digest.encode())
    return digest.hexdigest()


def cached_files(key: str) -> CompiledFiles | None:
    library = cached_entry(key + ".so")
    if library is None:
        return None
    # Stored before the library, so a library in the cache never lacks its proxy calls or its weights' names.
    extern_nodes = read_entry(CACHE_KIND, key + ".json")
    if extern_nodes is not None and cached_entry(key + ".json") is None:
        return None
    try:
        weights = json.loads(cached_entry(key + ".weights") or b"")
    except ValueError:
        return None
    if not isinstance(weights, list) or not all(isinstance(fqn, str) for fqn in weights):
        return None
    return CompiledFiles(library, extern_nodes, weights)


def cached_entry(name: str) -> bytes | None:
    data = read_entry(CACHE_KIND, name)
    # An entry is named by its key, and its content hash is kept beside it.
    expected = read_entry(CACHE_KIND, name + ".sha256")
    if data is None or expected is None:
        return None
    return data if content_key(data) == expected.decode().strip() else None


def store_files(key: str, files: CompiledFiles) -> None:
    """Add a compile's files to the cache, each hash before its file, the library last."""
    if files.extern_nodes is not None:
        store_entry(key + ".json", files.extern_nodes)
    store_entry(key + ".weights", json.dumps(files.weights).encode())
    store_entry(key + ".so", files.library)


def store_entry(name: str, data: bytes) -> None:
    write_entry(CACHE_KIND, name + ".sha256", content_key(data).encode())
    write_entry(CACHE_KIND, name, data)
