"""Fallback kernels: the ATen kernels AOTInductor's generated code calls instead of code of its own.

A target's runtime has only some of them: libtorch has every one, ExecuTorch's Metal runtime
four, a runtime without Python perhaps none. A kernel is named here as the ATen op it runs
(``aten.addmm.out``), whatever the device; Inductor writes a call to it as
``aoti_torch_<device>_addmm_out`` or, for ops outside its C shim, ``at::_ops::<op>::call``.

Two places ask which kernels a graph needs, and both ask Inductor itself, by recording its
C++ wrapper's kernel calls: a partitioner, per op, before claiming it (``probe.py``), and the
real compile of a whole partition (``compile.py``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import CompileSpecError, caused_by
from ...format.op_names import normalized_op_name, op_name
from ...format.specs import SpecKey

_SHIM_PREFIX = re.compile(r"^aoti_torch_(?:cpu|cuda|mps|xpu)_")


def kernel_op_name(kernel: str) -> str:
    """The ATen op an Inductor kernel call runs.

    Example::

        >>> kernel_op_name("aoti_torch_cpu_addmm_out")
        'aten.addmm.out'
        >>> kernel_op_name("at::_ops::sort_stable::call")
        'aten.sort.stable'
    """
    if "::" in kernel:
        parts = kernel.split("::")
        suffix = parts[-2] if parts[-1] == "call" else parts[-1]
    else:
        suffix = _SHIM_PREFIX.sub("", kernel)
    if has_overload(suffix, "default"):
        return f"aten.{suffix}.default"
    # An overload's name is joined to its op's with "_": try each split, longest op name first.
    for cut in reversed([i for i, char in enumerate(suffix) if char == "_" and i > 0]):
        name, overload = suffix[:cut], suffix[cut + 1 :]
        if has_overload(name, overload):
            return f"aten.{name}.{overload}"
    return kernel


def has_overload(name: str, overload: str) -> bool:
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    return isinstance(packet, torch._ops.OpOverloadPacket) and overload in packet.overloads()


def kernel_allowed(kernel: str, allowed: frozenset[str]) -> bool:
    """Whether ``kernel`` is in ``allowed``, by overload or by every overload of its op."""
    return kernel in allowed or kernel.rsplit(".", 1)[0] in allowed


def parse_kernel_list(value: bytes) -> frozenset[str]:
    """The ``fallback_kernels`` compile spec: op names separated by commas; empty allows none."""
    names = [name.strip() for name in value.decode().split(",") if name.strip()]
    try:
        return frozenset(normalized_op_name(name, f"compile spec {SpecKey.FALLBACK_KERNELS!r}") for name in names)
    except ValueError as exc:
        raise CompileSpecError(str(exc)) from None


@contextlib.contextmanager
def recorded_fallback_kernels() -> Iterator[set[str]]:
    """Record, as op names, every fallback kernel Inductor's C++ wrapper calls while this is open."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    kernels: set[str] = set()
    shim_call = CppWrapperCpu.generate_c_shim_extern_kernel_call
    lookup_call = CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_aot

    def recording_shim_call(self: Any, kernel: str, *args: Any, **kwargs: Any) -> Any:
        kernels.add(kernel_op_name(kernel))
        return shim_call(self, kernel, *args, **kwargs)

    def recording_lookup_call(self: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        kernels.add(op_name(op) if isinstance(op, torch._ops.OperatorBase) else str(op))
        return lookup_call(self, op, *args, **kwargs)

    with swapped_attributes(
        CppWrapperCpu,
        generate_c_shim_extern_kernel_call=recording_shim_call,
        generate_fallback_kernel_with_runtime_lookup_aot=recording_lookup_call,
    ):
        yield kernels


class CodegenFinished(Exception):
    """Raised in place of the C++ compile: code generation is all a probe needs."""


@contextlib.contextmanager
def stopped_before_cpp_compile() -> Iterator[None]:
    from torch._inductor.codecache import AotCodeCompiler

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise CodegenFinished

    with swapped_attributes(AotCodeCompiler, compile=staticmethod(stop)):
        yield


@contextlib.contextmanager
def swapped_attributes(owner: Any, **replacements: Any) -> Iterator[None]:
    originals = {name: owner.__dict__[name] for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in originals.items():
            setattr(owner, name, value)


def stopped_by_probe(exc: BaseException) -> bool:
    """Whether ``exc`` (Inductor wraps what it catches) is the probe's own stop."""
    return caused_by(exc, CodegenFinished)


