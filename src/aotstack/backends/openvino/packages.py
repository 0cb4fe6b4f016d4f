"""Whether OpenVINO is installed, and the error that says how to install it."""

from __future__ import annotations

from ...engine.registry import BUILT_IN
from ...errors import AotstackError


def require_openvino(message: str, error: type[AotstackError]) -> None:
    """Raise ``error`` with ``message`` and the pip command that installs OpenVINO, unless it is installed."""
    engine = BUILT_IN["openvino"]
    if not engine.installed():
        raise error(f"{message}; install it with: pip install 'aotstack[{engine.extra}]'")
