"""`producer batch` / `run_batch`: every image of a folder or manifest through a real
null-model worker and redis-server, into Parquet or JSON lines, read back with pyarrow."""

from __future__ import annotations

import asyncio
import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from producer import Producer
from producer.batch_runner import BatchOptions, Progress, run_batch
from producer.batch_sources import SourceError, open_source
from tests.images import jpeg_bytes
from tests.worker_harness import running_worker

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

NULL = {"model": "null", "input_size": 64, "batch_size": 8, "max_wait_ms": 5.0}


def make_folder(root: Path, good: int, broken: int = 0) -> set[str]:
    """Small JPEGs under nested folders (and a few broken ones, and a file that is not
    an image); returns the ids the batch should give them."""
    ids = set()
    for i in range(good):
        rel = f"{'cats' if i % 2 else 'dogs'}/sub{i % 3}/{i:04d}.jpg"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(jpeg_bytes(24, 16, seed=i, quality=70))
        ids.add(rel)
    for i in range(broken):
        rel = f"broken/{i}.jpg"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"not a jpeg at all " * 4)
        ids.add(rel)
    (root / "notes.txt").write_text("not an image")
    return ids


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return list(pq.read_table(path).to_pylist())
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(redis_url: str, source: str | Path, out: Path, **options: Any) -> Progress:
    with Producer(redis_url) as producer:
        return run_batch(str(source), out, producer, BatchOptions(**options))


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
async def test_a_folder_becomes_one_row_per_image_and_broken_images_are_error_rows(
    redis_url: str, tiny_weights: Path, tmp_path: Path, suffix: str
) -> None:
    folder = tmp_path / "images"
    ids = make_folder(folder, good=40, broken=3)
    out = tmp_path / f"out{suffix}"
    async with running_worker(redis_url, tiny_weights, **NULL):
        progress = await asyncio.to_thread(run, redis_url, folder, out, in_flight=16)

    rows = read_rows(out)
    assert Counter(r["id"] for r in rows) == Counter(ids)  # every id once
    by_id = {r["id"]: r for r in rows}
    assert {i for i, r in by_id.items() if r["status"] == "error"} == {
        f"broken/{i}.jpg" for i in range(3)
    }
    assert {by_id[f"broken/{i}.jpg"]["error_code"] for i in range(3)} <= {
        "decode_error",
        "unsupported_format",
    }
    ok = by_id["cats/sub1/0001.jpg"]
    assert ok["status"] == "ok" and ok["model"] == "null"
    assert ok["source"] == str(folder / "cats/sub1/0001.jpg")
    assert ok["label"].startswith("null_") and len(ok["labels"]) == len(ok["scores"]) >= 1
    assert progress.ok == 40 and progress.errors == 3 and progress.rows == 43
    assert not out.with_name(out.name + ".parts").exists()

    if suffix == ".parquet":
        schema = pq.read_schema(out)
        assert schema.field("labels").type == pa.list_(pa.string())
        assert schema.field("scores").type == pa.list_(pa.float32())
        timings = dict(pq.read_table(out).to_pylist()[0]["timings_ms"])
        assert timings["total"] > 0


async def test_manifests_of_each_format_give_their_ids_and_repeats_run_once(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    make_folder(folder, good=6)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.jpg"))
    (folder / "list.txt").write_text("# a comment\n" + "\n".join(files) + f"\n\n{files[0]}\n")
    with (folder / "list.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "path"])
        for n, rel in enumerate(files):
            w.writerow([f"img-{n}", rel])
    (folder / "list.jsonl").write_text(
        "".join(json.dumps({"path": str(folder / rel)}) + "\n" for rel in files)
    )
    pq.write_table(
        pa.table({"id": [f"p{n}" for n in range(len(files))], "path": files}),
        folder / "list.parquet",
    )
    async with running_worker(redis_url, tiny_weights, **NULL):
        outs = {}
        for name in ("list.txt", "list.csv", "list.jsonl", "list.parquet"):
            out = tmp_path / f"{name}.parquet"
            await asyncio.to_thread(run, redis_url, folder / name, out, in_flight=4)
            outs[name] = read_rows(out)

    assert sorted(r["id"] for r in outs["list.txt"]) == files  # the repeat once
    assert sorted(r["id"] for r in outs["list.csv"]) == sorted(f"img-{n}" for n in range(6))
    assert sorted(r["id"] for r in outs["list.jsonl"]) == sorted(str(folder / f) for f in files)
    assert sorted(r["id"] for r in outs["list.parquet"]) == sorted(f"p{n}" for n in range(6))
    assert all(r["status"] == "ok" for rows in outs.values() for r in rows)


def test_a_source_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file or folder"):
        open_source(str(tmp_path / "nothing"))
    bad = tmp_path / "bad.csv"
    bad.write_text("name,size\na,1\n")
    with pytest.raises(SourceError, match="needs a `url` or `path` column"):
        list(open_source(str(bad)).pages())
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"path": "a.jpg"}\n{"nothing": 1}\n')
    with pytest.raises(SourceError, match=r"bad.jsonl line 2: no url or path"):
        list(open_source(str(lines)).pages())
