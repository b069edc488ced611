"""The batch client's ids: 64-bit hashes in sorted numpy arrays, not a set of strings (the
memory a 1,000,000-line manifest costs is measured in test_batch_memory.py); the store's set
semantics, property-tested; and one writer per output."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer.batch_ids import IdStore, id_hashes
from producer.batch_output import Output, OutputError


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


def test_the_hash_of_an_id_is_the_first_8_bytes_of_its_blake2b_digest() -> None:
    # Outputs written by earlier versions are read back with the same hashes.
    import hashlib

    ids = ["a", "photos/0001.jpg", "é"]
    expected = [
        int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "little") for i in ids
    ]
    assert id_hashes(ids).tolist() == expected
    assert id_hashes([]).tolist() == []


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
