"""Tensors as raw bytes and back: how weights are stored without pickling."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch

# A blob as loaded: a read-only view into the mapped file, or bytes.
BytesLike = bytes | bytearray | memoryview


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements, contiguous, in native byte order."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: BytesLike, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over ``data`` itself, not a copy: the inverse of :func:`tensor_bytes`.

    It must not be written to (``data`` is read-only); ``clone()`` it to get a tensor that may.
    """
    if not data:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that the buffer is read-only; nothing writes to it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def content_key(data: BytesLike) -> str:
    """The content hash under which a blob is stored."""
    return hashlib.sha256(data).hexdigest()


WEIGHT_PREFIX = "weight:"


def weights_as_named_data(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Each weight as a named-data blob ``weight:<fqn>``, and the dtypes and shapes that read them back.

    Blobs are keyed by content in the package, so a weight two backends hold is stored once.
    """
    blobs = {WEIGHT_PREFIX + fqn: tensor_bytes(tensor) for fqn, tensor in weights.items()}
    meta = {fqn: {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)} for fqn, tensor in weights.items()}
    return blobs, meta
