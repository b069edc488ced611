"""`doctor` measures the Redis the operator names, or none: a REDIS_URL that does not answer
ends it with exit 3 and one line, never a report on a private stand-in (the private
redis-server path, with REDIS_URL unset, is run by tests/tools/test_doctor.py)."""

from __future__ import annotations

import pytest

from tests.support.cli_runner import run_module
from worker.config.settings import WorkerConfig
from worker.tools.doctor import run_doctor
from worker.tools.doctor.redis_access import RedisNotAnswering, free_port


def closed_url() -> str:
    return f"redis://ops:s3cret@127.0.0.1:{free_port()}/0"


@pytest.mark.slow
def test_an_unanswering_redis_url_is_refused() -> None:
    proc = run_module(
        "worker", "doctor", "--json", env={"REDIS_URL": closed_url(), "GPUFEED_MODEL": "null"}
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == ""  # no report, not even an empty one
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("gpufeed: doctor: REDIS_URL redis://ops:***@127.0.0.1:")
    assert "does not answer" in line
    assert "leave REDIS_URL unset (`REDIS_URL= python -m worker doctor`)" in line
    assert "s3cret" not in proc.stderr


async def test_a_redis_url_flag_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    # What `doctor --redis-url URL` builds (flags are overrides); in-process, as torch is
    # already loaded here.
    config = WorkerConfig.load(env={}, overrides={"redis_url": closed_url(), "model": "null"})
    with pytest.raises(RedisNotAnswering, match=r"REDIS_URL redis://ops:\*\*\*@127\.0\.0\.1:"):
        await run_doctor(config)
