"""``AotiBackend``: the compile side every AOTInductor backend builds on (the run side is ``run.py``).

The compile steps live here, once. A concrete backend only answers the
hooks: its device, the fallback kernels its runtime has, its decompositions, its Inductor
options and its graph passes. Concrete backends are final.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.nn.attention import SDPBackend

from ...compile.program_parts import partition_boundary, user_input_placeholders
from ...engine.interface import Backend
from ...engine.source import code_version
from ...errors import LoweringError, MissingFallbackKernelsError
from ...format.custom_ops import is_custom_op_name
from ...format.devices import HOST, Device
from ...format.specs import (
    CompileSpec,
    PreprocessResult,
    SpecKey,
    compile_spec_value,
    partition_label,
    switch_spec,
)
from ...format.tensor_data import content_key, weights_as_named_data
from .compile import CompileSteps, KernelCheck, ProgramPass, compile_partition
from .kernels import kernel_allowed, parse_kernel_list
from .lifted_constants import with_constants_as_buffers
from .passes import GraphPass, ReplaceViewCopyWithViewPass
from .probe import needed_fallback_kernels, probed_fallback_kernels
from .run import EXTERN_NODES_NAME, LIBRARY_NAME, PROCESSED_VERSION, device_available, proxy_calls, target_device
from .scalar_weights import with_scalar_weights_inlined


class AotiBackend(Backend):
    """Shared base of the AOTInductor backends: CPU, CUDA and Metal each answer the hooks.

    Compile specs every AOTI backend reads:

    - ``target_device``: ``cpu``, ``cuda:1``, ``mps``; its type must be the backend's.
    - ``fallback_kernels``: the ATen kernels the target's runtime has, as op names separated
      by commas (``aten.addmm.out,aten.convolution``); replaces the backend's own list.
    - ``emulate_precision_casts``: ``ON`` or ``OFF`` (the default). ON rounds every bf16 or fp16
      intermediate to its dtype as eager does between ops: closer to eager, slower on a GPU.
    """

    device_name: ClassVar[str]
    # 2: transformers' grouped expert matmuls compiled in prompts too (experts.py), not run by the proxy executor.
    compile_revision = 2
    # A library takes its weights by name at load, so it serves every partition of its structure (compile.py).
    shares_code_across_weights = True
    warm_up_fills_disk_cache = True
    # A library's C++ build alone takes 4-5 s on one core, its generated wrapper even for a part of a few ops.
    expected_compile_seconds = 10.0
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

    def program_passes(self) -> list[ProgramPass]:
        """Rewrites of the whole partition, weights included, this target runs before its graph passes."""
        return []

    def custom_passes(self) -> list[GraphPass]:
        """Graph passes this target runs after the view-copy pass, before decompositions."""
        return []

    def attention_kernels(self) -> list[SDPBackend] | None:
        """The attention kernels Inductor may pick while compiling; None leaves the choice to it."""
        return None

    # What every AOTI backend shares ----------------------------------------------------------

    def compile_options(self, compile_specs: list[CompileSpec]) -> dict[str, Any]:
        """Every AOTInductor option a compile uses: the target's, with weights kept out of the library but where
        they are frozen into it."""
        frozen = switch_spec(compile_specs, SpecKey.FREEZE_WEIGHTS, default=False)
        return {
            **self.inductor_options(compile_specs),
            # OFF, as plain AOTInductor and torch.compile: a fused kernel keeps bf16/fp16 intermediates
            # in float32. Set either way, so that Inductor's environment variable cannot change the file.
            "emulate_precision_casts": switch_spec(compile_specs, SpecKey.EMULATE_PRECISION_CASTS, default=False),
            # Set either way too (TORCHINDUCTOR_FREEZING): frozen weights are new constants, prepacked in
            # oneDNN's layouts, that only the library can hold.
            "freezing": frozen,
            "aot_inductor.package_constants_in_so": frozen,
        }

    def target_device(self, compile_specs: list[CompileSpec]) -> Device:
        return target_device(compile_specs, self.backend_id, self.device_name)

    def fallback_kernels(self, compile_specs: list[CompileSpec]) -> frozenset[str] | None:
        """The fallback kernels the target's runtime has; None means every one."""
        value = compile_spec_value(compile_specs, SpecKey.FALLBACK_KERNELS)
        return self.default_fallback_kernels if value is None else parse_kernel_list(value)

    def validate_compile_specs(self, compile_specs: list[CompileSpec]) -> None:
        """Raise ``CompileSpecError`` naming the first spec this backend cannot take."""
        self.target_device(compile_specs)
        self.fallback_kernels(compile_specs)
        self.compile_options(compile_specs)

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
            code=code_version(type(self)),
            program_passes=[with_scalar_weights_inlined, with_constants_as_buffers, *self.program_passes()],
        )

    def needed_fallback_kernels(self, node: Node, compile_specs: list[CompileSpec]) -> frozenset[str]:
        """The fallback kernels ``node``'s op needs on this target, asked of Inductor once per signature.

        Where this machine lacks the target device, the op is probed on the host instead, which
        can differ where Inductor lowers an op differently per device; the compile re-checks.
        """
        return needed_fallback_kernels(self.backend_id, node, self.probe_steps(compile_specs))

    def probed_fallback_kernels(self, node: Node, compile_specs: list[CompileSpec]) -> frozenset[str] | None:
        """The fallback kernels Inductor's code for ``node``'s op alone calls on this target (probed as above); None
        where Inductor cannot compile the op on its own."""
        return probed_fallback_kernels(self.backend_id, node, self.probe_steps(compile_specs))

    def probe_steps(self, compile_specs: list[CompileSpec]) -> CompileSteps:
        target = self.target_device(compile_specs)
        return self.compile_steps(compile_specs, target if device_available(target) else HOST)

    def warm_up(self) -> None:
        # Inductor's modules take seconds to import, and its probe of the CPU's vector
        # instructions compiles test programs; both are cached per process, so forked workers
        # inherit them.
        import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()

    def updates_in_place(self, buffer: torch.Tensor, compile_specs: list[CompileSpec]) -> bool:
        # The runner writes into the user-managed buffer it is given, on the host or on its device,
        # where loading puts the buffer's one state (format/state.py): a decode step's cache never
        # moves. Inductor folds a one-element buffer into the code as a constant, update and all
        # (plain AOTInductor packages get such a counter wrong too), so one stays an input.
        return buffer.numel() > 1

    # Compile side ----------------------------------------------------------------------------

    def preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult:
        result = self.compiled(exported_program, compile_specs, cache_only=False)
        assert result is not None
        return result

    def cached_preprocess(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec]
    ) -> PreprocessResult | None:
        return self.compiled(exported_program, compile_specs, cache_only=True)

    def compiled(
        self, exported_program: ExportedProgram, compile_specs: list[CompileSpec], *, cache_only: bool
    ) -> PreprocessResult | None:
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
            cache_only=cache_only,
        )
        if compiled is None:
            return None
        named_data, weights = weights_as_named_data(compiled.constants)
        named_data[LIBRARY_NAME] = compiled.library
        if compiled.extern_nodes is not None:
            named_data[EXTERN_NODES_NAME] = compiled.extern_nodes
        processed = {
            "version": PROCESSED_VERSION,
            "library": content_key(compiled.library),
            "weights": weights,
            # The library's name for a weight it asks for under another FQN: its code was compiled for
            # another partition of the same structure (the library is stored once in the package).
            "library_fqns": compiled.library_fqns,
            # Read a few rows a call: the run side lets their pages go after the first.
            "gathered": compiled.gathered,
            # Frozen into the library, which asks the package for none of them ("weights" is empty).
            "weights_in_library": compiled.holds_weights,
            "input_strides": [static_stride(node) for node in user_input_placeholders(exported_program)],
            # The CPU features its code may use: the run side refuses a CPU without them (it would die of SIGILL).
            "cpu_features": compiled.cpu_features,
            # What the library's code takes; its run side checks every call against it.
            "boundary": partition_boundary(exported_program, label, device.type.value).to_json(),
        }
        return PreprocessResult(json.dumps(processed).encode(), named_data, from_cache=compiled.from_cache)

    def custom_ops_called(self, claimed: list[str], result: PreprocessResult) -> list[str]:
        # Inductor compiles most custom ops into the library (torchao's quantize ops decompose);
        # the proxy executor's list names the ones it still calls.
        extern_nodes = result.named_data.get(EXTERN_NODES_NAME)
        if extern_nodes is None:
            return []
        return [name for name in proxy_calls(bytes(extern_nodes), self.backend_id) if is_custom_op_name(name)]

    def kernel_check(self, allowed: frozenset[str], compile_specs: list[CompileSpec]) -> KernelCheck:
        method = compile_spec_value(compile_specs, SpecKey.METHOD_NAME)

        def check(kernels: frozenset[str]) -> None:
            missing = {kernel: [] for kernel in kernels if not kernel_allowed(kernel, allowed)}
            if missing:
                raise MissingFallbackKernelsError(self.backend_id, missing, method.decode() if method else None)

        return check



def static_stride(node: torch.fx.Node) -> list[int] | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise LoweringError(f"partition input {node.name!r} is not a tensor")
    stride = value.stride()
    if all(isinstance(s, int) for s in stride):
        return list(stride)
    return None
