"""Export: one ``torch.export.ExportedProgram`` per method of a model."""

from __future__ import annotations

import copy
import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..errors import ExportError
from .attention import with_grouped_attention
from .empty_concat import with_empty_concat_operands_dropped
from .guards import shape_env_of, waive_guards_eager_agrees_past
from .int8_tensor import with_signed_int8_products
from .pooling import with_pooling_windows_fitted
from .program_parts import updated_buffers, without_outer_guards


@dataclass
class Program:
    """Every method of a model, exported: ``{method name: ExportedProgram}``."""

    methods: dict[str, ExportedProgram]
    # Buffers that methods of a larger program this one was taken from update (``only``).
    updated_elsewhere: frozenset[str] = frozenset()

    @property
    def state(self) -> set[str]:
        """The FQNs of the buffers a method updates (a KV cache): any other method reads them as they are now."""
        return updated_buffers(self.methods.values()) | self.updated_elsewhere

    def only(self, names: Iterable[str]) -> Program:
        """The methods ``names`` alone, still knowing which buffers the others update."""
        return Program({name: self.methods[name] for name in names}, frozenset(self.state))

    def __post_init__(self) -> None:
        if not self.methods:
            raise ExportError("a Program needs at least one method")
        for name, program in self.methods.items():
            if not isinstance(program, ExportedProgram):
                raise ExportError(
                    f"method {name!r}: expected a torch.export.ExportedProgram, got {type(program).__name__}"
                )
        # Every method is brought to the one form ``export`` gives, however it was exported:
        # - ``torch.export.export`` returns the training IR: eval-mode dropout, ``reshape`` and other ops an
        #   engine's converter may lack (OpenVINO's does) are still there, and split its part in pieces;
        # - a program exported elsewhere (transformers' export wrappers, say) may update its buffers in place,
        #   and lowering needs those updates as outputs of a functional graph;
        # - one exported from a model quantized with torchao holds its weights as tensor subclasses, which
        #   decomposing unwraps into the plain tensors they pack, which the file can store;
        # - a pooling window may overhang its input (``ceil_mode``), which every engine handles badly or not at all;
        # - a concatenation may start from an empty cache (``torch.tensor([])``), an operand OpenVINO refuses;
        # - a one-token attention may read its key/value heads repeated per query head, a copy of the cache per call;
        # - torchao's dynamic int8 layers take a form of their own on CPUs with VNNI and without AMX.
        # - its shape environment may hold a size narrower than its ranges say (a guard of its export that is no
        #   plain range, a decomposition before it came): the ranges are narrowed to match.
        self.methods = {name: narrowed_to_its_shapes(name, normalized(program))
                        for name, program in self.methods.items()}


def export(
    model: torch.nn.Module,
    methods: Mapping[str, tuple[Any, ...]],
    *,
    dynamic_shapes: Mapping[str, Any] | None = None,
    strict: bool | Mapping[str, bool] = False,
) -> Program:
    """Export each named method of ``model`` with its example arguments.

    Example::

        program = aotstack.export(model, {"forward": (x,), "encode": (x,)})

    ``dynamic_shapes`` maps a method name to the ``dynamic_shapes`` argument of
    ``torch.export.export`` for that method. ``strict=True`` traces with TorchDynamo, which a
    module needs when it updates tensors it holds outside its registered buffers (transformers'
    ``StaticCache`` does); a mapping says it per method (a method it leaves out is not strict).
    """
    if not methods:
        raise ExportError("export needs at least one method, e.g. {'forward': (x,)}")
    dynamic_shapes = dict(dynamic_shapes or {})
    unknown = set(dynamic_shapes) - set(methods)
    if unknown:
        raise ExportError(f"dynamic_shapes names methods that are not exported: {sorted(unknown)}")
    strictness = dict(strict) if isinstance(strict, Mapping) else dict.fromkeys(methods, strict)
    unknown = set(strictness) - set(methods)
    if unknown:
        raise ExportError(f"strict names methods that are not exported: {sorted(unknown)}")
    return Program(
        {
            name: export_method(model, name, args, dynamic_shapes.get(name), strictness.get(name, False))
            for name, args in methods.items()
        }
    )


def export_method(
    model: torch.nn.Module, name: str, args: tuple[Any, ...], dynamic_shapes: Any, strict: bool = False
) -> ExportedProgram:
    method = getattr(model, name, None)
    if not isinstance(method, types.MethodType):
        available = sorted(
            attr
            for attr, value in vars(type(model)).items()
            if callable(value) and not attr.startswith("_")
        )
        raise ExportError(
            f"{type(model).__name__} has no method {name!r}; methods it defines: {available}"
        )
    if not isinstance(args, tuple):
        raise ExportError(f"method {name!r}: example arguments must be a tuple, got {type(args).__name__}")
    module = model if name == "forward" else module_calling(model, name)
    try:
        # An inference program: a buffer updated from a weight (a KV cache) must not ask for gradients.
        with torch.no_grad():
            exported = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=strict)
            waive_guards_eager_agrees_past(name, module, exported)
            return functional(with_subclass_weights_frozen(with_made_tensors_renamed(exported)))
    except Exception as exc:
        raise ExportError(f"torch.export failed for method {name!r}: {exc}") from exc


def with_subclass_weights_frozen(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` whose tensor-subclass parameters ask for no gradients: the same data, in parameters of its own.

    transformers loads a torchao checkpoint's quantized weights (``Int8Tensor``, ``IntxUnpackedToInt8Tensor``) as
    parameters that ask for gradients, and ``run_decompositions`` cannot unwrap those into their integer parts
    ("Only Tensors of floating point and complex dtype can require gradients"). The caller's model keeps its own.
    """
    frozen: dict[int, torch.nn.Parameter] = {}  # by the original: tied weights stay one parameter
    for name, value in exported.state_dict.items():
        if isinstance(value, torch.nn.Parameter) and value.requires_grad and type(value) not in PLAIN_TENSOR_TYPES:
            if id(value) not in frozen:
                frozen[id(value)] = torch.nn.Parameter(value.detach(), requires_grad=False)
            exported.state_dict[name] = frozen[id(value)]
    return exported


def functional(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` with in-place ops made functional, ops otherwise kept as they are.

    ``torch.export.export`` keeps ``buf.add_(x)`` as written; functionalizing turns it into a
    value plus a buffer mutation in the signature, which lowering and the runtime act on.
    """
    with warnings.catch_warnings():
        # torch's TreeSpec warns about its own deprecated LeafSpec while being deep-copied.
        warnings.simplefilter("ignore", FutureWarning)
        return without_unnamed_weights(decomposed_unguarded(exported))


def decomposed_unguarded(exported: ExportedProgram) -> ExportedProgram:
    """``exported.run_decompositions({})``, its export's guards left out of the retrace.

    Retracing evaluates the program's guards (``_guards_code``) over symbolic sizes, and one with a max in it is
    decided by the traced size's value: VITS's windowed attention, exported at length 8, guards that its slice
    ``[Max(0, 5 - n), Max(0, 5 - n) + 2n - 1)`` is in bounds, and the retrace narrows n to at least 6 in the new
    program's shape environment while its ``range_constraints`` keep n >= 2. Inductor compiles for the narrow range
    (``Max(0, 5 - n)`` becomes 0) and the boundary check lets a length of 3 in: wrong values, silently. Those guards
    held over the declared ranges when exported, and the new program makes its own from its shape environment.
    """
    guards = list(getattr(exported, "_guards_code", []))
    without_outer_guards(exported)
    try:
        return exported.run_decompositions({})
    finally:
        if guards:
            exported._guards_code = guards


def without_unnamed_weights(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` without the weights its signature does not name, in place.

    Unwrapping tensor-subclass weights into their parts leaves behind, under its old name, each one
    the graph never read: Whisper's ``decode`` kept the encoder's torchao weights, whole, and reading
    them (to fingerprint the program) failed, as a torchao tensor cannot be flattened.
    """
    named = {spec.target for spec in exported.graph_signature.input_specs if spec.target is not None}
    for table in (exported.state_dict, exported.constants):
        for fqn in [fqn for fqn in table if fqn not in named]:
            del table[fqn]
    return exported


def normalized(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` as ``export`` would have made it: functional, in the inference IR, its pooling windows
    fitted, its concatenations rid of skipped empty operands, its one-token attention over repeated key/value
    heads run on the heads themselves, and its int8 products in the one form torchao exports them in on any CPU."""
    if exported.dialect == "TRAINING" or mutates_in_place(exported) or holds_subclass_weights(exported):
        exported = functional(exported)
    fitted = with_empty_concat_operands_dropped(with_pooling_windows_fitted(exported))
    return with_signed_int8_products(with_grouped_attention(fitted))


def narrowed_to_its_shapes(method: str, exported: ExportedProgram) -> ExportedProgram:
    """``exported``, or a copy whose ``range_constraints`` are no wider than the ranges its shape environment holds.

    A program decomposed before it came here (``run_decompositions``, as a user or an exporter may call it) can have
    its sizes narrowed in its shape environment by the retrace (``decomposed_unguarded``) but not in its
    ``range_constraints``; so can a guard of its own export that is no plain range (a strided convolution's output
    frames ``(n - 1) // 2 + 1 != 1`` holds n >= 3, ranges say n >= 2). Compilers build for the narrow range, the
    file's check would let the rest in. A size narrowed so is refused outside the narrow range, with a warning naming
    it, rather than computed wrongly.
    """
    from torch.utils._sympy.value_ranges import ValueRanges

    shape_env = shape_env_of(exported)
    if shape_env is None:
        return exported
    narrowed = {}
    for symbol, declared in exported.range_constraints.items():
        held = shape_env.var_to_range.get(symbol)
        if held is None:
            continue
        # A shape environment takes a dynamic size to be at least 2 (it specializes 0 and 1), where the program
        # takes the 1 or 0 it declares: not a narrowing.
        lower = held.lower if held.lower > max(declared.lower, 2) else declared.lower
        upper = min(held.upper, declared.upper)
        if (lower, upper) != (declared.lower, declared.upper):
            warnings.warn(f"method {method!r}: size {symbol} was declared in [{declared.lower}, {declared.upper}] "
                          f"but the program's shapes hold for [{lower}, {upper}] only (a guard of its export, or a "
                          "decomposition before aotstack saw it, narrowed it); sizes outside are refused", stacklevel=3)
            narrowed[symbol] = ValueRanges(lower, upper)
    if not narrowed:
        return exported
    program = copy.copy(exported)
    program._range_constraints = {**exported.range_constraints, **narrowed}
    return program


def mutates_in_place(exported: ExportedProgram) -> bool:
    """Whether any op of ``exported``'s graph writes to one of its arguments."""
    return any(
        isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
        for node in exported.graph.nodes
        if node.op == "call_function"
    )


def holds_subclass_weights(exported: ExportedProgram) -> bool:
    """Whether a weight or constant of ``exported`` is a tensor subclass (a torchao-quantized weight, say)."""
    values = [*exported.state_dict.values(), *exported.constants.values()]
    return any(isinstance(value, torch.Tensor) and type(value) not in PLAIN_TENSOR_TYPES for value in values)


PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def module_calling(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """A shallow copy of ``model`` whose ``forward`` is its method ``name``.

    Sharing the submodules keeps every weight's FQN as it is in ``model``, and the method's own
    signature names the program's inputs. The method stays bound to ``model``, so a method calling
    ``self.forward`` calls the model's own.
    """
    shallow = copy.copy(model)
    shallow.forward = getattr(model, name)
    return shallow


# Where TorchDynamo reaches a module through ``module_calling``'s copy: its ``forward`` is the model's bound method.
BOUND_METHOD_PATH = "forward.__self__."


def with_made_tensors_renamed(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` with each tensor a method made as it ran named by its module's path, in place.

    Strictly traced through ``module_calling``'s copy, such a tensor (GPT-Neo's attention makes its
    mask value) is lifted under ``forward.__self__.<module>``, a path the program's module lacks.
    """
    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.CONSTANT_TENSOR and (spec.target or "").startswith(BOUND_METHOD_PATH):
            renamed = spec.target.removeprefix(BOUND_METHOD_PATH)
            exported.constants[renamed] = exported.constants.pop(spec.target)
            spec.target = renamed
    return exported
