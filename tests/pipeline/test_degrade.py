"""Degrade under backlog: with GPUFEED_DEGRADE_AFTER_S a worker runs its batches on a cheaper
second step while the oldest waiting job is older than that, and back on the main step once
the backlog cleared; results say which step served them, and no job is lost or answered
twice across a switch."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from producer import AsyncProducer, Job
from producer.wire import JobResult
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.model_dirs import make_model_dir
from tests.support.worker_harness import running_worker, wait_results
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.lifecycle.service import Worker
from worker.model.loader import load_null
from worker.model.step import build_step, resample_matrix
from worker.pipeline.degrade import DegradeSwitch, WaitingClock, oldest_waiting_s
from worker.pipeline.launch import Launched

NULL = {"model": "null", "input_size": 64, "batch_size": 4}


def results_by_id(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> dict[str, JobResult]:
    parsed = [JobResult.from_fields(fields) for _, fields in entries]
    ids = Counter(r.id for r in parsed)
    assert [i for i, n in ids.items() if n > 1] == []  # answered once each
    return {r.id: r for r in parsed}


# ------------------------------------------------------------------------ the switch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_switch_turns_on_past_the_limit_and_off_only_after_a_calm_period() -> None:
    clock = Clock()
    changes: list[tuple[bool, float]] = []
    switch = DegradeSwitch(
        after_s=2.0, on_change=lambda on, age: changes.append((on, age)), clock=clock
    )
    assert not switch.observe(1.9) and not switch.on
    assert switch.observe(2.5) and switch.on
    # Under the limit but above half of it: the backlog has not cleared, it stays on.
    for age in (1.5, 1.2, 1.0):
        clock.now += 1.0
        assert not switch.observe(age) and switch.on
    # Under half the limit: off only once that has lasted after_s.
    clock.now += 1.0
    assert not switch.observe(0.5) and switch.on
    clock.now += 1.0
    assert not switch.observe(1.5) and switch.on  # the backlog grew again: calm restarts
    clock.now += 1.0
    assert not switch.observe(0.0)
    clock.now += 1.9
    assert not switch.observe(0.0) and switch.on
    clock.now += 0.2
    assert switch.observe(0.0) and not switch.on
    assert changes == [(True, 2.5), (False, 0.0)]
    assert switch.switches == 2


async def test_the_oldest_waiting_job_is_the_first_one_no_worker_has_read(
    redis_url: str, redis_client: redis.Redis
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    try:
        assert await oldest_waiting_s(client, ["no-such-stream"], "g") == 0.0
        seconds, _ = redis_client.time()
        base = (seconds - 100) * 1000
        # Entries enqueued 100 s, 60 s and 30 s ago (by the server's clock).
        for ago_ms in (0, 40_000, 70_000):
            redis_client.xadd("jobs", {"image": b"x"}, id=f"{base + ago_ms}-0")
        redis_client.xgroup_create("jobs", "g", id="0")
        age = await oldest_waiting_s(client, ["jobs"], "g")
        assert 99 < age < 160
        # Read (pending, not answered): no longer waiting.
        redis_client.xreadgroup("g", "c", {"jobs": ">"}, count=1)
        age = await oldest_waiting_s(client, ["jobs"], "g")
        assert 59 < age < 120
        redis_client.xreadgroup("g", "c", {"jobs": ">"}, count=2)
        assert await oldest_waiting_s(client, ["jobs"], "g") == 0.0
    finally:
        await client.aclose()


async def test_an_entry_id_from_the_future_does_not_hide_the_backlog_behind_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    clock = WaitingClock()
    try:
        # One forged ID, read at once; every entry after it numbers after it.
        redis_client.xadd("jobs", {"image": b"x"}, id="9999999999999-0")
        redis_client.xgroup_create("jobs", "g", id="0")
        redis_client.xreadgroup("g", "c", {"jobs": ">"})
        for _ in range(3):
            redis_client.xadd("jobs", {"image": b"x"})
        assert await clock.oldest_waiting_s(client, ["jobs"], "g") < 60
        await asyncio.sleep(1.2)
        # Seen waiting by a check 1.2 s ago: at least that old, whatever its ID says.
        assert 1.2 <= await clock.oldest_waiting_s(client, ["jobs"], "g") < 60
        redis_client.xreadgroup("g", "c", {"jobs": ">"})
        assert await clock.oldest_waiting_s(client, ["jobs"], "g") == 0.0
    finally:
        await client.aclose()


Step = tuple[str, int]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.just(0)),  # XADD *
            st.tuples(st.just("forge"), st.integers(1, 10**13)),
            st.tuples(st.just("tick"), st.integers(1, 5_000)),
            st.tuples(st.just("deliver"), st.integers(1, 3)),
            st.tuples(st.just("check"), st.just(0)),
        ),
        max_size=60,
    )
)
# The stream stood still from 0 to 3; an entry forged one past the last ID at 5 read as
# added at 0 (the first check that saw that ID), not after 3 (the last one).
@example([("tick", 3), ("check", 0), ("tick", 1), ("tick", 1), ("forge", 1), ("check", 0)])
def test_the_waiting_age_is_within_one_check_gap_of_the_truth_whatever_the_ids(
    steps: list[Step],
) -> None:
    """Entries added after the first check, with any IDs Redis would accept (auto ones, or
    forged ones from the future or the past): the measured age of the first waiting entry
    is never further from its true age than the widest gap between two checks."""
    clock = WaitingClock(max_samples=10_000)
    now = 0.0
    last = (0, 0)  # a new stream: XGROUP CREATE ... MKSTREAM
    entries: list[tuple[tuple[int, int], float]] = []  # (ID, when it was really added)
    delivered = 0
    checks = [now]
    clock.observe("s", now, last, None)
    for kind, n in steps:
        if kind == "tick":
            now += n
        elif kind in ("add", "forge"):
            if kind == "forge":
                new = (last[0] + n, 0)
            else:  # what XADD * does: the clock's ms, or after the last ID when it is ahead
                ms = max(int(now), last[0])
                new = (ms, last[1] + 1 if ms == last[0] else 0)
            last = new
            entries.append((new, now))
            now += 1  # one event per ms: nothing is added at a check's instant
        elif kind == "deliver":
            delivered = min(len(entries), delivered + n)
        else:
            checks.append(now)
            head = entries[delivered] if delivered < len(entries) else None
            age_ms = clock.observe("s", now, last, head[0] if head else None) * 1000
            if head is None:
                assert age_ms == 0.0
                continue
            gap = max(b - a for a, b in pairwise(checks))
            assert abs(age_ms - (now - head[1])) <= gap + 1e-6
            now += 1


async def test_an_entry_id_from_the_past_is_no_older_than_the_checks_allow(
    redis_url: str, redis_client: redis.Redis
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    clock = WaitingClock()
    try:
        redis_client.xgroup_create("fresh", "g", id="0", mkstream=True)
        assert await clock.oldest_waiting_s(client, ["fresh"], "g") == 0.0
        redis_client.xadd("fresh", {"image": b"x"}, id="1-0")  # 1970, by its ID
        # Added after the check above: younger than the time since.
        assert await clock.oldest_waiting_s(client, ["fresh"], "g") < 60
    finally:
        await client.aclose()


# ------------------------------------------------------------------------ the step


def test_the_resample_matrix_is_an_antialiased_resize_and_centre_crop() -> None:
    x = torch.rand(2, 3, 64, 64) * 255
    r = resample_matrix(64, 40, 32)
    want = F.interpolate(x, size=(40, 40), mode="bilinear", antialias=True)[:, :, 4:36, 4:36]
    assert torch.allclose(r @ x @ r.T, want, atol=1e-3)


def test_the_degraded_step_resizes_the_main_steps_staged_batch() -> None:
    cpu = torch.device("cpu")
    big = torch.randint(0, 256, (4, 64, 64, 3), dtype=torch.uint8)
    small = F.interpolate(
        big.permute(0, 3, 1, 2).float(), size=(32, 32), mode="bilinear", antialias=True
    )
    small_u8 = small.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    resized = build_step(
        load_null(input_size=32), device=cpu, dtype=torch.float32, top_k=3, input_side=64
    )
    plain = build_step(load_null(input_size=32), device=cpu, dtype=torch.float32, top_k=3)
    with torch.inference_mode():
        got, want = resized(big), plain(small_u8)
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], atol=1e-3)


# ------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"degrade_after_s": 1.0}, "GPUFEED_DEGRADE_AFTER_S: needs the cheaper step"),
        ({"degrade_input_size": 32}, "GPUFEED_DEGRADE_INPUT_SIZE: applies only with"),
        (
            {"degrade_after_s": 1.0, "degrade_model": "./no/such/model"},
            "GPUFEED_DEGRADE_MODEL: no/such/model is not a directory",
        ),
        (
            {"degrade_after_s": 1.0, "degrade_model": "resnet18"},
            "GPUFEED_DEGRADE_MODEL: must be a model directory",
        ),
        (
            {"degrade_after_s": 1.0, "degrade_input_size": 224, "input_size": 160},
            "GPUFEED_DEGRADE_INPUT_SIZE: 224 must be smaller than GPUFEED_INPUT_SIZE (160)",
        ),
    ],
)
def test_degrade_settings_are_checked(values: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        WorkerConfig.load(env={}, overrides=values)
    assert expected in str(err.value)


@pytest.mark.slow
def test_a_degraded_input_size_not_smaller_than_the_models_exits_2() -> None:
    proc = run_module(
        "worker",
        env={
            "GPUFEED_MODEL": "null",
            "GPUFEED_DEGRADE_AFTER_S": "5",
            "GPUFEED_DEGRADE_INPUT_SIZE": "64",  # the null model's own input size
            "GPUFEED_LOG_LEVEL": "error",
        },
    )
    assert proc.returncode == 2, proc.stderr
    assert "GPUFEED_DEGRADE_INPUT_SIZE: 64 is not smaller than null's input size 64" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_a_degraded_model_of_another_kind_is_refused(tmp_path: Path, redis_url: str) -> None:
    main = make_model_dir(tmp_path / "main", input_size=32)
    small = make_model_dir(tmp_path / "small", kind="embed", input_size=16)
    config = WorkerConfig.load(
        env={},
        overrides={
            "redis_url": redis_url,
            "model": str(main),
            "batch_size": 4,
            "degrade_after_s": 1.0,
            "degrade_model": str(small),
        },
    )
    worker = Worker(config)
    with pytest.raises(
        ConfigError, match="GPUFEED_DEGRADE_MODEL: small has output kind embed, main classify"
    ):
        await worker.startup(wait_for_redis=False)
    await worker.shutdown()


# ------------------------------------------------------------------------ end to end


async def test_off_by_default_results_carry_no_degraded_field(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights, **NULL) as worker:
        assert worker.report().degraded_model is None and "degrade" not in worker._tasks
        async with AsyncProducer(redis_url) as p:
            for i in range(3):
                await p.submit(jpeg_bytes(seed=i), id=f"j{i}")
        entries = await wait_results(redis_client, "gpufeed:results", 3)
    assert all(b"degraded" not in fields for _, fields in entries)
    assert {r.model for r in results_by_id(entries).values()} == {"null"}


@pytest.mark.slow
async def test_a_backlog_turns_the_degraded_step_on_and_its_end_turns_it_off(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    served: dict[str, bool] = {}  # job id -> whether its batch ran on the degraded step
    with capture_logs() as logs:
        # Decoding takes 0.1 s an image on 2 threads: 48 jobs at once are a backlog of
        # about 2 s, while the worker holds 20 (4 x (3 slots + 2)) at a time.
        async with running_worker(
            redis_url,
            tiny_weights,
            decode_delay_s=0.1,
            degrade_after_s=0.5,
            degrade_input_size=32,
            **NULL,
        ) as worker:
            switch, watcher = worker.stages.steps.switch, worker.stages.watcher
            assert switch is not None and not switch.on
            done = watcher._on_batch_done

            def record(launched: Launched, gpu_ms: float) -> None:
                degraded = launched.serving is not None and launched.serving.degraded
                for row in launched.batch.valid_rows:
                    served[launched.batch.jobs[row].job_id] = degraded
                if done is not None:
                    done(launched, gpu_ms)

            watcher._on_batch_done = record
            burst = [Job(image=jpeg_bytes(seed=i), id=f"b{i}") for i in range(48)]
            async with AsyncProducer(redis_url) as p:
                await p.submit_many(burst)  # one round trip: a backlog at once
                entries = await wait_results(redis_client, "gpufeed:results", 48)
                # The backlog is gone: the switch goes back off after its calm period.
                for _ in range(600):
                    if not switch.on:
                        break
                    await asyncio.sleep(0.05)
                assert not switch.on and switch.switches == 2
                for i in range(4):
                    await p.submit(jpeg_bytes(seed=100 + i), id=f"after{i}")
                entries = await wait_results(redis_client, "gpufeed:results", 52)
            metrics = worker.observer.metrics.render().decode()

    results = results_by_id(entries)
    assert len(results) == 52 and all(r.ok for r in results.values())
    degraded = {i for i, r in results.items() if r.degraded}
    assert degraded and all(i.startswith("b") for i in degraded)
    for job_id, r in results.items():
        # Each result says the step its whole batch ran on.
        assert r.degraded == served[job_id], job_id
        assert r.model == ("null@32" if r.degraded else "null")
        assert r.details["model"] == r.model
    on = [e for e in logs if e["event"] == "degrade_on"]
    off = [e for e in logs if e["event"] == "degrade_off"]
    assert len(on) == 1 and on[0]["oldest_waiting_s"] > 0.5
    assert len(off) == 1 and off[0]["oldest_waiting_s"] < 0.25
    assert "gpufeed_degraded 0.0" in metrics
    assert 'gpufeed_degrade_switches_total{to="on"} 1.0' in metrics
    assert 'gpufeed_degrade_switches_total{to="off"} 1.0' in metrics


@pytest.mark.slow
async def test_a_future_entry_id_before_a_backlog_still_turns_the_degraded_step_on(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(
        redis_url,
        tiny_weights,
        decode_delay_s=0.1,
        degrade_after_s=0.5,
        degrade_input_size=32,
        **NULL,
    ) as worker:
        switch = worker.stages.steps.switch
        assert switch is not None
        redis_client.xadd(
            "gpufeed:jobs", {"id": "forged", "image": jpeg_bytes()}, id="9999999999999-0"
        )
        burst = [Job(image=jpeg_bytes(seed=i), id=f"b{i}") for i in range(48)]
        async with AsyncProducer(redis_url) as p:
            await p.submit_many(burst)
            entries = await wait_results(redis_client, "gpufeed:results", 49)
        metrics = worker.observer.metrics.render().decode()
    results = results_by_id(entries)
    assert len(results) == 49 and all(r.ok for r in results.values())
    # Every entry of the burst numbers after the forged one, yet the backlog was seen.
    assert all(r.entry.startswith("9999999999999-") for r in results.values())
    assert switch.switches >= 1 and any(r.degraded for r in results.values())
    # Their latencies count from their reads: not all zero.
    (total,) = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("gpufeed_job_seconds_sum")
    ]
    assert total > 0


async def test_a_degraded_model_directory_with_other_classes_answers_in_its_own_terms(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    main = make_model_dir(tmp_path / "main", out=5, input_size=32)
    small = make_model_dir(
        tmp_path / "small", out=3, input_size=16, labels=["cat", "dog", "fox"], seed=1
    )
    async with running_worker(
        redis_url,
        tiny_weights,
        model=str(main),
        batch_size=4,
        top_k=5,
        degrade_after_s=3600.0,  # never on by itself here: the test turns it on
        degrade_model=str(small),
    ) as worker:
        switch, model = worker.stages.steps.switch, worker.engine.model
        assert switch is not None and worker.report().degraded_model == "small"
        assert model.degraded_out_ring is not model.out_ring  # 3 classes, not 5
        async with AsyncProducer(redis_url) as p:
            await p.submit(jpeg_bytes(seed=1), id="main")
            await wait_results(redis_client, "gpufeed:results", 1)
            switch.observe(7200.0)
            await p.submit(jpeg_bytes(seed=2), id="small")
            entries = await wait_results(redis_client, "gpufeed:results", 2)
    results = results_by_id(entries)
    assert not results["main"].degraded and results["main"].model == "main"
    assert len(results["main"].details["top_k"]) == 5
    small_result = results["small"]
    assert small_result.degraded and small_result.model == "small"
    assert small_result.label in ("cat", "dog", "fox")
    assert len(small_result.details["top_k"]) == 3
    assert small_result.weights is not None and "small" in small_result.weights


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_cuda_both_steps_replay_graphs_and_alternate_without_recompiling(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(
        redis_url,
        tiny_weights,
        device="cuda",
        compile="reduce-overhead",
        degrade_after_s=3600.0,  # the test turns the switch
        degrade_input_size=48,
    ) as worker:
        report = worker.report().compile_report
        assert report.compiled and report.cudagraph_replays > 0
        switch = worker.stages.steps.switch
        assert switch is not None
        async with AsyncProducer(redis_url) as p:
            for round_ in range(4):
                switch.on = round_ % 2 == 1
                for i in range(4):
                    await p.submit(jpeg_bytes(seed=10 * round_ + i), id=f"r{round_}-{i}")
                entries = await wait_results(redis_client, "gpufeed:results", 4 * (round_ + 1))
        # Neither step recompiled or fell out of its CUDA graph while they alternated.
        assert worker.observer.compile_check() == []
    results = results_by_id(entries)
    assert len(results) == 16 and all(r.ok for r in results.values())
    for job_id, r in results.items():
        odd = int(job_id[1]) % 2 == 1
        assert r.degraded == odd
        assert r.model == ("mobilenet_v3_small@48" if odd else "mobilenet_v3_small")


async def test_a_failure_of_the_degraded_step_fails_its_batch_alone_and_names_it(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    def broken(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise RuntimeError("out of memory (simulated)")

    async with running_worker(
        redis_url, tiny_weights, degrade_after_s=3600.0, degrade_input_size=32, **NULL
    ) as worker:
        steps = worker.stages.steps
        switch = steps.switch
        assert switch is not None and steps.degraded is not None
        steps.degraded = replace(steps.degraded, step=broken)
        async with AsyncProducer(redis_url) as p:
            switch.observe(7200.0)
            await p.submit(jpeg_bytes(seed=1), id="degraded")
            await wait_results(redis_client, "gpufeed:results", 1)
            switch.on = False
            await p.submit(jpeg_bytes(seed=2), id="main")
            entries = await wait_results(redis_client, "gpufeed:results", 2)
    results = results_by_id(entries)
    failed = results["degraded"]
    assert failed.error_code == "inference_error" and "simulated" in (failed.error or "")
    assert failed.degraded and failed.model == "null@32"
    assert results["main"].ok and not results["main"].degraded and results["main"].model == "null"


async def test_the_backlog_check_runs_under_the_documented_worker_acl(tmp_path: Path) -> None:
    import redis.asyncio as aioredis

    from tests.support.redis_server import RedisServer
    from tests.system.test_security import WORKER_ACL

    server = RedisServer(tmp_path / "acl").start()
    try:
        admin = redis.Redis(port=server.port)
        admin.execute_command("ACL", "SETUSER", "gpufeed", *WORKER_ACL.split())
        admin.xgroup_create("gpufeed:jobs", "gpufeed", id="0", mkstream=True)
        admin.xadd("gpufeed:jobs", {"image": b"x"})
        admin.close()
        user = f"redis://gpufeed:w0rker-pw@127.0.0.1:{server.port}/0"
        client = aioredis.from_url(user)
        try:
            age = await WaitingClock().oldest_waiting_s(client, ["gpufeed:jobs"], "gpufeed")
        finally:
            await client.aclose()
        assert 0.0 <= age < 60
    finally:
        server.stop()
