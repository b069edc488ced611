"""`producer submit --wait` on a stream nobody reads says so, and how to start a reader, at
once and again when the wait ends; a group with a consumer, or a tenant's user that may not
look at the group, gets no such line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.delivery.test_tenants import documented_tenant_acl
from tests.support.cli_runner import run_module

START = "start one with `make run-worker` or `python -m worker`"


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "cat.jpg"
    path.write_bytes(b"\xff\xd8\xff not decoded: no worker reads it")
    return path


def submit_wait(url: str, image: Path, *extra: str) -> tuple[int, list[str]]:
    proc = run_module(
        "producer", "submit", "--wait", "--timeout", "0.3", str(image), *extra,
        env={"REDIS_URL": url},
    )  # fmt: skip
    return proc.returncode, proc.stderr.strip().splitlines()


def test_no_group_is_said_before_and_after_the_wait(redis_url: str, image: Path) -> None:
    code, lines = submit_wait(redis_url, image)
    assert code == 1
    reason = f"no worker reads gpufeed:jobs (its group gpufeed does not exist): {START}"
    assert lines[0] == f"note: {reason}; waiting 0.3s for one"
    assert lines[-1] == f"error: 1 of 1 job(s) have no result after 0.3s; {reason}"


def test_a_group_without_consumers(redis_url: str, redis_client: redis.Redis, image: Path) -> None:
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="$", mkstream=True)
    code, lines = submit_wait(redis_url, image)
    assert code == 1
    assert "no worker reads gpufeed:jobs (its group gpufeed has 0 consumers)" in lines[0]
    assert lines[-1].endswith(f"has 0 consumers): {START}")


def test_a_group_with_a_reader_is_only_late(
    redis_url: str, redis_client: redis.Redis, image: Path
) -> None:
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="$", mkstream=True)
    redis_client.xgroup_createconsumer("gpufeed:jobs", "gpufeed", "worker-1")
    code, lines = submit_wait(redis_url, image)
    assert code == 1
    assert lines == ["error: 1 of 1 job(s) have no result after 0.3s"]


@pytest.fixture
def blind_tenant(redis_url: str) -> Iterator[str]:
    """Tenant acme's user as documented, less the reads of the group (TYPE, XLEN, XINFO)."""
    admin = redis.Redis.from_url(redis_url)
    rules = [r for r in documented_tenant_acl("acme") if r not in ("+type", "+xlen")]
    rules = [r for r in rules if not r.startswith("+xinfo")]
    admin.execute_command("ACL", "SETUSER", "tenant-acme", *rules)
    try:
        yield redis_url.replace("redis://", "redis://tenant-acme:t3nant-pw@", 1)
    finally:
        admin.execute_command("ACL", "DELUSER", "tenant-acme")
        admin.close()


def test_a_tenant_that_may_not_look_hears_nothing_more(blind_tenant: str, image: Path) -> None:
    code, lines = submit_wait(blind_tenant, image, "--tenant", "acme")
    assert code == 1
    assert lines == ["error: 1 of 1 job(s) have no result after 0.3s"]
