"""The AOTInductor run side: open a verified library, hand it its weights, run it."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...errors import CompileSpecError, DelegateInitError, PackageError
from ...format.devices import HOST, Device, DeviceType
from ...format.specs import CompileSpec, SpecKey, compile_spec_value, partition_label
from ...format.tensor_data import BytesLike, weights_from_named_data
from ..base import BackendRuntime

# The named data holding a partition's shared library.
LIBRARY_NAME = "model.so"


class AotiRuntime(BackendRuntime):
    """The run side every AOTInductor backend shares; each device type registers its own."""

    device_name: ClassVar[str]

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, BytesLike], compile_specs: list[CompileSpec]
    ) -> AotiHandle:
        label = partition_label(self.backend_id, compile_specs)
        device = target_device(compile_specs, self.backend_id, self.device_name)
        processed = json.loads(processed_bytes)
        weights = weights_from_named_data(named_data, processed["weights"])
        runner = open_runner(named_data[LIBRARY_NAME], processed["library"], device, label)
        if device != HOST:
            weights = {fqn: tensor.to(str(device)) for fqn, tensor in weights.items()}
        bound = bind_constants(runner, weights, label)
        strides = [None if s is None else tuple(s) for s in processed["input_strides"]]
        return AotiHandle(runner=runner, input_strides=strides, constants=bound)

    def execute(self, handle: AotiHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)


class AotiCpuRuntime(AotiRuntime):
    backend_id = "aoti_cpu"
    device_name = "cpu"


class CudaRuntime(AotiRuntime):
    backend_id = "aoti_cuda"
    device_name = "cuda"


class MetalRuntime(AotiRuntime):
    backend_id = "aoti_metal"
    device_name = "mps"


def target_device(compile_specs: list[CompileSpec], backend_id: str, device_name: str) -> Device:
    """The device the ``target_device`` spec names, the backend's own type where it names none."""
    value = compile_spec_value(compile_specs, SpecKey.TARGET_DEVICE)
    if value is None:
        return Device(DeviceType(device_name))
    try:
        device = Device.parse(value.decode())
    except ValueError as exc:
        raise CompileSpecError(f"compile spec 'target_device': {exc}") from None
    if device.type.value != device_name:
        raise CompileSpecError(
            f"compile spec 'target_device' is {value.decode()!r}, but {backend_id} compiles for {device_name} devices"
        )
    return device


@dataclass
class AotiHandle:
    """A loaded AOTInductor model and the input strides it was compiled for."""

    # torch's AOTIModelContainerRunner for the delegate's device.
    runner: Any
    # None where a dimension is dynamic: then the compiled code expects a contiguous tensor.
    input_strides: list[tuple[int, ...] | None]
    # The runner reads user-managed weights in place; they must live as long as it does.
    constants: dict[str, torch.Tensor]


def open_runner(library: BytesLike, key: str, device: Device, label: str) -> Any:
    """A runner over ``library`` (already verified, ``key`` its SHA-256) on ``device``, with its own weights slot."""
    open_on_device = runner_factory(device, label)
    try:
        return open_on_device(library_path(library, key))
    except RuntimeError as exc:
        raise PackageError(f"cannot open the AOTInductor library of {label}: {exc}") from exc


def runner_factory(device: Device, label: str) -> Callable[[str], Any]:
    """How to open a library for ``device``; ``DelegateInitError`` where this machine cannot run it."""
    if not device_available(device):
        raise DelegateInitError(f"{label} runs on {device}, which this machine lacks ({visible_devices()})")
    runners = torch._C._aoti
    if device.type is DeviceType.CPU:
        return lambda path: runners.AOTIModelContainerRunnerCpu(path, 1)
    if device.type is DeviceType.CUDA:
        return lambda path: runners.AOTIModelContainerRunnerCuda(path, 1, str(device))
    return lambda path: runners.AOTIModelContainerRunnerMps(path, 1)


def device_available(device: Device) -> bool:
    """Whether this machine, and this build of torch, has ``device``."""
    if device.type is DeviceType.CUDA:
        return torch.cuda.is_available() and device.index < torch.cuda.device_count()
    if device.type is DeviceType.MPS:
        return torch.backends.mps.is_available() and device.index == 0
    return True


def visible_devices() -> str:
    return f"CUDA devices: {torch.cuda.device_count()}, MPS: {'yes' if torch.backends.mps.is_available() else 'no'}"


_LIBRARY_PATHS: dict[str, str] = {}


def library_path(library: BytesLike, key: str) -> str:
    """A private file holding ``library``, written once per process for each distinct library.

    Delegates compiled to the same code share it, so the dynamic loader opens it once; each
    runner still keeps its own weights. ``key`` is the library's hash, recorded when it was
    compiled, so loading does not hash it a second time.
    """
    if key not in _LIBRARY_PATHS:
        directory = private_directory()
        fd, path = tempfile.mkstemp(prefix=key[:16] + "-", suffix=".so", dir=directory)
        with os.fdopen(fd, "wb") as file:
            file.write(library)
        _LIBRARY_PATHS[key] = path
    return _LIBRARY_PATHS[key]


@functools.cache
def private_directory() -> str:
    directory = tempfile.mkdtemp(prefix="aotstack-libraries-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def bind_constants(
    runner: Any,
    constants_by_fqn: dict[str, torch.Tensor],
    label: str,
) -> dict[str, torch.Tensor]:
    """Give the runner every weight it asks for; name the first one the package lacks."""
    bound = {}
    for name, fqn in runner.get_constant_names_to_original_fqns().items():
        if fqn not in constants_by_fqn:
            raise PackageError(f"{label}: the library asks for weight {fqn!r}, which the package lacks")
        bound[name] = constants_by_fqn[fqn]
    if bound:
        runner.update_constant_buffer(bound, False, True, True)
    return bound


def run(handle: AotiHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    strides = handle.input_strides
    for index, tensor in enumerate(inputs):
        expected = strides[index]
        if expected is None:
            if not tensor.is_contiguous():
                inputs[index] = tensor.contiguous()
        elif tensor.stride() != expected:
            inputs[index] = restrided(tensor, expected)
    return handle.runner.run(inputs)


def restrided(tensor: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A copy of ``tensor`` in the layout the compiled code indexes with."""
    return torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
