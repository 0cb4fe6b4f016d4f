"""Every error is raised by type, naming the bad input, before anything unsafe happens."""

from __future__ import annotations

import dataclasses
import os
import re
import zipfile

import pytest
import torch

import aotstack
from aotstack.backends.aoti import run as aoti_run
from aotstack.format import archive
from aotstack.format.archive import MANIFEST_PATH
from tests import models


@pytest.fixture
def linear_path(lowered_package):
    return lowered_package("linear")[1]


def test_all_errors_share_one_base_and_are_named_by_aotstack():
    from aotstack import errors

    classes = [value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, Exception)]
    assert len(classes) > 10
    for error in classes:
        assert issubclass(error, aotstack.AotstackError)
        # A user catches what export-hf or generate raises by the name aotstack gives it.
        assert getattr(aotstack, error.__name__) is error


def test_a_file_that_is_not_an_archive_is_refused(tmp_path):
    path = tmp_path / "notes.pt2"
    path.write_text("not a model")
    with pytest.raises(aotstack.PackageError, match="notes.pt2.*not a PT2 archive"):
        aotstack.load(path)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(aotstack.PackageError, match="no such file"):
        aotstack.load(tmp_path / "absent.pt2")


def test_a_pt2_archive_not_from_aotstack_is_refused(tmp_path):
    path = tmp_path / "stock.pt2"
    exported = torch.export.export(models.build("linear"), models.example_inputs("linear"))
    torch.export.save(exported, path)
    with pytest.raises(aotstack.PackageError, match="not one written by aotstack"):
        aotstack.load(path)


def test_a_truncated_file_is_refused(linear_path, tmp_path):
    path = tmp_path / "truncated.pt2"
    data = linear_path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(aotstack.PackageError, match="truncated.pt2"):
        aotstack.load(path)


def rewritten_archive(source, target, change):
    """A valid archive holding ``source``'s entries, with ``change(name, data)`` applied to each."""
    entries = archive.opened_archive(source).entries
    archive.write_archive(target, [(name, change(name, bytes(data))) for name, data in entries.items()])


def test_a_library_changed_by_one_byte_is_refused_before_it_is_opened(linear_path, tmp_path, monkeypatch):
    from aotstack.format.archive import read_manifest

    manifest = read_manifest(linear_path)
    [delegate] = manifest.methods["forward"].delegates
    library_key = delegate.named_data["model.so"]

    def flip_one_byte(name, data):
        if name.endswith(library_key):
            return data[:1000] + bytes([data[1000] ^ 1]) + data[1001:]
        return data

    tampered = tmp_path / "tampered.pt2"
    rewritten_archive(linear_path, tampered, flip_one_byte)
    opened = []
    monkeypatch.setattr(aoti_run, "open_runner", lambda *args: opened.append(args))

    with pytest.raises(aotstack.PackageError, match=f"tampered.pt2.*{library_key[:16]}.*model.so.*SHA-256"):
        aotstack.load(tampered)
    assert opened == []


def test_the_untampered_copy_loads(linear_path, tmp_path):
    copy = tmp_path / "copy.pt2"
    rewritten_archive(linear_path, copy, lambda name, data: data)
    x = models.example_inputs("linear")[0]
    torch.testing.assert_close(aotstack.load(copy).forward(x), aotstack.load(linear_path).forward(x))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), r"forward\(\) takes 1 argument\(s\) \(x\), got 0"),
        ((torch.randn(4, 16), torch.randn(4, 16)), r"takes 1 argument\(s\) \(x\), got 2"),
        ((torch.randn(4, 16, dtype=torch.float64),), r"'x' has dtype torch.float64, expected torch.float32"),
        ((torch.randn(4, 15),), r"'x' has shape \[4, 15\], expected \[4, 16\]"),
        ((torch.randn(16),), r"'x' has shape \[16\], expected \[4, 16\]"),
        (([1.0] * 16,), r"'x' must be a tensor, got list"),
    ],
)
def test_bad_inputs_are_refused_before_compiled_code_runs(linear_path, monkeypatch, args, message):
    loaded = aotstack.load(linear_path)
    executed = []
    monkeypatch.setattr(aoti_run, "run", lambda handle, inputs: executed.append(inputs))

    with pytest.raises(aotstack.InputError, match=message):
        loaded.forward(*args)
    assert executed == []


def test_an_unknown_method_names_the_ones_that_exist(linear_path):
    loaded = aotstack.load(linear_path)
    with pytest.raises(aotstack.MethodNotFoundError, match="no method 'decode'.*forward"):
        loaded.decode(torch.randn(4, 16))
    with pytest.raises(aotstack.MethodNotFoundError, match="forward"):
        loaded.run("decode")


def test_exporting_a_missing_method_names_the_model_and_its_methods():
    with pytest.raises(aotstack.ExportError, match="SharedModel has no method 'decode'.*forward.*score"):
        aotstack.export(models.build("shared"), {"decode": models.example_inputs("shared")})


def test_strictness_for_a_method_not_exported_is_refused_naming_it():
    with pytest.raises(aotstack.ExportError, match=r"strict names methods that are not exported: \['score'\]"):
        aotstack.export(models.build("shared"), {"forward": models.example_inputs("shared")},
                        strict={"forward": False, "score": True})


def test_an_unknown_excluded_op_is_named():
    with pytest.raises(ValueError, match="unknown op 'aten.not_an_op'"):
        aotstack.AotiCpuPartitioner(exclude_ops=["aten.not_an_op"])


def test_concrete_aoti_backends_are_final():
    with pytest.raises(TypeError, match="AotiCpuBackend is final"):
        class Derived(aotstack.AotiCpuBackend):  # noqa: F841
            pass


def test_a_failed_save_leaves_no_file_and_keeps_the_old_one(lowered_package, tmp_path, monkeypatch):
    lowered, _ = lowered_package("linear")
    path = tmp_path / "model.pt2"
    path.write_bytes(b"previous contents")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(archive, "write_entry", fail)
    with pytest.raises(aotstack.SaveError, match=re.escape(f"cannot write {path}: disk full")):
        lowered.save(path)
    assert path.read_bytes() == b"previous contents"
    assert os.listdir(tmp_path) == ["model.pt2"]


def test_saving_into_a_missing_folder_names_the_path_asked_for(lowered_package, tmp_path):
    lowered, _ = lowered_package("linear")
    path = tmp_path / "missing" / "model.pt2"
    message = re.escape(f"cannot write {path}: No such file or directory")
    with pytest.raises(aotstack.SaveError, match=message) as raised:
        lowered.save(path)
    assert isinstance(raised.value, OSError) and ".aotstack-" not in str(raised.value)
    assert os.listdir(tmp_path) == []


def test_the_manifest_records_versions_devices_specs_and_hashes(linear_path):
    import json

    with zipfile.ZipFile(linear_path) as package:
        [manifest_name] = [n for n in package.namelist() if n.endswith(MANIFEST_PATH)]
        manifest = json.loads(package.read(manifest_name))
    assert manifest["format_version"] == 4
    assert manifest["torch_version"] == torch.__version__
    [delegate] = manifest["methods"]["forward"]["delegates"]
    assert delegate["target_device"] == "cpu"
    assert delegate["inputs"] == [{"dtype": "float32", "shape": [4, 16]}]
    assert delegate["outputs"] == [{"dtype": "float32", "shape": [4, 8]}]
    assert all(len(key) == 64 for key in manifest["blobs"])


class SizeOnlyPartitioner(aotstack.Partitioner):
    """Claims the ``sym_size`` nodes alone: a partition whose output is a size, not a tensor."""

    def partition(self, exported_program):
        tags = {}
        for node in aotstack.get_non_lowered_nodes(exported_program.graph):
            if node.target == torch.ops.aten.sym_size.int:
                node.meta["delegation_tag"] = "sizes"
                tags["sizes"] = aotstack.DelegationSpec(aotstack.AotiCpuBackend.backend_id, [])
        return aotstack.PartitionResult(exported_program, tags)


class Flatten(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1) * 2


def test_a_partition_that_cannot_be_a_delegate_names_method_partition_and_node():
    program = aotstack.export(
        Flatten(), {"forward": (torch.randn(4, 3, 2),)},
        dynamic_shapes={"forward": {"x": {0: torch.export.Dim("batch", min=2, max=16)}}},
    )
    with pytest.raises(aotstack.LoweringError) as raised:
        aotstack.lower(program, [SizeOnlyPartitioner()])
    message = str(raised.value)
    assert "method 'forward', partition 'sizes' (aoti_cpu)" in message
    assert "node 'sym_size_int" in message and "gives a SymInt to nodes outside its partition" in message


@dataclasses.dataclass
class Halves:
    """A model's output type of its own, registered with torch's pytree as transformers registers its outputs."""

    first: torch.Tensor
    second: torch.Tensor


class Halving(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Halves:
        return Halves(x[:2] * 2, x[2:] + 1)


def test_an_output_type_no_module_registered_here_names_the_module_to_import(tmp_path):
    def registered() -> None:
        torch.utils._pytree.register_dataclass(Halves, serialized_type_name="tests.test_errors.Halves")

    registered()
    try:
        program = aotstack.export(Halving(), {"forward": (torch.randn(4, 3),)})
        aotstack.lower(program, []).save(tmp_path / "halves.pt2")
    finally:
        torch.utils._pytree._deregister_pytree_node(Halves)
    # As in a process that has not imported the module (transformers, for its ModelOutput classes): aotstack
    # imports nothing a file names, so the user is told what to import.
    with pytest.raises(aotstack.PackageError,
                       match=r"outputs are a tests.test_errors.Halves, .* import tests.test_errors before"):
        aotstack.load(tmp_path / "halves.pt2")
    registered()
    try:
        assert isinstance(aotstack.load(tmp_path / "halves.pt2").forward(torch.randn(4, 3)), Halves)
    finally:
        torch.utils._pytree._deregister_pytree_node(Halves)
