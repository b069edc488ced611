"""Redis ACL users, TLS, and no pickle anywhere."""

from __future__ import annotations

import ast
import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.redis_server import RedisServer, free_port
from tests.support.worker_harness import running_worker, wait_results

ROOT = Path(__file__).resolve().parents[2]


def documented_worker_acl() -> str:
    """The worker's ACL rules exactly as docs/security.md documents them, with a test
    password."""
    page = (ROOT / "docs" / "security.md").read_text()
    line = next(ln.strip() for ln in page.splitlines() if "ACL SETUSER gpufeed " in ln)
    rules = line.split("ACL SETUSER gpufeed ", 1)[1].split()
    return " ".join(">w0rker-pw" if r.startswith(">") else r for r in rules)


WORKER_ACL = documented_worker_acl()


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "acl").start()
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "gpufeed", *WORKER_ACL.split())
    admin.close()
    yield server
    server.stop()


async def test_a_worker_runs_with_an_acl_user_limited_to_its_keys_and_commands(
    acl_server: RedisServer, tiny_weights: Path
) -> None:
    admin = redis.Redis(port=acl_server.port)
    url = f"redis://gpufeed:w0rker-pw@127.0.0.1:{acl_server.port}/0"
    restricted = redis.Redis.from_url(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        restricted.set("other:key", "x")  # the user really is limited
    with pytest.raises(redis.exceptions.NoPermissionError):
        restricted.flushall()

    # A job that killed its worker (a ghost consumer read it and vanished), whose reply_to
    # the worker's user may not write: it is dead-lettered and answered all the same.
    poison = {"id": "acl-poison", "image": jpeg_bytes(), "reply_to": "tenant-x:results"}
    admin.xgroup_create("gpufeed:jobs", "gpufeed", id="0", mkstream=True)
    admin.xadd("gpufeed:jobs", poison)
    assert admin.xreadgroup("gpufeed", "ghost", {"gpufeed:jobs": ">"}, count=1)
    admin.xadd("gpufeed:jobs", {"id": "acl-1", "image": jpeg_bytes()})
    admin.xadd("gpufeed:jobs", {"id": "acl-bad", "image": b"nope"})
    tenant = {"id": "acl-tenant", "image": jpeg_bytes(), "reply_to": "tenant-x:r"}
    admin.xadd("gpufeed:jobs", tenant)
    async with running_worker(
        url,
        tiny_weights,
        worker_name="acl-worker",
        visibility_timeout_s=1.0,
        claim_interval_s=0.3,
        consumer_expiry_s=1.0,
        trim_interval_s=0.3,
        max_deliveries=1,
        stats_interval_s=0.5,
    ) as worker:
        entries = await wait_results(admin, "gpufeed:results", 4, timeout_s=30)
        by_id = {f[b"id"]: JobResult.from_fields(f) for _, f in entries}
        assert len(entries) == 4
        assert set(by_id) == {b"acl-1", b"acl-bad", b"acl-tenant", b"acl-poison"}
        assert by_id[b"acl-1"].ok and by_id[b"acl-bad"].error_code == "unsupported_format"
        # A reply_to the worker may not write is answered on the default stream, once.
        for job_id in (b"acl-tenant", b"acl-poison"):
            assert by_id[job_id].error_code == "invalid_job"
            assert "may not be written" in (by_id[job_id].error or "")
        assert "dead_letter" in (by_id[b"acl-poison"].error or "")
        assert admin.xlen("gpufeed:dead") == 1
        # The heartbeat (what `top` and `producer stats` read) is written under this user.
        deadline = time.monotonic() + 10
        while not admin.exists("gpufeed:worker:acl-worker"):
            assert time.monotonic() < deadline, "no heartbeat under the documented ACL"
            await asyncio.sleep(0.1)
        # Every housekeeping duty runs under the same user without a permission error.
        admin.xgroup_createconsumer("gpufeed:jobs", "gpufeed", "gone")
        reclaimer = worker.stages.reclaimers[0]
        await reclaimer.keepalive()
        await reclaimer.reclaim_and_tidy()
        assert await reclaimer.trim() >= 0
        # So does the fleet's hot list: its script, and the read a starting worker makes.
        hot = worker.stages.hot
        assert hot is not None
        assert await hot.add({'["path","gpufeed:results","a.jpg"]': 2}) == 1
        assert [e.ref for e in await hot.top()] == ["a.jpg"]
    assert admin.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0
    admin.close()
    restricted.close()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path / "tls"
    d.mkdir()

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    ssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    )
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary is not None
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(d / "server.crt"),
            "--tls-key-file",
            str(d / "server.key"),
            "--tls-ca-cert-file",
            str(d / "ca.crt"),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(d / "ca.crt"))
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                proc.wait()
                pytest.fail("redis-server with TLS did not start (built without TLS?)")
            time.sleep(0.05)
    client.close()
    yield port, d / "ca.crt"
    proc.terminate()
    proc.wait(10)


async def test_a_worker_speaks_tls_with_rediss_urls(
    tls_server: tuple[int, Path], tiny_weights: Path
) -> None:
    port, ca = tls_server
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    client = redis.Redis.from_url(url)
    client.xadd("gpufeed:jobs", {"id": "tls-1", "image": jpeg_bytes()})
    async with running_worker(url, tiny_weights):
        entries = await wait_results(client, "gpufeed:results", 1)
    assert entries[0][1][b"status"] == b"ok"
    # Plain-text connections are refused: the port only speaks TLS.
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping()
    client.close()


def test_no_pickle_anywhere() -> None:
    offenders = []
    for path in [
        *ROOT.glob("worker/**/*.py"),
        *ROOT.glob("producer/**/*.py"),
        *ROOT.glob("scripts/**/*.py"),
    ]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for n in names):
                offenders.append(str(path.relative_to(ROOT)))
            if (
                isinstance(node, ast.keyword)
                and node.arg == "weights_only"
                and isinstance(node.value, ast.Constant)
                and node.value.value is False
            ):
                offenders.append(f"{path.relative_to(ROOT)}: weights_only=False")
    assert offenders == []
