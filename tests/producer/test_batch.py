"""`producer batch` / `run_batch`: every image of a folder or manifest through a real
null-model worker and redis-server, into Parquet or JSON lines, read back with pyarrow."""

from __future__ import annotations

import asyncio
import csv
import json
import socket
import subprocess
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Producer
from producer.batch_runner import BatchOptions, Progress, run_batch
from producer.batch_sources import Source, SourceError, open_source
from producer.priorities import level_stream, pick_level
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker

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
    # JSON lines read with pyarrow too: each line an object of the same columns.
    import pyarrow.json as pj

    table = pj.read_json(path) if path.stat().st_size else None
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if table is not None:
        assert table.column("id").to_pylist() == [r["id"] for r in rows]
        assert table.column("status").to_pylist() == [r["status"] for r in rows]
    return rows


def run(redis_url: str, source: str | Path | Source, out: Path, **options: Any) -> Progress:
    with Producer(redis_url) as producer:
        given = source if isinstance(source, Source) else str(source)
        return run_batch(given, out, producer, BatchOptions(**options))


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


async def test_kept_manifest_columns_reach_each_output_row(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    """--keep-columns: a product id and a caption ride along with each job, error rows
    included, from each manifest format into Parquet and JSON lines; a value that is not
    text is its JSON, a key a JSON line lacks is null."""
    folder = tmp_path / "m"
    make_folder(folder, good=5, broken=1)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.jpg"))
    products = {rel: f"sku-{n:03d}" for n, rel in enumerate(files)}
    captions = {rel: f"a photo, number {n}" for n, rel in enumerate(files)}
    with (folder / "list.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "product_id", "caption", "unused"])
        for rel in files:
            w.writerow([rel, products[rel], captions[rel], "x"])
    (folder / "list.jsonl").write_text(
        "\n".join(
            json.dumps({"path": rel, "product_id": n, "caption": {"text": captions[rel]}})
            if n
            else json.dumps({"path": rel})
            for n, rel in enumerate(files)
        )
        + "\n"
    )
    pq.write_table(
        pa.table({"path": files, "product_id": [products[r] for r in files], "n": [1] * 6}),
        folder / "list.parquet",
    )
    keep = ["product_id", "caption"]
    async with running_worker(redis_url, tiny_weights, **NULL):
        outs = {}
        for name, suffix in (
            ("list.csv", ".parquet"),
            ("list.csv", ".jsonl"),
            ("list.jsonl", ".parquet"),
        ):
            out = tmp_path / f"{name}{suffix}"
            source = open_source(str(folder / name), keep_columns=keep)
            await asyncio.to_thread(run, redis_url, source, out, in_flight=4)
            outs[out.name] = read_rows(out)
        parquet_out = tmp_path / "from-parquet.parquet"
        source = open_source(str(folder / "list.parquet"), keep_columns=["product_id"])
        await asyncio.to_thread(run, redis_url, source, parquet_out, in_flight=4)

    for name in ("list.csv.parquet", "list.csv.jsonl"):
        rows = outs[name]
        assert len(rows) == 6 and sum(r["status"] == "error" for r in rows) == 1
        for row in rows:
            assert row["product_id"] == products[row["id"]], name
            assert row["caption"] == captions[row["id"]]
            assert "unused" not in row
    by_id = {r["id"]: r for r in outs["list.jsonl.parquet"]}
    assert by_id[files[0]]["product_id"] is None and by_id[files[0]]["caption"] is None
    assert by_id[files[2]]["product_id"] == "2"  # a JSON number, as its JSON text
    assert json.loads(by_id[files[2]]["caption"]) == {"text": captions[files[2]]}
    table = pq.read_table(parquet_out)
    assert table.schema.field("product_id").type == pa.string()
    assert {r["id"]: r["product_id"] for r in table.to_pylist()} == products


def test_kept_columns_must_be_a_manifests_own(tmp_path: Path) -> None:
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,product_id\na.jpg,1\n")
    with pytest.raises(SourceError, match=r"list\.csv has no such column"):
        open_source(str(manifest), keep_columns=["product_id", "caption"])
    with pytest.raises(SourceError, match="--keep-columns label: the output has a column"):
        open_source(str(manifest), keep_columns=["label"])
    (tmp_path / "list.txt").write_text("a.jpg\n")
    with pytest.raises(SourceError, match=r"needs a \.csv, \.jsonl, \.parquet manifest"):
        open_source(str(tmp_path / "list.txt"), keep_columns=["x"])
    with pytest.raises(SourceError, match=r"needs a \.csv, \.jsonl, \.parquet manifest"):
        open_source(str(tmp_path), keep_columns=["x"])
    # The command line says the same, and exits 2.
    done = run_module(
        "producer", "batch", str(manifest), "--out", str(tmp_path / "o.parquet"),
        "--keep-columns", "caption", "--redis-url", "redis://127.0.0.1:1/0",
    )  # fmt: skip
    assert done.returncode == 2 and "has no such column" in done.stderr


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


def until(check: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


async def test_no_more_than_in_flight_jobs_wait_and_a_full_backlog_waits_instead_of_failing(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "images"
    ids = make_folder(folder, good=30)
    out = tmp_path / "out.parquet"
    low = "gpufeed:jobs:bulk"  # the lowest level: online jobs pass these
    seen: list[Progress] = []

    def batch() -> Progress:
        with Producer(redis_url, priorities="online,bulk", max_backlog=6) as producer:
            return run_batch(
                str(folder),
                out,
                producer,
                BatchOptions(in_flight=10, checkpoint_s=0.1),
                on_progress=seen.append,
            )

    running = asyncio.create_task(asyncio.to_thread(batch))
    # No worker yet: the backlog limit (6) holds the jobs back, below --in-flight (10).
    await asyncio.to_thread(until, lambda: redis_client.xlen(low) == 6)
    await asyncio.to_thread(until, lambda: bool(seen) and seen[-1].refused >= 2)
    assert redis_client.xlen(low) == 6 and redis_client.xlen("gpufeed:jobs:online") == 0
    async with running_worker(redis_url, tiny_weights, priorities="online,bulk", **NULL):
        progress = await asyncio.wait_for(running, 60)

    assert progress.ok == len(ids) and progress.errors == 0
    assert max(p.in_flight for p in seen) <= 6
    assert Counter(r["id"] for r in read_rows(out)) == Counter(ids)
    assert redis_client.xlen("gpufeed:jobs:online") == 0


async def test_retry_failed_runs_the_error_rows_again_and_keeps_the_newest_row(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "images"
    ids = make_folder(folder, good=8, broken=2)
    out = tmp_path / "out.jsonl"
    async with running_worker(redis_url, tiny_weights, **NULL):
        first = await asyncio.to_thread(run, redis_url, folder, out, in_flight=4)
        # The same command again: nothing to do, the file stays as it was.
        again = await asyncio.to_thread(run, redis_url, folder, out, in_flight=4)
        before = read_rows(out)
        # The broken images are mended, and their rows run again.
        for i in range(2):
            (folder / f"broken/{i}.jpg").write_bytes(jpeg_bytes(24, 16, seed=99 + i))
        retried = await asyncio.to_thread(
            run, redis_url, folder, out, in_flight=4, retry_failed=True
        )

    assert (first.ok, first.errors) == (8, 2)
    assert (again.submitted, again.skipped, again.rows) == (0, 10, 10)
    assert Counter(r["status"] for r in before) == {"ok": 8, "error": 2}
    assert (retried.retried, retried.submitted, retried.ok, retried.errors) == (2, 2, 2, 0)
    rows = read_rows(out)
    assert Counter(r["id"] for r in rows) == Counter(ids)
    assert all(r["status"] == "ok" for r in rows)


def gpufeed(*args: str) -> subprocess.CompletedProcess[str]:
    return run_module("producer", *args)


def test_the_command_exits_2_for_bad_arguments_and_3_without_redis(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    make_folder(folder, good=2)
    bad_out = gpufeed("batch", str(folder), "--out", str(tmp_path / "out.csv"))
    assert bad_out.returncode == 2 and ".parquet or .jsonl" in bad_out.stderr
    missing = gpufeed("batch", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o.jsonl"))
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    away = gpufeed(
        "batch", str(folder), "--out", str(tmp_path / "o.jsonl"),
        "--redis-url", f"redis://127.0.0.1:{port}/0",
    )  # fmt: skip
    assert away.returncode == 3, away.stderr
    assert "Traceback" not in away.stderr


async def test_the_command_prints_json_progress_and_a_summary_and_exits_0_when_all_ok(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "images"
    ids = make_folder(folder, good=12)
    out = tmp_path / "out.parquet"
    async with running_worker(redis_url, tiny_weights, **NULL):
        proc = await asyncio.to_thread(
            gpufeed, "batch", str(folder), "--out", str(out), "--redis-url", redis_url, "--json"
        )
        plain = await asyncio.to_thread(
            gpufeed, "batch", str(folder), "--out", str(out), "--redis-url", redis_url
        )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[-1]["summary"]["ok"] == len(ids) and lines[-1]["summary"]["finished"]
    assert all("progress" in line for line in lines[:-1])
    assert plain.returncode == 0, plain.stderr
    assert "rows in the output" in plain.stdout and "wall time" in plain.stdout


@pytest.mark.parametrize("dtype", ["float16", "float32"])
async def test_embeddings_are_fixed_size_lists_of_their_dtype(
    redis_url: str, tmp_path: Path, dtype: str
) -> None:
    from tests.support.model_dirs import make_model_dir

    model = make_model_dir(
        tmp_path / "embedder", fmt="entry", kind="embed", out=6, output={"dtype": dtype}
    )
    folder = tmp_path / "images"
    ids = make_folder(folder, good=5, broken=1)
    out = tmp_path / "vectors.parquet"
    lines = tmp_path / "vectors.jsonl"
    async with running_worker(redis_url, Path("unused"), model=str(model), batch_size=4):
        await asyncio.to_thread(run, redis_url, folder, out)
        await asyncio.to_thread(run, redis_url, folder, lines)

    table = pq.read_table(out)
    assert table.schema.field("embedding").type == pa.list_(pa.from_numpy_dtype(dtype), 6)
    rows = {r["id"]: r for r in table.to_pylist()}
    assert set(rows) == ids
    assert rows["broken/0.jpg"]["embedding"] is None
    vector = rows["dogs/sub0/0000.jpg"]["embedding"]
    assert len(vector) == 6 and any(v != 0 for v in vector)
    as_json = {r["id"]: r for r in read_rows(lines)}
    assert as_json["dogs/sub0/0000.jpg"]["embedding"] == pytest.approx(vector, rel=1e-3)
    assert as_json["dogs/sub0/0000.jpg"]["dtype"] == dtype


async def test_a_sharded_deployment_runs_each_id_on_its_shard_and_once_in_the_output(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "images"
    ids = make_folder(folder, good=40, broken=3)
    out = tmp_path / "o.parquet"
    async with running_worker(redis_url, tiny_weights, shards=3, **NULL):

        def sharded() -> tuple[Progress, list[int]]:
            with Producer(redis_url, shard_count=3) as producer:
                progress = run_batch(str(folder), out, producer, BatchOptions(in_flight=9))
                level = pick_level(producer.levels, None)
                added = [
                    int(redis_client.xinfo_stream(level_stream(s.stream, level))["entries-added"])
                    for s in producer.shards
                ]
            return progress, added

        progress, added = await asyncio.to_thread(sharded)
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert (progress.ok, progress.errors) == (40, 3)
    # Each id went to its shard by the documented rule, crc32(id) % 3.
    expected = [sum(1 for i in ids if zlib.crc32(i.encode()) % 3 == n) for n in range(3)]
    assert added == expected
    assert progress.in_flight_limit == 9  # three shards, three each


async def test_with_a_path_root_the_workers_read_the_files_and_an_empty_source_gives_an_empty_file(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    root = tmp_path / "shared"
    ids = make_folder(root / "batch1", good=5)
    (root / "list.txt").write_text("".join(f"batch1/{i}\n" for i in sorted(ids)))
    out = tmp_path / "out.jsonl"
    empty = tmp_path / "nothing"
    empty.mkdir()
    async with running_worker(redis_url, tiny_weights, path_root=str(root), **NULL):
        progress = await asyncio.to_thread(
            run, redis_url, root / "list.txt", out, path_root=str(root)
        )
        none = await asyncio.to_thread(run, redis_url, empty, tmp_path / "none.parquet")
    assert progress.ok == 5
    assert {r["id"] for r in read_rows(out)} == {f"batch1/{i}" for i in ids}
    assert (none.rows, pq.read_table(tmp_path / "none.parquet").num_rows) == (0, 0)


async def test_jobs_past_their_deadline_are_error_rows_and_the_run_ends(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "images"
    ids = make_folder(folder, good=4)
    out = tmp_path / "late.parquet"
    running = asyncio.create_task(
        asyncio.to_thread(run, redis_url, folder, out, in_flight=8, deadline_s=0.2)
    )
    # No worker until the deadlines have passed.
    await asyncio.to_thread(until, lambda: redis_client.xlen("gpufeed:jobs") == 4)
    await asyncio.sleep(0.5)
    async with running_worker(redis_url, tiny_weights, **NULL):
        progress = await asyncio.wait_for(running, 60)
    assert (progress.ok, progress.errors) == (0, 4)
    rows = read_rows(out)
    assert {r["id"] for r in rows} == ids
    assert {r["error_code"] for r in rows} == {"deadline_exceeded"}


def test_answers_that_miss_the_reply_stream_are_found_in_their_result_hashes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """An answer the run's reply stream never saw (a worker that answered on the default
    results stream only) is looked up in its result hash after a quiet spell; for an id
    whose hash holds another entry's answer (an earlier job with the same id), the answer
    stored under this job's own entry is the one taken."""
    folder = tmp_path / "images"
    ids = make_folder(folder, good=3)
    out = tmp_path / "out.jsonl"
    running = threading.Thread(target=lambda: done.append(run(redis_url, folder, out)))
    done: list[Progress] = []
    running.start()
    until(lambda: redis_client.xlen("gpufeed:jobs") == 3)
    entries = {f[b"id"].decode(): e.decode() for e, f in redis_client.xrange("gpufeed:jobs")}
    first, *rest = sorted(ids)
    for job_id in rest:  # stored under the id, naming this job's entry
        redis_client.hset(
            f"gpufeed:result:{job_id}",
            mapping={"id": job_id, "entry": entries[job_id], "status": "ok", "model": "elsewhere"},
        )
    # Under the id: an earlier job's answer; under this job's entry: its own.
    redis_client.hset(
        f"gpufeed:result:{first}",
        mapping={"id": first, "entry": "1-1", "status": "ok", "model": "earlier"},
    )
    redis_client.hset(
        f"gpufeed:result:{entries[first]}",
        mapping={"id": first, "entry": entries[first], "status": "error",
                 "error": "decode_error: mine", "duplicate_of": "1-1"},
    )  # fmt: skip
    running.join(30)
    assert not running.is_alive()
    rows = {r["id"]: r for r in read_rows(out)}
    assert set(rows) == ids
    assert {rows[i]["model"] for i in rest} == {"elsewhere"}
    assert rows[first]["error_code"] == "decode_error" and rows[first]["duplicate_of"] == "1-1"
    assert (done[0].ok, done[0].errors) == (2, 1)
