"""The JSON Schema (draft 2020-12) of ``Report.to_json()``: what ``aotstack inspect --json`` prints.

``aotstack inspect --schema`` prints it. A tool may rely on every field listed here; a later
``schema_version`` may add fields, and changes the number when it changes or drops one.
"""

from __future__ import annotations

from typing import Any

from ..format.placement import COMPILE_STATES, REASON_KINDS
from .model import SCHEMA_NAME, SCHEMA_VERSION


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def strict(properties: dict[str, Any], description: str = "") -> dict[str, Any]:
    """An object with exactly these properties, every one required."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }
    if description:
        schema["description"] = description
    return schema


COUNT = {"type": "integer", "minimum": 0}
TEXT = {"type": "string"}

TENSOR = strict(
    {
        "dtype": {**TEXT, "description": "torch dtype name, e.g. float32"},
        "shape": {"type": "array", "items": nullable(COUNT), "description": "sizes; null for a dynamic one"},
    }
)

SECONDS = {"type": "number", "minimum": 0}

REASON = strict(
    {
        "engine": {**TEXT, "description": "backend id of the partitioner that looked at the op"},
        "kind": {"enum": list(REASON_KINDS)},
        "detail": {**TEXT, "description": "the reason in a sentence"},
    }
)

DELEGATE = strict(
    {
        "id": TEXT,
        "engine": {**TEXT, "description": "backend id, e.g. aoti_cpu, onnxruntime"},
        "device": {**TEXT, "description": "where it runs, e.g. cpu, cuda:0"},
        "ops": {**nullable(COUNT), "description": "ops it replaced; null where the file did not record them"},
        "op_counts": {"type": "object", "additionalProperties": COUNT, "description": "op name -> count"},
        "distinct_ops": {"type": "array", "items": TEXT},
        "inputs": {"type": "array", "items": TENSOR},
        "outputs": {"type": "array", "items": TENSOR},
        "code_bytes": {**nullable(COUNT), "description": "compiled code (libraries, engine models); null in a dry run"},
        "weight_bytes": {**COUNT, "description": "the weights it holds"},
        "compile_state": nullable({"enum": list(COMPILE_STATES)}),
        "compile_seconds": nullable({"type": "number", "minimum": 0}),
        "run_seconds": {**nullable(SECONDS), "description": "median seconds a call, where auto measured it"},
        "quantized": {
            "type": "object",
            "additionalProperties": COUNT,
            "description": "its quantized layers by kind and scheme, e.g. 'linear 8da4w, group 32' -> 28",
        },
        "state": {
            "type": "array",
            "items": {"type": "string"},
            "description": (
                "the buffers it owns (a KV cache), kept with it on its device: updated in place, or inside the "
                "engine where its run side keeps state (decided at load)"
            ),
        },
    }
)

CANDIDATE = strict(
    {
        "engines": {"type": "array", "items": TEXT, "description": "the plan's engines, in the order they claim"},
        "seconds": {**nullable(SECONDS), "description": "median seconds a call; null where it failed"},
        "engine_seconds": {"type": "object", "additionalProperties": SECONDS,
                           "description": "engine -> median seconds a call in its delegates"},
        "error": nullable(TEXT),
        "resident_bytes": {**nullable(COUNT),
                           "description": "resident memory the loaded file held after its calls; null where unknown"},
    }
)

SELECTION = strict(
    {
        "candidates": {"type": "array", "items": CANDIDATE},
        "chosen": {**COUNT, "description": "index of the plan kept"},
        "threads": {"type": "integer", "minimum": 1},
        "reason": {**TEXT, "description": "why the plan kept won, in a sentence"},
    },
    "how lower(..., 'auto') chose this method's engines",
)

METHOD = strict(
    {
        "name": TEXT,
        "inputs": {"type": "array", "items": TEXT, "description": "e.g. 'x: float32[4, s0 in [1, 64]]'"},
        "ops": {**nullable(COUNT), "description": "ops counted (no sizes, getitems or copies); null: not recorded"},
        "engines": {
            "type": "array",
            "description": "each engine's share of the ops, most first; 'aten' (plain ATen) last",
            "items": strict(
                {
                    "engine": TEXT,
                    "ops": COUNT,
                    "share": {"type": "number", "minimum": 0, "maximum": 1},
                    "delegates": COUNT,
                }
            ),
        },
        "delegates": {"type": "array", "items": DELEGATE},
        "unclaimed": {
            "type": "array",
            "description": "ops left to plain ATen, grouped by op and reasons, in graph order",
            "items": strict(
                {
                    "op": TEXT,
                    "nodes": {"type": "array", "items": TEXT},
                    "reasons": {
                        "type": "array",
                        "items": REASON,
                        "description": "one per partitioner that looked, in order; empty: no partitioner ran",
                    },
                }
            ),
        },
        "copies": {
            "type": "array",
            "items": strict({"step": TEXT, "source": TEXT, "to": {**TEXT, "description": "cpu for the host"}}),
        },
        "weights": strict({"count": COUNT, "bytes": COUNT}, "weights the method reads outside delegates"),
        "selection": nullable(SELECTION),
        "guards": {
            "type": "array",
            "items": TEXT,
            "description": "conditions on the input sizes, beyond their ranges, that a call must meet, as the file's "
                           "grammar writes them (Python's syntax for ints, size symbols, arithmetic and comparisons)",
        },
    }
)

REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "aotstack partition report",
    **strict(
        {
            "schema": {"const": SCHEMA_NAME},
            "schema_version": {"const": SCHEMA_VERSION},
            "source": {**nullable(TEXT), "description": "the file's path; null for a program not saved"},
            "planned": {"type": "boolean", "description": "a dry run: nothing was compiled"},
            "aotstack_version": TEXT,
            "torch_version": TEXT,
            "format_version": COUNT,
            "methods": {"type": "array", "items": METHOD},
            "sizes": strict(
                {
                    "total": COUNT,
                    "saved": {"type": "boolean", "description": "false: sizes are what saving would store"},
                    "parts": {"type": "array", "items": strict({"part": TEXT, "bytes": COUNT})},
                }
            ),
            "check": {
                **nullable({"type": "object"}),
                "description": "what lower(check=...) measured (CheckResult.to_json()); null where nothing was",
            },
            "custom_ops": {
                "type": "array",
                "description": "ops outside ATen the file calls; a loading process must register each first",
                "items": strict(
                    {
                        "name": {**TEXT, "description": "namespace.op.overload"},
                        "schema": TEXT,
                        "module": {**nullable(TEXT), "description": "the module whose import registers it"},
                        "used_by": {
                            "type": "array",
                            "items": TEXT,
                            "description": "delegate ids calling it; 'plan' where a plan step does (allow_ops)",
                        },
                        "devices": {"type": "array", "items": TEXT},
                    }
                ),
            },
        }
    ),
}
