"""Small integers packed into bytes, the layout the engines' 4-bit kernels read.

torchao keeps an int4 value in an int8 tensor; an engine whose kernel reads 4-bit weights wants
them two a byte, the first in the low nibble (ONNX Runtime's ``MatMulNBits`` and
``GatherBlockQuantized``, OpenVINO's ``i4`` and ``u4`` constants alike).
"""

from __future__ import annotations

import torch


def packed_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, n]`` uint8 values of ``bits`` bits packed into bytes along each row, low bits first.

    A row of odd length is padded with a zero, so each row starts a byte.
    """
    if bits == 8:
        return values.contiguous()
    if values.shape[-1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    return (values[:, 0::2] | (values[:, 1::2] << 4)).contiguous()


def signed_range(bits: int) -> range:
    """The values a signed ``bits``-bit integer holds: ``range(-8, 8)`` for 4 bits."""
    return range(-(1 << (bits - 1)), 1 << (bits - 1))


def fit_signed(values: torch.Tensor, bits: int) -> bool:
    """Whether integer ``values`` all lie in the signed ``bits``-bit range (so do none), so packing loses nothing."""
    limits = signed_range(bits)
    return not values.numel() or (int(values.min()) >= limits.start and int(values.max()) < limits.stop)


def packed_int4(values: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit ``values`` (held in a wider integer), two a byte in row-major order, as a flat uint8 tensor.

    Two's complement in each nibble; an odd count ends with a zero nibble.

    Example::

        packed_int4(torch.tensor([1, -1], dtype=torch.int8))  # tensor([0xF1], dtype=torch.uint8)
    """
    nibbles = (values.reshape(1, -1).to(torch.int16) & 0xF).to(torch.uint8)
    return packed_along_rows(nibbles, 4).reshape(-1)


def packed_int4_halves(values: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit ``[rows, n]`` ``values``, n even, as ``[rows, n // 2]`` uint8: each row's halves side by side.

    Byte ``j`` holds ``values[:, j] + 8`` in its low nibble and ``values[:, j + n // 2] + 8`` in its
    high one, so a kernel reads both halves of a row in one contiguous pass (AOTInductor's fused
    decode loop; see ``backends/aoti/int4_weights.py``).

    Example::

        packed_int4_halves(torch.tensor([[1, -1]], dtype=torch.int8))  # tensor([[0x79]], dtype=torch.uint8)
    """
    half = values.shape[-1] // 2
    offset = values.to(torch.int16) + 8
    return (offset[:, :half] | (offset[:, half:] << 4)).to(torch.uint8).contiguous()
