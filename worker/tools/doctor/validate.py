"""validate(): a report checked against SCHEMA, without a JSON Schema dependency."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from worker.tools.doctor.schema import SCHEMA

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate(instance: Any, schema: Mapping[str, Any] = SCHEMA, path: str = "$") -> list[str]:
    """Problems of `instance` against `schema` (empty: valid). Covers the JSON Schema
    keywords SCHEMA uses, so that no dependency is needed for it."""
    types = schema.get("type")
    allowed = [types] if isinstance(types, str) else list(types or [])
    if allowed and not any(_JSON_TYPES[t](instance) for t in allowed):
        return [f"{path}: expected {' or '.join(allowed)}, got {type(instance).__name__}"]
    problems: list[str] = []
    if "enum" in schema and instance not in schema["enum"]:
        problems.append(f"{path}: {instance!r} is not one of {schema['enum']}")
    if isinstance(instance, dict):
        props: Mapping[str, Any] = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in instance:
                problems.append(f"{path}: missing key {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in props:
                problems += validate(value, props[key], f"{path}.{key}")
            elif extra is False:
                problems.append(f"{path}: undocumented key {key!r}")
            elif isinstance(extra, Mapping):
                problems += validate(value, extra, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            problems += validate(item, schema["items"], f"{path}[{i}]")
    return problems
