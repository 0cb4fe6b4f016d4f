"""The per-op probe: which fallback kernels one op needs on a target, asked of Inductor once per signature.

A partitioner asks before claiming an op, where the target's runtime has only some kernels, and auto asks
whether compiling an op would still call ATen's kernel for it (``compiled_calls_aten_kernel``): the op alone
goes through the backend's compile steps and Inductor's code generation, stopped before the C++ compile
(``kernels.py`` records the calls). The answers are kept on disk beside the compiled libraries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import replace
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from ... import __version__
from ...compile.cache import read_entry, write_entry
from ...engine.processor import processor_fingerprint
from ...format.op_names import op_name
from .compile import CompileSteps, aoti_package, prepared_program
from .kernels import recorded_fallback_kernels, stopped_before_cpp_compile, stopped_by_probe

logger = logging.getLogger("aotstack")

# (backend id, its code, device, options, op signature) -> the kernels its code calls, or None where Inductor cannot
# compile the op on its own; one probe per process, and on disk.
_PROBED: dict[tuple[str, ...], frozenset[str] | None] = {}
CACHE_KIND = "aoti-probes"


def needed_fallback_kernels(backend_id: str, node: Node, steps: CompileSteps) -> frozenset[str]:
    """The fallback kernels ``node``'s op needs when compiled with ``steps``: an op Inductor cannot compile on its own
    needs ATen's own kernel."""
    probed = probed_fallback_kernels(backend_id, node, steps)
    return frozenset({op_name(node.target)}) if probed is None else probed


def probed_fallback_kernels(backend_id: str, node: Node, steps: CompileSteps) -> frozenset[str] | None:
    """The fallback kernels Inductor's code for ``node``'s op alone calls when compiled with ``steps``; None where it
    cannot compile the op on its own. Probed once per signature and kept in the cache on disk, so a later lowering
    asks again without Inductor."""
    key = (backend_id, steps.code, str(steps.device), repr(sorted(steps.options.items())), signature_key(node))
    if key not in _PROBED:
        name = disk_key(key)
        found, answer = kept_answer(name)
        if not found:
            answer = probe_answer(backend_id, node, steps)
            write_entry(CACHE_KIND, name, json.dumps(None if answer is None else sorted(answer)).encode())
        _PROBED[key] = answer
    return _PROBED[key]


def probe_answer(backend_id: str, node: Node, steps: CompileSteps) -> frozenset[str] | None:
    try:
        return generated_fallback_kernels(single_op_program(node), steps)
    except Exception as exc:  # noqa: BLE001 - the caller decides what an op Inductor cannot compile alone means
        logger.info("%s: %s cannot be compiled on its own (%s)", backend_id, node.name, exc)
        return None


def disk_key(key: tuple[str, ...]) -> str:
    """A probe's name in the cache: its key (the backend's ``code_version`` among it), with the versions and the
    processor Inductor's code depends on."""
    parts = (torch.__version__, __version__, processor_fingerprint(), *key)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest() + ".json"


def kept_answer(name: str) -> tuple[bool, frozenset[str] | None]:
    """Whether a probe's answer is kept on disk under ``name``, and the answer; not found where it cannot be read."""
    data = read_entry(CACHE_KIND, name)
    try:
        kernels = None if data is None else json.loads(data)
    except ValueError:
        return False, None
    if kernels is None:
        return data is not None, None
    if not isinstance(kernels, list) or not all(isinstance(kernel, str) for kernel in kernels):
        return False, None
    return True, frozenset(kernels)


def single_op_program(node: Node) -> ExportedProgram:
    """An exported program that runs ``node``'s op alone, on host tensors shaped like its inputs."""
    graph = Graph()
    placeholders = {source: graph.placeholder(f"input_{i}") for i, source in enumerate(node.all_input_nodes)}
    args, kwargs = pytree.tree_map_only(Node, placeholders.__getitem__, (node.args, node.kwargs))
    graph.output(graph.call_function(node.target, tuple(args), dict(kwargs)))
    module = GraphModule(torch.nn.Module(), graph)
    examples = tuple(example_value(source.meta.get("val")) for source in placeholders)
    return torch.export.export(module, examples, strict=False)


def example_value(value: Any) -> Any:
    """A real value standing in for a node's fake one; symbolic sizes take their hints."""
    if isinstance(value, torch.Tensor):
        shape = [size_hint(s) for s in value.shape]
        stride = [size_hint(s) for s in value.stride()]
        return torch.empty_strided(shape, stride, dtype=value.dtype).zero_()
    if isinstance(value, torch.SymInt):
        return size_hint(value)
    return value


def size_hint(size: int | torch.SymInt) -> int:
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else 2


def signature_key(node: Node) -> str:
    """What a probe of ``node``'s op depends on: the op and the shapes, strides and values it gets."""

    def described(value: Any) -> Any:
        if isinstance(value, Node):
            value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            sizes, strides = tuple(map(size_hint, value.shape)), tuple(map(size_hint, value.stride()))
            return ("tensor", str(value.dtype), sizes, strides)
        return repr(value)

    return repr((op_name(node.target), pytree.tree_map(described, (node.args, node.kwargs))))


def generated_fallback_kernels(exported_program: ExportedProgram, steps: CompileSteps) -> frozenset[str]:
    """The fallback kernels AOTInductor's code for ``exported_program`` calls, found without a C++ compile."""
    program = prepared_program(exported_program, steps)
    options = {**steps.options, "fx_graph_cache": False}
    with tempfile.TemporaryDirectory(prefix="aotstack-probe-") as workdir:
        with recorded_fallback_kernels() as kernels, stopped_before_cpp_compile():
            try:
                aoti_package(program, os.path.join(workdir, "probe.pt2"), replace(steps, options=options))
            except Exception as exc:
                if not stopped_by_probe(exc):
                    raise
    return frozenset(kernels)
