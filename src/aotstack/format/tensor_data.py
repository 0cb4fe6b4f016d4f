"""Tensors as raw bytes and back: how weights are stored without pickling."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch

# A blob as loaded: a read-only view into the mapped file, or bytes.
BytesLike = bytes | bytearray | memoryview
# A delegate's named data as loading hands it over: verified bytes of the file, or the writable state
# of a buffer it updates (host memory, or a uint8 tensor on its device: ``format/state.py``).
NamedDataValue = BytesLike | torch.Tensor


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements, contiguous, in native byte order, as a read-only byte view.

    A contiguous CPU tensor is viewed, not copied: the view holds the tensor's storage alive and
    sees later in-place changes to it. A tensor on a device, or one laid out otherwise (strided,
    a negated or conjugated view), is copied once into a new contiguous tensor that the view holds.
    """
    flat = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    # numpy() shares the storage and keeps the tensor as its base; the memoryview keeps the array.
    return memoryview(flat.view(torch.uint8).numpy()).toreadonly()


def tensor_is_viewable(tensor: torch.Tensor) -> bool:
    """Whether :func:`tensor_buffer` views ``tensor``'s memory rather than copying it."""
    return (
        tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
    )


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements, contiguous, in native byte order, copied into ``bytes``.

    Prefer :func:`tensor_buffer` where a view will do (hashing, writing): it copies nothing.
    """
    return tensor_buffer(tensor).tobytes()


def tensor_from_bytes(data: NamedDataValue, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over ``data`` itself, not a copy: the inverse of :func:`tensor_bytes`.

    It must not be written to (``data`` is read-only); ``clone()`` it to get a tensor that may.
    ``data`` may also be bytes already in a tensor (one dimension of uint8, on any device): a
    buffer's state that lives on a device (``format/state.py``), viewed as ``dtype`` there.
    """
    if isinstance(data, torch.Tensor):
        return data.view(dtype).reshape(shape)
    if not data:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that the buffer is read-only; nothing writes to it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def byte_count(data: NamedDataValue) -> int:
    """How many bytes ``data`` holds: a byte string, or bytes in a tensor on a device."""
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data).nbytes


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


def weights_as_named_data(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, BytesLike], dict[str, Any]]:
    """Each weight as a named-data blob ``weight:<fqn>``, and the dtypes and shapes that read them back.

    Each blob is a :func:`tensor_buffer` view of the weight's own memory, not a copy (a weight on a
    device is copied to the host), so a program's blobs cost no memory beyond its weights; the
    package reads them when it is saved. Blobs are keyed by content in the package, so a weight
    two backends hold is stored once.
    """
    blobs: dict[str, BytesLike] = {WEIGHT_PREFIX + fqn: tensor_buffer(tensor) for fqn, tensor in weights.items()}
    meta = {fqn: {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)} for fqn, tensor in weights.items()}
    return blobs, meta
