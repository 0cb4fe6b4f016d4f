"""The README's user-defined backend, run exactly as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import aotstack
from aotstack.engine import registry
from aotstack.format.archive import read_manifest

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_backend_example() -> str:
    section = README.read_text().split("## Your own backend", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_backend_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = readme_backend_example()
    assert len(code.strip().splitlines()) < 40

    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})

    manifest = read_manifest("add.pt2")
    [delegate] = manifest.methods["forward"].delegates
    assert delegate.backend_id == "example_add"
    assert delegate.ops == ["aten.add.Tensor"]


def test_loading_without_the_backend_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_backend_example(), str(README), "exec"), {"__name__": "readme_example"})
    monkeypatch.delitem(registry._RUNTIMES, "example_add")

    with pytest.raises(aotstack.BackendNotFoundError, match="example_add"):
        aotstack.load("add.pt2")
