"""aotstack: compile a PyTorch model ahead of time into one ``.pt2`` that runs without recompiling.

Example::

    import aotstack

    program = aotstack.export(model, {"forward": (x,)})
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
    lowered.save("model.pt2")
    y = aotstack.load("model.pt2").forward(x)
"""

__version__ = "0.1.0"

from .backend import Backend
from .backends.aoti import AotiBackend, AotiCpuBackend, AotiCpuPartitioner, AotiPartitioner
from .backends.ort import OrtBackend, OrtPartitioner
from .devices import DeviceType, parse_device_spec, propagate_device_pass
from .errors import (
    AotstackError,
    BackendNotFoundError,
    DelegateInitError,
    ExportError,
    InputError,
    LoweringError,
    MethodNotFoundError,
    PackageError,
)
from .export import Program, export
from .lower import Delegate, LoweredProgram, lower
from .partitioner import (
    Partitioner,
    SupportedOpsPartitioner,
    get_non_lowered_nodes,
    tag_constant_data,
    tag_mutated_buffer,
)
from .runtime import LoadedProgram, load
from .specs import CompileSpec, DelegationSpec, PartitionResult, PreprocessResult

__all__ = [
    "AotiBackend",
    "AotiCpuBackend",
    "AotiCpuPartitioner",
    "AotiPartitioner",
    "AotstackError",
    "Backend",
    "BackendNotFoundError",
    "CompileSpec",
    "Delegate",
    "DelegateInitError",
    "DelegationSpec",
    "DeviceType",
    "ExportError",
    "InputError",
    "LoadedProgram",
    "LoweredProgram",
    "LoweringError",
    "MethodNotFoundError",
    "OrtBackend",
    "OrtPartitioner",
    "PackageError",
    "PartitionResult",
    "Partitioner",
    "PreprocessResult",
    "Program",
    "SupportedOpsPartitioner",
    "export",
    "get_non_lowered_nodes",
    "load",
    "lower",
    "parse_device_spec",
    "propagate_device_pass",
    "tag_constant_data",
    "tag_mutated_buffer",
]
