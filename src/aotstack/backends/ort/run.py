"""ONNX Runtime run side: one session per delegate, tensors passed as views, not copies."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import DelegateInitError, LoweringError
from ...format.specs import CompileSpec, SpecKey, compile_spec_value, partition_label
from ...format.tensor_data import BytesLike, weights_from_named_data
from ..base import BackendRuntime
from .packages import require_packages

DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
# The named data holding a partition's ONNX model.
MODEL_NAME = "model.onnx"


class OrtRuntime(BackendRuntime):
    """ONNX Runtime's run side: one ``InferenceSession`` per delegate."""

    backend_id = "onnxruntime"

    def init(
        self, processed_bytes: bytes, named_data: Mapping[str, BytesLike], compile_specs: list[CompileSpec]
    ) -> OrtHandle:
        processed = json.loads(processed_bytes)
        weights = weights_from_named_data(named_data, processed["weights"])
        return open_session(
            bytes(named_data[MODEL_NAME]),
            weights,
            providers(compile_specs),
            processed["inputs"],
            processed["outputs"],
            partition_label(self.backend_id, compile_specs),
        )

    def execute(self, handle: OrtHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run(handle, inputs)


def providers(compile_specs: list[CompileSpec]) -> list[str]:
    """The execution providers named by the ``providers`` compile spec."""
    value = compile_spec_value(compile_specs, SpecKey.PROVIDERS)
    if value is None:
        return list(DEFAULT_PROVIDERS)
    names = [name.strip() for name in value.decode().split(",") if name.strip()]
    if not names or not all(name.endswith("ExecutionProvider") for name in names):
        raise LoweringError(
            f"compile spec 'providers' must list ONNX Runtime execution providers, such as "
            f"'CUDAExecutionProvider,CPUExecutionProvider'; got {value!r}"
        )
    return names


@dataclass(frozen=True)
class OrtHandle:
    session: Any
    input_names: list[str]
    output_names: list[str]
    # ONNX Runtime documents that the buffers behind external initializers must outlive the session.
    keep_alive: list[Any]


def open_session(
    model: bytes,
    weights: Mapping[str, torch.Tensor],
    providers: list[str],
    input_names: list[str],
    output_names: list[str],
    label: str,
) -> OrtHandle:
    """An ``InferenceSession`` for ``model``, its external initializers taken from ``weights``."""
    require_packages(("onnxruntime",), f"{label} needs {{missing}} to run", DelegateInitError)
    import onnxruntime

    available = onnxruntime.get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        raise DelegateInitError(
            f"{label} asks for ONNX Runtime providers {missing}, which this onnxruntime lacks "
            f"(available: {', '.join(available)})"
        )
    options = onnxruntime.SessionOptions()
    # Warnings about graph optimisations it skips are not the user's to act on; errors still show.
    options.log_severity_level = 3
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    names = list(weights)
    values = [onnxruntime.OrtValue.ortvalue_from_numpy(weights[name].numpy()) for name in names]
    if names:
        options.add_external_initializers(names, values)
    try:
        session = onnxruntime.InferenceSession(model, options, providers=providers)
    except Exception as error:
        raise DelegateInitError(f"{label}: ONNX Runtime could not open the model: {error}") from error
    return OrtHandle(session, input_names, output_names, keep_alive=[weights, values])


def run(handle: OrtHandle, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run one call. Contiguous inputs and every output are shared with ONNX Runtime, not copied."""
    feeds = {name: value.detach().contiguous().numpy() for name, value in zip(handle.input_names, inputs)}
    return [torch.from_numpy(array) for array in handle.session.run(handle.output_names, feeds)]
