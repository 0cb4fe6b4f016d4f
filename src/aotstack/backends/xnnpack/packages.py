"""Whether ExecuTorch is installed, and the error that says how to install it."""

from __future__ import annotations

from ...errors import AotstackError
from ..base import BUILT_IN


def require_executorch(message: str, error: type[AotstackError]) -> None:
    """Raise ``error`` with ``message`` and the pip command that installs ExecuTorch, unless it is installed."""
    engine = BUILT_IN["xnnpack"]
    if not engine.installed():
        raise error(f"{message}; install it with: pip install 'aotstack[{engine.extra}]'")
