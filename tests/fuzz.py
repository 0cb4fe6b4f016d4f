"""Damaged and tampered copies of packages, loaded and run: every case must end in aotstack's error or a run.

Run as a child process (``python -m tests.fuzz CASES SEED MODEL=PATH ...``) so that a crash ends the
child, not the test session. It prints one JSON line: the count of each outcome per kind of damage,
and the first few cases whose outcome is not allowed. The file it is working on is named in
``$FUZZ_DIR/current.json`` before each case, so a crash can be traced to it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import resource
import signal
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

import aotstack
from aotstack.format import archive
from tests import models, tamper

SECONDS_PER_CASE = 60


class Hang(Exception):
    pass


# Damage -------------------------------------------------------------------------------------------


def flipped_bits(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        position = rng.randrange(len(out))
        out[position] ^= 1 << rng.randrange(8)
    return bytes(out)


def truncated(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def appended(data: bytes, rng: random.Random) -> bytes:
    return data + rng.randbytes(rng.choice([1, 7, 100, 4096]))


def zeroed(data: bytes, rng: random.Random) -> bytes:
    start = rng.randrange(len(data))
    length = min(rng.choice([4, 64, 1024]), len(data) - start)
    return data[:start] + bytes(length) + data[start + length :]


BYTE_DAMAGE = {"flip": flipped_bits, "truncate": truncated, "append": appended, "zero": zeroed}


def entries_changed(contents: dict[str, bytes], rng: random.Random) -> tuple[str, list[tuple[str, bytes]]]:
    """One structural change that keeps a valid zip: entries removed, renamed, duplicated, swapped, added."""
    names = list(contents)
    kind = rng.choice(["remove", "rename", "duplicate", "swap", "traversal", "extra"])
    items = list(contents.items())
    if kind == "remove":
        victim = rng.choice(names)
        return kind, [(n, d) for n, d in items if n != victim]
    if kind == "rename":
        victim = rng.choice(names)
        renamed = rng.choice([victim + "x", victim[:-1], victim.replace("data/", "date/"), victim.upper()])
        return kind, [(renamed if n == victim else n, d) for n, d in items]
    if kind == "duplicate":
        victim = rng.choice(names)
        return kind, [*items, (victim, rng.choice([contents[victim], rng.randbytes(16)]))]
    if kind == "swap":
        first, second = rng.sample(names, 2)
        return kind, [(n, contents[second] if n == first else contents[first] if n == second else d) for n, d in items]
    if kind == "traversal":
        evil = rng.choice(["../../evil.so", "../outside.txt", "/tmp/absolute.so", "data/aotstack/../../x", "a/../../b"])
        return kind, [*items, (evil, b"\x7fELF" + rng.randbytes(64))]
    return kind, [*items, ("data/aotstack/" + "0" * 64, rng.randbytes(32))]


def manifest_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside the manifest (keys and list indexes)."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += manifest_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += manifest_paths(item, (*prefix, index))
    return paths


def other_value(value: Any, rng: random.Random) -> Any:
    """A value changed in type, size or value."""
    choices: list[Any] = [
        None, True, 0, -1, 1, 2**31, 2**63, -(2**70), 1e308, math.nan, "", "x" * 10_000, "../../etc/passwd",
        "aten.relu.default", "operator.attrgetter", [], [None] * 3, {}, {"ref": "x"}, {"list": [], "tuple": True},
        [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], list(range(100_000)),
    ]
    if isinstance(value, bool):
        choices.append(not value)
    elif isinstance(value, int):
        choices += [value + 1, value - 1, value * 1000, -value]
    elif isinstance(value, str):
        choices += [value[:-1], value + "0", value[::-1], value.upper()]
    elif isinstance(value, list) and value:
        choices += [value[:-1], value + value[-1:], list(reversed(value)), value * 1000]
    elif isinstance(value, dict) and value:
        key = rng.choice(list(value))
        choices += [{k: v for k, v in value.items() if k != key}, {**value, key + "_": value[key]}]
    return rng.choice(choices)


def manifest_changed(manifest: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    changed = copy.deepcopy(manifest)
    path = rng.choice(manifest_paths(changed)[1:])
    parent = changed
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = other_value(parent[path[-1]], rng)
    return changed


# Cases --------------------------------------------------------------------------------------------


def case_bytes(pristine: bytes, contents: dict[str, bytes], kind: str, rng: random.Random, work: Path) -> bytes:
    """The bytes of one damaged copy; ``kind`` picks the damage."""
    if kind in BYTE_DAMAGE:
        return BYTE_DAMAGE[kind](pristine, rng)
    if kind == "entries":
        _, entries = entries_changed(contents, rng)
    elif kind == "seal":
        seal = json.loads(contents[archive.SEAL_PATH])
        entries = list({**contents, archive.SEAL_PATH: json.dumps(manifest_changed(seal, rng)).encode()}.items())
    else:
        manifest = manifest_changed(json.loads(contents[archive.MANIFEST_PATH]), rng)
        manifest_bytes = json.dumps(manifest).encode()
        changed = {**contents, archive.MANIFEST_PATH: manifest_bytes}
        if kind == "manifest resealed":
            seal = json.loads(contents[archive.SEAL_PATH])
            seal["manifest_sha256"] = hashlib.sha256(manifest_bytes).hexdigest()
            changed[archive.SEAL_PATH] = json.dumps(seal).encode()
        entries = list(changed.items())
    path = work / "entries.pt2"
    archive.write_archive(path, entries)
    return path.read_bytes()


KINDS = [*BYTE_DAMAGE, "entries", "seal", "manifest", "manifest resealed"]
# A resealed manifest is one an attacker rewrote: an unsigned load trusts it, so it may run and
# give other numbers; every other kind of damage must be refused or leave the result unchanged.
MAY_DIFFER = {"manifest resealed"}


def outcome(path: Path, inputs: tuple[torch.Tensor, ...], expected: torch.Tensor) -> str:
    try:
        loaded = aotstack.load(path)
    except aotstack.AotstackError as exc:
        return f"refused: {type(exc).__name__}"
    try:
        result = loaded.forward(*inputs)
    except aotstack.AotstackError as exc:
        return f"call refused: {type(exc).__name__}"
    same = isinstance(result, torch.Tensor) and result.shape == expected.shape and torch.allclose(result, expected)
    return "ran, correct" if same else "ran, different"


def allowed(kind: str, result: str) -> bool:
    if result.startswith(("refused", "call refused")) or result == "ran, correct":
        return True
    return result == "ran, different" and kind in MAY_DIFFER


def fuzz(cases: int, seed: int, packages: dict[str, Path], work: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    pristine = {name: path.read_bytes() for name, path in packages.items()}
    contents = {name: tamper.entries(path) for name, path in packages.items()}
    inputs = {name: models.example_inputs(name) for name in packages}
    expected = {name: aotstack.load(path).forward(*inputs[name]) for name, path in packages.items()}
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    bad: list[dict[str, str]] = []
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Hang()))
    for index in range(cases):
        model = rng.choice(sorted(packages))
        kind = rng.choice(KINDS)
        path = work / f"case-{index % 8}.pt2"
        path.write_bytes(case_bytes(pristine[model], contents[model], kind, rng, work))
        (work / "current.json").write_text(json.dumps({"case": index, "model": model, "kind": kind}))
        signal.alarm(SECONDS_PER_CASE)
        try:
            result = outcome(path, inputs[model], expected[model])
        except Hang:
            result = "hang"
        except BaseException as exc:  # noqa: B036  (any other exception is what this counts)
            result = f"foreign: {type(exc).__name__}"
            if len(bad) < 10:
                error = f"{type(exc).__name__}: {exc}"[:500]
                bad.append({"case": str(index), "model": model, "kind": kind, "error": error})
        finally:
            signal.alarm(0)
        counts[kind][result] += 1
        if not allowed(kind, result) and not result.startswith("foreign") and len(bad) < 10:
            bad.append({"case": str(index), "model": model, "kind": kind, "error": result})
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "cases": cases,
        "counts": {kind: dict(counter) for kind, counter in sorted(counts.items())},
        "bad": bad,
        "peak_rss_growth_mb": (rss_after - rss_before) / 1024,
    }


def main() -> None:
    cases, seed = int(sys.argv[1]), int(sys.argv[2])
    packages = {item.split("=")[0]: Path(item.split("=")[1]) for item in sys.argv[3:]}
    work = Path(os.environ["FUZZ_DIR"])
    print(json.dumps(fuzz(cases, seed, packages, work)))


if __name__ == "__main__":
    main()
