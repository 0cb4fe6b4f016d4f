"""Backend options and the records a backend's compile side hands to the package."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import CompileSpecError

if TYPE_CHECKING:
    from .tensor_data import BytesLike


class SpecKey:
    """The compile spec keys aotstack and its backends read; a ``CompileSpec`` key may be any str."""

    # Where a delegate runs: ``cpu``, ``cuda:1``, ``mps``.
    TARGET_DEVICE = "target_device"
    # The method a partition belongs to; lowering sets it, for messages and the kernel check.
    METHOD_NAME = "method_name"
    # AOTInductor: the ATen fallback kernels the target's runtime has, comma-separated.
    FALLBACK_KERNELS = "fallback_kernels"
    # AOTInductor on CUDA: ``ON`` or ``OFF``.
    AUTOTUNE = "autotune"
    # AOTInductor: ``ON`` rounds every bf16/fp16 intermediate as eager does, ``OFF`` keeps it in float32.
    EMULATE_PRECISION_CASTS = "emulate_precision_casts"
    # AOTInductor: ``ON`` compiles with Inductor's freezing, the weights inside the library, convolutions' and
    # linears' prepacked for oneDNN; ``OFF`` (default) keeps them in the file's named data.
    FREEZE_WEIGHTS = "freeze_weights"
    # ONNX Runtime: execution providers in priority order, comma-separated.
    PROVIDERS = "providers"
    # AOTInductor on the CPU: the threads its generated loops run on, a positive integer (default: torch's thread
    # count when compiling, which the code bakes in). ATen calls inside the library follow torch's count at run.
    # ONNX Runtime, OpenVINO and XNNPACK: the threads their session runs on (default: torch's count at load; for
    # XNNPACK, at the first call). On a small decode step XNNPACK's pool gains nothing from a second thread and
    # loses to waking it at every op (measured: 1 thread inside a 2-thread process, 1.2x the tokens/s).
    THREADS = "threads"


@dataclass(frozen=True)
class CompileSpec:
    """One backend option, e.g. ``CompileSpec(SpecKey.TARGET_DEVICE, b"cpu")``."""

    key: str
    value: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes):
            raise TypeError(
                f"CompileSpec {self.key!r}: value must be bytes, got {type(self.value).__name__}"
            )


@dataclass(frozen=True)
class DelegationSpec:
    """Which backend a partition tag goes to, and with what options."""

    backend_id: str
    compile_specs: list[CompileSpec] = field(default_factory=list)


@dataclass
class PreprocessResult:
    """What a backend's compile side returns for one partition.

    ``processed_bytes`` is handed back to the run side as it is; ``named_data`` holds larger
    blobs (a shared library, weights) that the package stores once under a content hash; a
    blob may be a view of memory the backend keeps alive (a weight's own storage), not a copy.
    ``from_cache`` says the backend reused an earlier compile instead of compiling; progress
    and reports show it.
    """

    processed_bytes: bytes
    named_data: dict[str, BytesLike] = field(default_factory=dict)
    from_cache: bool = False


def compile_spec_value(compile_specs: list[CompileSpec], key: str) -> bytes | None:
    """The value of the last spec named ``key``, or None."""
    found = None
    for spec in compile_specs:
        if spec.key == key:
            found = spec.value
    return found


def switch_spec(compile_specs: list[CompileSpec], key: str, *, default: bool) -> bool:
    """A spec that is ``ON`` or ``OFF`` (any case, spaces around ignored), ``default`` when absent.

    Any other value raises ``CompileSpecError`` naming the spec and the value.
    """
    value = compile_spec_value(compile_specs, key)
    if value is None:
        return default
    setting = value.decode(errors="replace").strip().upper()
    if setting not in ("ON", "OFF"):
        raise CompileSpecError(f"compile spec {key!r} must be ON or OFF, got {value!r}")
    return setting == "ON"


def count_spec(compile_specs: list[CompileSpec], key: str) -> int | None:
    """A spec that is a positive integer in decimal (``b"2"``), None when absent.

    Any other value raises ``CompileSpecError`` naming the spec and the value.
    """
    value = compile_spec_value(compile_specs, key)
    if value is None:
        return None
    text = value.decode(errors="replace").strip()
    if not text.isdecimal() or int(text) < 1:
        raise CompileSpecError(f"compile spec {key!r} must be a positive integer, got {value!r}")
    return int(text)


def partition_label(backend_id: str, compile_specs: list[CompileSpec]) -> str:
    """``an onnxruntime partition of method 'forward'``, for error messages."""
    method = compile_spec_value(compile_specs, SpecKey.METHOD_NAME)
    where = f" of method {method.decode()!r}" if method else ""
    article = "an" if backend_id[:1].lower() in "aeiou" else "a"
    return f"{article} {backend_id} partition{where}"
