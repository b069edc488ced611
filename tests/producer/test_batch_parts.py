"""`producer batch --part I/N --out DIR/`: clients that split one source, on a sharded
deployment, into one Parquet dataset read back whole; the rule that splits it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer import batch_sources
from producer.batch_ids import id_hashes
from producer.batch_parts import Part
from producer.batch_sources import SourceError, open_source
from tests.support.cli_runner import ROOT, clean_env, run_module
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker

pa = pytest.importorskip("pyarrow")
ds = pytest.importorskip("pyarrow.dataset")

NULL: dict[str, Any] = {"model": "null", "input_size": 64, "batch_size": 8, "max_wait_ms": 5.0}


@given(st.lists(st.text(min_size=1, max_size=40), max_size=200), st.integers(1, 9))
def test_every_id_falls_in_exactly_one_part(ids: list[str], count: int) -> None:
    hashes = id_hashes(ids)
    owners = np.zeros(len(ids), dtype=int)
    for index in range(count):
        owners += Part(index, count).mine(hashes)
    assert (owners == 1).all()


@pytest.mark.parametrize("kind", ["txt", "csv", "folder"])
def test_the_parts_of_a_source_hold_each_of_its_items_once(kind: str, tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    names = [f"{n:03d}.jpg" for n in range(50)]
    for name in names:
        (folder / name).write_bytes(b"x")
    if kind == "txt":
        # Paths, URLs, and one URL signed twice (one id): its two lines in the same part.
        lines = [*names, "https://e.test/a.jpg?X-Amz-Signature=1", "s3://b/c.jpg",
                 "https://e.test/a.jpg?X-Amz-Signature=2"]  # fmt: skip
        (tmp_path / "m.txt").write_text("\n".join(lines) + "\n")
        src = open_source(str(tmp_path / "m.txt"))
    elif kind == "csv":
        rows = [f"{i},images/{name}" for i, name in enumerate(names)]
        (tmp_path / "m.csv").write_text("id,path\n" + "\n".join(rows) + "\n")
        src = open_source(str(tmp_path / "m.csv"))
    else:
        src = open_source(str(folder))
    whole = [item for page in src.pages() for item in page]
    others = [0]

    def count(n: int) -> None:
        others[0] += n

    parts = [
        [item for page in src.pages(part=Part(i, 3), on_other_part=count) for item in page]
        for i in range(3)
    ]
    assert sorted(item for part in parts for item in part) == sorted(whole)
    assert others[0] == 2 * len(whole)
    for i, part in enumerate(parts):
        assert Part(i, 3).mine(id_hashes([item.id for item in part])).all()


def _line_by_line(manifest: Path) -> tuple[list[tuple[int, str]], str | None]:
    """A text manifest's entries as one line read at a time gives them, and the error that
    ends them (None when none)."""
    entries: list[tuple[int, str]] = []
    try:
        with manifest.open("rb") as f:
            for n, text in batch_sources._lines(f, manifest):
                entry = text.strip()
                if entry and not entry.startswith("#"):
                    entries.append((n, entry))
    except SourceError as exc:
        return entries, str(exc)
    return entries, None


# Lines of a text manifest with what trips a reader of blocks: blank ones, comments, CRLF,
# spaces, text that is not ASCII, bytes that are not UTF-8, and lines near the limit.
_LINE = st.one_of(
    st.sampled_from([b"", b"# note", b"  a.jpg  ", b"b.jpg\r", b"https://e.test/x.jpg?a=1"]),
    st.text(alphabet="ab/\u00e9\u4e2d ", min_size=1, max_size=12).map(str.encode),
    st.binary(min_size=1, max_size=12).filter(lambda b: b"\n" not in b),
    st.integers(10, 14).map(lambda n: b"c" * n),
)


@given(st.lists(_LINE, max_size=40), st.booleans(), st.integers(1, 24), st.integers(1, 4))
def test_a_text_manifest_read_in_blocks_is_what_reading_it_line_by_line_gives(
    lines: list[bytes], last_break: bool, block: int, count: int
) -> None:
    """Each part's entries, and the error where one line is refused, are the line-by-line
    reading's whatever the block size (1 byte up) and wherever the lines fall."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch_sources, "TEXT_BLOCK", block)
        mp.setattr(batch_sources, "MAX_LINE_BYTES", 12)
        manifest = Path(tmp) / "m.txt"
        manifest.write_bytes(b"\n".join(lines) + (b"\n" if last_break and lines else b""))
        expected, error = _line_by_line(manifest)
        got: list[tuple[int, str]] = []
        errors: list[str] = []
        for index in range(count):
            try:
                rows = batch_sources._text_part_rows(manifest, Part(index, count), None)
                got.extend((n, row.get("url") or row["path"]) for n, row in rows)
            except SourceError as exc:
                errors.append(str(exc))
        assert sorted(got) == expected
        assert errors == ([error] * count if error else [])


@pytest.mark.parametrize("text", ["", "3", "1/0", "2/2", "-1/3", "a/b", "1/3/4"])
def test_a_part_that_is_not_i_of_n_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="give I/N"):
        Part.parse(text)


def test_the_command_refuses_a_part_without_a_dataset_and_a_bad_part(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(jpeg_bytes(8, 8))
    env = {"REDIS_URL": "redis://127.0.0.1:1/0"}
    one_file = run_module(
        "producer", "batch", str(folder), "--out", str(tmp_path / "o.parquet"), "--part", "1/2",
        env=env,
    )  # fmt: skip
    assert one_file.returncode == 2
    assert "ending in /" in one_file.stderr
    bad = run_module(
        "producer", "batch", str(folder), "--out", f"{tmp_path}/ds/", "--part", "2/2", env=env
    )
    assert bad.returncode == 2
    assert "give I/N" in bad.stderr


def finished(out: Path) -> tuple[list[str], dict[str, int]]:
    """The dataset's Parquet files, and its completion marker."""
    files = sorted(p.name for p in out.glob("*.parquet"))
    return files, json.loads((out / "_SUCCESS").read_text())


async def test_two_parts_on_three_shards_write_one_dataset_with_each_id_once(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "images"
    ids = set()
    for n in range(60):
        name = f"d{n % 3}/{n:03d}.jpg"
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(jpeg_bytes(16, 12, seed=n))
        ids.add(name)
    out = f"{tmp_path}/dataset/"
    env = clean_env(REDIS_URL=redis_url, GPUFEED_SHARDS="3")

    def client(part: str) -> subprocess.Popen[str]:
        args = ["batch", str(folder), "--out", out, "--part", part, "--json", "--in-flight", "6"]
        return subprocess.Popen(
            [sys.executable, "-m", "producer", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def both() -> list[tuple[int, str, str]]:
        procs = [client("0/2"), client("1/2")]
        return [(p.wait(120), *p.communicate()) for p in procs]

    async with running_worker(redis_url, tiny_weights, shards=3, **NULL):
        ended = await asyncio.to_thread(both)
        # A part run again: its ids are in its file, nothing is submitted.
        again = await asyncio.to_thread(both)
    summaries = []
    for code, stdout, stderr in ended + again:
        assert code == 0, stderr
        summaries.append(json.loads(stdout.splitlines()[-1])["summary"])
    first = summaries[:2]
    assert sorted(s["part"] for s in first) == ["0/2", "1/2"]
    assert sum(s["ok"] for s in first) == len(ids)
    assert all(s["ok"] + s["other_parts"] == len(ids) for s in first)
    assert [s["submitted"] for s in summaries[2:]] == [0, 0]
    table = ds.dataset(out, format="parquet").to_table()
    assert sorted(table.column("id").to_pylist()) == sorted(ids)
    files, marker = finished(Path(out))
    assert files == ["part-00000-of-00002.parquet", "part-00001-of-00002.parquet"]
    assert (marker["parts"], marker["rows"], marker["ok"]) == (2, len(ids), len(ids))
