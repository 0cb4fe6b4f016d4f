"""Whether ExecuTorch is installed and usable with this torch, and the error that says what to install."""

from __future__ import annotations

import functools
import importlib.metadata

import torch

from ...engine.registry import BUILT_IN
from ...errors import AotstackError

# The torch (major.minor) each ExecuTorch release's runtime extension is built against. Its
# pip package does not ask for torch, so pip installs it beside any torch, but the extension
# reads torch's tensors by torch's C++ layout: measured, executorch 1.5.1 beside torch 2.11
# lowers, and fails every call ("tensor does not have a device").
BUILT_FOR_TORCH = {"1.5": "2.13"}


def require_executorch(message: str, error: type[AotstackError]) -> None:
    """Raise ``error`` with ``message`` and what to install, unless a usable ExecuTorch is installed."""
    problem = executorch_problem()
    if problem is not None:
        raise error(f"{message}; {problem}")


@functools.cache
def executorch_problem() -> str | None:
    """Why ExecuTorch cannot serve here (not installed, or built for another torch); None where it can."""
    engine = BUILT_IN["xnnpack"]
    if not engine.installed():
        return f"executorch is not installed: pip install 'aotstack[{engine.extra}]'"
    try:
        version = importlib.metadata.version("executorch")
    except importlib.metadata.PackageNotFoundError:
        return None
    wanted = BUILT_FOR_TORCH.get(".".join(version.split(".")[:2]))
    have = ".".join(torch.__version__.split(".")[:2])
    if wanted is not None and wanted != have:
        return (f"executorch {version} is built for torch {wanted}, and this is torch {torch.__version__}: "
                f"install the executorch release built for it, or torch {wanted}")
    return None
