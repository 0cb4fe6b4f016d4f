"""Graphs that the ONNX exporter or ONNX Runtime's optimizers used to get wrong, lowered through ONNX Runtime alone
and checked against eager PyTorch (both seen first in SAM's vision encoder and mask decoder)."""

from __future__ import annotations

import pytest
import torch

import aotstack

pytest.importorskip("onnxruntime")


class PermutedPositions(torch.nn.Module):
    """Patches permuted to channels-last, plus a position embedding, normalised through a residual linear, and
    permuted back: SAM's vision encoder's opening."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 32, 16, stride=16)
        self.positions = torch.nn.Parameter(torch.randn(1, 8, 8, 32))
        self.norm = torch.nn.LayerNorm(32)
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.patches(pixels).permute(0, 2, 3, 1) + self.positions
        return (hidden + self.linear(self.norm(hidden))).permute(0, 3, 1, 2)


class RepeatedPerPrompt(torch.nn.Module):
    """Each image's rows repeated once per prompt, their count known only when it runs: SAM's mask decoder."""

    def forward(self, images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        return images.repeat_interleave(prompts.shape[1], 0) * 2 + prompts.flatten(0, 1)[:, :1]


def loaded_through_onnx_runtime(model: torch.nn.Module, inputs: tuple, tmp_path, dynamic_shapes=None):
    program = aotstack.export(model, {"forward": inputs}, dynamic_shapes=dynamic_shapes)
    lowered = aotstack.lower(program, "onnxruntime")
    assert {delegate.backend_id for delegate in lowered.delegates("forward")} == {"onnxruntime"}
    lowered.save(tmp_path / "model.pt2")
    return aotstack.load(tmp_path / "model.pt2")


def test_a_constant_added_between_a_transpose_and_its_inverse_keeps_its_layout(tmp_path):
    """ONNX Runtime's transpose optimizer moved the transposes through the addition and ran the position embedding
    untransposed where the session shared it from the package ("broadcast an axis ... 8 by 32")."""
    torch.manual_seed(0)
    model = PermutedPositions().eval()
    pixels = torch.randn(2, 3, 128, 128)
    loaded = loaded_through_onnx_runtime(model, (pixels,), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward(pixels), model(pixels), rtol=1e-4, atol=1e-4)


def test_rows_repeated_by_a_count_known_when_it_runs_match_eager_at_every_count(tmp_path):
    """The exporter's translation put such a count on the wrong axis: every count but 1 failed ("invalid expand
    shape"), as did every batch but 1."""
    model = RepeatedPerPrompt()
    images, prompts = torch.randn(2, 4, 8), torch.randn(2, 3, 4, 8)
    batch, count = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("prompts", min=1, max=16)
    loaded = loaded_through_onnx_runtime(
        model, (images, prompts), tmp_path,
        dynamic_shapes={"forward": ({0: batch}, {0: batch, 1: count})},
    )
    generator = torch.Generator().manual_seed(1)
    for rows, prompts_each in ((2, 3), (3, 5), (1, 1), (4, 1), (1, 6)):
        images = torch.randn(rows, 4, 8, generator=generator)
        prompts = torch.randn(rows, prompts_each, 4, 8, generator=generator)
        torch.testing.assert_close(loaded.forward(images, prompts), model(images, prompts))
