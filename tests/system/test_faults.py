"""Faults with real processes: real redis-servers, real `python -m worker` processes.

Each test does to a running deployment what happens in production (a worker SIGKILLed, a
worker frozen past the visibility timeout, Redis restarted) and checks what a user sees on
the wire: every job entry has exactly one result in the results stream, nothing stays
pending, and the workers that were not killed go on and exit 0 on SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import redis

from producer.wire import JobResult
from tests.support.images import jpeg_bytes, png_header_only, truncated_jpeg_bytes
from tests.support.process_harness import (
    FAST_RECLAIM_ENV,
    ROOT,
    ResultTally,
    WorkerProcess,
    pending_ids,
    pending_of,
    start_workers,
    stop_all,
    submit,
    wait_until_answered,
)
from tests.support.redis_server import RedisServer

# A handful of tiny JPEGs, reused: decoding is not what these tests are about.
IMAGES = [jpeg_bytes(64, 48, seed=i) for i in range(5)]


def good_jobs(n: int, prefix: str) -> list[dict[str, bytes | str]]:
    return [{"id": f"{prefix}-{i}", "image": IMAGES[i % len(IMAGES)]} for i in range(n)]


class Deployment:
    """Everything a test started, torn down whatever happens (SIGKILL for workers that are
    still alive when a test failed)."""

    def __init__(self, tmp_path: Path, weights: Path) -> None:
        self.tmp_path = tmp_path
        self.weights = weights
        self.servers: list[RedisServer] = []
        self.workers: list[WorkerProcess] = []

    def redis(self, *args: str, persistent: bool = False) -> RedisServer:
        server = RedisServer(self.tmp_path / "redis", *args, persistent=persistent).start()
        self.servers.append(server)
        return server

    def start_workers(self, names: list[str], url: str, **settings: str) -> list[WorkerProcess]:
        workers = start_workers(names, url, self.weights, self.tmp_path / "logs", **settings)
        self.workers += workers
        return workers

    def close(self) -> None:
        for w in self.workers:
            if w.alive:
                w.kill()
        for s in self.servers:
            s.stop()


@pytest.fixture
def deployment(tmp_path: Path, tiny_weights: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path, tiny_weights)
    try:
        yield d
    finally:
        d.close()


def results_of(tally: ResultTally, entry: str) -> list[JobResult]:
    return [JobResult.from_fields(f) for f in tally.fields.get(entry, [])]


def assert_exactly_one_result_each(tally: ResultTally, entries: list[str]) -> None:
    counts = Counter({e: tally.per_entry[e] for e in entries})
    missing = [e for e, n in counts.items() if n == 0]
    doubled = {e: n for e, n in counts.items() if n > 1}
    assert not missing, f"{len(missing)} jobs without a result, e.g. {missing[:5]}"
    assert not doubled, f"{len(doubled)} jobs with more than one result, e.g. {list(doubled)[:5]}"
    strangers = set(tally.per_entry) - set(entries)
    assert not strangers, f"results for entries nobody submitted: {sorted(strangers)[:5]}"


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)


def test_sigkill_of_one_of_three_workers_mid_run_loses_and_doubles_nothing(
    deployment: Deployment,
) -> None:
    server = deployment.redis()
    client = redis.Redis.from_url(server.url)
    victim, *survivors = deployment.start_workers(
        ["k1", "k2", "k3"], server.url, **FAST_RECLAIM_ENV
    )

    entries = submit(client, good_jobs(2000, "kill"))
    tally = ResultTally()
    wait_until_answered(
        client, tally, entries, timeout_s=60, workers=[victim, *survivors], at_least=300
    )
    # SIGKILL while it holds jobs it read and has not answered.
    wait_for(lambda: pending_of(client, victim.name) > 0, 10, "the victim to hold jobs")
    victim.kill()
    held = pending_ids(client, victim.name)
    assert held, "the killed worker held no job: the test proved nothing"
    assert tally.answered(entries) < len(entries), "the run was over before the kill"

    wait_until_answered(client, tally, entries, timeout_s=90, workers=survivors)
    time.sleep(1.5)  # room for a wrong second result to show up
    tally.poll(client)
    assert_exactly_one_result_each(tally, entries)
    assert pending_of(client) == 0
    # The jobs the dead worker held were answered by the others, and answered well.
    for entry in held:
        (result,) = results_of(tally, entry)
        assert result.ok, result.error
        assert result.details["worker"] in {w.name for w in survivors}
    assert all(r.ok for e in entries for r in results_of(tally, e))

    assert stop_all(survivors) == {w.name: 0 for w in survivors}
    assert [e for w in survivors for e in w.errors()] == []
    tally.poll(client)
    assert_exactly_one_result_each(tally, entries)
    client.close()


def test_a_frozen_worker_is_reclaimed_from_and_resumes_without_harm(
    deployment: Deployment,
) -> None:
    server = deployment.redis()
    client = redis.Redis.from_url(server.url)
    frozen, steady = deployment.start_workers(["frozen", "steady"], server.url, **FAST_RECLAIM_ENV)

    first = submit(client, good_jobs(1200, "stop"))
    tally = ResultTally()
    wait_until_answered(client, tally, first, timeout_s=60, workers=[frozen, steady], at_least=200)
    wait_for(lambda: pending_of(client, frozen.name) > 0, 10, "the worker to hold jobs")
    frozen.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    held = pending_ids(client, frozen.name)
    assert held, "the frozen worker held no job: the test proved nothing"

    # While it is frozen, past the 3 s visibility timeout, the other worker takes its jobs.
    wait_until_answered(client, tally, first, timeout_s=60, workers=[steady])
    assert psutil.Process(frozen.pid).status() == psutil.STATUS_STOPPED
    assert time.monotonic() - stopped_at >= 3
    for entry in held:
        (result,) = results_of(tally, entry)
        assert result.ok and result.details["worker"] == "steady"

    # Resumed, it finishes what it was doing: its late answers must not become results.
    frozen.signal(signal.SIGCONT)
    time.sleep(3)
    frozen.check_alive()
    tally.poll(client)
    assert_exactly_one_result_each(tally, first)

    # And it goes on working.
    second = submit(client, good_jobs(600, "after"))
    wait_until_answered(client, tally, second, timeout_s=60, workers=[frozen, steady])
    time.sleep(1)
    tally.poll(client)
    assert_exactly_one_result_each(tally, first + second)
    assert pending_of(client) == 0
    workers_of_second = Counter(results_of(tally, e)[0].details["worker"] for e in second)
    assert workers_of_second["frozen"] > 0, workers_of_second

    assert stop_all([frozen, steady]) == {"frozen": 0, "steady": 0}
    assert frozen.errors() == [] and steady.errors() == []
    tally.poll(client)
    assert_exactly_one_result_each(tally, first + second)
    client.close()


def test_redis_restart_mid_run_loses_nothing_and_workers_reconnect(
    deployment: Deployment,
) -> None:
    server = deployment.redis(persistent=True)
    client = redis.Redis.from_url(server.url)
    workers = deployment.start_workers(["r1", "r2"], server.url, **FAST_RECLAIM_ENV)

    first = submit(client, good_jobs(1500, "before"))
    tally = ResultTally()
    wait_until_answered(client, tally, first, timeout_s=60, workers=workers, at_least=300)
    server.stop()  # SIGTERM, mid-run
    answered_at_stop = tally.answered(first)
    assert answered_at_stop < len(first), "the run was over before Redis stopped"
    time.sleep(2)
    for w in workers:
        w.check_alive()
    server.start()  # same port, same folder: the AOF brings jobs, groups and results back
    client.close()

    second = submit(client, good_jobs(500, "after"))
    wait_until_answered(client, tally, first + second, timeout_s=90, workers=workers)
    time.sleep(1.5)
    tally.poll(client)
    assert_exactly_one_result_each(tally, first + second)
    assert pending_of(client) == 0
    assert all(r.ok for e in first + second for r in results_of(tally, e))
    # Both workers came back: each answered jobs submitted after the restart.
    after = Counter(results_of(tally, e)[0].details["worker"] for e in second)
    assert set(after) == {"r1", "r2"}, after

    assert stop_all(workers) == {"r1": 0, "r2": 0}
    tally.poll(client)
    assert_exactly_one_result_each(tally, first + second)
    client.close()


def test_a_job_whose_reply_to_is_not_a_stream_still_gets_exactly_one_result(
    deployment: Deployment,
) -> None:
    """docs/guarantees.md: "Every job that enters the stream ends with exactly one result".
    A reply_to naming a key that is not a stream cannot take the result; the writer then
    answers on the default results stream (invalid_job). It must not acknowledge the job
    and publish nothing (as it did when PUBLISH_RESULT ran XACK before the XADD that failed
    with WRONGTYPE: a Lua error does not undo the writes before it).
    """
    server = deployment.redis()
    client = redis.Redis.from_url(server.url)
    client.hset("not-a-stream", "x", "1")
    (worker,) = deployment.start_workers(["replier"], server.url, **FAST_RECLAIM_ENV)
    entries = submit(
        client,
        [
            {"id": "bad-reply", "image": IMAGES[0], "reply_to": "not-a-stream"},
            {"id": "good", "image": IMAGES[1]},
        ],
    )
    tally = ResultTally()
    wait_until_answered(client, tally, entries[1:], timeout_s=30, workers=[worker])
    with contextlib.suppress(TimeoutError):  # the two went out in the same batch
        wait_until_answered(client, tally, entries[:1], timeout_s=5, workers=[worker])
    assert tally.per_entry[entries[1]] == 1
    answers = results_of(tally, entries[0])
    assert answers, f"no result ({pending_of(client)} pending): acknowledged and dropped"
    (result,) = answers
    assert result.error_code == "invalid_job" and "reply_to" in (result.error or "")
    assert client.hget("gpufeed:result:bad-reply", "status") == b"error"
    assert worker.terminate() == 0
    client.close()


async def test_a_publish_that_meets_a_restarted_redis_is_retried_not_refused(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Redis restarts between two flushes: the writer's script was loaded on the old server,
    the new one's script cache is empty (Redis 7 does not persist it), so the EVALSHA is
    answered NOSCRIPT.

    The NOSCRIPT reply is not a refusal of the job: the script did not run, so the writer
    loads it and publishes again, and the job gets its real result on its reply stream (not
    "invalid_job: reply_to ... cannot receive results" on the default stream, nor no answer
    until it is reclaimed).
    """
    import redis.asyncio as aioredis

    from worker.delivery.redis_scripts import PUBLISH_RESULTS
    from worker.delivery.writer import ResultWriter, WriterSettings
    from worker.jobs import Job, Outcome
    from worker.model.answers import Classification

    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="0", mkstream=True)
    entry = redis_client.xadd(
        "gpufeed:jobs", {"id": "r1", "image": IMAGES[0], "reply_to": "team:results"}
    ).decode()
    redis_client.xreadgroup("gpufeed", "w1", {"gpufeed:jobs": ">"})
    redis_client.script_load(PUBLISH_RESULTS)
    redis_client.script_flush()  # the restart: the script cache is empty again
    client = aioredis.from_url(redis_url)
    writer = ResultWriter(
        client,
        WriterSettings(
            stream="gpufeed:jobs",
            group="gpufeed",
            result_prefix="gpufeed:result:",
            result_ttl_s=60,
            results_maxlen=1000,
            worker_name="w1",
            model_name="tiny",
        ),
        max_queued=4,
    )
    job = Job.new(
        entry_id=entry,
        job_id="r1",
        reply_to="team:results",
        meta=None,
        image=IMAGES[0],
        path=None,
        has_own_id=True,
    )
    try:
        answer = Classification(indices=[3], scores=[0.5])
        await writer.publish_now([Outcome(job=job, ok=True, answer=answer)])
    finally:
        await client.aclose()
    team = redis_client.xrange("team:results")
    default = redis_client.xrange("gpufeed:results")
    assert [JobResult.from_fields(f).status for _, f in team] == ["ok"], (team, default)
    assert default == []
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


MARKER = b"MARKER-SECRET-PIXELS"
PASSWORD = "pw-Vx7q-hunter2-Zz9"


def add_acl_user(server: RedisServer) -> None:
    """The worker's ACL user, and no access without a password."""
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "feeder", "on", f">{PASSWORD}", "~*", "&*", "+@all")
    admin.execute_command("ACL", "SETUSER", "default", "off")
    admin.close()


def test_logs_never_contain_image_bytes_or_the_redis_password(
    deployment: Deployment,
) -> None:
    server = deployment.redis(persistent=True)
    add_acl_user(server)
    url = f"redis://feeder:{PASSWORD}@127.0.0.1:{server.port}/0"
    client = redis.Redis.from_url(url)

    jpeg = jpeg_bytes(64, 48, seed=3)
    jobs: list[dict[str, bytes | str]] = [
        {"id": "raw", "image": b"%s is not an image %s" % (MARKER, MARKER * 20)},
        {"id": "prefix", "image": MARKER * 50},
        {"id": "tail", "image": jpeg + MARKER},
        {"id": "truncated", "image": truncated_jpeg_bytes(64, 48) + MARKER},
        {"id": "huge", "image": png_header_only(100_000, 100_000) + MARKER},
        {"id": "long-" + "x" * 200, "image": MARKER},
        {"id": "gif-ish", "image": b"GIF89a" + MARKER * 4},
        {"id": "png-ish", "image": b"\x89PNG\r\n\x1a\n" + MARKER * 4},
        {"id": "jpeg-ish", "image": b"\xff\xd8\xff\xe0" + MARKER * 4},
    ]
    (worker,) = deployment.start_workers(
        ["secretive"], url, GPUFEED_LOG_LEVEL="debug", **FAST_RECLAIM_ENV
    )
    entries = submit(client, jobs)
    tally = ResultTally()
    wait_until_answered(client, tally, entries, timeout_s=60, workers=[worker])
    assert_exactly_one_result_each(tally, entries)
    statuses = {r.id: r.status for e in entries for r in results_of(tally, e)}
    assert statuses["raw"] == "error" and statuses["huge"] == "error"
    assert statuses["tail"] == "ok"

    # Redis restarts without the ACL user (ACL SETUSER is not in the AOF): the worker's
    # reconnects fail authentication, which is where a password would most likely leak.
    server.restart(0.5)
    time.sleep(2)
    worker.check_alive()
    add_acl_user(server)
    client.close()
    late = submit(client, [{"id": "late", "image": jpeg + MARKER}])
    wait_until_answered(client, tally, late, timeout_s=60, workers=[worker])
    assert worker.terminate() == 0
    client.close()

    log = worker.log_path.read_bytes()
    assert b'"worker_ready"' in log  # the log is there and is JSON lines
    assert b"feeder" in log  # the URL is logged, redacted
    assert any(e.get("level") == "warning" for e in worker.events())  # the outage, logged
    assert PASSWORD.encode() not in log
    assert MARKER not in log
    assert MARKER.hex().encode() not in log
    assert MARKER.hex().upper().encode() not in log


def test_soak_script_short_run_with_faults(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFEED_")}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/soak.py",
            "--jobs",
            "600",
            "--rate",
            "60",
            "--workdir",
            str(tmp_path / "soak"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["jobs_in"] == 600
    assert report["results_out"] == 600
    assert report["missing"] == 0
    assert report["duplicates"] == 0
    assert report["unexpected"] == 0
    assert report["errors_by_code"], "the mix has bad jobs: they must come back as errors"
    assert report["ok"] + report["error"] == 600
    # The faults happened during the run, and every worker exited cleanly at the end.
    kinds = [f["kind"] for f in report["faults"]]
    assert "worker_sigkill" in kinds and "redis_restart" in kinds
    assert [w["exit_code"] for w in report["workers"] if w["ended_by"] == "sigterm"] == [0, 0]
    assert "jobs in" in proc.stdout and "duplicates" in proc.stdout
    # The tenants (60 jobs on top): every one of the victim's answered once, whatever
    # mallory did to its own stream; what mallory trimmed is its own loss, counted apart;
    # all it tried beyond its keys was refused; the long script ended no worker.
    assert {"tenant_trim", "long_script", "same_tail_images", "tenant_last_id"} <= set(kinds)
    victim, mallory = report["tenants"]["victim"], report["tenants"]["mallory"]
    assert victim["jobs_in"] >= 40 and victim["answered"] == victim["results_out"]
    assert victim["answered"] == victim["jobs_in"]
    assert mallory["trimmed_by_tenant"] > 0 and mallory["refused_stream_closed"] > 0
    assert mallory["answered"] == mallory["results_out"] == mallory["jobs_in"]
    attacks = report["tenant_attacks"]
    assert attacks["refused_noperm"] == attacks["attempts_on_others"] > 0
    assert not report["crashes"] and not report["tenant_failures"]
    assert "trimmed_by_tenant" in proc.stdout
