"""The compile cache: a second lowering of the same partition does not recompile."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import aotstack
from aotstack.backends.aoti import compile as aoti_compile
from tests import models


def test_second_lowering_reuses_the_cached_library(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    program = aotstack.export(models.build("add"), {"forward": models.example_inputs("add")})
    first = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
    assert len(list(tmp_path.glob("*.so"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again despite a cache entry")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    second = aotstack.lower(program, [aotstack.AotiCpuPartitioner()])

    assert second.delegates("forward")[0].named_data == first.delegates("forward")[0].named_data


def test_changed_weights_change_the_key():
    model = models.build("linear")
    program = aotstack.export(model, {"forward": models.example_inputs("linear")}).methods["forward"]
    key = aoti_compile.cache_key(program, {})
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in changed.parameters():
            parameter.add_(1)
    changed_program = aotstack.export(changed, {"forward": models.example_inputs("linear")}).methods["forward"]

    assert aoti_compile.cache_key(changed_program, {}) != key
    assert aoti_compile.cache_key(program, {"max_autotune": True}) != key
    assert aoti_compile.cache_key(program, {}) == key


def test_a_corrupt_cache_entry_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    files = aoti_compile.CompiledFiles(b"library bytes", b'{"nodes": []}')
    aoti_compile.store_files("k", files)
    assert aoti_compile.cached_files("k") == files

    (tmp_path / "k.json").write_bytes(b'{"nodes": [1]}')
    assert aoti_compile.cached_files("k") is None
    aoti_compile.store_files("k", files)
    (tmp_path / "k.so").write_bytes(b"library bytez")
    assert aoti_compile.cached_files("k") is None


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", "off")
    aoti_compile.store_files("k", aoti_compile.CompiledFiles(b"library bytes", None))
    assert aoti_compile.cached_files("k") is None


def test_the_thread_count_changes_the_key():
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")}).methods["forward"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = aoti_compile.cache_key(program, {})
        torch.set_num_threads(2)
        two = aoti_compile.cache_key(program, {})
    finally:
        torch.set_num_threads(threads)
    assert one != two


def test_an_onnx_runtime_partition_is_exported_once_and_its_weights_come_from_the_program(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    model = models.build("stacked")
    program = aotstack.export(model, {"forward": models.example_inputs("stacked")})
    first = aotstack.lower(program, [aotstack.OrtPartitioner()], jobs=1)

    def refuse(*args, **kwargs):
        raise AssertionError("exported again despite a cache entry")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    second = aotstack.lower(program, [aotstack.OrtPartitioner()], jobs=1)

    assert [r.state for r in second.compile_log["forward"]] == ["cached"]
    assert {k: bytes(v) for k, v in second.delegates("forward")[0].named_data.items()} == {
        k: bytes(v) for k, v in first.delegates("forward")[0].named_data.items()
    }
    second.save(tmp_path / "cached.pt2")
    x = models.example_inputs("stacked")
    torch.testing.assert_close(aotstack.load(tmp_path / "cached.pt2").forward(*x), model(*x).detach())
    (blob,) = [p for p in (tmp_path / ".preprocess").iterdir() if not p.name.endswith(".json")]
    blob.write_bytes(b"not the model")
    with pytest.raises(aotstack.LoweringError, match="exported again"):
        aotstack.lower(program, [aotstack.OrtPartitioner()], jobs=1)


def test_a_kept_result_whose_weight_the_backend_changed_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    aotstack.lower(program, [aotstack.OrtPartitioner()], jobs=1)
    (header,) = (tmp_path / ".preprocess").glob("*.json")
    kept = json.loads(header.read_text())
    kept["weights"] = {fqn: "0" * 64 for fqn in kept["weights"]}
    header.write_text(json.dumps(kept))

    again = aotstack.lower(program, [aotstack.OrtPartitioner()], jobs=1)

    assert [r.state for r in again.compile_log["forward"]] == ["compiled"]
