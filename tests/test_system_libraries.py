"""Opening AOTInductor libraries with their own symbols first (``backends/aoti/system_libraries.py``).

Nothing here needs a GPU. What it guards against (a library bound to another library's copies of
C++ templates, loaded with RTLD_GLOBAL) is built here with two tiny C libraries.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import aotstack
from aotstack.backends.aoti import run as aoti_run
from aotstack.backends.aoti import system_libraries
from aotstack.backends.aoti.system_libraries import deep_binding_allowed, preopened_library
from tests import models

needs_deep_binding = pytest.mark.skipif(not deep_binding_allowed(), reason="needs Linux with glibc, no LD_PRELOAD")
needs_a_c_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def shared_library(folder, name: str, source: str) -> str:
    path = os.path.join(folder, name)
    source_path = path + ".c"
    with open(source_path, "w") as file:
        file.write(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-O0", "-o", path, source_path], check=True)
    return path


def is_loaded(path: str) -> bool:
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_NOLOAD)
    except OSError:
        return False
    return True


@needs_deep_binding
@needs_a_c_compiler
def test_a_preopened_library_binds_to_its_own_definition_before_a_global_one(tmp_path):
    # As libcufile's std::regex code does for an AOTInductor library: a definition of the same
    # symbol in a library loaded earlier with RTLD_GLOBAL wins over the library's own.
    other = shared_library(tmp_path, "libother.so", "int aotstack_which(void) { return 2; }\n")
    source = "int aotstack_which(void) { return 1; }\nint aotstack_call_which(void) { return aotstack_which(); }\n"
    plain = shared_library(tmp_path, "libplain.so", source)
    preopened = shared_library(tmp_path, "libpreopened.so", source)
    script = textwrap.dedent(
        f"""
        import ctypes, os
        from aotstack.backends.aoti.system_libraries import preopened_library
        ctypes.CDLL({other!r}, mode=os.RTLD_GLOBAL)
        # Opened as torch's runner opens a library: RTLD_LOCAL, by path.
        plain = ctypes.CDLL({plain!r}).aotstack_call_which()
        preopened = ctypes.CDLL(preopened_library({preopened!r})).aotstack_call_which()
        print(plain, preopened)
        """
    )

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)

    assert result.stdout.split() == ["2", "1"]


@needs_deep_binding
def test_a_preopened_aoti_library_is_the_one_the_runner_opens_and_runs(tmp_path, monkeypatch):
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()]).save(tmp_path / "linear.pt2")
    opened: list[str] = []
    factory = aoti_run.runner_factory

    def preopening_factory(device, label):
        open_on_device = factory(device, label)
        # What open_runner does: open_on_device(preopened_library(library_path(...))).
        return lambda path: open_on_device(opened.append(preopened_library(path)) or path)

    monkeypatch.setattr(aoti_run, "runner_factory", preopening_factory)

    loaded = aotstack.load(tmp_path / "linear.pt2")
    x = models.example_inputs("linear")[0]

    with torch.no_grad():
        torch.testing.assert_close(loaded.forward(x), models.build("linear")(x))
    (path,) = opened
    assert is_loaded(path)
    # One copy of the library in the process: the runner got the object opened first.
    code = [line for line in open("/proc/self/maps") if line.rstrip().endswith(path) and " r-xp " in line]
    assert len(code) == 1


@needs_a_c_compiler
@pytest.mark.parametrize(
    ("setting", "value"),
    [("LD_PRELOAD", "/lib/x86_64-linux-gnu/libstdc++.so.6"), ("platform", "darwin")],
)
def test_where_deep_binding_is_not_allowed_nothing_is_opened(tmp_path, monkeypatch, setting, value):
    path = shared_library(tmp_path, "libunopened.so", "int aotstack_unopened(void) { return 0; }\n")
    if setting == "LD_PRELOAD":
        monkeypatch.setenv("LD_PRELOAD", value)
    else:
        monkeypatch.setattr(sys, "platform", value)

    assert not deep_binding_allowed()
    assert preopened_library(path) == path
    assert not is_loaded(path)


@needs_deep_binding
def test_a_library_that_cannot_be_opened_is_left_to_the_runner(tmp_path):
    path = str(tmp_path / "not_a_library.so")
    with open(path, "wb") as file:
        file.write(b"not an ELF file")

    assert preopened_library(path) == path
    assert path not in system_libraries._OPENED
