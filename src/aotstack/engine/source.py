"""Which code made a cached result: a hash of the source an engine's compile side runs.

A cache keyed only by versions and a hand-raised ``compile_revision`` hands a result made by other code to whoever
shares the cache folder: one process's edit that forgot to raise the revision (or a checkout of another commit of the
same version) reads what the other compiled. So each engine's entries are also keyed by the source of its folder and
of every module of ours it imports, transitively, read from the files themselves.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from pathlib import Path


def code_version(backend: type) -> str:
    """What ``backend``'s compiled results depend on in code: its ``compile_revision`` and ``source_digest``.

    Example: ``code_version(OrtBackend)`` is ``"revision 5 source 1f0c..."``; an edit to ``backends/ort/compile.py``
    or to a helper it imports changes it, one to the runtime does not.
    """
    return f"revision {getattr(backend, 'compile_revision', '?')} source {source_digest(backend.__module__)}"


@functools.cache
def source_digest(module: str) -> str:
    """A hash of the source of ``module``'s folder (its package's modules) and of every module they import from
    their own top-level package or aotstack, transitively; ``?`` where the source is not on disk."""
    files = imported_sources(module)
    if not files:
        return "?"
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def imported_sources(module: str) -> set[Path]:
    """The source files ``source_digest`` hashes for ``module`` (a loaded module): none where it has no file."""
    origin = getattr(sys.modules.get(module), "__file__", None)
    if not origin:
        return set()
    start = Path(origin)
    roots = {top: root for top in {module.partition(".")[0], __name__.partition(".")[0]}
             if (root := package_root(top)) is not None}
    # An engine is a folder: its partitioner, compile and run sides, helpers beside them.
    pending = sorted(start.parent.glob("*.py")) if "." in module else [start]
    seen: set[Path] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        name = module_of(path, roots) or module
        pending.extend(found for imported in imported_modules(path, name)
                       if (found := module_file(imported, roots)) is not None)
    return seen


def package_root(name: str) -> Path | None:
    """The folder of the top-level package ``name``, where it is imported from a folder."""
    loaded = sys.modules.get(name)
    origin = getattr(loaded, "__file__", None)
    return Path(origin).parent if origin and origin.endswith("__init__.py") else None


def module_file(name: str, roots: dict[str, Path]) -> Path | None:
    """The source file of module ``name`` under one of ``roots`` (a package's ``__init__.py``); None elsewhere."""
    top, _, rest = name.partition(".")
    root = roots.get(top)
    if root is None:
        return None
    base = root.joinpath(*rest.split(".")) if rest else root
    for candidate in (base.with_suffix(".py") if rest else None, base / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def module_of(path: Path, roots: dict[str, Path]) -> str | None:
    """The dotted name of the module at ``path``, under one of ``roots``; None elsewhere."""
    for top, root in roots.items():
        if path.is_relative_to(root):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


# ``from X import a, b`` (parenthesised over lines, too) and ``import X as y, Z``, wherever they stand in a module.
FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)", re.MULTILINE)
PLAIN_IMPORT = re.compile(r"^[ \t]*import[ \t]+([^\n#]*)", re.MULTILINE)


def imported_modules(path: Path, module: str) -> list[str]:
    """The modules the source at ``path`` (module ``module``) imports anywhere in it, absolute; for ``from X import
    Y``, both ``X`` and ``X.Y`` (which may be a module). Read as text, not parsed (a tenth of the time): an import
    spelled in a docstring only adds a file to hash."""
    text = path.read_text(encoding="utf-8", errors="replace")
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = [alias.split()[0] for found in PLAIN_IMPORT.findall(text) for alias in found.split(",") if alias.strip()]
    for origin, imported in FROM_IMPORT.findall(text):
        level = len(origin) - len(origin.lstrip("."))
        base = ".".join([*package[: len(package) - level + 1], origin[level:]] if level else [origin]).strip(".")
        names.append(base)
        names.extend(f"{base}.{alias.split()[0]}" for alias in imported.strip("()").split(",") if alias.strip())
    return names
