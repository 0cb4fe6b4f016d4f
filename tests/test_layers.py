"""The layers hold: loading imports no compiler, each layer imports only those below it, no import circles.

The rules, from the bottom up (README, "How it fits together"):
- ``errors`` and ``forking``: nothing of aotstack.
- ``format``: only ``errors``.
- ``engine`` (the engine interface, the registry, the shared run side): only ``format`` and ``errors``.
- a backend's run side (``run.py``, ``packages.py``): only the above, never its compile side.
- ``report``: only ``format`` and ``errors`` (it reads a manifest, saved or not).
- ``runtime``: only the above; a backend's run side is found through the registry, by name. It uses
  ``report`` only to show a loaded program in a notebook.
- ``compile`` and the backends' compile sides: anything but ``runtime``, the CLI and the demo;
  ``compile/check.py`` alone may use ``runtime`` too.
- ``integrations`` (other libraries' tools, e.g. a ``transformers.exporters`` backend): anything but the CLI
  and the demo; only the CLI and the demo use them.
- the CLI and the demo: anything.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import aotstack
from aotstack.engine.registry import run_side_modules
from tests import models
from tests.conftest import run_child
from tests.test_stacked_end_to_end import ORT_THEN_AOTI

PACKAGE = Path(aotstack.__file__).resolve().parent

# Each built-in engine's run module, and the helper beside it that says which packages it needs.
RUN_SIDE = run_side_modules() | {
    f"{engine.rpartition('.')[0]}.packages"
    for engine in run_side_modules()
    if (PACKAGE.parent / engine.rpartition(".")[0].replace(".", "/") / "packages.py").exists()
}
BELOW_RUNTIME = ("aotstack.errors", "aotstack.forking", "aotstack.format", "aotstack.engine")
# Module (or package prefix) -> the aotstack modules it may import (prefixes).
ALLOWED = {
    "aotstack.errors": (),
    "aotstack.forking": (),
    "aotstack.format": ("aotstack.errors", "aotstack.format"),
    "aotstack.engine": ("aotstack.errors", "aotstack.format", "aotstack.engine"),
    "aotstack.report": ("aotstack.errors", "aotstack.format", "aotstack.report"),
    "aotstack.runtime": (*BELOW_RUNTIME, "aotstack.runtime", "aotstack.report"),
    **{module: (*BELOW_RUNTIME, *RUN_SIDE) for module in RUN_SIDE},
}
# The tools on the top floor use every layer; nothing below uses them.
TOOLS = ("aotstack.__main__", "aotstack.cli", "aotstack.demo")
# Beside the tools: they use the compiler and the runtime, and only the tools use them.
INTEGRATIONS = "aotstack.integrations"
NEVER_FROM_THE_COMPILER = ("aotstack.runtime", INTEGRATIONS, *TOOLS)
# The numerical check and the timing of auto-lowering run what was packaged the way a user loads it.
RUNTIME_USED_BY = {"aotstack.compile.check", "aotstack.compile.measure"}

# What a process that only loads and runs a package may import of aotstack.
RUNTIME_MODULES = {
    "aotstack", "aotstack.errors", "aotstack.forking", "aotstack.format", "aotstack.runtime", "aotstack.backends",
    "aotstack.engine", "aotstack.engine.interface", "aotstack.engine.registry", "aotstack.engine.pages",
    "aotstack.engine.session", "aotstack.engine.processor", *(module.rpartition(".")[0] for module in RUN_SIDE),
    *RUN_SIDE,
}
RUNTIME_PACKAGES = ("aotstack.format.", "aotstack.runtime.")
HEAVY = ("torch._inductor", "torch._export.serde", "torch._dynamo", "onnx", "onnxscript")

LOAD_AND_RUN = """
import json, sys
import torch
from aotstack import load

shapes = json.loads(sys.argv[2])
loaded = load(sys.argv[1])
out = loaded.forward(*[torch.ones(shape) for shape in shapes])
print(json.dumps({"modules": sorted(sys.modules), "sum": float(out.sum())}))
"""


def test_loading_and_running_a_stacked_package_imports_no_compiler(lowered_with):
    _, path = lowered_with("stacked", *ORT_THEN_AOTI)
    shapes = [list(x.shape) for x in models.example_inputs("stacked")]

    child = run_child(LOAD_AND_RUN, str(path), json.dumps(shapes))

    ours = {m for m in child["modules"] if m.split(".")[0] == "aotstack"}
    compile_side = {m for m in ours if m not in RUNTIME_MODULES and not m.startswith(RUNTIME_PACKAGES)}
    assert compile_side == set(), "a load imported modules of the compiler"
    assert "aotstack.backends.aoti.run" in ours and "aotstack.backends.ort.run" in ours
    heavy = sorted(m for m in child["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == []
    expected = models.build("stacked")(*[torch.ones(s) for s in shapes])
    assert child["sum"] == pytest.approx(float(expected.detach().sum()), rel=1e-4)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The aotstack modules ``path`` imports, at any depth, leaving out imports for type checkers only."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    type_checking = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            # ``from . import x`` names module ``x``, not the package around it.
            submodules = {f"{module}.{alias.name}" for alias in node.names} & known
            found |= submodules or {module}
    return {m for m in found if m.split(".")[0] == "aotstack"}


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(modules)
    return {
        name: {m for m in imported_modules(path, known) if m in known and m != name} for name, path in modules.items()
    }


def rule_for(module: str) -> tuple[str, ...] | None:
    matches = [prefix for prefix in ALLOWED if module == prefix or module.startswith(prefix + ".")]
    return ALLOWED[max(matches, key=len)] if matches else None


def test_each_layer_imports_only_the_layers_below_it():
    broken = []
    for module, imports in sorted(import_graph().items()):
        if module in TOOLS:
            continue
        if module.startswith(INTEGRATIONS):
            broken += [f"{module} imports {imported}" for imported in sorted(imports) if imported in TOOLS]
            continue
        allowed = rule_for(module)
        for imported in sorted(imports):
            if allowed is not None:
                ok = any(imported == p or imported.startswith(p + ".") for p in allowed) or imported == "aotstack"
            else:
                ok = not imported.startswith(NEVER_FROM_THE_COMPILER) or (
                    module in RUNTIME_USED_BY and f"{imported}.".startswith("aotstack.runtime.")
                )
            if not ok:
                broken.append(f"{module} imports {imported}")
    assert broken == []


def test_no_module_imports_itself_in_a_circle():
    graph = import_graph()
    circles = []
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                circles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_the_walk_sees_the_imports_it_checks():
    graph = import_graph()
    assert "aotstack.format.specs" in graph["aotstack.format.manifest"]
    assert "aotstack.backends.aoti.run" in graph["aotstack.backends.aoti.backend"]
    assert "aotstack.compile.package" in graph["aotstack.compile.lower"]
