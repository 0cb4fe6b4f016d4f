"""This machine's processor, as compiled code depends on it: the instruction sets it has, and a fingerprint for caches.

AOTInductor writes vector code for the widest instructions the compiling CPU has (AVX-512,
AMX): a library compiled on one machine dies of SIGILL on a CPU without them, and what an engine
compiled or measured on one machine is not what it would on another. So caches key their
entries by ``processor_fingerprint`` and a library records the features it needs, which the run
side checks (``missing_features``) before it opens it.

Features are named as ``torch.cpu.get_capabilities()`` names them (cpuinfo's names: ``avx2``,
``avx512_f``, ``avx512_vnni``, ``amx_tile``, ...), on every platform torch runs on.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable

import torch

# The compiler flags whose feature's name is not the flag's own spelling.
_FLAG_FEATURES = {"fma": "fma3"}


@functools.cache
def capabilities() -> dict[str, object]:
    """What cpuinfo reports of this CPU; empty where torch cannot tell."""
    try:
        return dict(torch.cpu.get_capabilities())
    except (AttributeError, RuntimeError):
        return {}


def cpu_features() -> frozenset[str]:
    """The instruction-set features this CPU has, by cpuinfo's names (``avx512_f``, ``amx_tile``)."""
    return frozenset(name for name, value in capabilities().items() if value is True)


def processor_fingerprint() -> str:
    """A short hash of this processor's architecture, name and features: what compiled code and timings depend on.

    Example: a compile cached on an AVX2 machine is not reused on an AVX-512 one, nor the reverse.
    """
    found = capabilities()
    parts = [str(found.get("architecture", "?")), str(found.get("cpu_name", "?")), *sorted(cpu_features())]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def features_of_flags(flags: Iterable[str]) -> list[str]:
    """The features a compiler's ``-m`` flags (``-mavx512f``, ``-mamx-tile``) ask of the CPU, by cpuinfo's names.

    A flag is read against this CPU's own features (the compiler's target was checked to run
    here): ``-mavx512vnni`` is ``avx512_vnni``, ``-mfma`` is ``fma3``. A flag naming none of them
    (``-march=...``, ``-msve-vector-bits=256``) is left out.
    """
    known, features = cpu_features(), []
    for flag in flags:
        if not flag.startswith("-m") or "=" in flag:
            continue
        name = flag[2:].replace("-", "_")
        candidates = [_FLAG_FEATURES.get(name, name)]
        if name.startswith("avx512"):
            candidates.append("avx512_" + name.removeprefix("avx512"))
        feature = next((candidate for candidate in candidates if candidate in known), None)
        if feature is not None and feature not in features:
            features.append(feature)
    return features


# Features a compiler told ``-march=native`` may use anywhere in a library, not only in the vector code
# Inductor writes: the vector extensions and the bit-manipulation ones.
_NATIVE_CODE_PREFIXES = ("avx", "amx", "fma3", "f16c", "bmi", "lzcnt", "popcnt")


def native_code_features() -> list[str]:
    """The features code compiled with ``-march=native`` here may use, by cpuinfo's names."""
    # ``avx10_1`` names a set of AVX-512 features listed on their own, not instructions of its own.
    return sorted(name for name in cpu_features()
                  if name.startswith(_NATIVE_CODE_PREFIXES) and not name.startswith("avx10"))


def missing_features(needed: Iterable[str]) -> list[str]:
    """Which of ``needed`` this CPU lacks; none where torch cannot tell what it has (nothing is refused blind)."""
    if not capabilities():
        return []
    present = cpu_features()
    return [feature for feature in needed if feature not in present]
