"""The dry run: partition every method as ``lower`` would, compile nothing, and report what a compile would do."""

from __future__ import annotations

from ..errors import LoweringError
from ..report.model import Report
from .auto import auto_option
from .engines import named_plan
from .export import Program
from .lower import MethodOption, PartitionerPlan, check_lower_options, planned_lowering


def explain(
    program: Program,
    partitioners: PartitionerPlan | str,
    *,
    skip_h2d_for_method_inputs: MethodOption = False,
    skip_d2h_for_method_outputs: MethodOption = False,
) -> Report:
    """What ``lower(program, partitioners)`` would do, in seconds: which engine takes which ops, and why not.

    Every partitioner claims its parts as in ``lower``, and each claimed part stands in for its
    delegate, so later partitioners see what they would see; nothing is compiled (no C++
    compiler, no ONNX export). The report shows each part's ops, shapes and weights, with no
    code size or compile time.

    Example::

        print(aotstack.explain(program, [aotstack.OrtPartitioner(), aotstack.AotiCpuPartitioner()]))
    """
    check_lower_options(skip_h2d_for_method_inputs, skip_d2h_for_method_outputs, "raise")
    partitioners = named_plan(partitioners)
    if auto_option(partitioners) is not None:
        raise LoweringError(
            "explain is a dry run and compiles nothing, but auto chooses engines by timing compiled parts; "
            "pass the partitioners to explain, or lower with 'auto' and read lowered.report()"
        )
    return planned_lowering(
        program,
        partitioners,
        skip_h2d_for_method_inputs=skip_h2d_for_method_inputs,
        skip_d2h_for_method_outputs=skip_d2h_for_method_outputs,
    ).report()
