"""Every kind of program state, attention's layouts, and dynamic sizes across delegate boundaries."""

from __future__ import annotations

import torch
from torch.export import Dim

import aotstack
from aotstack.format.archive import read_manifest
from tests import models
from tests.conftest import assert_matches_eager, run_child, run_in_fresh_process


def test_attention_then_reshape_with_an_op_excluded_matches_eager(lowered_package):
    lowered, path = lowered_package("attention_block", exclude_ops=("aten.gelu",))

    delegates = lowered.delegates("forward")
    assert len(delegates) == 2
    assert any("aten.scaled_dot_product_attention.default" in d.ops for d in delegates)
    assert_matches_eager(run_in_fresh_process(path, "forward", "attention_block"), "attention_block")


CALL_THREE_TIMES = """
import json, sys
import aotstack
from tests import models

loaded = aotstack.load(sys.argv[1])
x, = models.example_inputs("state_kinds")
outputs = [loaded.forward(x).tolist() for _ in range(3)]
loaded.reset()
outputs.append(loaded.forward(x).tolist())
print(json.dumps(outputs))
"""


def test_every_kind_of_state_goes_with_its_partition_and_comes_back_at_load(lowered_package):
    lowered, path = lowered_package("state_kinds", exclude_ops=("aten.sigmoid",))
    assert len(lowered.delegates("forward")) == 2

    model, (x,) = models.build("state_kinds"), models.example_inputs("state_kinds")
    with torch.no_grad():
        expected = [model(x) for _ in range(3)]
    got = [torch.tensor(values) for values in run_child(CALL_THREE_TIMES, str(path))]
    for have, want in zip(got, expected + expected[:1], strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)

    manifest = read_manifest(path)
    method = manifest.methods["forward"]
    delegated = {
        local.removeprefix("weight:") for d in method.delegates for local in d.named_data if "weight:" in local
    }
    assert {"linear.weight", "offset", "scale", "positions"} <= delegated | set(method.weights)
    assert "calls" in method.weights, "a mutated buffer's state stays in the method"


class TransposedInput(torch.nn.Module):
    """A non-contiguous tensor with a dynamic size, made by plain ATen, read by a delegate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.transpose(1, 2)).cumsum(dim=-1) * 2


def test_a_non_contiguous_dynamic_input_reaches_a_delegate_intact(tmp_path):
    length = Dim("length", min=2, max=64)
    program = aotstack.export(
        TransposedInput(), {"forward": (torch.randn(2, 5, 3),)}, dynamic_shapes={"forward": {"x": {1: length}}}
    )
    lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner(exclude_ops=["aten.transpose"])])
    assert len(lowered.delegates("forward")) == 1
    lowered.save(tmp_path / "transposed.pt2")
    loaded = aotstack.load(tmp_path / "transposed.pt2")
    for size in (2, 7, 64):
        x = torch.randn(2, size, 3)
        torch.testing.assert_close(loaded.forward(x), TransposedInput()(x))
    [record] = read_manifest(tmp_path / "transposed.pt2").methods["forward"].inputs
    assert record.shape[1].min == 2 and record.shape[1].max == 64
