"""Changing a package the way a damaged disk or an attacker would, for the tests that refuse it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aotstack.format import archive


def entries(path: Path) -> dict[str, bytes]:
    """Every entry of the package at ``path``, by name below its root folder."""
    return {name: bytes(data) for name, data in archive.opened_archive(path).entries.items()}


def write(path: Path, contents: dict[str, bytes]) -> Path:
    archive.write_archive(path, list(contents.items()))
    return path


def manifest_edited(source: Path, target: Path, edit: Callable[[dict[str, Any]], None], reseal: bool = True) -> Path:
    """``source`` with ``edit`` applied to its manifest; with ``reseal``, its seal's digest follows.

    Resealing is what an attacker does, who can recompute a digest; a signature still stops it.
    """
    contents = entries(source)
    manifest = json.loads(contents[archive.MANIFEST_PATH])
    edit(manifest)
    contents[archive.MANIFEST_PATH] = json.dumps(manifest).encode()
    if reseal:
        seal = json.loads(contents[archive.SEAL_PATH])
        seal["manifest_sha256"] = hashlib.sha256(contents[archive.MANIFEST_PATH]).hexdigest()
        contents[archive.SEAL_PATH] = json.dumps(seal).encode()
    return write(target, contents)


def op_steps(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every op step of every method's plan, subgraphs included."""
    found = []

    def walk(steps: list[dict[str, Any]]) -> None:
        for step in steps:
            if step["kind"] == "op":
                found.append(step)
            elif step["kind"] == "subgraph":
                walk(step["plan"]["steps"])

    for method in manifest["methods"].values():
        walk(method["plan"]["steps"])
    return found
