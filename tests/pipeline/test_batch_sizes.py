"""Several batch shapes (the tuning constant batch_sizes): a batch runs on the smallest
compiled shape that holds it, so a lone job is not computed as a padded full batch."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, tiny_config, wait_results
from worker.base.errors import ConfigError
from worker.model.sizes import (
    KEEP_BELOW,
    MAX_SIZES,
    BatchSizes,
    candidate_sizes,
    keep_faster,
    parse_batch_sizes,
    planned_sizes,
)


def test_the_setting_reads_auto_off_or_a_list() -> None:
    assert parse_batch_sizes("auto") is None
    assert parse_batch_sizes("") is None
    assert parse_batch_sizes("off") == ()
    assert parse_batch_sizes(" 16, 1,16 ") == (1, 16)
    for bad in ("0", "1;2", "-1", "one", "1,,2", ",".join(str(i) for i in range(1, 9))):
        with pytest.raises(ValueError):
            parse_batch_sizes(bad)


def test_the_plan_always_holds_the_batch_size() -> None:
    assert planned_sizes(None, 64)[0] == (1, 8, 32, 64)
    assert planned_sizes(None, 8)[0] == (1, 4, 8)
    assert planned_sizes(None, 1)[0] == (1,)
    assert planned_sizes((), 64)[0] == (64,)
    assert planned_sizes((1, 16), 64)[0] == (1, 16, 64)
    with pytest.raises(ValueError, match="over the batch size 8"):
        planned_sizes((1, 16), 8)
    with pytest.raises(ValueError, match=f"at most {MAX_SIZES}"):
        planned_sizes((1, 2, 3, 4, 5, 6), 64)


@given(st.integers(1, 4096))
def test_auto_candidates_are_few_and_end_at_the_batch(batch: int) -> None:
    sizes = candidate_sizes(batch)
    assert sizes == tuple(sorted(set(sizes))) and sizes[0] == 1 and sizes[-1] == batch
    assert len(sizes) <= 4


@given(st.dictionaries(st.integers(1, 512), st.floats(0.01, 1000.0), min_size=1, max_size=6))
def test_a_size_is_kept_only_when_it_runs_faster_than_the_next_kept(
    step_ms: dict[int, float],
) -> None:
    kept = keep_faster(step_ms)
    assert kept[-1] == max(step_ms) and set(kept) <= set(step_ms)
    assert list(kept) == sorted(kept)
    for smaller, larger in itertools.pairwise(kept):
        assert step_ms[smaller] < KEEP_BELOW * step_ms[larger]
    # A dropped size is no faster than the smallest kept size above it.
    for size in set(step_ms) - set(kept):
        above = min(k for k in kept if k > size)
        assert step_ms[size] >= KEEP_BELOW * step_ms[above]


@given(
    st.sets(st.integers(1, 256), min_size=1, max_size=6).map(lambda s: tuple(sorted(s))),
    st.integers(0, 300),
)
def test_a_batch_runs_on_the_smallest_size_that_holds_it(sizes: tuple[int, ...], rows: int) -> None:
    size = BatchSizes(sizes).pick(rows)
    assert size in sizes
    if rows <= sizes[-1]:
        assert size >= rows
        assert all(s < rows for s in sizes if s < size)
    else:
        assert size == sizes[-1]


def test_a_listed_size_over_the_batch_size_is_refused_at_start_up(
    tmp_path: Path, tiny_weights: Path
) -> None:
    url = "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigError, match="GPUFEED_TUNING batch_sizes: 16 over the batch size 8"):
        tiny_config(url, tiny_weights, batch_size=8, batch_sizes="1,16")
    with pytest.raises(ConfigError, match="GPUFEED_TUNING batch_sizes"):
        tiny_config(url, tiny_weights, batch_sizes="0")


async def test_a_lone_job_runs_small_and_answers_as_in_a_full_batch(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """One job alone runs on shape 1; the same image among seven others runs on a larger
    shape and gets the same answer. The metrics count batches by the shape they ran on, and
    the rows run are those shapes' rows."""
    images = [jpeg_bytes(64 + 8 * i, 48 + 4 * i, seed=i) for i in range(8)]
    async with running_worker(
        redis_url, tiny_weights, batch_size=8, batch_sizes="1,4", decode_cache_mb=0
    ) as worker:
        assert worker.engine.model.runner.sizes.sizes == (1, 4, 8)
        assert [r.size for r in worker.engine.model.compile_report.batch_sizes] == [1, 4, 8]
        redis_client.xadd("gpufeed:jobs", {"id": "alone", "image": images[0]})
        await wait_results(redis_client, "gpufeed:results", 1)
        for i, data in enumerate(images):
            redis_client.xadd("gpufeed:jobs", {"id": f"many{i}", "image": data})
        results = await wait_results(redis_client, "gpufeed:results", 9)
        await asyncio.sleep(0.1)  # the last batch's metrics follow its results
        registry = worker.observer.metrics.registry

        def batches(size: int) -> float:
            return registry.get_sample_value("gpufeed_batches_total", {"size": str(size)}) or 0

        def rows(kind: str) -> float:
            return registry.get_sample_value("gpufeed_batch_rows_total", {"kind": kind}) or 0

        by_size = {s: batches(s) for s in (1, 4, 8)}
    parsed = {r.id: r for r in (JobResult.from_fields(f) for _, f in results)}
    assert all(r.status == "ok" for r in parsed.values())
    assert by_size[1] >= 1  # the lone job
    assert by_size[4] + by_size[8] >= 1  # the eight together
    assert rows("real") == 9 and rows("real") + rows("padding") == sum(
        s * n for s, n in by_size.items()
    )
    alone, together = parsed["alone"], parsed["many0"]
    assert alone.top1 == together.top1
    assert alone.score == pytest.approx(together.score, abs=1e-4)
