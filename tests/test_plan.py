"""The run plan: plain ATen ops with lists, keywords, dtypes and infinities survive save and load."""

from __future__ import annotations

import sys

import torch

import aotstack


class PlainOps(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor):
        joined = torch.cat([x, y], dim=0)
        total = joined.sum(dim=[0], keepdim=True, dtype=torch.float64)
        capped = torch.full((2, 3), float("inf")).clamp(max=1.0)
        return total, {"capped": capped, "mean": x.contiguous(memory_format=torch.contiguous_format).mean()}


def test_a_method_with_no_delegates_runs_from_its_plan(tmp_path):
    x, y = torch.randn(2, 3), torch.randn(4, 3)
    lowered = aotstack.lower(aotstack.export(PlainOps(), {"forward": (x, y)}), [])
    lowered.save(tmp_path / "plain.pt2")

    result = aotstack.load(tmp_path / "plain.pt2").forward(x, y)

    expected = PlainOps()(x, y)
    torch.testing.assert_close(result[0], expected[0])
    assert result[0].dtype == torch.float64
    torch.testing.assert_close(result[1]["capped"], expected[1]["capped"])
    torch.testing.assert_close(result[1]["mean"], expected[1]["mean"])


def test_loading_does_not_import_the_export_deserializer(lowered_package):
    import subprocess

    _, path = lowered_package("linear")
    probe = (
        "import sys, torch, aotstack\n"
        f"aotstack.load({str(path)!r}).forward(torch.randn(4, 16))\n"
        "print('torch._export.serde.serialize' in sys.modules)\n"
    )
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "False"
