"""The intake reads Redis's error answers with a private part of redis-py
(`redis._parsers.base.BaseParser.parse_error`): pyproject.toml pins redis-py to the range
where it is what worker/delivery/stream_reply.py expects, the installed one is in that
range, and a redis-py whose private part moved or changed stops the worker at start-up with
one line naming its version, never a traceback the first time Redis answers with an error.
Redis itself is never replaced: only redis-py's private attribute is taken away."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import pytest
import redis._parsers.base as redis_parsers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from redis.exceptions import ResponseError

from worker.delivery import stream_reply

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 hosts install tomli (pyproject.toml)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

# Modules that still import redis-py's private parsers themselves: being rewritten (their
# error answers are to be read through stream_reply's checked `_PARSE_ERROR`).
PRIVATE_IMPORT_ALLOWED: set[str] = set()


def pinned_redis() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "redis"]
    return pin


def test_pyproject_pins_redis_py_to_the_range_the_check_states_and_it_is_installed() -> None:
    pin = pinned_redis()
    assert pin.specifier == SpecifierSet(Requirement(stream_reply.SUPPORTED_REDIS_PY).specifier), (
        f"pyproject.toml pins {pin}, stream_reply.py says {stream_reply.SUPPORTED_REDIS_PY}"
    )
    assert any(s.operator == "<" for s in pin.specifier), f"{pin}: no upper bound"
    assert pin.specifier.contains(version("redis")), (
        f"redis-py {version('redis')} is installed, outside {pin.specifier}"
    )


def test_the_installed_redis_py_maps_error_answers_as_the_intake_expects() -> None:
    parse = stream_reply.redis_parse_error()
    error = stream_reply.ErrorReply("NOGROUP No such key 'jobs' or consumer group 'g'")
    assert isinstance(error.error, ResponseError)
    assert parse == redis_parsers.BaseParser.parse_error


def _wrong_mapping(response: str) -> Exception:
    return ResponseError(response)


CHANGES: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "module without BaseParser": lambda mp: mp.delattr(redis_parsers, "BaseParser"),
    "BaseParser without parse_error": lambda mp: mp.delattr(
        redis_parsers.BaseParser, "parse_error"
    ),
    "parse_error taking other arguments": lambda mp: mp.setattr(
        redis_parsers.BaseParser, "parse_error", classmethod(lambda cls, a, b: ResponseError(a))
    ),
    "parse_error mapping LOADING otherwise": lambda mp: mp.setattr(
        redis_parsers.BaseParser, "parse_error", staticmethod(_wrong_mapping)
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_private_api_is_refused_in_one_line_naming_the_version(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    CHANGES[change](monkeypatch)
    with pytest.raises(stream_reply.RedisPyUnsupported) as refused:
        stream_reply.redis_parse_error()
    line = str(refused.value)
    assert line.startswith(f"redis-py {version('redis')} ")
    assert "\n" not in line and stream_reply.SUPPORTED_REDIS_PY in line


def test_the_worker_stops_at_start_up_with_that_line_and_no_traceback() -> None:
    # The reader's import is where a worker first loads stream_reply (before any read).
    code = (
        "import redis._parsers.base as b\n"
        "del b.BaseParser.parse_error\n"
        "import worker.delivery.reader\n"
        "print('imported')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        f"gpufeed: redis-py {version('redis')} has no "
        "redis._parsers.base.BaseParser.parse_error (the worker reads Redis's error answers "
        f"with it): pip install '{stream_reply.SUPPORTED_REDIS_PY}'"
    ]


def test_redis_py_private_parsers_are_imported_in_one_place() -> None:
    importers = set()
    for path in [*ROOT.joinpath("worker").rglob("*.py"), *ROOT.joinpath("producer").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "redis._parsers" or n.startswith("redis._parsers.") for n in names):
                importers.add(path.relative_to(ROOT).as_posix())
    assert importers - PRIVATE_IMPORT_ALLOWED == {"worker/delivery/stream_reply.py"}
