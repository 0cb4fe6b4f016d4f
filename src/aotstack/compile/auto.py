"""``lower(program, "auto")``: let every installed engine propose its parts, measure, keep the fastest per method.

The algorithm, kept small so a report can explain it:

1. The plans. Every installed engine for the target device makes one plan: that engine first,
   then the device's AOTInductor engine, which takes whatever op it leaves (AOTInductor alone is
   a plan too). A plan is an ordered partitioner list, as a user would write it.
2. Each plan lowers the whole program (a part whose compile fails is left to the next engine,
   not fatal), is saved and loaded as a user would, and each method is timed on its example
   inputs (or those ``Auto.inputs`` gives it) in the caller's thread count: warm-up calls, then
   the median of several calls. Each delegate's time is recorded too, so the report can say
   where a call's time went. Compiles and timings run in child processes: an engine that crashes
   (a signal in its native code) fails its plan with an ``EngineCrashError`` the report names,
   and auto goes on with the others.
   A plan lowers its opening engine first, alone (``opening_plan``), the ops it leaves run as
   plain ATen. Where it leaves none, that is the plan. Where it leaves some, its delegates' time
   is the least the whole plan can take: the closing engine's parts are compiled, and the plan
   lowered and timed whole, only where that is within ``CLOSING_CONTENDING`` of the fastest
   whole plan (``closing_refusal``). Each of those parts costs an AOTInductor compile (about
   7 s here, however small), for a plan that would lose. Within reach, a dry run says which ops the
   closing engine would take, and the opening timing what each took as plain ATen: where those ops
   cost under ``CLOSING_WORTH`` of its call, the most the closing parts could save, the opening
   engine alone is the plan, chosen among the others as it measured (``closing_gain_refusal``).
3. Per method, the measured plans' regions propose one more plan that mixes engines region by
   region (``mixing.py``): each engine's region that measured faster than every other plan's
   estimate for the same nodes is kept, the closing engine takes the rest. It is lowered and
   timed like the others (at most one more plan per method), so boundaries are in its time too,
   and the selection's reason lists the regions it kept and what each measured against.
4. At more than one thread on the CPU, the fastest plan whose AOTInductor parts run between
   another engine's (where it, or its opening engine alone, is within ``ONE_THREAD_CONTENDING`` of
   the fastest) is lowered once more with those parts compiled for one thread (``SpecKey.THREADS``),
   and timed like the others: there AOTInductor's OpenMP threads, waiting for the next loop, spin on
   the cores the other engine's own pool needs (``one_thread_base``). It is lowered once more with
   the other engines' sessions on one thread instead (the same spec, which only their run sides
   read, so nothing compiles again): a decode step's small ops do not pay for waking a pool's
   second thread at each.
5. On the CPU, a method whose convolutions do most of its arithmetic, where AOTInductor alone is within
   ``FROZEN_CONTENDING`` of the fastest, is lowered once more by AOTInductor alone with its weights frozen into
   its library (``SpecKey.FREEZE_WEIGHTS``, ``frozen_plans``), and timed like the others: there a convolution
   runs oneDNN's kernel on weights prepacked once, where ATen's reorders them at every call.
6. Per method, the fastest plan wins; boundary costs are in its time, as they are in a user's
   call. Within ``TIE`` of AOTInductor alone, AOTInductor alone wins: one engine and no
   boundaries for a difference the measurement cannot tell apart. Otherwise, among the plans
   within ``TIE`` of the fastest, one holding at least ``LIGHTER`` less memory once loaded and
   called (an engine that repacks weights keeps its own copy of them) wins over the fastest.
   The kept plan and every other plan within ``CONTENDING`` of the fastest (AOTInductor alone
   among them) are timed again, alternately, ``CONFIRMING_ROUNDS`` times each
   (``lower.confirmed_selection``), each keeping its median timing, and the choice is made again.
   Methods choose separately, so one file may run ``prefill`` in one engine and ``decode`` in
   another.

The figures are cached by the method's program, the inputs it is timed on, the plan, the thread count
and the versions of torch, aotstack and the engines: re-lowering an unchanged model compiles
only the chosen plans (from the compile cache, where an engine has one) and measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from .. import __version__
from ..engine.processor import processor_fingerprint
from ..engine.registry import BUILT_IN, backend_class
from ..engine.source import code_version
from ..errors import EngineCrashError, InputError, LoweringError
from ..format.devices import parse_device_spec
from ..format.placement import Candidate, Selection
from ..format.specs import CompileSpec, SpecKey
from ..format.tensor_data import tensor_buffer
from ..report.text import megabytes
from .cache import package_version, read_entry, write_entry
from .check import check_call_inputs, example_inputs
from .measure import CallInputs, MethodTiming
from .mixing import Mix, Region, RegionPartitioner
from .partitioner import Partitioner
from .work import is_convolution, known_work

logger = logging.getLogger("aotstack")

# A plan no more than this much slower than another is level with it: AOTInductor alone keeps its place against a
# level plan, and a level plan holding at least LIGHTER less memory than the fastest displaces it.
TIE = 0.03
LIGHTER = 0.10
# Times the contending plans (``contenders``) are timed again, alternately, before the choice is made again: a stretch
# of load (or of quiet) on a shared machine then changes a timing of each, not every timing of one.
CONFIRMING_ROUNDS = 2
# A plan whose first timing took at most this many times the fastest's contends, and is timed again: a burst of load
# while it was timed once would otherwise rule it out for good. The worst measured here slowed a timing 1.65x
# (OpenVINO's plan for a BERT encoder at 2 threads, 46.2 ms, against 21-29 ms in six other lowerings). Timing a
# plan again costs its calls alone: it stays loaded in the process that timed it (``measure.SavedPrograms``).
CONTENDING = 2.0
# The plan whose AOTInductor parts auto compiles again for one thread (``one_thread_base``) took at most this many
# times the fastest plan's time: that costs a compile, not a timing.
ONE_THREAD_CONTENDING = 1.35
# A plan's opening engine's delegates, timed with the ops it leaves run as plain ATen, took at most this many times
# the fastest whole plan's call for auto to compile its closing engine's parts and time it whole. Their time is the
# least the whole plan can take; the margin is one timing's noise (a burst of load slowed one 1.65x, but rarely).
# XNNPACK's 12 parts of a BERT encoder took 1.7x OpenVINO's whole call at 2 threads; a decode step's a fraction of it.
CLOSING_CONTENDING = 1.35
# The ops a plan's closing engine would take (a dry run says which) cost at least this share of its opening engine's
# call as plain ATen there for auto to compile that engine's parts and time the plan whole: less is all they could
# save, and a difference under ``TIE`` is one a timing cannot tell (``closing_gain_refusal``).
CLOSING_WORTH = TIE
# The measurements' cache; each entry keeps its plan's regions (``mixing.py``) and memory, which older entries lack,
# older entries timed a plan keeping state in its engine with a reload of that state in every call, and older entries
# of plans close to the fastest were timed once only (and before that kind, every plan beyond 1.35x the fastest
# time), and older entries of a plan with AOTInductor's parts compiled for one thread ran their ATen calls on torch's
# thread count.
CACHE_KIND = "measurements-7"

Plan = tuple[str, ...]


@dataclass(frozen=True)
class Auto:
    """How ``lower`` chooses engines by measuring: for ``device``, among ``engines`` (default: every installed one).

    Each method is timed on its example inputs, unless ``inputs`` gives it others, as ``(args,
    kwargs)``: where a call's cost depends on what it is given, time it on what it is given most.
    A decoder's step exported at position 0 reads one key of its cache there, and an engine that
    reads only the keys filled so far (AOTInductor's attention) then looks faster against one that
    reads the whole cache than it is halfway through a reply.

    Example::

        lowered = aotstack.lower(program, aotstack.Auto(engines=["openvino", "onnxruntime"]))
        lowered = aotstack.lower(program, aotstack.Auto(inputs={"decode": ((token, torch.tensor([512])), {})}))
    """

    device: str = "cpu"
    engines: Sequence[str] | None = None
    inputs: Mapping[str, CallInputs] | None = None


def auto_option(partitioners: object) -> Auto | None:
    """The auto-lowering ``partitioners`` asks for (an ``Auto``; ``engines.named_plan`` makes ``"auto"`` one);
    None for a partitioner plan."""
    return partitioners if isinstance(partitioners, Auto) else None


def candidate_plans(auto: Auto) -> list[Plan]:
    """AOTInductor alone, then each other engine first with AOTInductor after it."""
    device_type, _ = parse_device_spec(auto.device)
    device = device_type.value
    usable = {backend_id: engine for backend_id, engine in BUILT_IN.items() if device in engine.devices}
    closing = [backend_id for backend_id, engine in usable.items() if engine.takes_every_op]
    if not closing:
        raise LoweringError(f"no engine compiles every op for device {auto.device!r}, so auto cannot lower for it")
    named = list(usable) if auto.engines is None else list(auto.engines)
    unknown = [name for name in named if name not in usable]
    if unknown:
        raise LoweringError(
            f"auto: no engine {', '.join(map(repr, unknown))} for device {auto.device!r}; "
            f"engines for it: {', '.join(usable)}"
        )
    missing = [name for name in named if not usable[name].installed()]
    if auto.engines is not None and missing:
        raise LoweringError(
            "auto: " + "; ".join(f"{name} needs pip install 'aotstack[{usable[name].extra}]'" for name in missing)
        )
    last = closing[0]
    others = [name for name in named if name != last and name not in missing]
    return [(last,), *((name, last) for name in others)]


def plan_partitioners(
    plan: Plan,
    device: str,
    closing_threads: int | None = None,
    opening_threads: int | None = None,
    frozen: bool = False,
) -> list[Partitioner]:
    """The partitioners of ``plan``, each with its defaults; AOTInductor for ``device``, its generated code on
    ``closing_threads`` threads where given, its weights frozen into its libraries where ``frozen``; the other
    engines' sessions on ``opening_threads`` where given."""
    partitioners = []
    for backend_id in plan:
        cls = BUILT_IN[backend_id].partitioner_class()
        if BUILT_IN[backend_id].takes_every_op:
            partitioners.append(aoti_partitioner(cls, device, closing_threads, frozen))
        elif opening_threads is not None:
            partitioners.append(cls(compile_specs=[CompileSpec(SpecKey.THREADS, str(opening_threads).encode())]))
        else:
            partitioners.append(cls())
    return partitioners


def aoti_partitioner(cls: type, device: str, threads: int | None = None, frozen: bool = False) -> Partitioner:
    specs = [CompileSpec(SpecKey.TARGET_DEVICE, device.encode())]
    if threads is not None:
        specs.append(CompileSpec(SpecKey.THREADS, str(threads).encode()))
    if frozen:
        specs.append(CompileSpec(SpecKey.FREEZE_WEIGHTS, b"ON"))
    return cls(compile_specs=specs)


def plan_text(plan: Sequence[str]) -> str:
    return " > ".join(plan)


def timing_inputs(program: Mapping[str, ExportedProgram], auto: Auto) -> dict[str, TimingInputs]:
    """Per method of ``program``, the arguments auto times it on: those ``auto.inputs`` gives it, checked
    against what the method takes, else its example inputs."""
    given = dict(auto.inputs or {})
    unknown = [name for name in given if name not in program]
    if unknown:
        raise LoweringError(f"Auto.inputs names {', '.join(map(repr, unknown))}, which the program lacks; its "
                            f"methods: {', '.join(program)}")
    missing = [name for name, exported in program.items() if name not in given and exported.example_inputs is None]
    if missing:
        raise LoweringError(
            f"auto times each method on its example inputs, and {', '.join(map(repr, missing))} has none (its "
            f"ExportedProgram.example_inputs is None): export it with torch.export.export or aotstack.export, or "
            f"give auto the inputs to time it on: Auto(inputs={{{missing[0]!r}: (args, kwargs)}})"
        )
    return {
        name: TimingInputs(checked_inputs(name, exported, given[name]), given=True) if name in given
        else TimingInputs(example_inputs(name, exported), given=False)
        for name, exported in program.items()
    }


@dataclass(frozen=True)
class TimingInputs:
    """The arguments one method is timed on, and whether the user gave them (``Auto.inputs``)."""

    call: CallInputs
    given: bool

    def digest(self) -> list[Any]:
        """What of them a measurement depends on: each tensor's dtype and shape, each other value's ``repr``, and
        where the user gave them, each tensor's values too (example inputs are often random, made anew at each
        export, and would never meet their cached measurement again)."""
        leaves = torch.utils._pytree.tree_leaves(self.call)
        described: list[Any] = [
            [str(leaf.dtype), list(leaf.shape)] if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in leaves
        ]
        if self.given:
            values = hashlib.sha256()
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    values.update(tensor_buffer(leaf))
            described.append(values.hexdigest())
        return described


def checked_inputs(name: str, exported: ExportedProgram, given: Any) -> CallInputs:
    """``given`` as ``(args, kwargs)`` for method ``name``; a ``LoweringError`` naming what does not fit it."""
    if not (isinstance(given, (tuple, list)) and len(given) == 2 and isinstance(given[0], (tuple, list))
            and isinstance(given[1], dict)):
        raise LoweringError(f"Auto.inputs[{name!r}] must be (args, kwargs): a tuple of positional arguments and a "
                            f"dict of keyword ones, got {type(given).__name__}")
    args, kwargs = tuple(given[0]), dict(given[1])
    try:
        check_call_inputs(name, exported, args, kwargs)
    except InputError as error:
        raise LoweringError(f"Auto.inputs[{name!r}] does not fit the method: {error}") from None
    return args, kwargs


def measurement_key(fingerprint: str, inputs: TimingInputs, plan: Plan, threads: int) -> str:
    """What a measurement depends on: the program (its ``program_fingerprint``), the inputs it is timed on, the
    plan, the thread count, the processor and the versions of torch, aotstack and the plan's engines (their
    code too).
    """
    parts = [torch.__version__, __version__, str(threads), processor_fingerprint(), json.dumps(list(plan)),
             json.dumps(inputs.digest())]
    parts += [f"{name}={package_version(name)}" for backend_id in plan for name in BUILT_IN[backend_id].packages]
    parts += [f"{backend_id} {backend_code(backend_id)}" for backend_id in plan]
    return hashlib.sha256("\0".join([*parts, fingerprint]).encode()).hexdigest()


def backend_code(backend_id: str) -> str:
    """``backend_id``'s ``code_version``; ``?`` where its compile side cannot be loaded here (an engine built for
    another torch), whose plan then fails alone when its partitioners are made."""
    try:
        return code_version(backend_class(backend_id))
    except Exception:  # noqa: BLE001 - the plan's own lowering reports why
        return "?"


# What the cache holds for a plan whose first engine took no op of a method: for that method it is
# AOTInductor alone again, so it is neither timed nor listed (two timings of one plan would let noise choose).
SAME_AS_ALONE = "same_as_alone"

# What the cache holds, under a whole plan's key, for a plan not lowered whole for a method because its closing engine
# could save too little there (``closing_gain_refusal``): why, so a warm lowering asks no dry run again.
OPENING_ALONE = "opening_alone"

# A plan's measurement of one method: its candidate, each delegate's seconds a call, and its delegates as regions.
Measurement = tuple[Candidate, dict[str, float], list[Region]]


def cached_measurement(key: str, engines: Sequence[str]) -> Measurement | str | None:
    """A measurement kept by an earlier lowering (``engines`` name its plan in the report),
    ``SAME_AS_ALONE``, or None where there is none."""
    data = read_entry(CACHE_KIND, key + ".json")
    if data is None:
        return None
    try:
        entry = json.loads(data)
        if entry.get(SAME_AS_ALONE) is True:
            return SAME_AS_ALONE
        held = entry.get("resident_bytes")
        candidate = Candidate(list(engines), float(entry["seconds"]), dict(entry["engine_seconds"]),
                              resident_bytes=None if held is None else int(held))
        regions = [
            Region(str(r["engine"]), {str(k): float(v) for k, v in r["nodes"].items()}, float(r["seconds"]))
            for r in entry["regions"]
        ]
        return candidate, {str(k): float(v) for k, v in entry["delegate_seconds"].items()}, regions
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def cached_plain_op_seconds(key: str) -> dict[str, float] | None:
    """The seconds each plain ATen op took a call in the measurement kept under ``key`` (``measure.plain_op_seconds``);
    None where there is none, or it was kept without them."""
    data = read_entry(CACHE_KIND, key + ".json")
    try:
        ops = None if data is None else json.loads(data).get("plain_op_seconds")
        return None if ops is None else {str(name): float(seconds) for name, seconds in ops.items()}
    except (ValueError, TypeError, AttributeError):
        return None


def store_measurement(
    key: str, measured: Measurement | str, plain_op_seconds: Mapping[str, float] | None = None
) -> None:
    """Keep a measured plan (with its plain ops' seconds, where given), or that it is AOTInductor alone for this
    method; a failed plan is not kept, as its cause may be gone next time."""
    if isinstance(measured, str):
        entry: dict[str, object] = {SAME_AS_ALONE: True}
    else:
        candidate, delegate_seconds, regions = measured
        if candidate.seconds is None:
            return
        entry = {"seconds": candidate.seconds, "engine_seconds": candidate.engine_seconds,
                 "resident_bytes": candidate.resident_bytes,
                 "delegate_seconds": dict(delegate_seconds),
                 "regions": [{"engine": r.engine, "nodes": r.nodes, "seconds": r.seconds} for r in regions]}
        if plain_op_seconds is not None:
            entry["plain_op_seconds"] = dict(plain_op_seconds)
    write_entry(CACHE_KIND, key + ".json", json.dumps(entry).encode())


def store_gain_refusal(key: str, why: str) -> None:
    """Keep, under a whole plan's ``key``, that it was not lowered whole for the closing gain, and why
    (``closing_gain_refusal``): what it is decided from is kept too, so deciding again would say the same."""
    write_entry(CACHE_KIND, key + ".json", json.dumps({OPENING_ALONE: why}).encode())


def cached_gain_refusal(key: str) -> str | None:
    """Why the plan kept under ``key`` was not lowered whole (``store_gain_refusal``); None where that is not kept."""
    data = read_entry(CACHE_KIND, key + ".json")
    try:
        why = None if data is None else json.loads(data).get(OPENING_ALONE)
    except (ValueError, AttributeError):
        return None
    return why if isinstance(why, str) else None


def median_key(key: str) -> str:
    """Where a plan's median over its confirming timings is kept (``confirmed_selection``). Its own ``key`` keeps its
    first timing, which auto's choices of what else to lower (whole plans, a mix, a frozen or one-thread plan) read:
    so a warm lowering, reading the cache, makes the same choices and finds each of those plans measured, where the
    medians would propose another mix, to compile and time again."""
    return f"{key}-median"


def opening_plan(plan: Plan) -> Plan:
    """What auto lowers of ``plan`` first: its opening engine alone, the ops it leaves run as plain ATen."""
    return plan[:1]


def closing_refusal(plan: Plan, opened: Measurement, listed: Mapping[Plan, Measurement]) -> str | None:
    """Why ``plan``'s closing engine's parts are not compiled for a method, for the report; None where they are.

    ``opened`` timed the plan's opening engine alone, the ops it leaves as plain ATen; ``listed``
    holds the whole plans measured. They are compiled where the opening engine's delegates took at
    most ``CLOSING_CONTENDING`` times the fastest whole plan's call, or where either could not be timed.
    """
    candidate = opened[0]
    took = candidate.engine_seconds.get(plan[0]) if candidate.seconds is not None else None
    timed = [(c.seconds, whole) for whole, (c, _, _) in listed.items() if c.seconds is not None]
    if took is None or not timed:
        return None
    fastest, fastest_plan = min(timed)
    if took <= fastest * CLOSING_CONTENDING:
        return None
    return (f"{plan_text(plan)} was not lowered whole: {plan[0]}'s parts alone took {milliseconds(took)} a call "
            f"(the ops it leaves run as plain ATen), {took / fastest:.2f}x the fastest plan, "
            f"{plan_text(fastest_plan)} ({milliseconds(fastest)}), so its {plan[-1]} parts were not compiled")


def closing_gain_refusal(
    plan: Plan,
    opened: Measurement,
    closing_nodes: Collection[str] | None,
    op_seconds: Mapping[str, float] | None,
    calls_aten_kernel: Callable[[str], bool] = lambda node: False,
) -> str | None:
    """Why ``plan`` is not lowered whole for a method though within reach (``closing_refusal``), for the report: the
    ops its closing engine's parts would take (``closing_nodes``, from a dry run) could save less than
    ``CLOSING_WORTH`` of its opening engine's call; so the opening engine alone, the ops it leaves run as plain ATen,
    is the plan. None where they could save more, or where that is not known.

    What they could save is what they took as plain ATen there (``op_seconds``), but for the ops whose compiled code
    would call ATen's own kernel all the same (``calls_aten_kernel``, asked of the closing engine: an attention, a
    matmul). The costliest ops are asked first, and only until the answer is sure.

    Each of those parts costs an AOTInductor compile (about 8 s here however small); a part of a few cheap ops
    (an embedding lookup, a mask), or of an op compiled code hands back to ATen, buys less than a timing can tell.
    """
    call = opened[0].seconds
    if call is None or closing_nodes is None or op_seconds is None or not set(closing_nodes) <= op_seconds.keys():
        return None
    worth = call * CLOSING_WORTH
    took = unasked = sum(op_seconds[name] for name in closing_nodes)
    savable, kernel_calls = 0.0, []
    for node in sorted(closing_nodes, key=lambda name: -op_seconds[name]):
        if savable >= worth or savable + unasked < worth:
            break
        unasked -= op_seconds[node]
        if calls_aten_kernel(node):
            kernel_calls.append(node)
        else:
            savable += op_seconds[node]
    at_most = savable + max(unasked, 0.0)
    if at_most >= worth:
        return None
    if not closing_nodes:
        return (f"{plan_text(plan)} was not lowered whole: its {plan[-1]} engine would take none of the ops "
                f"{plan[0]} leaves (each a lone op between other parts, which runs as plain ATen), so {plan[0]} "
                "alone is the plan")
    handed_back = ""
    if kernel_calls:
        handed_back = (f"; compiled, {', '.join(kernel_calls)} ({milliseconds(took - at_most)}) would still call "
                       "ATen's own kernels")
    return (f"{plan_text(plan)} was not lowered whole: the {len(closing_nodes)} ops its {plan[-1]} parts would "
            f"take ran {milliseconds(took)} a call as plain ATen beside {plan[0]}'s parts{handed_back}; so those "
            f"parts could save at most {milliseconds(at_most)} ({at_most / call:.1%} of the call; under "
            f"{CLOSING_WORTH:.0%}), and {plan[0]} alone, the ops it leaves run as plain ATen, is the plan")


def takes_nothing(plan: Plan, backends: Sequence[str]) -> bool:
    """Whether ``plan``'s first engine took no op of a method whose delegates run on ``backends``."""
    return len(plan) > 1 and plan[0] not in backends


def measured_candidate(plan: Plan, timing: MethodTiming, backends: Mapping[str, str]) -> Candidate:
    """A plan's timing of one method, its delegates' time summed by engine (``backends``: delegate id -> engine)."""
    by_engine: dict[str, float] = {}
    for delegate_id, seconds in timing.delegate_seconds.items():
        engine = backends.get(delegate_id, "?")
        by_engine[engine] = by_engine.get(engine, 0.0) + seconds
    return Candidate(list(plan), timing.seconds, by_engine, resident_bytes=timing.resident_bytes)


def failed_candidate(plan: Sequence[str], error: BaseException) -> Candidate:
    """``plan`` as it failed; an engine's crash is named by its own short message (engine, stage, signal)."""
    if isinstance(error, EngineCrashError) and isinstance(error.__cause__, EngineCrashError):
        error = error.__cause__
    return Candidate(list(plan), None, {}, f"{type(error).__name__}: {error}"[:2000])


def mix_partitioners(
    mix: Mix, device: str, closing_threads: int | None = None, opening_threads: int | None = None
) -> list[Partitioner]:
    """The mixed plan's partitioners: each engine kept to its regions, in order, then the closing engine."""
    restricted: list[Partitioner] = [
        RegionPartitioner(plan_partitioners((engine,), device, opening_threads=opening_threads)[0], engine,
                          mix.regions(engine))
        for engine in mix.engines
    ]
    return [*restricted, *plan_partitioners((mix.closing,), device, closing_threads)]


def mix_key(fingerprint: str, inputs: TimingInputs, mix: Mix, threads: int) -> str:
    """What a mixed plan's measurement depends on: what a plan's does, and which nodes each engine keeps."""
    plan = (*mix.engines, mix.closing)
    return hashlib.sha256((measurement_key(fingerprint, inputs, plan, threads) + mix.digest).encode()).hexdigest()


@dataclass(frozen=True)
class AddedPlan:
    """A plan auto builds for one method from what it measured there (a mix of regions, a plan with its closing
    engine's parts on one thread): how the report names it, its partitioners, its measurement's cache key, and why
    it was built."""

    label: Plan
    partitioners: Callable[[], list[Partitioner]]
    key: str
    explanation: str


def one_thread_base(
    listed: Mapping[Plan, Measurement], closing: str, threads: int, device: str,
    opened: Mapping[Plan, Measurement] | None = None,
) -> Plan | None:
    """The plan whose ``closing`` parts auto also compiles for one thread: the measured plan whose closing engine
    runs parts between another engine's that could be fastest, where it could take at most ``ONE_THREAD_CONTENDING``
    times the fastest plan's time; None at one thread, off the CPU (``SpecKey.THREADS`` is AOTInductor's on the CPU)
    or where there is none.

    Between another engine's parts, AOTInductor's parallel loops gain little (a decode step's glue is a
    few small ops) while its OpenMP threads, spinning as they wait for the next loop, hold cores that the
    other engine's own thread pool needs. Whether the plan is faster without them is measured, not assumed.
    Where ``opened`` timed a plan's opening engine alone, that engine's delegates' time is what the plan
    could take: the spinning itself slows the whole plan's timing (a small Qwen3's prefill at 2 threads, ONNX
    Runtime's parts 1.2 ms alone, the whole plan 15.6 ms, 2.1 ms with AOTInductor's parts on one thread).
    """
    timed = {plan: c.seconds for plan, (c, _, _) in listed.items() if c.seconds is not None}
    if threads < 2 or not timed or parse_device_spec(device)[0].value != "cpu":
        return None
    between = [
        plan for plan, (_, _, regions) in listed.items()
        if plan in timed and {r.engine for r in regions} > {closing}
    ]
    if not between:
        return None

    def reach(plan: Plan) -> float:
        """The least ``plan`` could take: its opening engine's delegates alone, where they were timed so."""
        alone = (opened or {}).get(plan)
        took = alone[0].engine_seconds.get(plan[0]) if alone is not None and alone[0].seconds is not None else None
        return timed[plan] if took is None else min(took, timed[plan])

    base = min(between, key=reach)
    return base if reach(base) <= min(timed.values()) * ONE_THREAD_CONTENDING else None


def one_thread_plans(base: Plan, partitioners: Callable[..., list[Partitioner]], key: str) -> list[AddedPlan]:
    """``base`` with its closing engine's parts compiled for one thread (``partitioners(closing_threads=1)``), and
    with the other engines' sessions on one thread (``opening_threads=1``); ``key`` is ``base``'s measurement's
    cache key, from which each takes its own.

    The second because a decode step's small linears gain nothing from a second thread of XNNPACK's pool and pay
    for waking it at every op (measured: 1.2x the tokens/s of a 2-thread `8da4w` decode with XNNPACK on one).
    """
    closing = (*base[:-1], f"{base[-1]} (1 thread)")
    opening = (*(f"{engine} (1 thread)" for engine in base[:-1]), base[-1])
    others = ", ".join(base[:-1])
    return [
        AddedPlan(closing, lambda: partitioners(closing_threads=1), variant_key(key, "closing engine on one thread"),
                  f"{plan_text(closing)} is {plan_text(base)} with {base[-1]}'s parts compiled for one thread, so "
                  "that no thread of theirs waits spinning on a core the other engines' threads need"),
        AddedPlan(opening, lambda: partitioners(opening_threads=1), variant_key(key, "opening engines on one thread"),
                  f"{plan_text(opening)} is {plan_text(base)} with {others} on one thread, whose pool's second "
                  "thread a small op's work does not pay for"),
    ]


# The share of a method's arithmetic (``work.known_work``) its convolutions must do for auto to compile it frozen too:
# a ViT's one patch convolution is not worth a second compile of the whole method. Frozen AOTInductor prepacks their
# weights for oneDNN's kernels, where ATen's convolution reorders them at every call (ResNet-50: 1.7x faster).
CONVOLVING = 0.5
# AOTInductor alone took at most this many times the fastest plan's time for auto to compile it frozen too: the most
# freezing gained here (ResNet-50 in bf16, 41.5 to 22.7 ms; 1.7x in float32). Beyond it, the frozen plan would lose.
FROZEN_CONTENDING = 1.8


def frozen_plans(
    listed: Mapping[Plan, Measurement], closing: str, method: ExportedProgram, device: str,
    builds: Mapping[Plan, Callable[..., list[Partitioner]]], keys: Mapping[Plan, str],
) -> list[AddedPlan]:
    """AOTInductor alone (``(closing,)``, built by ``builds``, its measurement's cache key in ``keys``) with its
    weights frozen into its library (``SpecKey.FREEZE_WEIGHTS``), where ``method``'s convolutions do at least
    ``CONVOLVING`` of its arithmetic, on the CPU, and AOTInductor alone took at most ``FROZEN_CONTENDING`` times
    the fastest plan's time; none elsewhere.

    Frozen, the library holds the weights, so no other method shares them; hence a plan of its own, kept
    only where it measures faster.
    """
    alone = (closing,)
    timed = [seconds for candidate, _, _ in listed.values() if (seconds := candidate.seconds) is not None]
    took = listed[alone][0].seconds if alone in listed and alone in builds else None
    if took is None or took > min(timed) * FROZEN_CONTENDING:
        return []
    if parse_device_spec(device)[0].value != "cpu" or convolution_share(method) < CONVOLVING:
        return []
    label = (f"{closing} (frozen)",)
    partitioners = builds[alone]
    return [AddedPlan(label, lambda: partitioners(frozen=True), variant_key(keys[alone], "weights frozen"),
                      f"{plan_text(label)} is {closing} with the weights frozen into its library, its convolutions "
                      "on weights prepacked once for oneDNN")]


def convolution_share(method: ExportedProgram) -> float:
    """The share of ``method``'s arithmetic its convolutions do; by count of ops where a size is symbolic."""
    nodes = [node for node in method.graph_module.graph.nodes if node.op == "call_function"]
    convolutions = [node for node in nodes if is_convolution(node)]
    if not convolutions:
        return 0.0
    total, convolving = known_work(nodes), known_work(convolutions)
    if total is None or convolving is None or not total:
        return len(convolutions) / len(nodes)
    return convolving / total


def variant_key(key: str, variant: str) -> str:
    return hashlib.sha256(f"{key}\0{variant}".encode()).hexdigest()


def selection(method: str, candidates: list[Candidate], threads: int) -> Selection:
    """The plan ``method`` keeps among ``candidates`` (the first is AOTInductor alone), and why."""
    timed = [(index, c) for index, c in enumerate(candidates) if c.seconds is not None]
    if not timed:
        failures = "; ".join(f"{plan_text(c.engines)}: {c.error}" for c in candidates)
        raise LoweringError(f"method {method!r}: auto could not lower it with any plan: {failures}")
    fastest, best = min(timed, key=lambda item: item[1].seconds)
    baseline = candidates[0]
    assert best.seconds is not None
    level = [(index, c) for index, c in timed if c.seconds is not None and c.seconds <= best.seconds * (1 + TIE)]
    lighter = lightest(level, best)
    if fastest != 0 and baseline.seconds is not None and baseline.seconds <= best.seconds * (1 + TIE):
        fastest, best = 0, baseline
        reason = (f"{plan_text(baseline.engines)} alone is within {TIE:.0%} of the fastest plan, "
                  "so one engine with no boundaries is kept")
    elif lighter is not None:
        assert lighter[1].resident_bytes is not None and best.resident_bytes is not None
        reason = (f"{plan_text(lighter[1].engines)} is within {TIE:.0%} of the fastest plan, "
                  f"{plan_text(best.engines)} ({milliseconds(best.seconds)} a call), and holds "
                  f"{megabytes(lighter[1].resident_bytes)} of memory against its {megabytes(best.resident_bytes)}")
        fastest, best = lighter
    else:
        reason = f"{plan_text(best.engines)} is the fastest ({milliseconds(best.seconds)} a call)"
        others = [c for index, c in timed if index != fastest]
        if others:
            runner_up = min(others, key=lambda c: c.seconds or 0.0)
            assert runner_up.seconds is not None
            reason += (f", {runner_up.seconds / best.seconds:.2f}x faster than the next, "
                       f"{plan_text(runner_up.engines)} ({milliseconds(runner_up.seconds)})")
    failed = [c for c in candidates if c.seconds is None]
    if failed:
        reason += "; " + ", ".join(plan_text(c.engines) for c in failed) + " could not be lowered or run"
    return Selection(candidates, fastest, threads, reason)


def contenders(kept: Selection) -> list[int]:
    """The plans of ``kept`` timed again before its choice is made again, the kept plan first: every plan whose
    timing took at most ``CONTENDING`` times the fastest's (AOTInductor alone too, which keeps its place where a
    burst of load made every boundary look worth paying for); none where no other plan contends with the kept one.
    """
    timed = sorted((c.seconds, index) for index, c in enumerate(kept.candidates) if c.seconds is not None)
    if not timed:
        return []
    close = timed[0][0] * CONTENDING
    others = [index for seconds, index in timed if seconds <= close and index != kept.chosen]
    return [kept.chosen, *others] if others else []


def lightest(level: list[tuple[int, Candidate]], fastest: Candidate) -> tuple[int, Candidate] | None:
    """The plan of ``level`` (plans within ``TIE`` of ``fastest``) holding the least memory, where it holds at least
    ``LIGHTER`` less than ``fastest``; None where none does, or memory was not measured."""
    measured = [(index, c) for index, c in level if c.resident_bytes is not None]
    if not measured or fastest.resident_bytes is None:
        return None
    index, candidate = min(measured, key=lambda item: item[1].resident_bytes or 0)
    assert candidate.resident_bytes is not None
    # Strictly less: where the fastest holds nothing measurable, no plan is lighter (0 is not 10% under 0).
    lighter = candidate.resident_bytes < fastest.resident_bytes * (1 - LIGHTER)
    return (index, candidate) if candidate is not fastest and lighter else None


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"
