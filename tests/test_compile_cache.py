"""The compile cache: a second lowering of the same partition does not recompile."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import aotstack
from aotstack.backends.aoti import compile as aoti_compile
from aotstack.compile.program_parts import program_structure
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
    # A library from the cache still names the CPU features its code needs.
    features = [json.loads(lowered.delegates("forward")[0].processed_bytes)["cpu_features"]
                for lowered in (first, second)]
    assert features[0] and features[1] == features[0]


def test_a_lookup_that_misses_does_not_probe_the_cpu(tmp_path, monkeypatch):
    """Inductor's probe of the CPU's vector instructions compiles test programs (seconds on a cold Inductor cache);
    the lowering process looks every partition up before compiling, and a miss must not make it wait for the probe."""
    from aotstack.backends.aoti.cpu import AotiCpuBackend

    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    program = aotstack.export(models.build("add"), {"forward": models.example_inputs("add")}).methods["forward"]

    def refuse(*args, **kwargs):
        raise AssertionError("probed the CPU for a partition the cache does not hold")

    monkeypatch.setattr(aoti_compile, "library_cpu_features", refuse)

    assert AotiCpuBackend().cached_preprocess(program, []) is None


def test_a_new_compile_revision_compiles_the_library_again(tmp_path, monkeypatch):
    """AOTInductor's own library cache is keyed by the backend's compile_revision too, so a change to its passes is
    not hidden by a library compiled before it (the lowering cache above it already was)."""
    from aotstack.backends.aoti.cpu import AotiCpuBackend

    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    program = aotstack.export(models.build("add"), {"forward": models.example_inputs("add")})
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()])
    monkeypatch.setattr(AotiCpuBackend, "compile_revision", AotiCpuBackend.compile_revision + 1)
    aotstack.lower(program, [aotstack.AotiCpuPartitioner()])

    assert len(list(tmp_path.glob("*.so"))) == 2


def linear_program(model: torch.nn.Module, rows: int = 4) -> torch.export.ExportedProgram:
    return aotstack.export(model, {"forward": (torch.randn(rows, 16),)}).methods["forward"]


def key_of(program: torch.export.ExportedProgram, options: dict | None = None) -> str:
    options = options or {}
    structure = program_structure(program, every_value=aoti_compile.folds_weights(options))
    return aoti_compile.cache_key(structure, options)


def test_the_key_follows_the_code_and_small_weights_not_large_weights_or_names():
    model = models.build("linear")
    key = key_of(linear_program(model))
    # Linear(16, 8): its 128-element weight is bound by name at load, its 8-element bias may be in the code.
    other_weight = copy.deepcopy(model)
    other_bias = copy.deepcopy(model)
    with torch.no_grad():
        other_weight.linear.weight.add_(1)
        other_bias.linear.bias.add_(1)
    renamed = torch.nn.Sequential(torch.nn.Identity(), copy.deepcopy(model.linear))

    assert key_of(linear_program(other_weight)) == key
    assert key_of(linear_program(renamed)) == key
    assert key_of(linear_program(other_bias)) != key
    assert key_of(linear_program(model, rows=5)) != key
    assert key_of(linear_program(model), {"max_autotune": True}) != key
    # Freezing folds every weight into the code.
    assert key_of(linear_program(other_weight), {"freezing": True}) != key_of(linear_program(model), {"freezing": True})


def test_a_library_serves_a_partition_of_the_same_structure_with_its_own_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    first, second = models.build("linear"), models.build("linear")
    x = models.example_inputs("linear")
    aotstack.lower(aotstack.export(first, {"forward": x}), [aotstack.AotiCpuPartitioner()])

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again despite a library of the same structure")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    lowered = aotstack.lower(aotstack.export(second, {"forward": x}), [aotstack.AotiCpuPartitioner()])
    assert [r.state for r in lowered.compile_log["forward"]] == ["cached"]
    lowered.save(tmp_path / "second.pt2")
    torch.testing.assert_close(aotstack.load(tmp_path / "second.pt2").forward(*x), second(*x).detach())


def test_a_corrupt_cache_entry_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", str(tmp_path))
    files = aoti_compile.CompiledFiles(b"library bytes", b'{"nodes": []}', ["linear.weight"])
    aoti_compile.store_files("k", files)
    assert aoti_compile.cached_files("k") == files

    (tmp_path / "k.json").write_bytes(b'{"nodes": [1]}')
    assert aoti_compile.cached_files("k") is None
    aoti_compile.store_files("k", files)
    (tmp_path / "k.so").write_bytes(b"library bytez")
    assert aoti_compile.cached_files("k") is None
    aoti_compile.store_files("k", files)
    (tmp_path / "k.weights").write_bytes(b'["other.weight"]')
    assert aoti_compile.cached_files("k") is None


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("AOTSTACK_CACHE_DIR", "off")
    aoti_compile.store_files("k", aoti_compile.CompiledFiles(b"library bytes", None, []))
    assert aoti_compile.cached_files("k") is None


def test_the_thread_count_the_code_is_compiled_for_changes_the_key():
    """torch's thread count, or the ``threads`` spec's count (``cpp.threads``) where given, whatever torch's is."""
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")}).methods["forward"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, pinned_at_one = key_of(program), key_of(program, {"cpp.threads": 1})
        torch.set_num_threads(2)
        two, pinned_at_two = key_of(program), key_of(program, {"cpp.threads": 1})
    finally:
        torch.set_num_threads(threads)
    assert one != two
    assert pinned_at_one == pinned_at_two
    assert pinned_at_two != key_of(program, {"cpp.threads": 2})


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


def test_a_new_compile_revision_keys_compiles_and_auto_measurements_apart(monkeypatch):
    from aotstack.backends.ort.backend import OrtBackend
    from aotstack.compile.auto import TimingInputs, measurement_key
    from aotstack.compile.cache import preprocess_key

    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")}).methods["forward"]
    plan = ("onnxruntime", "aoti_cpu")
    inputs = TimingInputs((tuple(program.example_inputs[0]), {}), given=False)
    before = preprocess_key(OrtBackend(), program, []), measurement_key("fingerprint", inputs, plan, 1)
    monkeypatch.setattr(OrtBackend, "compile_revision", OrtBackend.compile_revision + 1)
    after = preprocess_key(OrtBackend(), program, []), measurement_key("fingerprint", inputs, plan, 1)

    assert before[0] != after[0] and before[1] != after[1]


def test_an_engines_cache_entries_are_keyed_by_the_source_it_runs(tmp_path, monkeypatch):
    """A result is reused only by the code that made it: an edit to the engine's folder or to a module it imports
    (lazily too, transitively) keys its entries apart without a raised compile_revision; an edit elsewhere does not.
    A clean clone sharing the home directory's cache once read models a development edit had compiled."""
    from aotstack.engine import source

    package = tmp_path / "myengines"
    (package / "engine").mkdir(parents=True)
    (package / "shared").mkdir()
    files = {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/backend.py": "from ..shared import names\n\nclass MyBackend:\n    compile_revision = 3\n",
        "engine/compile.py": "def convert():\n    from ..shared.quantized import (\n        packed,\n    )\n",
        "shared/__init__.py": "",
        "shared/names.py": "NAME = 'a'\n",
        "shared/quantized.py": "import myengines.shared.deep as deep\n",
        "shared/deep.py": "LEVEL = 1\n",
        "shared/unrelated.py": "OTHER = 1\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    from myengines.engine.backend import MyBackend

    def version_after(edited: str) -> str:
        (package / edited).write_text((package / edited).read_text() + "# edited\n")
        source.source_digest.cache_clear()
        return source.code_version(MyBackend)

    first = source.code_version(MyBackend)
    assert first.startswith("revision 3 source ") and "?" not in first
    assert version_after("shared/unrelated.py") == first
    seen = {first}
    for edited in ("engine/compile.py", "shared/names.py", "shared/deep.py"):
        seen.add(version_after(edited))
    assert len(seen) == 4
    source.source_digest.cache_clear()
