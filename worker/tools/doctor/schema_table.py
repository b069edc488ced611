"""schema_markdown(): SCHEMA as the Markdown table that docs/doctor-schema.md holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.tools.doctor.schema import SCHEMA
from worker.tools.markdown import table


def _type_text(node: Mapping[str, Any]) -> str:
    types = node.get("type")
    text = types if isinstance(types, str) else " or ".join(types or [])
    if "enum" in node:
        text += ": " + ", ".join(f"`{v}`" for v in node["enum"])
    return text


def _shared(node: Mapping[str, Any]) -> str:
    """A block defined for several reports (`x-see`): its keys, and where they are told."""
    keys = ", ".join(f"`{k}`" for k in node.get("properties", {}))
    return f"{node.get('description', '')}: {keys}, as [report heads]({node['x-see']}) describes"


def schema_markdown(schema: Mapping[str, Any] = SCHEMA) -> str:
    """The schema as a Markdown table (docs/doctor-schema.md holds exactly this). A block
    shared with other reports is one row that points to its page, not its fields again."""
    rows: list[list[str]] = []

    def walk(node: Mapping[str, Any], path: str) -> None:
        if path:
            meaning = _shared(node) if "x-see" in node else node.get("description", "")
            rows.append([f"`{path}`", _type_text(node), node.get("unit", ""), meaning])
        if "x-see" in node:
            return
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}" if path else key)
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping):
            walk(extra, f"{path}.<{node.get('x-key', 'key')}>")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    return table(["key", "type", "unit", "meaning"], rows, escape=False) + "\n"
