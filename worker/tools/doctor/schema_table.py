"""schema_markdown(): SCHEMA as the Markdown table that docs/doctor-schema.md holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.tools.doctor.schema import SCHEMA
from worker.tools.markdown import table


def schema_markdown(schema: Mapping[str, Any] = SCHEMA) -> str:
    """The schema as a Markdown table (docs/doctor-schema.md holds exactly this)."""
    rows: list[list[str]] = []

    def walk(node: Mapping[str, Any], path: str) -> None:
        types = node.get("type")
        type_text = types if isinstance(types, str) else " or ".join(types or [])
        if "enum" in node:
            type_text += ": " + ", ".join(f"`{v}`" for v in node["enum"])
        if path:
            unit = node.get("unit", "")
            rows.append([f"`{path}`", type_text, unit, node.get("description", "")])
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}" if path else key)
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping):
            walk(extra, f"{path}.<{node.get('x-key', 'key')}>")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    return table(["key", "type", "unit", "meaning"], rows, escape=False) + "\n"
