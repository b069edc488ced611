"""One tree of errors: every exception class worker/ defines derives from GpufeedError, and
the ones that end a command carry their exit code and the line said, found without a table
of names."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import worker
from producer.wire import ErrorCode
from worker.base.errors import EXIT_COMPILE, EXIT_CONFIG, EXIT_REDIS, ConfigError, GpufeedError
from worker.cli import exit_for
from worker.decode.cpu import DecodeError
from worker.delivery.redis_check import REDIS_FIX, RedisUnavailable
from worker.model.compiler import CompileRefused
from worker.model.loader import WEIGHTS_FIX, WeightsUnavailable
from worker.tools.doctor.redis_access import RedisNotAnswering


def worker_exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a module of worker/ (each module imported)."""
    found: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(worker.__path__, "worker."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == info.name
            ):
                found.append(value)
    return found


def test_every_error_worker_defines_is_a_gpufeed_error() -> None:
    classes = worker_exception_classes()
    assert len(classes) >= 20, classes  # the walk found the modules
    outside = sorted(
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, GpufeedError)
    )
    assert not outside, f"derive these from worker.base.errors.GpufeedError: {outside}"


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (
            ConfigError("GPUFEED_BATCH_SIZE must be > 0"),
            EXIT_CONFIG,
            "GPUFEED_BATCH_SIZE must be > 0",
        ),
        (WeightsUnavailable("no network"), EXIT_CONFIG, f"no network. {WEIGHTS_FIX}"),
        (RedisUnavailable("refused"), EXIT_REDIS, f"refused; {REDIS_FIX}"),
        (CompileRefused("graph breaks"), EXIT_COMPILE, "graph breaks"),
        (RedisNotAnswering("redis://x:6379 refused"), EXIT_REDIS, "redis://x:6379 refused"),
    ],
)
def test_an_error_that_ends_a_command_brings_its_code_and_line(
    error: GpufeedError, code: int, line: str
) -> None:
    assert exit_for(error) == (code, line)


def test_an_error_that_ends_no_command_goes_on_up() -> None:
    assert exit_for(DecodeError(ErrorCode.DECODE_ERROR, "truncated")) is None
    assert exit_for(ValueError("not ours")) is None


def test_every_error_with_an_exit_code_uses_one_of_the_documented_codes() -> None:
    codes = {c.exit_code for c in worker_exception_classes() if issubclass(c, GpufeedError)}
    assert codes <= {None, EXIT_CONFIG, EXIT_REDIS, EXIT_COMPILE}, codes
