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


# The words a row's values are packed into for AOTInductor's decode loop, widest first: 32 bits
# typed float32 (read as floats, a full vector a load; ``backends/aoti/packed_weights.py``), and bytes.
WORDS = (torch.float32, torch.uint8)


def slots_in(word: torch.dtype, bits: int) -> int:
    """How many ``bits``-bit values a ``word`` holds: 8 int4 values in a 32-bit word."""
    return word.itemsize * 8 // bits


def packed_words(values: torch.Tensor, bits: int, word: torch.dtype) -> torch.Tensor:
    """Signed ``bits``-bit ``[rows, n]`` ``values`` as ``[rows, n // slots]`` words of ``slots`` values each.

    Slot ``i`` of word ``j`` (bits ``i * bits`` on, lowest first) holds ``values[:, i * n // slots + j]``
    offset by ``2 ** (bits - 1)``, so unsigned: each slot holds a contiguous run of the row's
    columns, and a kernel reads every run of a row in one contiguous pass (AOTInductor's fused
    decode loop; see ``backends/aoti/packed_weights.py``). A 32-bit word is typed float32; its bits
    are the integer's.

    Example::

        packed_words(torch.tensor([[1, -1]], dtype=torch.int8), 4, torch.uint8)  # tensor([[0x79]], dtype=torch.uint8)
    """
    slots = slots_in(word, bits)
    rows, columns = values.shape
    runs = (values.to(torch.int64) + (1 << (bits - 1))).reshape(rows, slots, columns // slots)
    shifts = torch.arange(slots, dtype=torch.int64).mul(bits).reshape(1, slots, 1)
    packed = (runs << shifts).sum(1)
    if word is torch.uint8:
        return packed.to(torch.uint8).contiguous()
    # Two's complement of the top bit, so the int32 cast keeps every bit.
    signed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return signed.to(torch.int32).view(word).contiguous()
