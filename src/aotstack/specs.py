"""The small records passed between partitioners, the lowering pass and backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.export import ExportedProgram


@dataclass(frozen=True)
class CompileSpec:
    """One backend option, e.g. ``CompileSpec("target_device", b"cpu")``."""

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
class PartitionResult:
    """What a partitioner returns: the program with ``delegation_tag`` set on claimed nodes."""

    tagged_exported_program: ExportedProgram
    partition_tags: dict[str, DelegationSpec]


@dataclass
class PreprocessResult:
    """What a backend's compile side returns for one partition.

    ``processed_bytes`` is handed back to the run side as it is; ``named_data`` holds larger
    blobs (a shared library, weights) that the package stores once under a content hash.
    """

    processed_bytes: bytes
    named_data: dict[str, bytes] = field(default_factory=dict)


def compile_spec_value(compile_specs: list[CompileSpec], key: str) -> bytes | None:
    """The value of the last spec named ``key``, or None."""
    found = None
    for spec in compile_specs:
        if spec.key == key:
            found = spec.value
    return found


def partition_label(backend_id: str, compile_specs: list[CompileSpec]) -> str:
    """``an onnxruntime partition of method 'forward'``, for error messages."""
    method = compile_spec_value(compile_specs, "method_name")
    where = f" of method {method.decode()!r}" if method else ""
    article = "an" if backend_id[:1].lower() in "aeiou" else "a"
    return f"{article} {backend_id} partition{where}"
