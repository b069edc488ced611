"""README.md is the operator's manual: it must name every setting and every error code."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from producer.wire import ErrorCode
from worker.config import WorkerConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_setting_is_documented() -> None:
    missing = [
        f.metadata["env"] for f in fields(WorkerConfig) if f"`{f.metadata['env']}`" not in README
    ]
    assert missing == []


def test_every_error_code_is_documented() -> None:
    missing = [code.value for code in ErrorCode if f"| `{code.value}` |" not in README]
    assert missing == []


def test_the_documented_test_command_is_what_ci_runs() -> None:
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "make test     #" in README
    assert ci.strip().splitlines()[-1] == "make test"
