"""Which optional packages ONNX Runtime's sides need, and the error that names the missing ones."""

from __future__ import annotations

import importlib.util

from ...errors import AotstackError


def require_packages(modules: tuple[str, ...], message: str, error: type[AotstackError]) -> None:
    """Raise ``error`` naming the packages of ``modules`` that are not installed."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise error(message.format(missing=", ".join(missing)) + "; install them with: pip install 'aotstack[onnx]'")
