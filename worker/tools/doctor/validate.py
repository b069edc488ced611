"""validate(): a report checked against SCHEMA, by the reports' one validator
(worker/tools/harness/report_head.py, `check`), without a JSON Schema dependency."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.tools.doctor.schema import SCHEMA
from worker.tools.harness.report_head import check


def validate(instance: Any, schema: Mapping[str, Any] = SCHEMA, path: str = "$") -> list[str]:
    """Problems of `instance` against `schema` (empty: valid)."""
    return check(instance, schema, path)
