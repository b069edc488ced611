"""Jobs through the whole pipeline on the CPU: counts, correctness per row, bad jobs; each
test in a small host's shape and in a GPU host's (the `host_shape` fixture)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from torchvision.models import MobileNet_V3_Small_Weights

from producer.wire import JobResult
from tests.support.images import jpeg_bytes, png_bytes
from tests.support.worker_harness import (
    HostShape,
    SharedWorker,
    running_worker,
    served_test,
    shared_worker,
    wait_results,
)
from worker.decode.cpu import DecodeSpec, decode_to_array
from worker.model.loader import load_model
from worker.model.step import build_step


def reference_scores(weights: Path, images: list[bytes]) -> np.ndarray:
    """Top-5 scores computed the slow, obvious way: one image at a time, eager."""
    loaded = load_model("mobilenet_v3_small", str(weights), input_size=64)
    step = build_step(loaded, device=torch.device("cpu"), dtype=torch.float32, top_k=5)
    spec = DecodeSpec(size=loaded.resize_size)
    out = []
    with torch.inference_mode():
        for data in images:
            arr, _ = decode_to_array(data, spec)
            _, scores = step(torch.from_numpy(arr)[None])
            out.append(scores[0].numpy())
    return np.stack(out)


@pytest.fixture(scope="module")
def e2e_worker(
    host_shape: HostShape, tiny_weights: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedWorker]:
    """One worker per shape for the tests whose settings agree. max_wait_ms: the bad jobs
    and the good ones meet in the same batches."""
    workdir = tmp_path_factory.mktemp("redis")
    with shared_worker(host_shape, tiny_weights, workdir, batch_size=4, max_wait_ms=200) as w:
        yield w


@pytest.fixture
def shared(e2e_worker: SharedWorker) -> Iterator[redis.Redis]:
    """The shared worker's Redis, for one test."""
    with served_test(e2e_worker) as client:
        yield client


@pytest.mark.parametrize("n_jobs", [1, 4, 5])
async def test_counts_around_the_batch_size(
    n_jobs: int, shared: redis.Redis, tiny_weights: Path
) -> None:
    images = [jpeg_bytes(200 + 10 * i, 150, seed=i) for i in range(n_jobs)]
    for i, data in enumerate(images):
        shared.xadd("gpufeed:jobs", {"id": f"j{i}", "image": data})
    entries = await wait_results(shared, "gpufeed:results", n_jobs)

    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    assert len(entries) == n_jobs and set(results) == {f"j{i}" for i in range(n_jobs)}
    assert all(r.ok for r in results.values())
    # Each row of a padded batch must carry its own image's answer, not a neighbour's.
    expected = reference_scores(tiny_weights, images)
    for i in range(n_jobs):
        got = np.array(results[f"j{i}"].details["scores"])
        np.testing.assert_allclose(got, expected[i], atol=1e-4)


async def test_a_few_hundred_jobs_each_get_exactly_one_result(shared: redis.Redis) -> None:
    n = 300
    images = [jpeg_bytes(96, 72, seed=i, quality=80) for i in range(8)]
    pipe = shared.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd("gpufeed:jobs", {"id": f"bulk-{i}", "image": images[i % 8]})
    pipe.execute()
    entries = await wait_results(shared, "gpufeed:results", n, timeout_s=120)

    ids = Counter(f[b"id"] for _, f in entries)
    assert len(ids) == n and set(ids.values()) == {1}
    assert all(f[b"status"] == b"ok" for _, f in entries)
    group = shared.xinfo_groups("gpufeed:jobs")[0]
    assert group["pending"] == 0
    # Same image, same answer, whichever batch and row it landed in.
    top1_by_image: dict[int, set[bytes]] = {}
    for _, f in entries:
        i = int(f[b"id"].split(b"-")[1])
        top1_by_image.setdefault(i % 8, set()).add(f[b"top1"])
    assert all(len(v) == 1 for v in top1_by_image.values())


async def test_bad_jobs_fail_alone(shared: redis.Redis) -> None:
    good = jpeg_bytes(160, 120, seed=5)
    jobs: dict[str, dict[str, bytes]] = {
        "good-1": {"image": good},
        "not-an-image": {"image": b"hello, this is text"},
        "truncated": {"image": good[: len(good) // 2]},
        "empty": {"image": b""},
        "nothing": {"caption": b"no image and no path"},
        "good-2": {"image": png_bytes(50, 40)},
        "both": {"image": good, "path": b"x.jpg"},
        "path-disabled": {"path": b"photo.jpg"},
        "good-3": {"image": good},
    }
    for job_id, fields in jobs.items():
        shared.xadd("gpufeed:jobs", {"id": job_id, **fields})
    entries = await wait_results(shared, "gpufeed:results", len(jobs))

    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    assert len(entries) == len(jobs)
    assert {k: v.error_code for k, v in results.items()} == {
        "good-1": None,
        "not-an-image": "unsupported_format",
        "truncated": "decode_error",
        "empty": "empty_image",
        "nothing": "invalid_job",
        "good-2": None,
        "both": "invalid_job",
        "path-disabled": "path_disabled",
        "good-3": None,
    }
    assert "truncated" in (results["truncated"].error or "")
    assert results["good-1"].top1 == results["good-3"].top1
    for job_id in ("good-1", "good-2", "good-3"):
        assert results[job_id].status == "ok"


async def test_path_jobs_under_the_root(
    redis_url: str,
    redis_client: redis.Redis,
    tiny_weights: Path,
    tmp_path: Path,
    host_shape: HostShape,
) -> None:
    root = tmp_path / "images"
    root.mkdir()
    # Small enough for a row: on a GPU host the decode process stages its bytes for the GPU.
    (root / "a.jpg").write_bytes(jpeg_bytes(200, 150, seed=9))
    (tmp_path / "secret.jpg").write_bytes(jpeg_bytes(seed=10))
    async with running_worker(redis_url, tiny_weights, shape=host_shape, path_root=root):
        redis_client.xadd("gpufeed:jobs", {"id": "p-ok", "path": "a.jpg"})
        redis_client.xadd("gpufeed:jobs", {"id": "p-escape", "path": "../secret.jpg"})
        redis_client.xadd("gpufeed:jobs", {"id": "p-missing", "path": "nope.jpg"})
        entries = await wait_results(redis_client, "gpufeed:results", 3)
    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    assert results["p-ok"].ok
    assert results["p-escape"].error_code == "forbidden_path"
    assert results["p-missing"].error_code == "path_not_found"


async def test_a_random_weights_worker_answers_with_the_published_class_names(
    redis_url: str, redis_client: redis.Redis, host_shape: HostShape
) -> None:
    """GPUFEED_WEIGHTS=none: the answers are meaningless, but they read as a pretrained
    model's do, with the class names torchvision ships for the model's weights."""
    names = MobileNet_V3_Small_Weights.DEFAULT.meta["categories"]
    async with running_worker(redis_url, Path("none"), shape=host_shape):
        redis_client.xadd("gpufeed:jobs", {"id": "r1", "image": jpeg_bytes(64, 48)})
        (entry,) = await wait_results(redis_client, "gpufeed:results", 1)
    result = JobResult.from_fields(entry[1])
    assert result.ok and result.top1 is not None
    assert result.label == names[result.top1]
    assert redis_client.hget("gpufeed:result:r1", "label") == names[result.top1].encode()
