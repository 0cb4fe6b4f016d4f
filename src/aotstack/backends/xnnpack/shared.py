"""One XNNPACK lowering for every partition of the same structure: a model's repeated layers.

Where every constant XNNPACK writes to the data file is a weight's own bytes (float linears: the
segment ``data:<key>`` holds the tensor as it is, ``key`` the SHA-256 of those bytes), a lowering
of one partition serves each other partition of its structure (``program_structure``: the same
ops on the same shapes, other weights): the program and the data file's frame name each constant
by its key, once each, so giving them the other partition's keys (as long, 64 hex digits) and its
weights' bytes is the lowering ExecuTorch would write for it. Where XNNPACK transforms a constant
(4-bit weights packed two to a byte, a convolution's filter reordered), or the program holds
constants itself (a vector XNNPACK multiplies by, a weight it does not pack), no template is kept
and each partition lowers on its own. A weight whose values cannot show a reordering (a zero bias,
two weights alike) stays as it is in the template, which then fits only partitions with the same
bytes there (``keep_template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.export import ExportedProgram

from ...compile.cache import read_entry, write_entry
from ...compile.program_parts import Structure, program_weights
from ...format.tensor_data import content_key, tensor_buffer
from .run import DATA_PREFIX

CACHE_KIND = "xnnpack-structure"


def role_tensors(exported_program: ExportedProgram, structure: Structure) -> list[torch.Tensor]:
    """Each weight, contiguous, in the order of ``structure``'s weight roles."""
    weights = program_weights(exported_program)
    return [weights[fqn].detach().contiguous() for fqn in structure.weights]


def may_hide_a_transform(tensor: torch.Tensor) -> bool:
    """Whether a reordering XNNPACK applies could leave ``tensor``'s bytes as they were: all its elements equal (a
    zero- or one-initialised weight), or a square matrix equal to its transpose; its segment then proves nothing."""
    flat = tensor.reshape(-1)
    if flat.numel() < 2 or bool((flat == flat[0]).all()):
        return True
    return tensor.dim() == 2 and tensor.shape[0] == tensor.shape[1] and torch.equal(tensor, tensor.T)


def keep_template(
    key: str, tensors: list[torch.Tensor], processed: Mapping[str, Any], named_data: Mapping[str, bytes],
    program_name: str, frame_name: str,
) -> None:
    """Keep a lowering as the template of its structure, where each of its segments is its weights' bytes.

    A segment is ``raw`` where one weight of telling values is its bytes, named once in the program and the frame:
    another partition's weight takes its place. It is ``fixed`` where the weights it equals may not tell (all
    elements equal, a symmetric matrix, two weights alike: a zero bias): another partition fits the template only
    where those weights have the very same bytes, which ExecuTorch then writes the same.
    """
    by_key: dict[str, list[int]] = {}
    for role, tensor in enumerate(tensors):
        by_key.setdefault(content_key(tensor_buffer(tensor)), []).append(role)
    program, frame = named_data[program_name], named_data.get(frame_name, b"")
    raw, fixed = {}, {}
    for name, _, _ in processed["segments"]:
        segment_key = name.removeprefix(DATA_PREFIX)
        roles = by_key.get(segment_key)
        if roles is None:
            return  # XNNPACK wrote something other than a weight's bytes
        named_once = program.count(segment_key.encode()) == 1 and frame.count(segment_key.encode()) == 1
        if len(roles) == 1 and named_once and not may_hide_a_transform(tensors[roles[0]]):
            raw[segment_key] = roles[0]
        else:
            fixed[segment_key] = roles
    template = {"processed": dict(processed), "raw": raw, "fixed": fixed, "program": program.hex(),
                "frame": frame.hex()}
    write_entry(CACHE_KIND, key, json.dumps(template).encode())


def from_template(
    key: str, tensors: list[torch.Tensor], program_name: str, frame_name: str
) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    """The processed record (but its boundary) and named data of the partition whose weights are ``tensors`` (by
    role), made from its structure's template; None where there is none, or the weights do not fit it
    (``keep_template``)."""
    entry = read_entry(CACHE_KIND, key)
    if entry is None:
        return None
    try:
        template = json.loads(entry)
        weights = [tensor_buffer(tensor) for tensor in tensors]
        keys = [content_key(data) for data in weights]
        fixed: dict[str, list[int]] = template["fixed"]
        if any(keys[role] != segment_key for segment_key, roles in fixed.items() for role in roles):
            return None
        renamed = {old: keys[role] for old, role in template["raw"].items()}
        if len(set(renamed.values())) != len(renamed) or set(renamed.values()) & set(fixed):
            return None  # two segments would share a name
        first_role = {**template["raw"], **{segment_key: roles[0] for segment_key, roles in fixed.items()}}
        processed = template["processed"]
        if any(size != weights[first_role[name.removeprefix(DATA_PREFIX)]].nbytes
               for name, _, size in processed["segments"]):
            return None
        program, frame = bytes.fromhex(template["program"]), bytes.fromhex(template["frame"])
        for old, new in renamed.items():
            program, frame = program.replace(old.encode(), new.encode()), frame.replace(old.encode(), new.encode())

        def new_name(name: str) -> str:
            return DATA_PREFIX + renamed.get(name.removeprefix(DATA_PREFIX), name.removeprefix(DATA_PREFIX))

        segments = [[new_name(name), offset, size] for name, offset, size in processed["segments"]]
        packed = [new_name(name) for name in processed["packed"]]
        data = {DATA_PREFIX + renamed.get(old, old): bytes(weights[role]) for old, role in first_role.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    named_data = {program_name: program, **data}
    if frame:
        named_data[frame_name] = frame
    return {**processed, "segments": segments, "packed": packed}, named_data
