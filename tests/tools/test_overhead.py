"""The tools for measuring gpufeed itself: the null model and the queue ceiling."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import torch
from click.testing import CliRunner

from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.base.errors import ConfigError
from worker.cli import cli
from worker.config.settings import WorkerConfig
from worker.model.loader import load_configured
from worker.model.step import build_step
from worker.tools.harness.queue_ceiling import queue_ceiling


def test_the_null_model_is_a_classifier_of_fixed_answers() -> None:
    loaded = load_configured("null", "DEFAULT")
    assert loaded.categories is not None and loaded.categories[0] == "null_0"
    assert (loaded.crop_size, loaded.resize_size) == (64, 64)
    step = build_step(loaded, device=torch.device("cpu"), dtype=torch.float32, top_k=3)
    dark = torch.zeros((1, 64, 64, 3), dtype=torch.uint8)
    light = torch.full((1, 64, 64, 3), 255, dtype=torch.uint8)
    with torch.inference_mode():
        indices, scores = step(torch.cat([dark, light, dark]))
    assert indices.shape == (3, 3) and scores.shape == (3, 3)
    # An image's answer depends on its pixels only, not on the batch around it.
    assert torch.equal(indices[0], indices[2]) and torch.equal(scores[0], scores[2])
    assert not torch.equal(scores[0], scores[1])
    assert bool((scores[:, :-1] >= scores[:, 1:]).all())


def test_the_null_model_takes_an_input_size() -> None:
    assert load_configured("null", "none", input_size=32).crop_size == 32


def test_model_check_accepts_the_null_model() -> None:
    result = CliRunner().invoke(
        cli, ["model", "check", "null", "--json", "--seconds", "0.1", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["model"] == "null" and report["kind"] == "classify"
    assert report["images_per_s"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_null_model_through_a_worker_on_cuda(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    n = 300
    images = [jpeg_bytes(64, 64, seed=i) for i in range(3)]
    overrides = {"model": "null", "batch_size": 64, "device": "cuda", "compile": "auto"}
    async with running_worker(redis_url, tmp_path / "unused", **overrides) as worker:
        assert worker.report().compile_report.compiled
        pipe = redis_client.pipeline(transaction=False)
        for i in range(n):
            pipe.xadd("gpufeed:jobs", {"id": f"c{i}", "image": images[i % 3]})
        pipe.execute()
        entries = await wait_results(redis_client, "gpufeed:results", n, timeout_s=120)
    results = [JobResult.from_fields(f) for _, f in entries]
    assert sorted(r.id for r in results) == sorted(f"c{i}" for i in range(n))
    assert all(r.ok and r.label is not None and r.label.startswith("null_") for r in results)


def test_config_accepts_null_and_a_misspelling_names_it() -> None:
    assert WorkerConfig.load(env={"GPUFEED_MODEL": "null"}).model == "null"
    with pytest.raises(ConfigError, match=r"unknown model 'nul'; did you mean null\?"):
        load_configured("nul", "none")


async def test_null_model_jobs_get_contract_results_through_a_worker(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    n = 40
    images = [jpeg_bytes(64, 64, seed=i) for i in range(5)]
    async with running_worker(redis_url, tmp_path / "unused", model="null", batch_size=16):
        pipe = redis_client.pipeline(transaction=False)
        for i in range(n):
            pipe.xadd("gpufeed:jobs", {"id": f"n{i}", "image": images[i % 5]})
        pipe.xadd("gpufeed:jobs", {"id": "bad", "image": b"not an image"})
        pipe.execute()
        entries = await wait_results(redis_client, "gpufeed:results", n + 1)

    results = [JobResult.from_fields(f) for _, f in entries]
    assert Counter(r.id for r in results) == Counter([*(f"n{i}" for i in range(n)), "bad"])
    by_id = {r.id: r for r in results}
    assert not by_id["bad"].ok and by_id["bad"].error
    good = [by_id[f"n{i}"] for i in range(n)]
    assert all(r.ok and r.model == "null" for r in good)
    assert all(r.label is not None and r.label.startswith("null_") for r in good)
    assert all(r.score is not None and 0.0 < r.score <= 1.0 for r in good)
    # The same image gets the same answer in whichever batch it came.
    assert len({(r.label, r.score) for r in good[0::5]}) == 1
    assert redis_client.xinfo_groups("gpufeed:jobs")[0]["pending"] == 0


async def test_queue_ceiling_publishes_every_job_and_leaves_no_key(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    try:
        await client.set("unrelated", "kept")
        out = await queue_ceiling(
            client, "qc:{t}", payload=jpeg_bytes(64, 64, seed=1), jobs=300, batch=64
        )
        left = [k async for k in client.scan_iter(match="qc:*")]
        assert await client.get("unrelated") == b"kept"
    finally:
        await client.aclose()
    assert out["jobs"] == 300 and out["published"] == 300
    assert out["batches"] == 5  # 4 full reads of 64 and the rest
    assert out["jobs_per_s"] > 0 and out["loop_cpu_us_per_job"] > 0
    assert left == []


async def test_queue_ceiling_writes_what_a_worker_writes(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    try:
        with pytest.raises(ValueError, match="at least 1"):
            await queue_ceiling(client, "qc2", payload=b"x", jobs=0, batch=8)
        await queue_ceiling(client, "qc2", payload=b"x", jobs=10, batch=4, keep=True)
        entries = await client.xrange("qc2:results")
        pending = (await client.xinfo_groups("qc2:jobs"))[0]["pending"]
        stored = await client.hgetall("qc2:result:qc2-3")
    finally:
        await client.aclose()
    results = [JobResult.from_fields(f) for _, f in entries]
    assert sorted(r.id for r in results) == sorted(f"qc2-{i}" for i in range(10))
    assert all(r.ok and r.label == "null_0" and r.model == "null" for r in results)
    assert pending == 0
    assert JobResult.from_fields(stored).id == "qc2-3"
