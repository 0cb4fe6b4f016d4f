"""torchao's stored integer weights in the layouts ONNX Runtime's quantized kernels read.

torchao keeps signed integers (int4 in an int8 tensor) ``[rows, columns]`` with a float scale and an
integer zero point per group of ``group`` columns. ONNX Runtime's ``MatMulNBits`` and
``GatherBlockQuantized`` read unsigned values packed along the columns (two 4-bit values a byte,
the first in the low nibble) in blocks of ``block`` columns, with unsigned zero points that default
to ``2**(bits - 1)``: a signed value ``q`` is stored as ``q + 2**(bits - 1)``, so zero points of 0
need no tensor. ``DynamicQuantizeMatMul`` and ``MatMulInteger`` read uint8 ``[columns, rows]`` with
per-row scales and zero points.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...compile.packed_integers import fit_signed, packed_along_rows, signed_range
from ...errors import LoweringError


@dataclass(frozen=True)
class PackedWeights:
    """A kernel's weight inputs: the packed values, scales, and zero points (None: the kernel's default)."""

    values: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    # ``MatMulInteger``'s: each output channel's sum of ``values - zero_points``, which turns the
    # product of raw activation integers into the product of activations less their zero point.
    column_sums: torch.Tensor | None = None


def block_packed(
    stored: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, bits: int, group: int, block: int,
    name: str,
) -> PackedWeights:
    """Weights for ``MatMulNBits`` (values ``[rows, blocks, block * bits / 8]``) or ``GatherBlockQuantized``.

    ``GatherBlockQuantized`` reads the same bytes as ``[rows, columns * bits / 8]``; the caller reshapes.
    """
    rows, columns = stored.shape
    check_range(stored, bits, f"weights {name!r}")
    blocks = columns // block
    values = packed_along_rows(unsigned(stored, bits), bits).reshape(rows, blocks, block * bits // 8)
    block_scales = scales.reshape(rows, columns // group).repeat_interleave(group // block, dim=1)
    points = None
    if zero_points is not None and bool(zero_points.any()):
        check_range(zero_points, bits, f"zero points of {name!r}")
        points = zero_points.reshape(rows, columns // group).repeat_interleave(group // block, dim=1)
        points = packed_along_rows(unsigned(points, bits), bits)
    return PackedWeights(values.contiguous(), block_scales.to(torch.float32).contiguous(), points)


def channel_transposed(
    stored: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, name: str
) -> PackedWeights:
    """Weights for ``DynamicQuantizeMatMul`` and ``MatMulInteger``: uint8 ``[columns, rows]``, one scale and
    zero point per row.

    Unsigned, ``q + 128`` with zero point ``z + 128``: ONNX Runtime multiplies uint8 activations
    by int8 weights with 16-bit sums of pairs on x86 CPUs without VNNI, which saturate (0.36 off
    on outputs of 1); uint8 by uint8 widens first and is exact on every CPU.
    """
    rows = stored.shape[0]
    points = torch.zeros(rows, dtype=torch.int32)
    if zero_points is not None and bool(zero_points.any()):
        check_range(zero_points, 8, f"zero points of {name!r}")
        points = zero_points.reshape(rows).to(torch.int32)
    centred = stored.to(torch.int32) - points[:, None]
    return PackedWeights(unsigned(stored, 8).t().contiguous(), scales.reshape(rows).to(torch.float32).contiguous(),
                         (points + 128).to(torch.uint8).contiguous(),
                         centred.sum(dim=1, dtype=torch.int32).contiguous())


def unsigned(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed ``bits``-bit integers shifted to ``[0, 2**bits)``, as uint8."""
    return (values.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)


def check_range(values: torch.Tensor, bits: int, what: str) -> None:
    if not fit_signed(values, bits):
        limits = signed_range(bits)
        raise LoweringError(f"{what} hold values outside the {bits}-bit range [{limits.start}, {limits.stop - 1}]")
