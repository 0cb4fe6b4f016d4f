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
from .backends.aoti import (
    AotiBackend,
    AotiCpuBackend,
    AotiCpuPartitioner,
    AotiPartitioner,
    CudaBackend,
    CudaPartitioner,
    MetalBackend,
    MetalPartitioner,
    ReplaceViewCopyWithViewPass,
)
from .backends.ort import OrtBackend, OrtPartitioner
from .devices import DeviceType, parse_device_spec, propagate_device_pass
from .errors import (
    AotstackError,
    BackendNotFoundError,
    CompileSpecError,
    DelegateInitError,
    ExportError,
    InputError,
    LoweringError,
    MethodNotFoundError,
    MissingFallbackKernelsError,
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
    "CompileSpecError",
    "CudaBackend",
    "CudaPartitioner",
    "Delegate",
    "DelegateInitError",
    "DelegationSpec",
    "DeviceType",
    "ExportError",
    "InputError",
    "LoadedProgram",
    "LoweredProgram",
    "LoweringError",
    "MetalBackend",
    "MetalPartitioner",
    "MethodNotFoundError",
    "MissingFallbackKernelsError",
    "OrtBackend",
    "OrtPartitioner",
    "PackageError",
    "PartitionResult",
    "Partitioner",
    "PreprocessResult",
    "Program",
    "ReplaceViewCopyWithViewPass",
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
