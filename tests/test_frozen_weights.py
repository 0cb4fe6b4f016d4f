"""AOTInductor's frozen weights (compile spec ``freeze_weights``): Inductor folds and prepacks them into the library.

Frozen, a convolution runs oneDNN's kernel on a weight packed once at compile time, where the
default calls ATen's convolution, which reorders its weight at every call (ResNet-50 here: 1.7x
faster frozen). The library then holds every weight of its partition, and the file none apart.
"""

from __future__ import annotations

import pytest
import torch

import aotstack
from aotstack import CompileSpec
from aotstack.compile.auto import frozen_plans
from aotstack.format.archive import read_manifest
from aotstack.format.placement import Candidate
from aotstack.format.tensor_data import WEIGHT_PREFIX
from tests import models
from tests.conftest import assert_matches_eager, run_in_fresh_process

FROZEN = [CompileSpec("freeze_weights", b"ON")]


@pytest.fixture(scope="module")
def frozen_conv_net(tmp_path_factory):
    program = aotstack.export(models.build("conv_net"), {"forward": models.example_inputs("conv_net")})
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner(compile_specs=FROZEN)])
    path = tmp_path_factory.mktemp("frozen") / "conv_net.pt2"
    lowered.save(str(path))
    return lowered, path


@pytest.mark.parametrize(
    ("specs", "frozen"), [([], False), (FROZEN, True), ([CompileSpec("freeze_weights", b"off")], False)]
)
def test_freezing_is_a_compile_spec_off_by_default_that_puts_the_weights_in_the_library(specs, frozen):
    options = aotstack.AotiCpuBackend().compile_options(specs)

    # Both set either way, so that TORCHINDUCTOR_FREEZING cannot leave a library asking for weights no file holds.
    assert options["freezing"] is frozen
    assert options["aot_inductor.package_constants_in_so"] is frozen


def test_a_freeze_weights_value_other_than_on_or_off_is_refused_naming_it():
    with pytest.raises(aotstack.CompileSpecError, match="compile spec 'freeze_weights' must be ON or OFF, got b'yes'"):
        aotstack.AotiCpuPartitioner(compile_specs=[CompileSpec("freeze_weights", b"yes")])


def test_a_frozen_convolutional_network_runs_prepacked_convolutions_from_its_library(frozen_conv_net):
    lowered, path = frozen_conv_net
    [delegate] = lowered.delegates("forward")

    assert b"mkldnn__convolution_pointwise" in bytes(delegate.named_data["model.so"])
    [stored] = read_manifest(str(path)).methods["forward"].delegates
    assert not [name for name in stored.named_data if name.startswith(WEIGHT_PREFIX)]


def test_a_frozen_convolutional_network_matches_eager_in_another_process(frozen_conv_net):
    _, path = frozen_conv_net

    assert_matches_eager(run_in_fresh_process(path, "forward", "conv_net"), "conv_net")


def test_auto_times_a_convolutional_method_frozen_too_and_its_file_holds_the_weights_where_the_plan_has_them(
    tmp_path,
):
    program = aotstack.export(models.build("conv_net"), {"forward": models.example_inputs("conv_net")})

    lowered = aotstack.lower(program, aotstack.Auto(engines=[]), progress=False)

    chosen = lowered.placements["forward"].selection
    assert [c.engines for c in chosen.candidates] == [["aoti_cpu"], ["aoti_cpu (frozen)"]]
    assert all(c.seconds is not None for c in chosen.candidates)
    assert "with the weights frozen into its library" in chosen.reason
    [delegate] = lowered.delegates("forward")
    weights = [name for name in delegate.named_data if name.startswith(WEIGHT_PREFIX)]
    assert (not weights) is (chosen.chosen == 1)
    lowered.save(str(tmp_path / "auto.pt2"))
    assert_matches_eager(run_in_fresh_process(tmp_path / "auto.pt2", "forward", "conv_net"), "conv_net")


class PatchEmbedding(torch.nn.Module):
    """A ViT's shape of work: one patch convolution, then linears that do most of the arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 64, kernel_size=8, stride=8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.patches(image).flatten(2).transpose(1, 2))


def measured(alone: float | None, other: float) -> dict:
    """AOTInductor alone and another plan, each taking the seconds given."""
    return {("aoti_cpu",): (Candidate(["aoti_cpu"], alone), {}, []),
            ("onnxruntime", "aoti_cpu"): (Candidate(["onnxruntime", "aoti_cpu"], other), {}, [])}


@pytest.mark.parametrize(
    ("model", "image", "device", "seconds", "planned"),
    [
        (models.ConvNet, (1, 3, 16, 16), "cpu", (0.017, 0.010), True),
        (PatchEmbedding, (1, 3, 32, 32), "cpu", (0.010, 0.010), False),
        (models.ConvNet, (1, 3, 16, 16), "cuda", (0.010, 0.010), False),
        (models.ConvNet, (1, 3, 16, 16), "cpu", (None, 0.010), False),
        (models.ConvNet, (1, 3, 16, 16), "cpu", (0.019, 0.010), False),
    ],
    ids=["convolutions do most of the work", "one patch convolution", "not the cpu", "aoti alone failed",
         "aoti alone too slow for freezing to win"],
)
def test_auto_compiles_a_method_frozen_too_only_where_convolutions_do_most_of_its_work_on_the_cpu(
    model, image, device, seconds, planned
):
    method = torch.export.export(model().eval(), (torch.randn(image),))
    built: list[dict] = []

    def partitioners(**options):
        built.append(options)
        return []

    plans = frozen_plans(measured(*seconds), "aoti_cpu", method, device, {("aoti_cpu",): partitioners},
                         {("aoti_cpu",): "key"})

    assert [plan.label for plan in plans] == ([("aoti_cpu (frozen)",)] if planned else [])
    for plan in plans:
        plan.partitioners()
    assert built == ([{"frozen": True}] if planned else [])


def test_a_part_that_updates_a_buffer_is_not_frozen_and_the_error_names_the_buffer():
    program = aotstack.export(models.build("buffer"), {"forward": models.example_inputs("buffer")})

    with pytest.raises(aotstack.LoweringError, match=r"updates buffers \(running\), which cannot be frozen"):
        aotstack.lower(program, [aotstack.AotiCpuPartitioner(compile_specs=FROZEN)], progress=False)
