"""A batch output as a Parquet dataset: each part's file appears whole, readers see finished
parts only, `_SUCCESS` sums the parts once all have finished, a killed part resumes from its
commits, and a part of another shape is refused; in a folder and under an S3 prefix."""

from __future__ import annotations

import importlib
import io
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from producer import wire
from producer.batch_dataset import open_output
from producer.batch_ids import contains, id_hashes
from producer.batch_output import Existing, Output, OutputError
from producer.batch_rows import Rows, error_fields
from tests.fetch.test_fetch import put_objects, s3_endpoint

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ds = pytest.importorskip("pyarrow.dataset")

__all__ = ["s3_endpoint"]  # the fixture, shared with the fetch tests

SOURCE = "images/"
STREAM = "gpufeed:results:batch:0123456789abcdef:00"


def ok_fields(job_id: str) -> dict[bytes, bytes]:
    return {
        wire.RES_ID: job_id.encode(),
        wire.RES_STATUS: b"ok",
        wire.RES_MODEL: b"null",
        wire.RES_WEIGHTS: b"none",
        wire.RES_LABEL: b"cat",
        wire.RES_SCORE: b"0.75",
        wire.RES_RESULT: msgpack.packb({"top_k": [3], "scores": [0.75], "labels": ["cat"]}),
    }


def rows_of(ids: list[str], failed: frozenset[str] = frozenset()) -> Rows:
    rows = Rows()
    for i in ids:
        if i in failed:
            rows.add(error_fields(i, wire.ErrorCode.PATH_NOT_FOUND, "gone"), f"/images/{i}")
        else:
            rows.add(ok_fields(i), f"/images/{i}")
    return rows


def run_part(
    out: str,
    part: int,
    parts: int,
    batches: list[list[str]],
    failed: frozenset[str] = frozenset(),
    *,
    staging: Path | None = None,
    retry_failed: bool = False,
    check: Path | None = None,
) -> tuple[Output, Existing, int]:
    """A part's run as the runner drives it: start, a commit per batch, finish."""
    output = open_output(out, part=part, parts=parts, source=SOURCE, staging=staging)
    existing = output.start(retry_failed=retry_failed)
    try:
        output.note_reply_stream(STREAM)
        for ids in batches:
            output.write(rows_of(ids, failed))
            output.commit()
            if check is not None:
                assert_only_finished_parts(check)
        rows = output.finish(existing.contested)
    finally:
        output.release()
    if check is not None:
        assert_only_finished_parts(check)
    return output, existing, rows


def assert_only_finished_parts(out: Path) -> None:
    """Nothing temporary directly in the dataset's folder, and what readers take is whole
    part files alone."""
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    visible = [p.name for p in out.iterdir() if not p.name.startswith(("_", "."))]
    assert all(n.startswith("part-") and n.endswith(".parquet") for n in visible), visible
    for name in visible:
        pq.ParquetFile(out / name)  # readable: a whole file


def ids_in(out: Path) -> list[str]:
    return sorted(ds.dataset(str(out), format="parquet").to_table(columns=["id"])["id"].to_pylist())


def success(out: Path) -> dict[str, Any] | None:
    path = out / "_SUCCESS"
    return json.loads(path.read_text()) if path.exists() else None


def summed(out: Path) -> dict[str, Any]:
    found = success(out)
    assert found is not None, "no _SUCCESS"
    return found


def done(existing: Existing, ids: list[str]) -> list[bool]:
    return [bool(x) for x in contains(existing.done, id_hashes(ids))]


# ---------------------------------------------------------------------- a local folder
def test_two_parts_make_one_dataset_and_success_comes_after_both(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = f"{out}/"
    first = [f"a{n:02d}" for n in range(30)]
    second = [f"b{n:02d}" for n in range(20)]

    zero, _, rows = run_part(spec, 0, 2, [first[:12], first[12:]], frozenset({"a03"}), check=out)
    assert rows == 30
    assert zero.display == f"{out}/part-00000-of-00002.parquet"
    assert success(out) is None  # part 1 has not finished
    assert ids_in(out) == first  # a reader sees the finished part, and only it
    marker = json.loads((out / "_gpufeed" / "part-00000-of-00002.json").read_text())
    assert marker["rows"] == 30 and marker["ok"] == 29 and marker["errors"] == 1
    assert marker["error_codes"] == {"path_not_found": 1}
    assert marker["file"] == "part-00000-of-00002.parquet"

    # Part 1 mid-run: its committed segment is not a part file yet.
    one = open_output(spec, part=1, parts=2, source=SOURCE)
    existing = one.start(retry_failed=False)
    one.write(rows_of(second[:5]))
    one.commit()
    assert_only_finished_parts(out)
    assert ids_in(out) == first
    one.write(rows_of(second[5:], frozenset({"b07", "b08"})))
    assert one.finish(existing.contested) == 20
    one.release()

    assert_only_finished_parts(out)
    assert ids_in(out) == sorted(first + second)  # every row once
    assert summed(out) == {
        "parts": 2,
        "rows": 50,
        "ok": 47,
        "errors": 3,
        "error_codes": {"path_not_found": 3},
        "files": ["part-00000-of-00002.parquet", "part-00001-of-00002.parquet"],
        "finished_at": summed(out)["finished_at"],
    }
    assert one.tally() == {"ok": 18, "path_not_found": 2}
    # What is left beside the part files: the record, the markers and _SUCCESS.
    assert sorted(p.name for p in out.iterdir()) == [
        "_SUCCESS",
        "_gpufeed",
        "part-00000-of-00002.parquet",
        "part-00001-of-00002.parquet",
    ]
    assert sorted(p.name for p in (out / "_gpufeed").iterdir()) == [
        "dataset.json",
        "part-00000-of-00002.json",
        "part-00001-of-00002.json",
    ]
    assert json.loads((out / "_gpufeed" / "dataset.json").read_text()) == {
        "parts": 2,
        "source": SOURCE,
    }
    duckdb = _duckdb()
    if duckdb is not None:
        count = duckdb.sql(f"select count(*) from read_parquet('{out}/*.parquet')").fetchone()
        assert count == (50,)


def _duckdb() -> Any:
    try:
        return importlib.import_module("duckdb")
    except ImportError:
        return None


def test_a_killed_part_resumes_from_its_committed_segments(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = f"{out}/"
    ids = [f"x{n:03d}" for n in range(40)]
    first = open_output(spec, part=1, parts=3, source=SOURCE)
    first.start(retry_failed=False)
    first.note_reply_stream(STREAM)
    first.write(rows_of(ids[:15]))
    first.commit()
    first.write(rows_of(ids[15:25]))  # not committed: lost with the process
    assert_only_finished_parts(out)

    # While the first holds the part, a second client of the same part is refused.
    with pytest.raises(OutputError, match="another batch is writing"):
        open_output(spec, part=1, parts=3, source=SOURCE).start(retry_failed=False)
    first.release()  # the process ends

    again = open_output(spec, part=1, parts=3, source=SOURCE)
    existing = again.start(retry_failed=False)
    assert existing.rows == 15
    assert done(existing, ids) == [True] * 15 + [False] * 25
    assert again.reply_streams() == [STREAM]  # deleted by this run, as the runner does
    again.write(rows_of(ids[15:]))
    assert again.finish(existing.contested) == 40
    again.release()
    assert_only_finished_parts(out)
    assert ids_in(out) == ids
    assert success(out) is None  # parts 0 and 2 have not run


def test_a_rerun_part_takes_success_back_until_it_finishes_again(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = f"{out}/"
    run_part(spec, 0, 2, [["a", "b", "c"]], frozenset({"b"}))
    run_part(spec, 1, 2, [["d", "e"]], frozenset({"e"}))
    assert summed(out)["errors"] == 2

    rerun = open_output(spec, part=0, parts=2, source=SOURCE)
    existing = rerun.start(retry_failed=True)
    # Its counts are about to change: neither its marker nor _SUCCESS claims them.
    assert success(out) is None
    assert not (out / "_gpufeed" / "part-00000-of-00002.json").exists()
    assert existing.retried == 1 and done(existing, ["a", "b", "c"]) == [True, False, True]
    rerun.write(rows_of(["b"]))
    assert rerun.finish(existing.contested) == 3
    rerun.release()

    table = pq.read_table(out / "part-00000-of-00002.parquet")
    assert sorted(zip(table["id"].to_pylist(), table["status"].to_pylist(), strict=True)) == [
        ("a", "ok"),
        ("b", "ok"),
        ("c", "ok"),
    ]
    counts = summed(out)
    assert (counts["rows"], counts["ok"], counts["errors"]) == (5, 4, 1)
    assert counts["error_codes"] == {"path_not_found": 1}

    # A part run again with nothing to do leaves its file as it is and _SUCCESS as well.
    before = (out / "part-00001-of-00002.parquet").read_bytes()
    run_part(spec, 1, 2, [])
    assert (out / "part-00001-of-00002.parquet").read_bytes() == before
    assert summed(out)["rows"] == 5


def test_a_part_file_holds_bounded_row_groups_of_gathered_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("producer.batch_dataset.DATASET_ROW_GROUP", 100)
    out = tmp_path / "out"
    ids = [f"r{n:04d}" for n in range(350)]
    output = open_output(f"{out}/", part=0, parts=1, source=SOURCE)
    existing = output.start(retry_failed=False)
    # Small writes (7 rows each) and a checkpoint every 70 rows: 5 segments of tiny groups.
    for start in range(0, 350, 7):
        output.write(rows_of(ids[start : start + 7]))
        if (start + 7) % 70 == 0:
            output.commit()
    assert output.finish(existing.contested) == 350
    output.release()
    meta = pq.ParquetFile(out / "part-00000-of-00001.parquet").metadata
    groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert groups == [100, 100, 100, 50]
    assert ids_in(out) == ids

    # A part within one checkpoint is assembled all the same, not moved as written.
    small = tmp_path / "small"
    output = open_output(f"{small}/", part=0, parts=1, source=SOURCE)
    existing = output.start(retry_failed=False)
    for start in range(0, 63, 7):
        output.write(rows_of(ids[start : start + 7]))
    output.finish(existing.contested)
    output.release()
    meta = pq.ParquetFile(small / "part-00000-of-00001.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [63]


def test_a_part_of_another_shape_is_refused_naming_both(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = f"{out}/"
    run_part(spec, 0, 2, [["a"]])
    with pytest.raises(OutputError) as refused:
        open_output(spec, part=1, parts=3, source=SOURCE).start(retry_failed=False)
    assert str(refused.value) == (
        f"{out}/: a dataset of 2 parts of images/, not 3 parts of images/"
    )
    with pytest.raises(OutputError) as refused:
        open_output(spec, part=1, parts=2, source="s3://other/").start(retry_failed=False)
    assert str(refused.value) == (
        f"{out}/: a dataset of 2 parts of images/, not 2 parts of s3://other/"
    )
    # The same source with or without its final slash is the same source.
    assert run_part(spec.rstrip("/") + "/", 1, 2, [["b"]])[2] == 1
    assert success(out) is not None
    # The refused starts left nothing of theirs.
    assert sorted(p.name for p in (out / "_gpufeed").iterdir()) == [
        "dataset.json",
        "part-00000-of-00002.json",
        "part-00001-of-00002.json",
    ]


def test_clients_starting_at_once_agree_on_one_shape(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Four clients of a 4-part dataset and four of a 5-part one start together: one shape
    # is recorded, and every client of the other is refused.
    starts = [(part, 4) for part in range(4)] + [(part, 5) for part in range(4)]
    barrier = threading.Barrier(len(starts))
    outcome: dict[tuple[int, int], str] = {}

    def start(part: int, parts: int) -> None:
        output = open_output(f"{out}/", part=part, parts=parts, source=SOURCE)
        barrier.wait()
        try:
            output.start(retry_failed=False)
            outcome[part, parts] = "started"
        except OutputError as exc:
            outcome[part, parts] = str(exc)
        finally:
            output.release()

    threads = [threading.Thread(target=start, args=s) for s in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recorded = json.loads((out / "_gpufeed" / "dataset.json").read_text())["parts"]
    for (_, parts), said in outcome.items():
        if parts == recorded:
            assert said == "started"
        else:
            assert f"a dataset of {recorded} parts" in said
    assert not [p for p in (out / "_gpufeed").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("out", "part", "parts", "said"),
    [
        ("{tmp}/one.parquet", 0, 2, "a part writes into a dataset, give --out ending in /"),
        ("{tmp}/set.jsonl/", 0, 1, "a dataset is Parquet files"),
        ("ftp://host/prefix/", 0, 1, "unknown scheme ftp://"),
        ("s3:///prefix/", 0, 1, "a dataset under a store is s3://BUCKET/PREFIX/"),
        ("s3://bucket/a//b/", 0, 1, "an empty, . or .. step in the prefix"),
        ("s3://bucket/a/../b/", 0, 1, "an empty, . or .. step in the prefix"),
        ("s3://bucket/out.parquet", 0, 1, "not a local file"),
        ("{tmp}/out/", 2, 2, "part 2 of 2: a part is 0 to N-1"),
    ],
)
def test_mistakes_in_out_are_one_line(
    tmp_path: Path, out: str, part: int, parts: int, said: str
) -> None:
    with pytest.raises(OutputError) as refused:
        open_output(out.format(tmp=tmp_path), part=part, parts=parts, source=SOURCE)
    assert said in str(refused.value)
    assert "\n" not in str(refused.value)


def test_mistakes_in_the_folder_are_one_line_at_start(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    inside_a_file = tmp_path / "inside"
    inside_a_file.mkdir()
    (inside_a_file / "_gpufeed").write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pq.write_table(pa.table({"x": [1]}), foreign / "theirs.parquet")
    cases = {
        f"{a_file}/": f"{a_file}: a file; a dataset's --out is a folder",
        f"{a_file}/below/": "Not a directory",
        f"{inside_a_file}/": "a file where a folder should be",
        f"{foreign}/": "holds theirs.parquet, not a part of this dataset",
    }
    for out, said in cases.items():
        with pytest.raises(OutputError) as refused:
            open_output(out, part=0, parts=1, source=SOURCE).start(retry_failed=False)
        assert said in str(refused.value)
        assert "\n" not in str(refused.value)
    assert not (foreign / "_gpufeed" / "dataset.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_an_unwritable_folder_is_one_line(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match=r"cannot make|not writable"):
            open_output(f"{locked}/", source=SOURCE).start(retry_failed=False)
    finally:
        locked.chmod(0o700)


def test_a_single_file_is_todays_output(tmp_path: Path) -> None:
    output = open_output(str(tmp_path / "one.parquet"), source=SOURCE)
    assert type(output) is Output
    assert output.path == tmp_path / "one.parquet"


# ---------------------------------------------------------------------- S3 (moto)
BUCKET = "dataset-out"


@pytest.fixture
def bucket(s3_endpoint: str) -> Iterator[str]:
    """An empty bucket: its objects are removed after the test."""
    import obstore
    from obstore.store import S3Store

    put_objects(s3_endpoint, BUCKET, {})
    yield BUCKET
    store = S3Store(BUCKET)
    keys = [m["path"] for chunk in obstore.list(store) for m in chunk]
    if keys:
        obstore.delete(store, keys)


def objects(prefix: str) -> dict[str, bytes]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET)
    found = [m["path"] for chunk in obstore.list(store, prefix) for m in chunk]
    return {k[len(prefix) :]: bytes(obstore.get(store, k).bytes()) for k in found}


def s3_ids(prefix: str) -> list[str]:
    tables = [
        pq.read_table(io.BytesIO(data))
        for name, data in objects(prefix).items()
        if "/" not in name and name.endswith(".parquet")
    ]
    return sorted(i for t in tables for i in t["id"].to_pylist())


def test_a_dataset_under_an_s3_prefix(bucket: str, tmp_path: Path) -> None:
    spec = f"s3://{bucket}/runs/one/"
    first = [f"a{n:02d}" for n in range(25)]
    second = [f"b{n:02d}" for n in range(10)]

    zero = open_output(spec, part=0, parts=2, source=SOURCE, staging=tmp_path / "m0")
    assert zero.display == f"{spec}part-00000-of-00002.parquet"
    existing = zero.start(retry_failed=False)
    zero.note_reply_stream(STREAM)
    zero.write(rows_of(first[:10]))
    zero.commit()
    # The committed segment is under the prefix; no part file is yet.
    held = objects("runs/one/")
    work = sorted(k for k in held if k.startswith("_gpufeed/part-00000-of-00002/"))
    assert work == [
        "_gpufeed/part-00000-of-00002/r000001-000001.parquet",
        "_gpufeed/part-00000-of-00002/reply-streams",
    ]
    segments = work[:1]
    assert pq.read_table(io.BytesIO(held[segments[0]])).num_rows == 10
    assert s3_ids("runs/one/") == []
    zero.write(rows_of(first[10:], frozenset({"a20"})))
    assert zero.finish(existing.contested) == 25
    zero.release()
    assert s3_ids("runs/one/") == first
    assert "_SUCCESS" not in objects("runs/one/")

    run_part(spec, 1, 2, [second[:4], second[4:]], staging=tmp_path / "m1")
    held = objects("runs/one/")
    assert sorted(held) == [
        "_SUCCESS",
        "_gpufeed/dataset.json",
        "_gpufeed/part-00000-of-00002.json",
        "_gpufeed/part-00001-of-00002.json",
        "part-00000-of-00002.parquet",
        "part-00001-of-00002.parquet",
    ]
    assert s3_ids("runs/one/") == sorted(first + second)
    counts = json.loads(held["_SUCCESS"])
    assert (counts["parts"], counts["rows"], counts["ok"], counts["errors"]) == (2, 35, 34, 1)
    assert counts["error_codes"] == {"path_not_found": 1}
    assert json.loads(held["_gpufeed/dataset.json"]) == {"parts": 2, "source": SOURCE}

    with pytest.raises(OutputError) as refused:
        open_output(spec, part=0, parts=4, source=SOURCE, staging=tmp_path / "m9").start(
            retry_failed=False
        )
    assert str(refused.value) == f"{spec}: a dataset of 2 parts of images/, not 4 parts of images/"


def test_a_part_under_s3_resumes_on_another_machine(bucket: str, tmp_path: Path) -> None:
    spec = f"s3://{bucket}/resume/"
    ids = [f"x{n:03d}" for n in range(30)]
    first = open_output(spec, part=0, parts=1, source=SOURCE, staging=tmp_path / "first")
    first.start(retry_failed=False)
    first.note_reply_stream(STREAM)
    first.write(rows_of(ids[:8]))
    first.commit()
    first.write(rows_of(ids[8:12], frozenset({"x009"})))
    first.commit()
    first.write(rows_of(ids[12:20]))  # not committed
    first.release()  # the machine is lost

    # Another machine, an empty staging folder: the committed segments come from the prefix.
    other = open_output(spec, part=0, parts=1, source=SOURCE, staging=tmp_path / "other")
    existing = other.start(retry_failed=False)
    assert existing.rows == 12 and existing.errors == 1
    assert done(existing, ids) == [True] * 12 + [False] * 18
    assert other.reply_streams() == [STREAM]
    other.write(rows_of(ids[12:]))
    assert other.finish(existing.contested) == 30
    other.release()
    assert s3_ids("resume/") == ids
    assert json.loads(objects("resume/")["_SUCCESS"])["rows"] == 30

    # Back on the first machine: its staging folder's segments were merged elsewhere; the
    # part file under the prefix is what it resumes from, each id once.
    back = open_output(spec, part=0, parts=1, source=SOURCE, staging=tmp_path / "first")
    existing = back.start(retry_failed=True)
    assert existing.rows == 30 and existing.retried == 1
    back.write(rows_of(["x009"]))
    assert back.finish(existing.contested) == 30
    back.release()
    assert s3_ids("resume/") == ids
    counts = json.loads(objects("resume/")["_SUCCESS"])
    assert (counts["rows"], counts["ok"], counts["errors"]) == (30, 30, 0)

    # The prefix emptied: a staging folder that had the part starts it afresh.
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET)
    obstore.delete(store, [f"resume/{k}" for k in objects("resume/")])
    again = open_output(spec, part=0, parts=1, source=SOURCE, staging=tmp_path / "first")
    assert again.start(retry_failed=False).rows == 0
    again.release()


def test_a_missing_bucket_is_one_line(s3_endpoint: str, tmp_path: Path) -> None:
    output = open_output(
        "s3://no-such-bucket/x/", part=0, parts=1, source=SOURCE, staging=tmp_path / "m"
    )
    with pytest.raises(OutputError) as refused:
        output.start(retry_failed=False)
    said = str(refused.value)
    assert (
        said
        == "cannot list s3://no-such-bucket/x/: 404 Not Found: The specified bucket does not exist"
    )


def test_the_staging_folder_defaults_under_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    output = open_output("s3://bucket/prefix/", part=2, parts=3, source=SOURCE)
    import hashlib

    digest = hashlib.sha1(b"s3://bucket/prefix/").hexdigest()[:16]
    folder = tmp_path / "cache" / "gpufeed" / "batch" / digest / "part-00002-of-00003"
    assert output.path == folder / "part-00002-of-00003.parquet"
    assert output.display == "s3://bucket/prefix/part-00002-of-00003.parquet"
