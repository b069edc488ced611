"""The per-flush histograms and classify reader: what a scrape and a result show is what
prometheus_client's own Histogram and the per-answer reading showed."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from worker.model.readers import ClassifyReader
from worker.observe.metrics import _SECONDS, FOLD_AT, STAGES, BatchHistogram


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """`name{labels}` -> value, without the `_created` series a custom collector has not."""
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_batch_histogram_scrapes_like_a_prometheus_histogram() -> None:
    rng = np.random.default_rng(3)
    # Values on every bound (le is inclusive), below the first, above the last, and spread.
    values = [*_SECONDS, 0.0, 31.0, 1e9, *rng.exponential(0.05, 500).tolist()]
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    hist = Histogram("gpufeed_stage_seconds", "doc", ["stage"], buckets=_SECONDS, registry=theirs)
    for stage in STAGES:
        hist.labels(stage)
    batch = BatchHistogram(
        "gpufeed_stage_seconds", "doc", _SECONDS, label="stage", values=STAGES, registry=ours
    )
    for value in values:
        hist.labels("decode").observe(value)
    hist.labels("write").observe(0.003)
    batch.observe_many(values[:100], "decode")
    # A flush's stages in one call, in milliseconds as the jobs' timings hold them.
    batch.observe_series(
        {"decode": [v * 1000 for v in values[100:]], "queue": [], "write": [3.0]}, scale=1 / 1000
    )
    want, got = _samples(theirs), _samples(ours)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert np.isclose(got[key], value, rtol=1e-12), key


def test_unlabelled_batch_histogram_counts_every_flush() -> None:
    registry = CollectorRegistry()
    hist = BatchHistogram("gpufeed_job_seconds", "doc", (0.1, 1.0), registry=registry)
    hist.observe_many([0.05, 0.1, 0.5])
    hist.observe_many(np.array([2.0]))
    got = _samples(registry)
    assert got['gpufeed_job_seconds_bucket{le="0.1"}'] == 2
    assert got['gpufeed_job_seconds_bucket{le="1.0"}'] == 3
    assert got['gpufeed_job_seconds_bucket{le="+Inf"}'] == 4
    assert got["gpufeed_job_seconds_count"] == 4
    assert np.isclose(got["gpufeed_job_seconds_sum"], 2.65)


def test_values_kept_past_the_fold_and_under_it_all_count() -> None:
    """Flushes are counted in bulk once FOLD_AT values wait, the rest at the scrape: every
    value is counted once, whichever way it went."""
    registry = CollectorRegistry()
    hist = BatchHistogram(
        "gpufeed_stage_seconds", "doc", (0.1, 1.0), label="stage", values=STAGES,
        registry=registry,
    )  # fmt: skip
    flush = [0.05, 0.5, 5.0]
    flushes = FOLD_AT // len(flush) + 7
    for _ in range(flushes):
        hist.observe_series({"decode": flush, "write": [500.0]}, scale=1 / 1000)
        hist.observe_series({"decode": [v * 1000 for v in flush]}, scale=1 / 1000)
    got = _samples(registry)
    assert got['gpufeed_stage_seconds_count{stage="decode"}'] == 6 * flushes
    assert got['gpufeed_stage_seconds_bucket{le="0.1",stage="decode"}'] == 4 * flushes
    assert got['gpufeed_stage_seconds_bucket{le="1.0",stage="write"}'] == flushes
    assert np.isclose(got['gpufeed_stage_seconds_sum{stage="decode"}'], 5.55555 * flushes)
    # A scrape counts what waits; a second scrape counts nothing twice.
    assert _samples(registry) == got


def test_a_series_the_histogram_has_not_is_refused_when_observed() -> None:
    hist = BatchHistogram("gpufeed_stage_seconds", "doc", (0.1,), label="stage", values=STAGES)
    with pytest.raises(KeyError, match="nowhere"):
        hist.observe_series({"nowhere": [1.0]})


def test_classify_reader_names_and_rounds_per_batch() -> None:
    indices = np.array([[0, 2, 5], [-1, 1, 0]], dtype=np.int64)
    scores = np.array([[0.51234567, 0.3, 0.1], [0.9, 0.05, 0.0000004]], dtype=np.float32)
    named, empty, unnamed = (ClassifyReader(c) for c in (["a", "b", "c"], [], None))
    first, second = named.read([indices, scores], [0, 1])
    # An index outside the class names reads as its number, as the hash's `label` does.
    assert first.details()["labels"] == ["a", "c", "5"]
    assert second.details()["labels"] == ["-1", "b", "a"]
    assert first.details()["scores"] == [0.512346, 0.3, 0.1]
    assert second.details()["scores"] == [0.9, 0.05, 0.0]
    assert first.hash_fields()[-1] == "0.512346"
    assert empty.read([indices, scores], [1])[0].details()["labels"] == ["-1", "1", "0"]
    assert "labels" not in unnamed.read([indices, scores], [0])[0].details()
