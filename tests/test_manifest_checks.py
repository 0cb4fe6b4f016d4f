"""A manifest is checked field by field before anything uses it; each refusal names what is wrong."""

from __future__ import annotations

import pytest

import aotstack
from tests import models, tamper


@pytest.fixture(scope="module")
def plain_package(tmp_path_factory):
    """The linear model with nothing compiled: its weights are the method's own."""
    path = tmp_path_factory.mktemp("plain") / "plain.pt2"
    program = aotstack.export(models.build("linear"), {"forward": models.example_inputs("linear")})
    aotstack.lower(program, []).save(path)
    return path


def first_method(manifest):
    return manifest["methods"]["forward"]


def loosen_weight(manifest):
    weight = next(iter(first_method(manifest)["weights"].values()))
    weight["shape"] = [dim * 1000 for dim in weight["shape"]]


def read_before_computed(manifest):
    steps = first_method(manifest)["plan"]["steps"]
    steps.insert(0, steps.pop())


def unknown_delegate(manifest):
    for step in first_method(manifest)["plan"]["steps"]:
        if step["kind"] == "delegate":
            step["delegate"] = "forward.99"


def delegate_output_out_of_range(manifest):
    for step in first_method(manifest)["plan"]["steps"]:
        if step["kind"] == "delegate":
            step["outputs"][0][0] = 7


def blob_key_with_a_path(manifest):
    delegate = first_method(manifest)["delegates"][0]
    delegate["named_data"]["model.so"] = "../../" + "0" * 58


def huge_symbolic_range(manifest):
    first_method(manifest)["inputs"][0]["shape"][0] = {"symbol": "s0", "min": 5, "max": 2}


def guard_calling_code(manifest):
    first_method(manifest)["guards"] = ["__import__('os').getcwd() == 0"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (loosen_weight, r"weight '[\w.]+' is float32\[.*\], \d+ bytes, but its blob holds \d+"),
        (read_before_computed, r"reads '\w+' before any step computes it"),
        (unknown_delegate, r"calls delegate 'forward.99', which the method lacks"),
        (delegate_output_out_of_range, r"reads output 7 of delegate forward.\d, which has 1"),
        (blob_key_with_a_path, r"named_data must map names to blob keys"),
        (huge_symbolic_range, r"range must be sizes with min <= max"),
        (guard_calling_code, r"method 'forward': size guard term .*getcwd.*: found Call; a size guard compares"),
    ],
)
def test_a_resealed_manifest_with_a_bad_field_is_refused_naming_it(
    lowered_package, plain_package, tmp_path, edit, message
):
    source = plain_package if edit is loosen_weight else lowered_package("split", exclude_ops=("aten.sigmoid",))[1]
    with pytest.raises(aotstack.PackageError, match=message):
        aotstack.load(tamper.manifest_edited(source, tmp_path / "edited.pt2", edit))


def test_a_step_that_fails_while_running_is_named(lowered_package, tmp_path):
    def extra_argument(manifest):
        step = tamper.op_steps(manifest)[0]
        step["args"]["list"].append(3)

    source = lowered_package("split", exclude_ops=("aten.sigmoid",))[1]
    loaded = aotstack.load(tamper.manifest_edited(source, tmp_path / "edited.pt2", extra_argument))
    with pytest.raises(aotstack.RunError, match=r"step 'sigmoid\w*' \(aten.sigmoid.default\) failed: "):
        loaded.forward(*models.example_inputs("split"))
