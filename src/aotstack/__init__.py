"""aotstack: compile a PyTorch model ahead of time into one ``.pt2`` that runs without recompiling.

Example::

    import aotstack

    program = aotstack.export(model, {"forward": (x,)})
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
    lowered.save("model.pt2")
    y = aotstack.load("model.pt2").forward(x)

Public names are imported when first used, so ``from aotstack import load`` brings in the
runtime alone, never the compiler.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "AotiBackend": "backends.aoti.backend",
    "AotiCpuBackend": "backends.aoti.cpu",
    "AotiCpuPartitioner": "backends.aoti.cpu",
    "AotiPartitioner": "backends.aoti.partitioner",
    "CudaBackend": "backends.aoti.cuda",
    "CudaPartitioner": "backends.aoti.cuda",
    "MetalBackend": "backends.aoti.metal",
    "MetalPartitioner": "backends.aoti.metal",
    "ReplaceViewCopyWithViewPass": "backends.aoti.passes",
    "OrtBackend": "backends.ort.backend",
    "OrtPartitioner": "backends.ort.partitioner",
    "OpenVinoBackend": "backends.openvino.backend",
    "OpenVinoPartitioner": "backends.openvino.partitioner",
    "XnnpackBackend": "backends.xnnpack.backend",
    "XnnpackPartitioner": "backends.xnnpack.partitioner",
    "Backend": "engine.interface",
    "BackendRuntime": "engine.interface",
    "AotstackError": "errors",
    "AudioFileError": "errors",
    "BackendNotFoundError": "errors",
    "CompileSpecError": "errors",
    "CheckError": "errors",
    "DelegateInitError": "errors",
    "EngineCrashError": "errors",
    "ExportError": "errors",
    "GenerationError": "errors",
    "InputError": "errors",
    "LoweringError": "errors",
    "MethodNotFoundError": "errors",
    "MissingFallbackKernelsError": "errors",
    "ModelFolderError": "errors",
    "PackageError": "errors",
    "SaveError": "errors",
    "QuantizationError": "errors",
    "CustomOpError": "errors",
    "SignatureError": "errors",
    "RunError": "errors",
    "UnsupportedModelError": "errors",
    "sign": "format.archive",
    "verify": "format.archive",
    "CompileSpec": "format.specs",
    "DelegationSpec": "format.specs",
    "PreprocessResult": "format.specs",
    "SpecKey": "format.specs",
    "DeviceType": "format.devices",
    "parse_device_spec": "format.devices",
    "Delegate": "format.records",
    "Program": "compile.export",
    "Quantization": "compile.quantize",
    "quantize": "compile.quantize",
    "export": "compile.export",
    "Auto": "compile.auto",
    "Check": "compile.check",
    "CheckResult": "compile.check",
    "CompileFailure": "compile.lower",
    "CompileRecord": "compile.lower",
    "LoweredProgram": "compile.lower",
    "explain": "compile.explain",
    "Report": "report.model",
    "file_report": "report.model",
    "lower": "compile.lower",
    "propagate_device_pass": "compile.devices",
    "Partitioner": "compile.partitioner",
    "PartitionResult": "compile.partitioner",
    "SupportedOpsPartitioner": "compile.partitioner",
    "get_non_lowered_nodes": "compile.partitioner",
    "tag_constant_data": "compile.partitioner",
    "tag_mutated_buffer": "compile.partitioner",
    "LoadedProgram": "runtime.load",
    "load": "runtime.load",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aotstack' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

