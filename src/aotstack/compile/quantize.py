"""Quantize: a model's linears and embeddings to int8 or int4 weights with torchao, under ExecuTorch's names.

Linear schemes: ``8w`` and ``4w`` store int8 or int4 weights; ``8da8w`` and ``8da4w`` also quantize
each row of activations to int8 as the model runs, so the matmul itself is integer. Embedding
schemes: ``8w`` and ``4w``. Weights are quantized symmetrically in groups of ``group_size`` along
the input dimension (0: one scale per output channel), as ExecuTorch's LLM export does, with
torchao's ``quantize_``, before export. The exported program carries torchao's
quantize/dequantize ops around each linear and embedding, which each engine maps to its own
quantized kernels.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import QuantizationError
from .int8_tensor import int8_linear

LINEAR_SCHEMES: dict[str, tuple[int, bool]] = {
    # scheme: (weight bits, activations quantized at run time)
    "8w": (8, False),
    "8da8w": (8, True),
    "4w": (4, False),
    "8da4w": (4, True),
}
EMBEDDING_SCHEMES: dict[str, int] = {"8w": 8, "4w": 4}


@dataclass(frozen=True)
class Quantization:
    """What ``quantize`` applies: a linear scheme, an embedding scheme (either may be None), a group size."""

    linear: str | None = None
    embedding: str | None = None
    group_size: int = 32

    def __post_init__(self) -> None:
        check_scheme(self.linear, LINEAR_SCHEMES, "linear")
        check_scheme(self.embedding, EMBEDDING_SCHEMES, "embedding")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 0:
            raise QuantizationError(
                f"group_size must be a non-negative int (0: one scale per output channel), got {self.group_size!r}"
            )

    def __bool__(self) -> bool:
        return self.linear is not None or self.embedding is not None

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Quantize ``model``'s layers in place and return it (``quantize``'s work)."""
        if not isinstance(model, torch.nn.Module):
            raise QuantizationError(f"quantize needs a torch.nn.Module, got {type(model).__name__}")
        if not self:
            return model
        require_torchao()
        from torchao.quantization import quantize_

        # Embeddings first: a tied output projection keeps its own float weight to quantize as a linear.
        if self.embedding is not None:
            layers = quantizable_layers(model, torch.nn.Embedding)
            check_group_size(layers, self.group_size, f"embedding {self.embedding}")
            quantize_(model, embedding_config(self), filter_fn=in_layers(layers))
        if self.linear is not None:
            layers = quantizable_layers(model, torch.nn.Linear)
            check_group_size(layers, self.group_size, f"linear {self.linear}")
            quantize_(model, linear_config(self), filter_fn=in_layers(layers))
        return model

    def describe(self) -> str:
        """``"linear 8da4w, embedding 4w, group 32"``."""
        parts = [f"{kind} {scheme}" for kind, scheme in (("linear", self.linear), ("embedding", self.embedding))
                 if scheme is not None]
        group = "per channel" if self.group_size == 0 else f"group {self.group_size}"
        return ", ".join([*parts, group]) if parts else "none"


def quantize(
    model: torch.nn.Module, *, linear: str | None = None, embedding: str | None = None, group_size: int = 32
) -> torch.nn.Module:
    """Quantize ``model``'s ``nn.Linear`` and ``nn.Embedding`` weights in place and return it.

    Example::

        model = aotstack.quantize(model, linear="8da4w", embedding="4w", group_size=32)
        program = aotstack.export(model, {"forward": (input_ids,)})

    Raises ``QuantizationError`` for an unknown scheme, when torchao is not installed, or when a
    layer's input dimension is not a multiple of ``group_size`` (naming the layer).
    """
    return Quantization(linear, embedding, group_size).apply(model)


def check_scheme(scheme: str | None, schemes: dict[str, Any], kind: str) -> None:
    if scheme is not None and scheme not in schemes:
        raise QuantizationError(
            f"unknown {kind} quantization {scheme!r}; supported: {', '.join(schemes)} (or None to leave them float)"
        )


def require_torchao() -> None:
    if importlib.util.find_spec("torchao") is None:
        raise QuantizationError("quantize needs torchao; install it with: pip install 'aotstack[quantize]'")


def quantizable_layers(model: torch.nn.Module, kind: type[torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """The layers of ``kind`` whose weight is still a plain floating tensor, by qualified name.

    ``nn.MultiheadAttention``'s output projection is left float, as torchao's own filter leaves it:
    the attention reads its weight as a plain tensor (``F.multi_head_attention_forward``), which a
    quantized weight is not (SigLIP's pooling head failed eagerly, in a vision tower).
    """
    return {
        name: module for name, module in model.named_modules()
        if isinstance(module, kind)
        and not isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear)
        and type(module.weight) in (torch.Tensor, torch.nn.Parameter)
        and module.weight.is_floating_point()
    }


def check_group_size(layers: dict[str, torch.nn.Module], group_size: int, scheme: str) -> None:
    if group_size == 0:
        return
    misfits = {name: tuple(layer.weight.shape) for name, layer in layers.items() if layer.weight.shape[-1] % group_size}
    if misfits:
        listed = ", ".join(f"{name or 'the model'} {list(shape)}" for name, shape in list(misfits.items())[:5])
        more = f" and {len(misfits) - 5} more" if len(misfits) > 5 else ""
        raise QuantizationError(
            f"{scheme}: group_size {group_size} does not divide the input dimension of {listed}{more}; "
            "pick a group size that divides it, or 0 for one scale per output channel"
        )


def in_layers(layers: dict[str, torch.nn.Module]) -> Callable[[torch.nn.Module, str], bool]:
    chosen = {id(layer) for layer in layers.values()}
    return lambda module, name: id(module) in chosen


def granularity(group_size: int) -> Any:
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group_size == 0 else PerGroup(group_size)


def weight_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else torch.int4


def linear_config(quantization: Quantization) -> Any:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig

    bits, dynamic_activations = LINEAR_SCHEMES[quantization.linear]
    if dynamic_activations:
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=weight_dtype(bits), weight_granularity=granularity(quantization.group_size)
        )
    return IntxWeightOnlyConfig(weight_dtype=weight_dtype(bits), granularity=granularity(quantization.group_size))


def embedding_config(quantization: Quantization) -> Any:
    from torchao.quantization import IntxWeightOnlyConfig

    bits = EMBEDDING_SCHEMES[quantization.embedding]
    return IntxWeightOnlyConfig(weight_dtype=weight_dtype(bits), granularity=granularity(quantization.group_size))


def quantized_layers(nodes: Iterable[torch.fx.Node]) -> dict[str, int]:
    """How many quantized linears and embeddings ``nodes`` hold, by ``"linear 8da4w, group 32"``-style label.

    Read from the graph torchao's configs leave: a linear or embedding whose weight is a
    ``dequantize_affine`` of integer weights, and, for ``8da…``, a linear whose input is a
    quantize-dequantize round of the activations; or an ``Int8Tensor`` linear
    (``Int8WeightOnlyConfig``, ``Int8DynamicActivationInt8WeightConfig``; see ``int8_tensor.py``),
    counted at its result. Any engine's partition can be described so.
    """
    counts: dict[str, int] = {}
    for node in nodes:
        label = quantized_layer_label(node)
        if label is not None:
            counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items()))


def quantized_layer_label(node: torch.fx.Node) -> str | None:
    int8_layer = int8_linear(node)
    if int8_layer is not None:
        return int8_layer.label
    if node.op != "call_function" or node.target not in QUANTIZABLE_OPS:
        return None
    linear = node.target is torch.ops.aten.linear.default
    weight = node.args[1] if linear else node.args[0]
    bits_and_group = dequantized_weight(weight)
    if bits_and_group is None:
        return None
    bits, group = bits_and_group
    activations = "8da" if linear and is_dequantize(node.args[0]) and is_quantize(node.args[0].args[0]) else ""
    grouping = "per channel" if group == 0 else f"group {group}"
    return f"{'linear' if linear else 'embedding'} {activations}{bits}w, {grouping}"


def dequantized_weight(value: Any) -> tuple[int, int] | None:
    """(bits, group size; 0 per channel) of a weight dequantized from stored integers, or None."""
    if not is_dequantize(value) or value.args[0].op != "placeholder":
        return None
    stored, block_size = value.args[0].meta.get("val"), value.args[1]
    quant_min, quant_max = (list(value.args[5:7]) + [None, None])[:2]
    if not isinstance(stored, torch.Tensor) or quant_min is None or quant_max is None:
        return None
    bits = int(quant_max - quant_min + 1).bit_length() - 1
    group = int(block_size[-1])
    return bits, 0 if group == stored.shape[-1] else group


def zero_free(zero_point: Any, fqns: Mapping[torch.fx.Node, str], weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether a dequantization's zero point is absent or a stored tensor of zeros (symmetric quantization)."""
    if zero_point is None:
        return True
    value = weights.get(fqns[zero_point]) if zero_point in fqns else None
    return isinstance(value, torch.Tensor) and not bool(value.any())


def is_dequantize(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and value.op == "call_function" and op_qualname(value) == DEQUANTIZE


def is_quantize(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and value.op == "call_function" and op_qualname(value) == QUANTIZE


def op_qualname(node: torch.fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None)
    return None if schema is None else schema.name


QUANTIZABLE_OPS = (torch.ops.aten.linear.default, torch.ops.aten.embedding.default)
DEQUANTIZE = "torchao::dequantize_affine"
QUANTIZE = "torchao::quantize_affine"
