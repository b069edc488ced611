"""README.md is the operator's manual: it must name every setting and every error code,
and `--help` must say what each setting does."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer.wire import ErrorCode
from worker import settings_help
from worker.cli import cli
from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_setting_is_documented() -> None:
    missing = [
        f.metadata["env"] for f in fields(WorkerConfig) if f"`{f.metadata['env']}`" not in README
    ]
    assert missing == []


def test_every_setting_has_a_meaning() -> None:
    assert settings_help.missing() == [], "add a row to worker/settings_help.py"
    known = {f.metadata["env"] for f in fields(WorkerConfig)}
    assert set(settings_help.SETTINGS) <= known, "a row for a setting that does not exist"


def test_readme_configuration_table_is_the_settings_table() -> None:
    table = settings_help.markdown_table()
    assert table in README, (
        "README.md's Configuration table differs from worker/settings_help.py; it should read:\n"
        + table
    )


def test_every_error_code_is_documented() -> None:
    missing = [code.value for code in ErrorCode if f"| `{code.value}` |" not in README]
    assert missing == []


def test_the_documented_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test     #" in README
    assert ci.strip().splitlines()[-1] == "make test"


def _squeeze(text: str) -> str:
    # Help text is wrapped (sometimes after a hyphen): compare without any whitespace.
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"]])
def test_worker_help_shows_every_setting_with_its_meaning(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args, prog_name="python -m worker")
    assert result.exit_code == 0, result.output
    shown = _squeeze(result.output)
    for f in fields(WorkerConfig):
        env = f.metadata["env"]
        flag = "--" + f.name.replace("_", "-")
        assert flag in result.output, flag
        assert _squeeze(f"{settings_help.meaning(env)} [env {env};") in shown, env
    assert result.output.count("--help") == 1
    if args == ["--help"]:
        for command in ("run", "demo", "doctor", "top", "bench"):
            assert re.search(rf"^\s+{command}\s", result.output, re.M), command
