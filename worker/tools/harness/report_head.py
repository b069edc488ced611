"""The block every measurement report opens with: where and on what it ran.

The doctor's report and the GPU check's call it `environment`, the benchmark's `host`; each
carries a part of one set of fields (FIELDS), and some of the bench's under a name of its
own (`gpu` for `device_name`). FIELDS is that block's one definition: the builders
(environment.py, provenance.py) pass what they measured through `block`, each report's
validator checks its block with `problems`, the doctor's schema embeds `json_schema`, and
docs/report-common.md holds `head_markdown()`.

The JSON Schema subset the doctor's whole report and these blocks are written in (type,
properties, required, additionalProperties, items, enum; a `unit` beside `description`) is
here too, with its one validator, `check`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from worker.tools.markdown import table

DOCTOR, GPU_CHECK, BENCH = "doctor", "gpu_check", "bench"
REPORTS = (DOCTOR, GPU_CHECK, BENCH)
# Each report's name for the block: saved reports and their readers (docs/figures/*.json,
# measure/bench/figures_page.py, the doctor's console view) use these.
BLOCK_NAMES = {DOCTOR: "environment", GPU_CHECK: "environment", BENCH: "host"}
REPORT_TITLES = {DOCTOR: "doctor", GPU_CHECK: "GPU check", BENCH: "bench"}
PAGE = "report-common.md"
ALWAYS = "yes"


# --------------------------------------------------------------------------- JSON Schema
def node(types: str | list[str], description: str, unit: str = "", **extra: Any) -> dict[str, Any]:
    """A leaf of a schema: its JSON type(s), what it means, and its unit where it has one."""
    made: dict[str, Any] = {"type": types, "description": description}
    if unit:
        made["unit"] = unit
    made.update(extra)
    return made


def object_node(
    description: str, properties: dict[str, Any], *, nullable: bool = False
) -> dict[str, Any]:
    """An object whose every key is given, and no other."""
    return {
        "type": ["object", "null"] if nullable else "object",
        "description": description,
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def check(instance: Any, schema: Mapping[str, Any], path: str = "$") -> list[str]:
    """Problems of `instance` against `schema` (empty: valid). Covers the keywords the
    reports' schemas use, so that no JSON Schema dependency is needed for them."""
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
                problems += check(value, props[key], f"{path}.{key}")
            elif extra is False:
                problems.append(f"{path}: undocumented key {key!r}")
            elif isinstance(extra, Mapping):
                problems += check(value, extra, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            problems += check(item, schema["items"], f"{path}[{i}]")
    return problems


# --------------------------------------------------------------------------- the fields
@dataclass(frozen=True)
class Carried:
    """How one report carries a field: `when` it has the key (ALWAYS: every report of that
    kind has it, so the validator requires it; otherwise the condition, and the key is
    optional), and its own `name` for it where that differs."""

    when: str = ALWAYS
    name: str = ""


@dataclass(frozen=True)
class Field:
    key: str
    types: tuple[str, ...]
    meaning: str
    unit: str
    carried: Mapping[str, Carried]

    def name_in(self, report: str) -> str:
        return self.carried[report].name or self.key


def _field(key: str, types: str, meaning: str, unit: str = "", **carried: str | Carried) -> Field:
    return Field(
        key=key,
        types=tuple(types.split("|")),
        meaning=meaning,
        unit=unit,
        carried={
            report: how if isinstance(how, Carried) else Carried(how)
            for report, how in carried.items()
        },
    )


# Reports saved before a report carried a key lack it and stay valid: its `when` is the date
# that report started writing it.
_SINCE_SHARED = "since 2026-12-05"
_SINCE_HEAD = "since 2026-12-07"
_SINCE_PROVENANCE = "since 2026-12-04"

FIELDS: tuple[Field, ...] = (
    _field("host", "string", "host name", doctor=ALWAYS, gpu_check=ALWAYS, bench=ALWAYS),
    _field("python", "string", "Python version", doctor=ALWAYS, gpu_check=ALWAYS, bench=ALWAYS),
    _field("torch", "string", "PyTorch version", doctor=ALWAYS, gpu_check=ALWAYS, bench=ALWAYS),
    _field(
        "cpu_count",
        "integer",
        "CPU cores: the doctor and the GPU check count those this process may use, the bench "
        "the host's",
        "cores",
        doctor=ALWAYS,
        gpu_check=_SINCE_SHARED,
        bench=ALWAYS,
    ),
    _field(
        "cuda_available",
        "boolean",
        "whether PyTorch sees a CUDA device",
        doctor=ALWAYS,
        gpu_check=ALWAYS,
    ),
    _field(
        "device_name",
        "string|null",
        "the CUDA device's name (the first one's; the bench's, the device measured); null on CPU",
        doctor=ALWAYS,
        gpu_check=ALWAYS,
        bench=Carried("on CUDA", name="gpu"),
    ),
    _field("device_count", "integer", "CUDA devices PyTorch sees", "devices", gpu_check="on CUDA"),
    _field(
        "capability",
        "string",
        "the first CUDA device's compute capability, e.g. `9.0`",
        gpu_check="on CUDA",
    ),
    _field(
        "torch_cuda",
        "string|null",
        "the CUDA version PyTorch was built for; null for a CPU build",
        gpu_check=ALWAYS,
    ),
    _field("torchvision", "string", "torchvision's version", gpu_check="where installed"),
    _field(
        "cpu_model",
        "string|null",
        "the first `model name` of /proc/cpuinfo; null without one",
        gpu_check=_SINCE_HEAD,
        bench=_SINCE_PROVENANCE,
    ),
    _field(
        "commit",
        "string|null",
        "`git rev-parse HEAD` of the source tree measured; null outside a git checkout",
        gpu_check=_SINCE_HEAD,
        bench=_SINCE_PROVENANCE,
    ),
    _field(
        "commit_dirty",
        "boolean|null",
        "tracked files differed from that commit; null when unknown",
        gpu_check=_SINCE_HEAD,
        bench=_SINCE_PROVENANCE,
    ),
    _field("platform", "string", "the operating system, its kernel and C library", bench=ALWAYS),
    _field("torch_threads", "integer", "PyTorch's intra-op threads", "threads", bench=ALWAYS),
    _field("device", "string", "the device measured, e.g. `cpu`, `cuda:0`", bench=ALWAYS),
    _field(
        "load_avg_1m_at_start",
        "number",
        "the 1-minute load average when the benchmark started",
        bench=ALWAYS,
    ),
    _field("load_avg_1m_at_end", "number", "the same when it ended", bench=ALWAYS),
)


def fields_of(report: str) -> list[Field]:
    """The fields `report` carries, in the table's order."""
    if report not in REPORTS:
        raise ValueError(f"no report {report!r}: one of {REPORTS}")
    return [f for f in FIELDS if report in f.carried]


# --------------------------------------------------------------------------- uses
def block(report: str, measured: Mapping[str, Any]) -> dict[str, Any]:
    """`report`'s block from what was measured (keyed by FIELDS' keys): the fields it
    carries, under its own names, and nothing else. What it always carries and was not
    measured is for its validator to find (the bench adds its load at the end later)."""
    return {f.name_in(report): measured[f.key] for f in fields_of(report) if f.key in measured}


def _leaf(f: Field) -> dict[str, Any]:
    return node(list(f.types) if len(f.types) > 1 else f.types[0], f.meaning, f.unit)


def json_schema(report: str) -> dict[str, Any]:
    """`report`'s block as a JSON Schema node: every field it carries typed, those it always
    carries required, no other key."""
    carried = fields_of(report)
    return {
        "type": "object",
        "description": "where and on what it ran",
        "properties": {f.name_in(report): _leaf(f) for f in carried},
        "required": [f.name_in(report) for f in carried if f.carried[report].when == ALWAYS],
        "additionalProperties": False,
        "x-see": f"{PAGE}#the-fields",
    }


def problems(head: Any, report: str, path: str | None = None) -> list[str]:
    """What is wrong with `report`'s block `head` (empty: nothing); `path` names it in each
    problem (the report's name for it by default)."""
    return check(head, json_schema(report), path or BLOCK_NAMES[report])


def _carried_cell(f: Field, report: str) -> str:
    how = f.carried.get(report)
    if how is None:
        return "–"
    return how.when + (f", as `{how.name}`" if how.name else "")


def head_markdown() -> str:
    """FIELDS as the Markdown table docs/report-common.md holds: each field, and which
    report carries it, when, and under which name."""
    rows = [
        [
            f"`{f.key}`",
            " or ".join(f.types),
            f.unit,
            f.meaning,
            *(_carried_cell(f, r) for r in REPORTS),
        ]
        for f in FIELDS
    ]
    header = ["key", "type", "unit", "meaning", *(REPORT_TITLES[r] for r in REPORTS)]
    return table(header, rows) + "\n"
