"""``AotiBackend``: the one base every AOTInductor backend builds on.

The compile steps and the run side live here, once. A concrete backend only answers the
hooks: its device, the fallback kernels its runtime has, its decompositions, its Inductor
options and its graph passes. Concrete backends are final.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.nn.attention import SDPBackend

from ...backend import Backend
from ...devices import HOST, Device, DeviceType
from ...errors import CompileSpecError, LoweringError, MissingFallbackKernelsError
from ...op_names import op_name
from ...specs import CompileSpec, PreprocessResult, compile_spec_value, partition_label
from ...tensor_data import BytesLike, content_key, weights_as_named_data, weights_from_named_data
from .compile import CompileSteps, KernelCheck, compile_partition, generated_fallback_kernels
from .kernels import (
    FALLBACK_KERNELS_SPEC,
    kernel_allowed,
    parse_kernel_list,
    signature_key,
    single_op_program,
)
from .passes import GraphPass, ReplaceViewCopyWithViewPass
from .run import AotiHandle, bind_constants, device_available, open_runner, run

LIBRARY_NAME = "model.so"

logger = logging.getLogger("aotstack")


class AotiBackend(Backend):
    """Shared base of the AOTInductor backends: CPU, CUDA and Metal each answer the hooks.

    Compile specs every AOTI backend reads:

    - ``target_device``: ``cpu``, ``cuda:1``, ``mps``; its type must be the backend's.
    - ``fallback_kernels``: the ATen kernels the target's runtime has, as op names separated
      by commas (``aten.addmm.out,aten.convolution``); replaces the backend's own list.
    """

    device_name: ClassVar[str]
    # None: the target's runtime has every fallback kernel AOTInductor can call.
    default_fallback_kernels: ClassVar[frozenset[str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        for base in cls.__mro__[1:]:
            if base is not AotiBackend and issubclass(base, AotiBackend) and "backend_id" in base.__dict__:
                raise TypeError(
                    f"{base.__qualname__} is final; subclass AotiBackend to add an AOTInductor backend"
                )
        super().__init_subclass__(**kwargs)

    # Hooks -----------------------------------------------------------------------------------

    def decomposition_table(self) -> dict[Any, Callable[..., Any]]:
        """Decompositions applied before compiling (none by default)."""
        return {}

    def inductor_options(self, compile_specs: list[CompileSpec]) -> dict[str, Any]:
        """AOTInductor options for this target; a bad compile spec raises ``CompileSpecError``."""
        return {}

    def custom_passes(self) -> list[GraphPass]:
        """Graph passes this target runs after the view-copy pass, before decompositions."""
        return []

    def attention_kernels(self) -> list[SDPBackend] | None:
        """The attention kernels Inductor may pick while compiling; None leaves the choice to it."""
        return None

    # What every AOTI backend shares ----------------------------------------------------------

    def compile_options(self, compile_specs: list[CompileSpec]) -> dict[str, Any]:
        """Every AOTInductor option a compile uses: the target's, with weights kept out of the library."""
        return {**self.inductor_options(compile_specs), "aot_inductor.package_constants_in_so": False}

    def default_target_device(self) -> Device:
        return Device(DeviceType(self.device_name))

    def target_device(self, compile_specs: list[CompileSpec]) -> Device:
        value = compile_spec_value(compile_specs, "target_device")
        if value is None:
            return self.default_target_device()
        try:
            device = Device.parse(value.decode())
        except ValueError as exc:
            raise CompileSpecError(f"compile spec 'target_device': {exc}") from None
        if device.type.value != self.device_name:
            raise CompileSpecError(
                f"compile spec 'target_device' is {value.decode()!r}, but {self.backend_id} "
                f"compiles for {self.device_name} devices"
            )
        return device

    def fallback_kernels(self, compile_specs: list[CompileSpec]) -> frozenset[str] | None:
        """The fallback kernels the target's runtime has; None means every one."""
        value = compile_spec_value(compile_specs, FALLBACK_KERNELS_SPEC)
        return self.default_fallback_kernels if value is None else parse_kernel_list(value)

    def validate_compile_specs(self, compile_specs: list[CompileSpec]) -> None:
        """Raise ``CompileSpecError`` naming the first spec this backend cannot take."""
        self.target_device(compile_specs)
        self.fallback_kernels(compile_specs)
        self.inductor_options(compile_specs)

    def compile_steps(self, compile_specs: list[CompileSpec], device: Device | None = None) -> CompileSteps:
        options = self.compile_options(compile_specs)
        if device == HOST and self.device_name != "cpu":
            # Standing in for a device this machine lacks: autotuning would tune for the host.
            options = {key: value for key, value in options.items() if not key.startswith("max_autotune")}
        return CompileSteps(
            device=self.target_device(compile_specs) if device is None else device,
            passes=[ReplaceViewCopyWithViewPass(), *self.custom_passes()],
            decompositions=self.decomposition_table(),
            attention_kernels=self.attention_kernels(),
            options=options,
        )

    def needed_fallback_kernels(self, node: Node, compile_specs: list[CompileSpec]) -> frozenset[str]:
        """The fallback kernels ``node``'s op needs on this target, asked of Inductor once per signature.

        Where this machine lacks the target device, the op is probed on the host instead, which
        can differ where Inductor lowers an op differently per device; the compile re-checks.
        """
        target = self.target_device(compile_specs)
        device = target if device_available(target) else HOST
        steps = self.compile_steps(compile_specs, device)
        key = (self.backend_id, str(device), repr(sorted(steps.options.items())), signature_key(node))
        if key not in _PROBED:
            try:
                _PROBED[key] = generated_fallback_kernels(single_op_program(node), steps)
            except Exception as exc:  # an op Inductor cannot compile on its own needs ATen's own kernel
                logger.info("%s: %s cannot be compiled on its own (%s)", self.backend_id, node.name, exc)
                _PROBED[key] = frozenset({op_name(node.target)})
        return _PROBED[key]

    def updates_in_place(self, buffer: torch.Tensor, compile_specs: list[CompileSpec]) -> bool:
        # The runner writes into the user-managed buffer it is given; a device copy would not be the
        # shared state. Inductor folds a one-element buffer into the code as a constant, update and all
        # (plain AOTInductor packages get such a counter wrong too), so one stays an input.
        return self.target_device(compile_specs) == HOST and buffer.numel() > 1

    # Compile side ----------------------------------------------------------------------------

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        label = partition_label(self.backend_id, compile_specs)
        self.validate_compile_specs(compile_specs)
        device = self.target_device(compile_specs)
        if not device_available(device):
            raise LoweringError(
                f"{label} compiles for {device}, which this machine lacks; "
                "AOTInductor builds device code on the device itself"
            )
        allowed = self.fallback_kernels(compile_specs)
        compiled = compile_partition(
            exported_program,
            self.compile_steps(compile_specs),
            label=label,
            kernel_check=None if allowed is None else self.kernel_check(allowed, compile_specs),
        )
        named_data, weights = weights_as_named_data(compiled.constants)
        named_data[LIBRARY_NAME] = compiled.library
        processed = {
            "library": content_key(compiled.library),
            "weights": weights,
            "input_strides": [static_stride(node) for node in user_input_nodes(exported_program)],
        }
        return PreprocessResult(json.dumps(processed).encode(), named_data)

    def kernel_check(self, allowed: frozenset[str], compile_specs: list[CompileSpec]) -> KernelCheck:
        method = compile_spec_value(compile_specs, "method_name")

        def check(kernels: frozenset[str]) -> None:
            missing = {kernel: [] for kernel in kernels if not kernel_allowed(kernel, allowed)}
            if missing:
                raise MissingFallbackKernelsError(self.backend_id, missing, method.decode() if method else None)

        return check

    # Run side --------------------------------------------------------------------------------

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, BytesLike], compile_specs: list[CompileSpec]
    ) -> AotiHandle:
        label = partition_label(self.backend_id, compile_specs)
        device = self.target_device(compile_specs)
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


_PROBED: dict[tuple[str, ...], frozenset[str]] = {}


def user_input_nodes(exported_program: ExportedProgram) -> list[torch.fx.Node]:
    user_inputs = set(exported_program.graph_signature.user_inputs)
    return [n for n in exported_program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]


def static_stride(node: torch.fx.Node) -> list[int] | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise LoweringError(f"partition input {node.name!r} is not a tensor")
    stride = value.stride()
    if all(isinstance(s, int) for s in stride):
        return list(stride)
    return None
