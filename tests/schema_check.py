"""A small JSON Schema checker, for the subset the report's schema uses (no network, no extra package)."""

from __future__ import annotations

from typing import Any

TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def schema_errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema``, each as ``path: what``; empty where it follows it."""
    if "anyOf" in schema:
        if all(schema_errors(value, option, where) for option in schema["anyOf"]):
            return [f"{where}: matches none of {len(schema['anyOf'])} alternatives"]
        return []
    errors = []
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    kind = schema.get("type")
    if kind is not None and not has_type(value, kind):
        return [*errors, f"{where}: expected {kind}, got {type(value).__name__}"]
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: {value} is below {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: {value} is above {schema['maximum']}")
    if isinstance(value, dict):
        errors += object_errors(value, schema, where)
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{index}]")
    return errors


def object_errors(value: dict[str, Any], schema: dict[str, Any], where: str) -> list[str]:
    errors = [f"{where}: lacks {key!r}" for key in schema.get("required", ()) if key not in value]
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            errors += schema_errors(item, properties[key], f"{where}.{key}")
        elif extra is False:
            errors.append(f"{where}: unexpected {key!r}")
        elif isinstance(extra, dict):
            errors += schema_errors(item, extra, f"{where}.{key}")
    return errors


def has_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, TYPES[kind])
