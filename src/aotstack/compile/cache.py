"""Where aotstack keeps what it can reuse between lowerings: compiled libraries, measurements."""

from __future__ import annotations

import os
import tempfile


def cache_dir(kind: str) -> str | None:
    """The folder for one kind of cached entry; ``AOTSTACK_CACHE_DIR=off`` turns every cache off.

    ``AOTSTACK_CACHE_DIR=DIR`` keeps compiled libraries in ``DIR`` itself, as it always has, and
    other kinds in folders beside it.
    """
    configured = os.environ.get("AOTSTACK_CACHE_DIR")
    if configured is not None:
        if configured.lower() in ("", "0", "off", "none"):
            return None
        return configured if kind == "aoti" else os.path.join(configured, f".{kind}")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aotstack", kind)


def read_entry(kind: str, name: str) -> bytes | None:
    directory = cache_dir(kind)
    if directory is None:
        return None
    try:
        with open(os.path.join(directory, name), "rb") as file:
            return file.read()
    except OSError:
        return None


def write_entry(kind: str, name: str, data: bytes) -> None:
    """Add an entry; it appears whole (written aside, then renamed) or not at all."""
    directory = cache_dir(kind)
    if directory is None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".partial-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, os.path.join(directory, name))
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass  # a cache that cannot be written only costs the work again next time
