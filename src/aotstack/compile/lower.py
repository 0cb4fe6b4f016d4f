"""Lowering: partition each method, compile each tagged part, splice in delegate calls."""

from __future__ import annotations

import copy
import logging
import os
from collections import Counter
from collections.abc import Callable, Collection, Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal, TypeVar, get_args

import torch
from torch.export import ExportedProgram
from torch.fx.passes.utils.fuser_utils import validate_partition

from ..engine.registry import backend_class
from ..errors import (
    CheckError,
    CompileSpecError,
    EngineCrashError,
    LoweringError,
    MissingFallbackKernelsError,
)
from ..format.custom_ops import is_custom_op_name
from ..format.op_names import op_name
from ..format.ops import is_delegate_call
from ..format.placement import Candidate, DelegatePlacement, Placement, Reason, Selection, UnclaimedOp
from ..format.plan import runs_as_plain_op
from ..format.records import Delegate, TensorSpec
from ..format.specs import CompileSpec, DelegationSpec, PreprocessResult, SpecKey
from ..format.tensor_data import WEIGHT_PREFIX, weights_as_named_data
from ..report.model import Report, program_report
from .auto import (
    CONFIRMING_ROUNDS,
    SAME_AS_ALONE,
    AddedPlan,
    Auto,
    Measurement,
    Plan,
    TimingInputs,
    auto_option,
    cached_gain_refusal,
    cached_measurement,
    cached_plain_op_seconds,
    candidate_plans,
    closing_gain_refusal,
    closing_refusal,
    contenders,
    failed_candidate,
    frozen_plans,
    measured_candidate,
    measurement_key,
    median_key,
    mix_key,
    mix_partitioners,
    one_thread_base,
    one_thread_plans,
    opening_plan,
    plan_partitioners,
    plan_text,
    selection,
    store_gain_refusal,
    store_measurement,
    takes_nothing,
    timing_inputs,
)
from .check import Check, CheckResult, check_lowered, check_option
from .constants import without_unused_constants
from .devices import propagate_device_pass
from .engines import named_plan
from .export import Program
from .input_sizes import sizes_read_from_inputs
from .jobs import CompileJob, CompileOutcome
from .measure import CallInputs, MethodTiming, SavedPrograms, measured_methods
from .mixing import MeasuredPlan, Mix, delegate_regions, mixed_cover
from .package import save, unsaved_manifest
from .parallel import Batch, CompilePool, default_workers, quiet_torch_warnings
from .partitioner import DELEGATION_TAG, Partitioner, PartitionResult, get_non_lowered_nodes
from .program_parts import (
    called_ops,
    constant_placeholders,
    drop_metadata_checks,
    is_size_computation,
    mark_state_of_other_methods,
    program_fingerprint,
    program_weights,
    unbacked_sizes_left_behind_dropped,
)
from .progress import Progress, progress_for
from .quantize import quantized_layers
from .splice import (
    clear_tags,
    drop_buffer_mutations,
    drop_unused_size_computations,
    drop_unused_subgraphs,
    splice_delegate_call,
)
from .subprogram import PartitionProgram, partition_program, views_as_reshapes
from .work import node_work


@dataclass(frozen=True)
class CompileFailure:
    """A partition whose compile failed and that ``on_compile_error="fallback"`` left undelegated.

    Its nodes stayed in the method for the partitioners after the one that claimed it, and
    otherwise run as plain ATen ops; this record is how a caller learns the method got slower.
    """

    method: str
    backend_id: str
    # The partitioner's tag for the partition, e.g. ``aoti_cpu_0``.
    partition: str
    # Op names such as ``aten.relu.default``, sorted, each once.
    ops: tuple[str, ...]
    # ``RuntimeError: ...``: the exception the backend's ``preprocess`` raised.
    error: str


@dataclass(frozen=True)
class CompileRecord:
    """How one partition's compile went: where it ran, how long it took, what became of it."""

    method: str
    partition: str
    backend_id: str
    # ``compiled``, ``cached`` (from a compile cache, or shared with an identical partition) or ``failed``.
    state: str
    seconds: float
    # The delegate it became; None where its compile failed.
    delegate_id: str | None = None
    # The worker process that compiled it; None where it compiled in the lowering process.
    worker: int | None = None
    # ``method/partition`` of the identical partition whose compile it shares.
    same_as: str | None = None


@dataclass
class LoweredProgram:
    """Every method lowered, with the delegates their graphs call.

    ``compile_failures`` lists, per method, the partitions left to plain ATen because their
    compile failed under ``on_compile_error="fallback"`` (an empty list where none did);
    ``compile_log`` records, per method, every partition's compile in lowering order.
    """

    methods: dict[str, ExportedProgram]
    delegate_table: dict[str, list[Delegate]]
    compile_failures: dict[str, list[CompileFailure]] = field(default_factory=dict)
    compile_log: dict[str, list[CompileRecord]] = field(default_factory=dict)
    # Per method, each delegate's partition as a standalone program of the eager ops it replaced;
    # kept only for ``lower(..., check="partition")``.
    references: dict[str, dict[str, ExportedProgram]] = field(default_factory=dict, repr=False)
    # What ``lower(..., check=...)`` measured; None where nothing was checked.
    check_result: CheckResult | None = None
    # Per method, where each op went and why (what ``report()`` shows, saved with the file).
    placements: dict[str, Placement] = field(default_factory=dict, repr=False)
    # A dry run's result (``aotstack.explain``): partitioned, nothing compiled, nothing to save.
    planned: bool = False

    def delegates(self, method: str) -> list[Delegate]:
        """The delegates of ``method``, in lowering order: partitioner by partitioner, each in graph order."""
        if method not in self.delegate_table:
            raise LoweringError(f"no method {method!r}; methods: {sorted(self.delegate_table)}")
        return list(self.delegate_table[method])

    def save(self, path: str) -> None:
        """Write every method, compiled part and weight into one ``.pt2`` file."""
        if self.planned:
            raise LoweringError("a dry run (aotstack.explain) compiles nothing, so there is nothing to save; "
                                "lower the program with aotstack.lower to save it")
        save(self.methods, self.delegate_table, path, self.placements)

    def report(self) -> Report:
        """What went where and why: per method, each engine's share, each delegate, each op left to plain ATen.

        Print it for a table, ``report().to_json()`` for data; in a notebook it shows as HTML.
        """
        manifest = unsaved_manifest(self.methods, self.delegate_table, self.placements)
        check = None if self.check_result is None else self.check_result.to_json()
        return program_report(manifest, planned=self.planned, check=check)

    def draw(self, path: str | os.PathLike[str]) -> None:
        """Draw every method's graph into the SVG file ``path``: delegates as boxes coloured by engine."""
        report = self.report()
        with open(path, "w", encoding="utf-8") as file:
            file.write(report.svg())

    def _repr_html_(self) -> str:
        return self.report()._repr_html_()


logger = logging.getLogger("aotstack")

PartitionerPlan = Sequence[Partitioner] | Mapping[str, Sequence[Partitioner]]


MethodOption = bool | Collection[str]

OnCompileError = Literal["raise", "fallback"]
ON_COMPILE_ERROR: tuple[str, ...] = get_args(OnCompileError)

# How many op names an error message lists before it says how many more there are.
OPS_IN_MESSAGE = 8


def lower(
    program: Program,
    partitioners: PartitionerPlan | str | Auto = "auto",
    *,
    skip_h2d_for_method_inputs: MethodOption = False,
    skip_d2h_for_method_outputs: MethodOption = False,
    on_compile_error: OnCompileError = "raise",
    jobs: int | None = None,
    progress: bool | Progress | None = None,
    check: bool | str | Check | None = False,
) -> LoweredProgram:
    """Apply ``partitioners``, in order, to every method and compile what they claim.

    ``"auto"`` (the default) lets every installed engine propose its parts and keeps, per
    method, the plan that runs fastest on the example inputs (see ``compile/auto.py``; an
    ``Auto`` picks the device and engines); ``LoweredProgram.report()`` shows what it measured.
    Engine names in claiming order, as the command line takes them, name a plan of their
    default partitioners: ``lower(program, "ort,aoti")``.

    Then every boundary tensor is given a device, with host-device copies where a delegate runs
    elsewhere. The two ``skip_*`` options (True, or the names of the methods they apply to) keep
    a method's inputs or outputs on the device instead of copying them.

    The partitions one partitioner claims, in every method, compile at once in up to ``jobs``
    worker processes (default: one per core; ``jobs=1`` compiles one at a time); identical
    partitions compile once. An engine that crashes in a worker raises ``EngineCrashError``
    naming it, the partition and the signal; this process goes on. ``progress`` shows each compile as it runs: a
    live table when standard error is a terminal (the default, None), log lines otherwise;
    True always draws the table, False never.

    When a backend fails to compile a partition, ``on_compile_error="raise"`` (the default)
    raises ``LoweringError`` naming the method, the partition and its ops, and stops the other
    compiles. ``"fallback"`` leaves that partition's nodes in the method instead, for the later
    partitioners or plain ATen, logs a warning and records it in
    ``LoweredProgram.compile_failures``: one unsupported corner of a model then costs speed,
    not the whole package.

    ``check=True`` then runs every method on its example inputs, eagerly and from the lowered
    program saved and loaded as a user would, and raises ``CheckError`` naming each output
    further apart than the tolerance; ``check="partition"`` also compares each delegate's
    outputs with the eager ops it replaced; ``check=aotstack.Check(atol=..., rtol=...)`` sets
    the tolerance. ``LoweredProgram.check_result`` holds what was measured.

    Example::

        lowered = aotstack.lower(program, [aotstack.AotiCpuPartitioner()], jobs=2)
        lowered.save("model.pt2")
    """
    check_lower_options(skip_h2d_for_method_inputs, skip_d2h_for_method_outputs, on_compile_error)
    workers = checked_jobs(jobs)
    checking = check_option(check)
    partitioners = named_plan(partitioners)
    auto = auto_option(partitioners)
    with progress_for(progress) as shown:
        lower_plan = PlanLowering(
            workers,
            shown,
            on_compile_error,
            skip_h2d_for_method_inputs,
            skip_d2h_for_method_outputs,
            keep_references=checking is not None and checking.partition,
        )
        if auto is None:
            lowered = lower_plan(program, partitioners)  # type: ignore[arg-type]
        else:
            lowered = auto_lowered(program, auto, lower_plan)
    if checking is not None:
        lowered.check_result = check_lowered(
            program, lowered.methods, lowered.delegate_table, lowered.references, checking
        )
        if not lowered.check_result.passed:
            raise CheckError(lowered.check_result.failure_message(), lowered.check_result, lowered)
    return lowered


def auto_lowered(program: Program, auto: Auto, lower_plan: PlanLowering) -> LoweredProgram:
    """Every candidate plan lowered and measured (or its figures read from the cache), the fastest kept per method.

    A plan that cannot be lowered (a part failed to compile, under ``on_compile_error="raise"``)
    or run is reported in the selection, not raised, unless no plan works for a method. The plans
    lower together, so one plan's parts compile while the next is partitioned; then each is
    timed, with no compile running beside it. Then, per method, the plans' regions propose one
    mixed plan (``mixing.py``), measured like the others.
    """
    with SavedPrograms() as saved:
        return measured_lowering(program, auto, lower_plan, saved)


def measured_lowering(program: Program, auto: Auto, lower_plan: PlanLowering, saved: SavedPrograms) -> LoweredProgram:
    """``auto_lowered``'s work, each plan's file kept in ``saved`` for its timings."""
    # Timing loads each plan in a child already: an engine crashing as it opens drops that plan.
    lower_plan = replace(lower_plan, open_once=False)
    threads = torch.get_num_threads()
    plans = candidate_plans(auto)
    inputs = timing_inputs(program.methods, auto)
    fingerprints = {name: program_fingerprint(exported) for name, exported in program.methods.items()}
    keys = {
        (name, plan): measurement_key(fingerprints[name], inputs[name], plan, threads)
        for name in program.methods
        for plan in plans
    }
    # (method, plan) -> its measurement, or SAME_AS_ALONE; absent where neither is known yet.
    measured = {pair: entry for pair, key in keys.items() if (entry := cached_measurement(key, pair[1])) is not None}
    # (method, plan) -> the measurement of the plan's opening engine alone, where it leaves ops to the closing one.
    opening_keys = {
        (name, plan): measurement_key(fingerprints[name], inputs[name], opening_plan(plan), threads)
        for name, plan in keys if len(plan) > 1
    }
    opened = {
        pair: entry for pair, key in opening_keys.items()
        if pair not in measured and isinstance(entry := cached_measurement(key, opening_plan(pair[1])), tuple)
    }
    # (method, plan) -> the seconds each plain ATen op took a call in the timing of the plan's opening engine alone.
    opened_ops = {pair: ops for pair in opened if (ops := cached_plain_op_seconds(opening_keys[pair])) is not None}
    # (method, plan) -> why an earlier lowering kept the plan's opening engine alone (``closing_gain_refusal``).
    gain_refused = {pair: why for pair in opened if (why := cached_gain_refusal(keys[pair])) is not None}
    known = measured.keys() | opened.keys()
    unmeasured = [plan for plan in plans if not all((name, plan) in known for name in program.methods)]
    lowerings = lower_plan.together(opening_lowerings(program, unmeasured, auto.device))
    # (method, plan) -> the plan's lowering timed now.
    lowered_by: dict[tuple[str, Plan], LoweredProgram] = {}

    def keep_whole(name: str, plan: Plan, lowered: LoweredProgram, timings: Mapping[str, MethodTiming]) -> None:
        """Keep method ``name``'s timing of ``plan`` lowered whole, or that it is AOTInductor alone there."""
        if name not in timings:
            measured[name, plan] = SAME_AS_ALONE
        else:
            measured[name, plan] = plan_measurement(plan, lowered.delegate_table[name], timings[name])
            lowered_by[name, plan] = lowered
            logger.info("auto: %s: %s takes %.3g ms a call", name, plan_text(plan), timings[name].seconds * 1e3)
        store_measurement(keys[name, plan], measured[name, plan])

    for plan in unmeasured:
        lowered = lowerings[plan]
        try:
            if isinstance(lowered, Exception):
                raise lowered
            timings = measured_plan(program, plan, lowered, inputs, saved)
        except Exception as error:  # noqa: BLE001 - a plan that fails is one the report names, not the end of auto
            if len(plan) > 1 and not isinstance(lowered, Exception):
                # Lowered whole below: the closing engine takes what its opening one left and could not run as is.
                failed = failed_candidate(opening_plan(plan), error)
                opened.update({(name, plan): (failed, {}, []) for name in program.methods})
                continue
            failed = failed_candidate(plan, error)
            logger.warning("auto: %s could not be lowered or run: %s", plan_text(plan), failed.error)
            for name in program.methods:
                measured[name, plan] = (failed, {}, [])
            continue
        for name in program.methods:
            if name not in timings or len(plan) == 1 or not lowered.placements[name].unclaimed:
                keep_whole(name, plan, lowered, timings)
            else:
                opening = opening_plan(plan)
                opened[name, plan] = plan_measurement(opening, lowered.delegate_table[name], timings[name])
                opened_ops[name, plan] = timings[name].plain_op_seconds
                logger.info("auto: %s: %s takes %.3g ms a call, the ops it leaves run as plain ATen", name,
                            plan_text(opening), timings[name].seconds * 1e3)
                store_measurement(opening_keys[name, plan], opened[name, plan], opened_ops[name, plan])
    # Per method, the plans not lowered whole (``closing_refusal``), each as its opening engine measured, and why;
    # the other plans whose opening engine left ops are lowered whole now, together, but where the ops their
    # closing engine would take cost too little to be worth its compiles (``closing_gain_refusal``): there the
    # opening engine alone is the plan, as it measured.
    refused: dict[str, list[tuple[Candidate, str]]] = {name: [] for name in program.methods}
    within: dict[Plan, list[str]] = {}
    for (name, plan), entry in opened.items():
        if (name, plan) in measured:
            continue
        measured_whole = {p: m for p in plans if isinstance(m := measured.get((name, p)), tuple)}
        refusal = closing_refusal(plan, entry, measured_whole)
        if refusal is None:
            within.setdefault(plan, []).append(name)
        else:
            logger.info("auto: %s: %s", name, refusal)
            refused[name].append((entry[0], refusal))
    # Per method, the plans kept as their opening engine alone, and why.
    alone: dict[str, list[tuple[Plan, str]]] = {name: [] for name in program.methods}
    whole: dict[Plan, list[str]] = {}
    built = {plan: plan_partitioners(plan, auto.device) for plan in within}
    for plan, names in within.items():
        undecided = [name for name in names if (name, plan) not in gain_refused]
        taken = closing_nodes(program.only(undecided), plan, built[plan], lower_plan) if undecided else {}
        for name in names:
            why = gain_refused.get((name, plan)) or closing_gain_refusal(
                plan, opened[name, plan], taken.get(name), opened_ops.get((name, plan)),
                compiled_calls_aten_kernel(built[plan][-1], program.methods[name]),
            )
            if why is None:
                whole.setdefault(plan, []).append(name)
                continue
            logger.info("auto: %s: %s", name, why)
            if (name, plan) not in gain_refused:
                store_gain_refusal(keys[name, plan], why)
            opening = opening_plan(plan)
            alone[name].append((plan, why))
            keys[name, opening] = opening_keys[name, plan]
            if isinstance(lowerings.get(plan), LoweredProgram):
                lowered_by[name, opening] = lowerings[plan]
    closed = lower_plan.together({plan: (program.only(names), built[plan]) for plan, names in whole.items()})
    for plan, names in whole.items():
        lowered = closed[plan]
        try:
            if isinstance(lowered, Exception):
                raise lowered
            timings = measured_plan(program.only(names), plan, lowered, inputs, saved)
        except Exception as error:  # noqa: BLE001 - as above
            failed = failed_candidate(plan, error)
            logger.warning("auto: %s could not be lowered or run: %s", plan_text(plan), failed.error)
            measured.update({(name, plan): (failed, {}, []) for name in names})
            continue
        for name in names:
            keep_whole(name, plan, lowered, timings)
    # Per method, the plans that differ from AOTInductor alone there, with what each measured.
    listed: dict[str, dict[Plan, Measurement]] = {
        name: {plan: entry for plan in plans if isinstance(entry := measured.get((name, plan)), tuple)}
        for name in program.methods
    }
    for name, kept_alone in alone.items():
        listed[name].update({opening_plan(plan): opened[name, plan] for plan, _ in kept_alone})
    closing = plans[0][0]
    # Per method, the plans built from what its plans measured (``AddedPlan``), and those lowered now.
    added: dict[str, dict[Plan, AddedPlan]] = {name: {} for name in program.methods}
    added_lowerings: dict[tuple[str, Plan], LoweredProgram] = {}
    # Per method, why the mix its plans' regions propose was not measured, where it was not.
    unmeasured_mixes: dict[str, list[str]] = {name: [] for name in program.methods}
    for name in program.methods:
        builds: dict[Plan, Callable[..., list[Partitioner]]] = {
            plan: partial(plan_partitioners, plan, auto.device) for plan in listed[name]
        }
        keys_by_plan = {plan: keys[name, plan] for plan in listed[name]}
        mix = method_mix(listed[name], closing)
        if mix is not None and not mix.worth_measuring:
            unmeasured_mixes[name].append(mix.refusal())
            logger.info("auto: %s: %s", name, unmeasured_mixes[name][-1])
        elif mix is not None:
            label = tuple(mix.labels)
            logger.info("auto: %s: the plans' regions propose %s (%s)", name, plan_text(label), mix.explanation())
            builds[label] = partial(mix_partitioners, mix, auto.device)
            keys_by_plan[label] = mix_key(fingerprints[name], inputs[name], mix, threads)
            mixed = AddedPlan(label, builds[label], keys_by_plan[label], mix.explanation())
            measure_added(program.only([name]), name, inputs[name].call, mixed, lower_plan, listed, added,
                          added_lowerings, saved)
        for frozen in frozen_plans(listed[name], closing, program.methods[name], auto.device, builds, keys_by_plan):
            logger.info("auto: %s: %s is measured too", name, plan_text(frozen.label))
            measure_added(program.only([name]), name, inputs[name].call, frozen, lower_plan, listed, added,
                          added_lowerings, saved)
        base = one_thread_base(listed[name], closing, threads, auto.device,
                               {plan: entry for (method, plan), entry in opened.items() if method == name})
        for one_thread in one_thread_plans(base, builds[base], keys_by_plan[base]) if base is not None else []:
            logger.info("auto: %s: %s is measured too", name, plan_text(one_thread.label))
            measure_added(program.only([name]), name, inputs[name].call, one_thread, lower_plan, listed, added,
                          added_lowerings, saved)
    for name in program.methods:
        # A plan measured by an earlier lowering is chosen among by its median, where it was confirmed.
        earlier = {plan: keys[name, plan] for plan in listed[name]
                   if (name, plan) in keys and (name, plan) not in lowered_by}
        earlier.update({label: extra.key for label, extra in added[name].items()
                        if (name, label) not in added_lowerings})
        for plan, key in earlier.items():
            if isinstance(median := cached_measurement(median_key(key), plan), tuple):
                listed[name][plan] = median
    selections = {
        name: selection(name, [candidate for candidate, _, _ in entries.values()], threads)
        for name, entries in listed.items()
    }
    for name, kept in selections.items():
        # Each plan measured now: its lowering and its measurement's cache key.
        sources = {plan: (lowered_by[name, plan], keys[name, plan]) for plan in listed[name]
                   if (name, plan) in lowered_by}
        sources.update({
            label: (added_lowerings[name, label], extra.key)
            for label, extra in added[name].items() if (name, label) in added_lowerings
        })
        selections[name] = confirmed_selection(name, inputs[name].call, kept, listed[name], sources, threads, saved)
    chosen = {name: list(listed[name])[kept.chosen] for name, kept in selections.items()}
    by_method = {name: lowered_by[name, plan] for name, plan in chosen.items() if (name, plan) in lowered_by}
    by_method.update({name: added_lowerings[name, plan] for name, plan in chosen.items()
                      if (name, plan) in added_lowerings})
    # A method whose plans were measured from the cache is lowered now, from the compile caches.
    unlowered = [name for name in program.methods if name not in by_method]
    if unlowered:
        again = lower_plan(
            program.only(unlowered),
            {
                name: added[name][chosen[name]].partitioners()
                if chosen[name] in added[name] else plan_partitioners(chosen[name], auto.device)
                for name in unlowered
            },
        )
        by_method.update(dict.fromkeys(unlowered, again))
    by_method = {name: by_method[name] for name in program.methods}
    merged = merged_methods(by_method)
    for name, placement in merged.placements.items():
        # Listed after the plans it chose among: a plan not lowered whole cannot be chosen.
        kept = replace(selections[name], candidates=[*selections[name].candidates,
                                                     *(candidate for candidate, _ in refused[name])])
        explanations = [*(why for _, why in refused[name]), *(why for _, why in alone[name]), *unmeasured_mixes[name],
                        *(extra.explanation for extra in added[name].values())]
        kept = replace(kept, reason="; ".join([kept.reason, *explanations]))
        merged.placements[name] = measured_placement(placement, kept, listed[name][chosen[name]][1])
    return merged


def opening_lowerings(
    program: Program, plans: Sequence[Plan], device: str
) -> dict[Plan, tuple[Program, PartitionerPlan] | Exception]:
    """What ``PlanLowering.together`` lowers first for each plan, its ``opening_plan``, or why its partitioners
    cannot be made (an engine installed but unusable here, such as ExecuTorch built for another torch): that plan
    fails, not auto."""
    lowerings: dict[Plan, tuple[Program, PartitionerPlan] | Exception] = {}
    for plan in plans:
        try:
            lowerings[plan] = (program, plan_partitioners(opening_plan(plan), device))
        except Exception as error:  # noqa: BLE001 - reported as the plan's failure
            lowerings[plan] = error
    return lowerings


def closing_nodes(
    program: Program, plan: Plan, partitioners: list[Partitioner], lower_plan: PlanLowering
) -> dict[str, set[str]]:
    """Per method of ``program``, the nodes ``plan``'s closing engine would take were it lowered whole with
    ``partitioners``: a dry run (``planned_outcomes``), which compiles nothing; none where the dry run fails (the plan
    is then lowered whole)."""
    try:
        planned = planned_lowering(
            program,
            partitioners,
            skip_h2d_for_method_inputs=lower_plan.skip_h2d_for_method_inputs,
            skip_d2h_for_method_outputs=lower_plan.skip_d2h_for_method_outputs,
        )
    except Exception:  # noqa: BLE001 - the lowering itself meets the problem and reports it
        logger.debug("auto: the dry run of %s failed", plan_text(plan), exc_info=True)
        return {}
    return {
        name: {node for delegate in delegates if delegate.backend_id == plan[-1] for node in delegate.nodes}
        for name, delegates in planned.delegate_table.items()
    }


def compiled_calls_aten_kernel(closing: Partitioner, exported: ExportedProgram) -> Callable[[str], bool]:
    """Whether ``closing``'s engine would compile the node of ``exported`` so named to a call of ATen's own kernel
    (``Partitioner.compiled_calls_aten_kernel``); False for a name the method's graph lacks."""
    nodes = {node.name: node for node in exported.graph.nodes}

    def calls_aten_kernel(name: str) -> bool:
        return name in nodes and closing.compiled_calls_aten_kernel(nodes[name])

    return calls_aten_kernel


def measured_plan(
    program: Program, plan: Plan, lowered: LoweredProgram, inputs: Mapping[str, TimingInputs], saved: SavedPrograms
) -> dict[str, MethodTiming]:
    """Each method of ``plan``'s lowering of ``program`` timed, but those its first engine took no op of, where it
    is AOTInductor alone again (``takes_nothing``)."""
    backends = {name: [d.backend_id for d in lowered.delegate_table[name]] for name in program.methods}
    timed = [name for name in program.methods if not takes_nothing(plan, backends[name])]
    if not timed:
        return {}
    return measured_methods(
        {name: lowered.methods[name] for name in timed},
        {name: lowered.delegate_table[name] for name in timed},
        {name: inputs[name].call for name in timed},
        saved,
    )


def plan_measurement(engines: Sequence[str], delegates: list[Delegate], timing: MethodTiming) -> Measurement:
    by_id = {d.delegate_id: d.backend_id for d in delegates}
    regions = delegate_regions(delegates, timing.delegate_seconds)
    return measured_candidate(tuple(engines), timing, by_id), timing.delegate_seconds, regions


def confirmed_selection(
    name: str,
    inputs: CallInputs,
    kept: Selection,
    listed: dict[Plan, Measurement],
    sources: Mapping[Plan, tuple[LoweredProgram, str]],
    threads: int,
    saved: SavedPrograms,
) -> Selection:
    """``kept`` made again after its contending plans (``auto.contenders``: the kept plan, AOTInductor alone where
    the kept plan beat it, the plans close to the fastest) are timed ``CONFIRMING_ROUNDS`` more times, alternately,
    each keeping its median timing (in ``listed``, and in the cache under ``median_key``).

    A shared machine's speed drifts both ways over seconds: a burst of load slowed one timing
    (AOTInductor alone at 1.5x its time, OpenVINO alone at 1.3x), and a quiet stretch sped one up
    (a decode, which reads every weight, at 0.8x its time while its neighbours left the memory
    bus idle). The choice is cached, so one timing either way would decide it for good.
    Alternating the plans, each is timed in the same stretches as the others, and a plan is judged
    by the middle of its timings. Plans measured by an earlier lowering (not in ``sources``) were
    confirmed then.
    """
    plans = list(listed)
    timed_now = [plans[index] for index in contenders(kept) if plans[index] in sources]
    if len(timed_now) < 2:
        return kept
    timings = {plan: [listed[plan]] for plan in timed_now}
    for _ in range(CONFIRMING_ROUNDS):
        for plan in timed_now:
            again = timed_again(name, inputs, plan, sources[plan][0], saved)
            if again is not None and again[0].seconds is not None:
                timings[plan].append(again)
    for plan, measured in timings.items():
        listed[plan] = median_measurement(measured)
        store_measurement(median_key(sources[plan][1]), listed[plan])
    confirmed = selection(name, [candidate for candidate, _, _ in listed.values()], threads)
    names = [plan_text(plan) for plan in timed_now]
    return replace(confirmed, reason=f"{confirmed.reason}; {', '.join(names[:-1])} and {names[-1]} were timed "
                                     f"{CONFIRMING_ROUNDS} more times, alternately, each keeping its median timing")


def median_measurement(measurements: Sequence[Measurement]) -> Measurement:
    """The one of ``measurements`` (timings of one plan) whose time is the median, the faster of the two middle ones
    where their number is even."""
    ordered = sorted(measurements, key=lambda m: m[0].seconds or 0.0)
    return ordered[(len(ordered) - 1) // 2]


def timed_again(
    name: str, inputs: CallInputs, plan: Plan, lowered: LoweredProgram, saved: SavedPrograms
) -> Measurement | None:
    """Method ``name`` of ``plan``'s lowering timed once more, as the first time; None where it fails now."""
    try:
        measurement, seconds = method_measurement(name, inputs, plan, lowered, saved)
    except Exception as error:  # noqa: BLE001 - the first timing stands
        logger.warning("auto: %s: %s could not be timed again: %s", name, plan_text(plan), error)
        return None
    logger.info("auto: %s: %s takes %.3g ms a call, timed again", name, plan_text(plan), seconds * 1e3)
    return measurement


def method_measurement(
    name: str, inputs: CallInputs, plan: Plan, lowered: LoweredProgram, saved: SavedPrograms
) -> tuple[Measurement, float]:
    """Method ``name`` of ``plan``'s lowering timed on ``inputs``; and its seconds a call."""
    delegates = lowered.delegate_table[name]
    timing = measured_methods({name: lowered.methods[name]}, {name: delegates}, {name: inputs}, saved)[name]
    return plan_measurement(plan, delegates, timing), timing.seconds


def method_mix(listed: Mapping[Plan, Measurement], closing: str) -> Mix | None:
    """The mixed plan one method's measured plans propose, where they propose one."""
    plans = [
        MeasuredPlan(tuple(plan), regions, candidate.seconds)
        for plan, (candidate, _, regions) in listed.items()
        if candidate.seconds is not None and regions
    ]
    return mixed_cover(plans, closing) if len(plans) > 1 else None


def measure_added(
    method: Program,
    name: str,
    inputs: CallInputs,
    plan: AddedPlan,
    lower_plan: PlanLowering,
    listed: dict[str, dict[Plan, Measurement]],
    added: dict[str, dict[Plan, AddedPlan]],
    lowerings: dict[tuple[str, Plan], LoweredProgram],
    saved: SavedPrograms,
) -> None:
    """``plan``'s measurement of ``method``'s only method ``name`` (timed on ``inputs``), from the cache or lowered
    and timed now, put in ``listed``; ``plan`` in ``added``, and its lowering, where it was lowered now, in
    ``lowerings``."""
    added[name][plan.label] = plan
    cached = cached_measurement(plan.key, plan.label)
    if isinstance(cached, tuple):
        listed[name][plan.label] = cached
        return
    try:
        lowered = lower_plan(method, {name: plan.partitioners()}, plan.label)
        measurement, seconds = method_measurement(name, inputs, plan.label, lowered, saved)
    except Exception as error:  # noqa: BLE001 - like any plan, an added plan that fails is named, not raised
        failed = failed_candidate(plan.label, error)
        logger.warning("auto: %s could not be lowered or run: %s", plan_text(plan.label), failed.error)
        listed[name][plan.label] = (failed, {}, [])
        return
    logger.info("auto: %s: %s takes %.3g ms a call", name, plan_text(plan.label), seconds * 1e3)
    store_measurement(plan.key, measurement)
    listed[name][plan.label] = measurement
    lowerings[name, plan.label] = lowered


def measured_placement(placement: Placement, chosen: Selection, delegate_seconds: Mapping[str, float]) -> Placement:
    """``placement`` with auto's selection and each delegate's measured seconds a call."""
    delegates = {
        delegate_id: replace(delegate, run_seconds=delegate_seconds.get(delegate_id))
        for delegate_id, delegate in placement.delegates.items()
    }
    return replace(placement, delegates=delegates, selection=chosen)


def merged_methods(by_method: Mapping[str, LoweredProgram]) -> LoweredProgram:
    """One program holding each method as lowered in the program given for it."""
    return LoweredProgram(
        methods={name: lowered.methods[name] for name, lowered in by_method.items()},
        delegate_table={name: lowered.delegate_table[name] for name, lowered in by_method.items()},
        compile_failures={name: lowered.compile_failures.get(name, []) for name, lowered in by_method.items()},
        compile_log={name: lowered.compile_log.get(name, []) for name, lowered in by_method.items()},
        references={name: lowered.references.get(name, {}) for name, lowered in by_method.items()},
        placements={name: lowered.placements[name] for name, lowered in by_method.items()},
    )


# Compiles the partitions one partitioner position claimed, in every method; their outcomes by job.
CompileLevel = Callable[[Mapping[str, list["Claim"]]], Mapping[CompileJob, CompileOutcome]]


class ClaimAhead:
    """Sent to lowering steps in place of outcomes: the claims they yielded last still compile; yield the next
    position's claims as if they all compile, or None where there is no next position."""


CLAIM_AHEAD = ClaimAhead()
# A lowering in steps: it yields each partitioner position's claims, in every method, is sent
# their compile outcomes (or ``CLAIM_AHEAD``), and returns the lowered program. It yields None
# when it waits for the outcomes of claims it yielded before.
LoweringSteps = Generator[
    Mapping[str, list["Claim"]] | None, Mapping[CompileJob, CompileOutcome] | ClaimAhead, "LoweredProgram"
]


def lowered_program(steps: LoweringSteps, compile_level: CompileLevel) -> LoweredProgram:
    """What ``steps`` (``lowering_steps``) return, each level's claims compiled by ``compile_level`` in turn.

    Example, a dry run: ``lowered_program(lowering_steps(program, plan, ..., planned=True), planned_outcomes)``.
    """
    with quiet_torch_warnings():
        try:
            claims = next(steps)
            while True:
                claims = steps.send(compile_level(claims))
        except StopIteration as finished:
            return finished.value


def planned_lowering(
    program: Program,
    partitioners: PartitionerPlan,
    *,
    skip_h2d_for_method_inputs: MethodOption = False,
    skip_d2h_for_method_outputs: MethodOption = False,
) -> LoweredProgram:
    """``program`` as ``partitioners`` would lower it, nothing compiled: each claimed part stands in for its delegate
    (``planned_outcomes``), so later partitioners see what they would see (``explain``'s dry run)."""
    steps = lowering_steps(
        program,
        partitioners,
        skip_h2d_for_method_inputs=skip_h2d_for_method_inputs,
        skip_d2h_for_method_outputs=skip_d2h_for_method_outputs,
        planned=True,
    )
    return lowered_program(steps, planned_outcomes)


def planned_outcomes(claims: Mapping[str, list[Claim]]) -> dict[CompileJob, CompileOutcome]:
    """Each claimed part as if compiled, for a dry run: no code, and its weights as the named data a compile would
    store."""
    outcomes = {}
    for listed in claims.values():
        for claim in listed:
            named_data, _ = weights_as_named_data(program_weights(claim.part.program))
            outcomes[claim.job] = CompileOutcome(claim.job, PreprocessResult(b"", named_data))
    return outcomes


def lowering_steps(
    program: Program,
    partitioners: PartitionerPlan,
    *,
    skip_h2d_for_method_inputs: MethodOption,
    skip_d2h_for_method_outputs: MethodOption,
    keep_references: bool = False,
    planned: bool = False,
) -> LoweringSteps:
    """Every method partitioned, level by level, each claimed part compiled by the caller and spliced in.

    The steps yield each level's claims, in every method, and take their outcomes, so the caller
    decides how and beside what they compile (``lowered_program``, ``PlanLowering.together``).
    A caller that sends ``CLAIM_AHEAD`` instead gets the next level's claims at once, made on the
    graph as it will be once the last level's parts have all compiled; it must then send each
    level's outcomes in turn, and may only do so where a failed part ends the lowering.
    ``planned``: the outcomes compiled nothing (a dry run), and the result says so.
    """
    plan = partitioners_by_method(program, partitioners)
    states = {
        name: MethodLowering.of(name, exported, program.state, keep_references=keep_references, planned=planned)
        for name, exported in program.methods.items()
    }
    # Level by level: the partitioners at one position, in every method, compile together. Sent
    # CLAIM_AHEAD, the last level's partitions are spliced in before their compiles end and the
    # next level claims: its compiles start beside theirs.
    levels = max((len(listed) for listed in plan.values()), default=0)

    def claims_of(level: int) -> dict[str, list[Claim]]:
        return {name: state.claim(plan[name][level]) for name, state in states.items() if level < len(plan[name])}

    # The levels whose outcomes have not come back, oldest first, and whether each was spliced ahead.
    in_flight: list[tuple[dict[str, list[Claim]], bool]] = []
    claimed = 0
    while claimed < levels or in_flight:
        if not in_flight:
            in_flight.append((claims_of(claimed), False))
            claimed += 1
            sent = yield in_flight[-1][0]
        else:
            sent = yield None
        while isinstance(sent, ClaimAhead):
            if claimed == levels:
                sent = yield None
                continue
            last, _ = in_flight[-1]
            for name, listed in last.items():
                states[name].splice_ahead(listed)
            in_flight[-1] = (last, True)
            in_flight.append((claims_of(claimed), False))
            claimed += 1
            sent = yield in_flight[-1][0]
        oldest, spliced_ahead = in_flight.pop(0)
        for name, listed in oldest.items():
            if spliced_ahead:
                states[name].settle(sent)
            else:
                states[name].splice(listed, sent)
    methods: dict[str, ExportedProgram] = {}
    for name, state in states.items():
        # A view left to plain ATen was valid for the layout eager gave its input; a delegate's output may have another.
        views_as_reshapes(state.working.graph)
        propagate_device_pass(
            state.working,
            {d.delegate_id: (d.backend_id, d.target_device) for d in state.delegates},
            skip_h2d_for_method_inputs=applies_to(skip_h2d_for_method_inputs, name),
            skip_d2h_for_method_outputs=applies_to(skip_d2h_for_method_outputs, name),
        )
        # Rebuilt so the output specs name the copies that now feed the output.
        methods[name] = without_unused_constants(state.working, set())
    return LoweredProgram(
        methods,
        {name: state.delegates for name, state in states.items()},
        {name: state.failures for name, state in states.items()},
        {name: state.compiles for name, state in states.items()},
        {name: state.references for name, state in states.items()},
        placements={name: state.placement(methods[name]) for name, state in states.items()},
        planned=planned,
    )


PlanKey = TypeVar("PlanKey", bound=Hashable)


@dataclass(frozen=True)
class PlanLowering:
    """``lower``'s options, applied to one partitioner plan (a call) or to several at once (``together``)."""

    workers: int
    progress: Progress
    on_compile_error: OnCompileError
    skip_h2d_for_method_inputs: MethodOption
    skip_d2h_for_method_outputs: MethodOption
    keep_references: bool = False
    # Open once, in a child, each part of an engine that compiles when opened (``parallel.py``).
    open_once: bool = True

    @property
    def claims_ahead(self) -> bool:
        """Whether a plan's next partitioner claims before the parts of the one before it have compiled: only where
        a failed compile ends the lowering, so no failed part has to be given back to the next partitioner."""
        return self.on_compile_error == "raise"

    def __call__(self, program: Program, partitioners: PartitionerPlan, plan: Plan = ()) -> LoweredProgram:
        """``program`` lowered with ``partitioners``; ``plan`` names them in progress lines (auto's mixed plan)."""
        lowered = self.together({plan: (program, partitioners)})[plan]
        if isinstance(lowered, Exception):
            raise lowered
        return lowered

    def together(
        self, plans: Mapping[PlanKey, tuple[Program, PartitionerPlan] | Exception]
    ) -> dict[PlanKey, LoweredProgram | Exception]:
        """Each plan lowered, or the exception it raised (or was given as); their compiles share one pool of workers.

        A plan's parts compile while this process partitions the next plan, so workers one plan
        leaves idle compile another's (auto lowers its candidate plans this way). Where a key is an
        auto ``Plan`` (engine names), progress lines name it beside each part.
        """
        results: dict[PlanKey, LoweredProgram | Exception] = {}
        # Each plan between steps: its steps, and each level of claims it yielded whose outcomes it has not been sent,
        # with the batch compiling them, oldest first.
        waiting: dict[PlanKey, tuple[LoweringSteps, list[tuple[Mapping[str, list[Claim]], Batch]]]] = {}
        with quiet_torch_warnings(), CompilePool(self.workers, self.progress, open_once=self.open_once) as pool:

            def ended(key: PlanKey, result: LoweredProgram | Exception) -> None:
                results[key] = result
                for _, batch in waiting.pop(key, (None, []))[1]:
                    pool.cancel(batch)

            def advance(key: PlanKey, steps: LoweringSteps, sent: Mapping[CompileJob, CompileOutcome] | None) -> None:
                try:
                    claims = next(steps) if sent is None else steps.send(sent)
                    while claims is not None:
                        jobs = [claim.job for listed in claims.values() for claim in listed]
                        for job in jobs:
                            job.plan = plan_text(key) if isinstance(key, tuple) else ""
                        batch = pool.submit(jobs, stop_on_error=self.on_compile_error == "raise")
                        waiting.setdefault(key, (steps, []))[1].append((claims, batch))
                        # Where a failed compile ends the lowering, the next partitioner claims what this level
                        # leaves while its parts compile: a plan's closing AOTInductor parts need not wait for
                        # the first engine's compiles.
                        claims = steps.send(CLAIM_AHEAD) if self.claims_ahead and not batch.done else None
                except StopIteration as finished:
                    ended(key, finished.value)
                except Exception as error:  # noqa: BLE001 - one plan's failure is its result; the others go on
                    ended(key, error)

            for key, given in plans.items():
                if isinstance(given, Exception):
                    results[key] = given
                else:
                    advance(key, self.steps(*given), None)
                # A plan's claims may take this process seconds (ExecuTorch's question of a whole method): the
                # workers that ended meanwhile take the next queued parts before the next plan claims.
                pool.start()
            while waiting:
                done = [key for key, (_, levels) in waiting.items() if levels[0][1].done]
                if not done:
                    pool.advance()
                for key in done:
                    steps, levels = waiting[key]
                    claims, batch = levels.pop(0)
                    outcomes = {outcome.job: outcome for outcome in pool.outcomes(batch)}
                    try:
                        raise_first_failure(claims, outcomes, self.on_compile_error)
                    except Exception as error:  # noqa: BLE001 - as in advance
                        steps.close()
                        ended(key, error)
                        continue
                    advance(key, steps, outcomes)
                    pool.start()
        return {key: results[key] for key in plans}

    def steps(self, program: Program, partitioners: PartitionerPlan) -> LoweringSteps:
        return lowering_steps(
            program,
            partitioners,
            skip_h2d_for_method_inputs=self.skip_h2d_for_method_inputs,
            skip_d2h_for_method_outputs=self.skip_d2h_for_method_outputs,
            keep_references=self.keep_references,
        )


def checked_jobs(jobs: object) -> int:
    """How many compiles may run at once: ``jobs``, or one per core where it is None."""
    if jobs is None:
        return default_workers()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, or None for one per core; got {jobs!r}")
    return jobs


def raise_first_failure(
    claims: Mapping[str, list[Claim]], outcomes: Mapping[CompileJob, CompileOutcome], on_compile_error: OnCompileError
) -> None:
    """With ``"raise"``, raise for the first claimed partition that failed to compile, in lowering order."""
    if on_compile_error != "raise":
        return
    for listed in claims.values():
        for claim in listed:
            error = claim_error(claim, outcomes[claim.job])
            if error is not None:
                raise_compile_error(claim, error)


def check_on_compile_error(value: object, option: str = "on_compile_error") -> None:
    """Refuse an ``on_compile_error`` other than ``ON_COMPILE_ERROR``'s, naming ``option`` as the caller took it."""
    if not isinstance(value, str) or value not in ON_COMPILE_ERROR:
        raise ValueError(f"{option} must be one of {', '.join(map(repr, ON_COMPILE_ERROR))}, got {value!r}")


def check_lower_options(skip_h2d: object, skip_d2h: object, on_compile_error: object) -> None:
    """Refuse a bad option before any compile starts, rather than after minutes of compiling."""
    check_on_compile_error(on_compile_error)
    for option, value in (("skip_h2d_for_method_inputs", skip_h2d), ("skip_d2h_for_method_outputs", skip_d2h)):
        # A bare str is a Collection[str] too, and would match its own substrings as method names.
        if isinstance(value, bool):
            continue
        if isinstance(value, str | bytes) or not isinstance(value, Collection) or not all(
            isinstance(name, str) for name in value
        ):
            raise TypeError(
                f"{option} must be a bool or a collection of method names, got {type(value).__name__} {value!r}"
            )


def applies_to(option: MethodOption, method: str) -> bool:
    return option if isinstance(option, bool) else method in option


def partitioners_by_method(program: Program, partitioners: PartitionerPlan) -> dict[str, list[Partitioner]]:
    if isinstance(partitioners, Mapping):
        unknown = set(partitioners) - set(program.methods)
        if unknown:
            raise LoweringError(
                f"partitioners given for unknown methods {sorted(unknown)}; methods: {sorted(program.methods)}"
            )
        plan = {name: list(partitioners.get(name, ())) for name in program.methods}
    else:
        plan = {name: list(partitioners) for name in program.methods}
    for name, listed in plan.items():
        for partitioner in listed:
            if not isinstance(partitioner, Partitioner):
                raise LoweringError(
                    f"method {name!r}: expected a Partitioner, got {type(partitioner).__name__}"
                )
    return plan


@dataclass
class Claim:
    """A partition a partitioner claimed: its nodes, its standalone program and the job that compiles it."""

    nodes: list[torch.fx.Node]
    part: PartitionProgram
    ops: tuple[str, ...]
    job: CompileJob
    # The id its delegate gets if every partition before it in its method compiles.
    delegate_id: str
    # The partition's eager ops, copied before any compile, for ``check="partition"``.
    reference: ExportedProgram | None = None

    @property
    def tag(self) -> str:
        return self.job.tag

    @property
    def backend_id(self) -> str:
        return self.job.backend_id


@dataclass
class MethodLowering:
    """One method while it is lowered: its graph so far, its delegates and its failed partitions."""

    name: str
    working: ExportedProgram
    # Weights read before lowering stay in the method, read or not.
    read_before: set[str]
    # Ids stay unique even in a graph that already calls delegates.
    first_id: int
    delegates: list[Delegate] = field(default_factory=list)
    failures: list[CompileFailure] = field(default_factory=list)
    compiles: list[CompileRecord] = field(default_factory=list)
    keep_references: bool = False
    references: dict[str, ExportedProgram] = field(default_factory=dict)
    # A dry run: claimed partitions become delegate calls without compiling.
    planned: bool = False
    # Node name -> why each partitioner that looked at it left it, in lowering order.
    reasons: dict[str, list[Reason]] = field(default_factory=dict)
    # Delegate calls in the graph so far, their compiles ended or not.
    spliced: int = 0
    # Per level spliced ahead of its compiles (``splice_ahead``), oldest first: each claim and its delegate so far.
    ahead: list[list[tuple[Claim, Delegate]]] = field(default_factory=list)
    # Delegate id -> the ops it took and how its compile went.
    taken: dict[str, DelegatePlacement] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        name: str,
        exported: ExportedProgram,
        program_state: set[str],
        *,
        keep_references: bool = False,
        planned: bool = False,
    ) -> MethodLowering:
        """The method's lowering, on a copy; ``program_state``: the buffers any method of the program updates."""
        working = copied_program(exported)
        drop_metadata_checks(working.graph_module)
        sizes_read_from_inputs(working.graph_module)
        mark_state_of_other_methods(working, program_state)
        read_before = {node.name for node in constant_placeholders(working) if node.users}
        first_id = sum(1 for node in working.graph.nodes if is_delegate_call(node))
        return cls(name, working, read_before, first_id, keep_references=keep_references, planned=planned)

    def claim(self, partitioner: Partitioner) -> list[Claim]:
        """Let ``partitioner`` tag the graph; each tagged partition as a program ready to compile."""
        try:
            with unbacked_sizes_left_behind_dropped(self.working):
                result = partitioner.partition(self.working)
        except MissingFallbackKernelsError as exc:
            raise exc.in_method(self.name) from None
        self.working = result.tagged_exported_program
        self.note_refusals(partitioner, result)
        first = self.first_id + self.spliced
        claims = [
            claimed(self.working, self.name, tag, spec, f"{self.name}.{first + index}")
            for index, (tag, spec) in enumerate(result.partition_tags.items())
        ]
        if self.keep_references:
            # Copied before compiling: a backend compiling in this process may change the program it is given.
            for claim in claims:
                claim.reference = copied_program(claim.part.program)
        return claims

    def splice(self, claims: list[Claim], outcomes: Mapping[CompileJob, CompileOutcome]) -> None:
        """Put a delegate call in place of each compiled partition, in graph order; record the failed ones.

        Nothing in the graph changed between claiming and here, so a failed partition leaves it as it was.
        """
        # A partition that read another's output reads it from the other's delegate call once that is spliced.
        replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        for claim in claims:
            outcome = outcomes[claim.job]
            error = claim_error(claim, outcome)
            if error is not None or outcome.result is None:
                assert error is not None, "a cancelled compile only happens when the first failure raises"
                self.failures.append(compile_failure(self.name, claim.tag, claim.backend_id, claim.ops, error))
                self.compiles.append(compile_record(outcome, "failed", None))
                failed = Reason(claim.backend_id, "compile_failed", f"its part {claim.tag} failed to compile: {error}")
                for node in claim.nodes:
                    self.reasons.setdefault(node.name, []).append(failed)
                continue
            self.compiled(claim, self.spliced_in(claim, replaced), outcome)
        self.tidy()

    def splice_ahead(self, claims: list[Claim]) -> None:
        """Put a delegate call in place of every partition of ``claims`` before their compiles end, so the next
        partitioner may claim what they leave while they compile; ``settle`` records their outcomes.

        Only where a failed compile ends the lowering: a partition that failed would have to leave the graph as it
        was.
        """
        replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        self.ahead.append([(claim, self.spliced_in(claim, replaced)) for claim in claims])
        self.tidy()

    def settle(self, outcomes: Mapping[CompileJob, CompileOutcome]) -> None:
        """Record the outcomes of the oldest claims spliced ahead, each partition's compiled code in its delegate."""
        for claim, shell in self.ahead.pop(0):
            outcome = outcomes[claim.job]
            error = claim_error(claim, outcome)
            if error is not None:
                raise_compile_error(claim, error)
            self.compiled(claim, shell, outcome)

    def spliced_in(self, claim: Claim, replaced: dict[torch.fx.Node, torch.fx.Node]) -> Delegate:
        """Put ``claim``'s delegate call in place of its nodes; its delegate, without the compiled code."""
        if not validate_partition(claim.nodes):
            raise LoweringError(
                f"method {self.name!r}: partition {claim.tag!r} is not convex once the partitions before it "
                "became delegate calls (it would create a dependency cycle)"
            )
        delegate_id = f"{self.name}.{self.first_id + self.spliced}"
        # Read before the splice takes the nodes out of the graph.
        shell = delegate_shell(claim, delegate_id)
        inputs = [replaced.get(node, node) for node in claim.part.inputs]
        drop_buffer_mutations(self.working, claim.part.updated_buffers)
        replaced.update(splice_delegate_call(self.working.graph, claim.nodes, delegate_id, inputs, claim.part.outputs))
        drop_unused_subgraphs(self.working.graph_module)
        self.spliced += 1
        return shell

    def compiled(self, claim: Claim, shell: Delegate, outcome: CompileOutcome) -> None:
        """Record ``claim``'s delegate, spliced in as ``shell``, with the code its compile (``outcome``) made."""
        assert outcome.result is not None
        delegate = with_compiled_code(shell, outcome.result)
        self.delegates.append(delegate)
        self.taken[delegate.delegate_id] = DelegatePlacement(
            dict(Counter(op_name(n.target) for n in claim.nodes if is_counted_op(n))),
            "planned" if self.planned else outcome.state,
            None if self.planned else outcome.seconds,
        )
        if claim.reference is not None:
            self.references[delegate.delegate_id] = claim.reference
        self.compiles.append(compile_record(outcome, outcome.state, delegate.delegate_id))

    def tidy(self) -> None:
        """After splicing: untag what was not spliced (a failed partition's nodes, for the next partitioner) and drop
        what no node reads any more."""
        clear_tags(self.working.graph)
        drop_unused_size_computations(self.working.graph)
        self.working = without_unused_constants(self.working, self.read_before)

    def note_refusals(self, partitioner: Partitioner, result: PartitionResult) -> None:
        """Record why ``partitioner`` left each node it was offered and did not tag."""
        engine = engine_name(partitioner, result)
        for node in get_non_lowered_nodes(self.working.graph):
            if DELEGATION_TAG in node.meta or not is_counted_op(node):
                continue
            reason = result.refusals.get(node.name) or Reason(
                engine, "not_claimed", f"{type(partitioner).__name__} claimed it in no part and gave no reason"
            )
            self.reasons.setdefault(node.name, []).append(reason)

    def placement(self, lowered: ExportedProgram) -> Placement:
        """Where each op of the lowered method went: the delegates' ops, and the ops left as plain ATen."""
        unclaimed = []
        for node in get_non_lowered_nodes(lowered.graph):
            if is_counted_op(node):
                reasons = list(self.reasons.get(node.name, ()))
                reasons.extend(plain_op_reasons(node))
                unclaimed.append(UnclaimedOp(node.name, op_name(node.target), reasons))
        return Placement(dict(self.taken), unclaimed)


NOT_RUNNABLE = Reason(
    "aotstack",
    "not_runnable",
    "a package calls only ATen and prims ops outside delegates, so saving will fail; claim it with a partitioner",
)


def plain_op_reasons(node: torch.fx.Node) -> list[Reason]:
    """What the report adds for an op left to the plan: why it cannot run there, or what its loader must allow."""
    names = [op_name(op) for op in called_ops(node)]
    custom = [name for name in names if is_custom_op_name(name)]
    if custom:
        allow = sorted({name.rsplit(".", 1)[0] for name in custom})
        return [
            Reason(
                "aotstack",
                "needs_allow_ops",
                f"no engine claimed this custom op, so it runs in the plan where the loader allows it: "
                f"aotstack.load(path, allow_ops={allow!r})",
            )
        ]
    return [] if runs_as_plain_op(op_name(node.target)) else [NOT_RUNNABLE]


def engine_name(partitioner: Partitioner, result: PartitionResult) -> str:
    """The backend a partitioner claims for, to name it in a reason."""
    backend_id = getattr(partitioner, "backend_id", None)
    if isinstance(backend_id, str):
        return backend_id
    backends = sorted({spec.backend_id for spec in result.partition_tags.values()})
    return ", ".join(backends) if backends else type(partitioner).__name__


def is_counted_op(node: torch.fx.Node) -> bool:
    """Whether ``node`` counts as an op in the report: an ATen, prims or control-flow call computing a tensor.

    Sizes, getitems, delegate calls and aotstack's host-device copies are plumbing, not ops.
    """
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OperatorBase)
        and node.target.namespace != "aotstack"
        and not is_size_computation(node)
    )


def copied_program(exported: ExportedProgram) -> ExportedProgram:
    """A deep copy whose node names still match its signature, sharing the weights themselves.

    Lowering changes graphs, signatures and which weights a program lists, never a weight's
    values, so the copy keeps the very tensors (a second copy of every weight would double a
    large model's memory). Deep-copying an ExportedProgram renames a placeholder that shadows a
    builtin (``input`` becomes ``input_1``) but not its signature entry; the names are put back.
    """
    shared = {id(tensor): tensor for tensor in program_weights(exported).values()}
    # torch's TreeSpec warns about its deprecated LeafSpec while being deep-copied; lower's
    # quiet_torch_warnings, around every call of this, keeps that from the user.
    working = copy.deepcopy(exported, memo=dict(shared))
    for original, copied in zip(exported.graph.nodes, working.graph.nodes, strict=True):
        copied.name = original.name
    return working


def claimed(exported: ExportedProgram, method: str, tag: str, spec: DelegationSpec, delegate_id: str) -> Claim:
    """The nodes tagged ``tag`` as a standalone program, checked, with the job that compiles it.

    A partition that is malformed (empty, not convex, not expressible as a program) is the
    partitioner's mistake and always raises.
    """
    nodes = [n for n in exported.graph.nodes if n.op == "call_function" and n.meta.get(DELEGATION_TAG) == tag]
    if not nodes:
        raise LoweringError(f"method {method!r}: partition {tag!r} tags no call_function node")
    if not validate_partition(nodes):
        raise LoweringError(
            f"method {method!r}: partition {tag!r} is not convex (it would create a dependency cycle)"
        )
    backend = backend_class(spec.backend_id)()
    compile_specs = [s for s in spec.compile_specs if s.key != SpecKey.METHOD_NAME]
    compile_specs.append(CompileSpec(SpecKey.METHOD_NAME, method.encode()))
    try:
        part = partition_program(
            exported, nodes, in_place=lambda buffer: backend.updates_in_place(buffer, compile_specs)
        )
    except LoweringError as exc:
        raise LoweringError(f"method {method!r}, partition {tag!r} ({spec.backend_id}): {exc}") from None
    job = CompileJob(method, tag, backend, part.program, compile_specs, len(nodes))
    return Claim(nodes, part, partition_ops(nodes), job, delegate_id)


def claim_error(claim: Claim, outcome: CompileOutcome) -> Exception | None:
    """Why ``claim``'s compile cannot be used: its error, or a buffer it updates without storing it."""
    if outcome.error is not None or outcome.result is None:
        return outcome.error
    # A buffer the partition updates in place must come back as its named data: its one shared state.
    for fqn in claim.part.updated_buffers:
        if WEIGHT_PREFIX + fqn not in outcome.result.named_data:
            return LoweringError(
                f"{claim.backend_id} updates buffer {fqn!r} in place but stores no named data "
                f"{WEIGHT_PREFIX + fqn!r} for it"
            )
    return None


def raise_compile_error(claim: Claim, error: Exception) -> None:
    raised = compile_error(claim.job.method, claim.tag, claim.backend_id, claim.delegate_id, claim.ops, error)
    if raised is error:
        raise error
    raise raised from error


def compile_record(outcome: CompileOutcome, state: str, delegate_id: str | None) -> CompileRecord:
    job, first = outcome.job, outcome.same_as
    return CompileRecord(
        method=job.method,
        partition=job.tag,
        backend_id=job.backend_id,
        state=state,
        seconds=outcome.seconds,
        delegate_id=delegate_id,
        worker=outcome.worker,
        same_as=None if first is None else f"{first.method}/{first.tag}",
    )


def delegate_shell(claim: Claim, delegate_id: str) -> Delegate:
    """``claim``'s delegate as its graph describes it, before its compile: no code, no named data."""
    part = claim.part
    return Delegate(
        delegate_id=delegate_id,
        backend_id=claim.backend_id,
        compile_specs=claim.job.compile_specs,
        ops=list(claim.ops),
        inputs=[TensorSpec.of(n.meta["val"]) for n in part.inputs],
        outputs=[TensorSpec.of(n.meta["val"]) for n in part.outputs],
        processed_bytes=b"",
        named_data={},
        updated_buffers=list(part.updated_buffers),
        quantized=quantized_layers(claim.nodes),
        nodes={node.name: node_work(node) for node in claim.nodes},
    )


def with_compiled_code(shell: Delegate, result: PreprocessResult) -> Delegate:
    """``shell`` with the code and named data its compile made, and the custom ops that code calls."""
    calls = backend_class(shell.backend_id)().custom_ops_called(list(shell.ops), result)
    return replace(
        shell, processed_bytes=result.processed_bytes, named_data=dict(result.named_data), calls=sorted(set(calls))
    )


def partition_ops(nodes: list[torch.fx.Node]) -> tuple[str, ...]:
    """The op names the nodes call, sorted, each once (getitems and other Python callables left out).

    A functionalized call names the op it wraps too, so a custom op inside one is listed.
    """
    return tuple(sorted({op_name(op) for node in nodes for op in called_ops(node)}))


def ops_text(ops: Sequence[str]) -> str:
    """``aten.add.Tensor, aten.relu.default``, cut short for a partition of many ops."""
    shown = ", ".join(ops[:OPS_IN_MESSAGE]) or "none"
    return shown if len(ops) <= OPS_IN_MESSAGE else f"{shown} and {len(ops) - OPS_IN_MESSAGE} more"


def compile_error(
    method: str, tag: str, backend_id: str, delegate_id: str, ops: Sequence[str], exc: Exception
) -> LoweringError:
    """The error to raise for a failed compile: where it failed, then why.

    ``MissingFallbackKernelsError`` keeps its type and fields, which callers read, and names
    the method already; a ``CompileSpecError`` stays one, so it remains a ``ValueError`` too, and
    an ``EngineCrashError`` (the engine's compile worker died) stays one, with its signal.
    """
    if isinstance(exc, MissingFallbackKernelsError):
        return exc if exc.method else exc.in_method(method)
    message = (
        f"method {method!r}, partition {tag!r} ({backend_id}, delegate {delegate_id}) failed to compile "
        f"(ops: {ops_text(ops)}): {type(exc).__name__}: {exc}\n"
        "lower(..., on_compile_error='fallback') (--on-compile-error fallback on the command line) would leave this "
        "partition to the next partitioner or plain ATen"
    )
    if isinstance(exc, EngineCrashError):
        return EngineCrashError(message, exc.signal)
    return (CompileSpecError if isinstance(exc, CompileSpecError) else LoweringError)(message)


def compile_failure(method: str, tag: str, backend_id: str, ops: tuple[str, ...], exc: Exception) -> CompileFailure:
    """Record, and warn of, a partition left to plain ATen because its compile failed."""
    failure = CompileFailure(method, backend_id, tag, ops, f"{type(exc).__name__}: {exc}")
    logger.warning(
        "%s: %s failed to compile partition %r (ops: %s); its nodes stay in the method for the next partitioner "
        "or plain ATen: %s",
        method, backend_id, tag, ops_text(ops), failure.error,
    )
    return failure
