"""The batch client's memory for the ids of a large manifest: 64-bit hashes in sorted
numpy arrays, not a set of strings; and the store's set semantics, property-tested."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer import wire
from producer.batch_ids import IdStore, id_hashes
from producer.batch_output import Output, OutputError
from producer.batch_rows import error_row
from producer.batch_sources import open_source

LINES = 200_000


@given(st.lists(st.lists(st.text(min_size=1, max_size=12), max_size=40), max_size=12))
def test_the_store_keeps_each_id_once_across_chunks(chunks: list[list[str]]) -> None:
    store = IdStore()
    seen: set[str] = set()
    for chunk in chunks:
        new = store.add_new(id_hashes(chunk))
        expected = []
        for i in chunk:
            expected.append(i not in seen)
            seen.add(i)
        assert new.tolist() == expected
    assert len(store) == len(seen)


def test_a_resumed_run_over_a_large_manifest_holds_its_ids_in_8_bytes_each(
    tmp_path: Path,
) -> None:
    manifest = tmp_path / "urls.txt"
    manifest.write_text("".join(f"s3://bucket/photos/{n:07d}.jpg\n" for n in range(LINES)))
    out = Output(tmp_path / "out.parquet")
    out.start(retry_failed=False)
    # Half of the manifest is in the output already (as rows of an earlier run).
    for start in range(0, LINES // 2, 20_000):
        out.write(
            [
                error_row(f"s3://bucket/photos/{n:07d}.jpg", "", wire.ErrorCode.FETCH_FAILED, "x")
                for n in range(start, start + 20_000)
            ]
        )
    out.commit()
    out.release()

    resumed = Output(tmp_path / "out.parquet")
    tracemalloc.start()
    try:
        existing = resumed.start(retry_failed=False)
        store = IdStore(existing.done)
        fresh = 0
        for page in open_source(str(manifest)).pages():
            fresh += int(store.add_new(id_hashes(i.id for i in page)).sum())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        resumed.release()

    assert existing.rows == LINES // 2 and fresh == LINES - LINES // 2
    assert store.nbytes == 8 * LINES
    # The whole start and the pass over 200,000 lines: the hashes (8 bytes an id) and
    # their sorting, one page of items, one row group read; a set of the id strings alone
    # would take about 90 bytes an id.
    assert peak < 40 * LINES, f"peak {peak / 1e6:.1f} MB"


def test_a_second_writer_of_the_same_output_is_refused_until_the_first_is_gone(
    tmp_path: Path,
) -> None:
    first = Output(tmp_path / "out.parquet")
    first.start(retry_failed=False)
    with pytest.raises(OutputError, match="another batch is writing"):
        Output(tmp_path / "out.parquet").start(retry_failed=False)
    first.release()
    second = Output(tmp_path / "out.parquet")
    second.start(retry_failed=False)
    second.release()
