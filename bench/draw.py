"""How long the graph picture takes: ``aotstack.report.graph.program_svg`` on a 500- and a 2000-node method.

The methods are synthetic run plans shaped like a transformer stack: per block a layer norm and a few
plain ATen ops on the residual stream, an attention delegate on the CPU reading a mask from the method's
first input (an edge spanning the whole picture), an MLP delegate on ``cuda:0`` between two host-device
copies, weights read throughout, and size ops fed by nothing drawn. Each figure is the median of 5 draws.

    .venv/bin/python bench/draw.py
"""

from __future__ import annotations

import statistics
import time

from aotstack.format.manifest import DelegateRecord, InputRecord, MethodRecord
from aotstack.format.plan import DelegateStep, InputStep, MethodPlan, OpStep, Ref, Step, WeightStep
from aotstack.format.records import TensorSpec
from aotstack.report.graph import program_svg
from common import Figure, Figures, Settings, run_standalone

DRAWS = 5
SIZES = (500, 2000)
NODES_PER_BLOCK = 9


def synthetic_method(nodes: int) -> MethodRecord:
    """A method whose picture has about ``nodes`` boxes."""
    spec = TensorSpec("float32", [8, 64])
    steps: list[Step] = [InputStep("x"), InputStep("mask")]
    delegates: list[DelegateRecord] = []
    weights = 0

    def op(name: str, target: str, *args: object) -> str:
        steps.append(OpStep(name, target, list(args), {}))
        return name

    def delegate(backend: str, device: str, ops: list[str], *inputs: str) -> str:
        delegate_id = f"forward.{len(delegates)}"
        output = f"getitem_{len(delegates)}"
        delegates.append(DelegateRecord(delegate_id, backend, device, [], ops, [spec] * len(inputs), [spec], "", {}))
        steps.append(DelegateStep(delegate_id, list(inputs), [(0, output)]))
        return output

    stream = "x"
    for block in range(max(1, nodes // NODES_PER_BLOCK)):
        weight = f"p_norm_{block}"
        steps.append(WeightStep(weight, f"layers.{block}.norm.weight"))
        weights += 1
        size = op(f"sym_size_{block}", "aten.sym_size.int", 8, 0)
        normed = op(f"norm_{block}", "aten.layer_norm.default", Ref(stream), [Ref(size), 64], Ref(weight))
        attended = delegate("aoti_cpu", "cpu", ["aten.mm.default", "aten.softmax.int"], normed, "mask")
        stream = op(f"add_{block}", "aten.add.Tensor", Ref(stream), Ref(attended))
        activated = op(f"gelu_{block}", "aten.gelu.default", Ref(stream))
        there = op(f"h2d_{block}", "aotstack.h2d_copy.default", Ref(activated), "cuda:0")
        mlp = delegate("aoti_cuda", "cuda:0", ["aten.addmm.default", "aten.silu.default"], there)
        back = op(f"d2h_{block}", "aotstack.d2h_copy.default", Ref(mlp))
        stream = op(f"add_mlp_{block}", "aten.add.Tensor", Ref(stream), Ref(back))
    plan = MethodPlan(steps, [Ref(stream)], [])
    inputs = [InputRecord("x", "tensor", "float32", [8, 64]), InputRecord("mask", "tensor", "bool", [8, 8])]
    return MethodRecord("", inputs, plan, "", "", {}, delegates)


def median_draw_ms(record: MethodRecord) -> tuple[float, int]:
    """Median milliseconds of ``DRAWS`` draws, and the document's size in bytes."""
    times, svg = [], ""
    for _ in range(DRAWS):
        started = time.perf_counter()
        svg = program_svg({"forward": record})
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), len(svg.encode())


def draw_times(settings: Settings) -> Figures:
    figures: Figures = {}
    for nodes in SIZES:
        milliseconds, size = median_draw_ms(synthetic_method(nodes))
        figures[f"draw a {nodes}-node method"] = Figure(
            milliseconds, "ms", note=f"median of {DRAWS}; the SVG is {size / 1e3:.0f} kB"
        )
    return figures


if __name__ == "__main__":
    run_standalone(__doc__, draw_times)
