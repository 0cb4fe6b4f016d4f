"""The records that describe a lowered program's compiled parts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .specs import CompileSpec, SpecKey, compile_spec_value
from .tensor_data import BytesLike, dtype_name


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of a tensor crossing a boundary; None for a dynamic dimension."""

    dtype: str
    shape: list[int | None]

    @classmethod
    def of(cls, value: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(value.dtype), [d if isinstance(d, int) else None for d in value.shape])


@dataclass
class Delegate:
    """One compiled partition, as a delegate call in a lowered method."""

    delegate_id: str
    backend_id: str
    compile_specs: list[CompileSpec]
    ops: list[str]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    processed_bytes: bytes
    # Blobs by name: bytes, or views of memory they keep alive (a weight's own storage).
    named_data: dict[str, BytesLike] = field(repr=False)
    # Buffers the delegate updates in place (their state is its named data ``weight:<fqn>``).
    updated_buffers: list[str] = field(default_factory=list)
    # Custom ops its compiled code calls back through torch, which a loading process registers.
    calls: list[str] = field(default_factory=list)
    # Its quantized layers, counted by kind and scheme: ``{"linear 8da4w, group 32": 28}``.
    quantized: dict[str, int] = field(default_factory=dict)
    # The method's nodes it took, by name, each with a rough count of its arithmetic (``compile/mixing.py``);
    # known to the lowering process only, not stored in a file.
    nodes: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def target_device(self) -> str:
        value = compile_spec_value(self.compile_specs, SpecKey.TARGET_DEVICE)
        return value.decode() if value else "cpu"
