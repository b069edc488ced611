"""`producer batch` against a hostile tenant and odd sources, with a real null-model worker
and redis-server: answers forged onto the run's reply stream or into result hashes are
ignored and counted; FIFOs, devices, sockets and oversized files are never read; manifest
lines that make no sense end the run with one message naming the line; the exit code and
the summary describe the whole output file."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from producer import Producer, batch_runner
from producer.batch_runner import BatchOptions, Progress, run_batch
from producer.batch_sources import SourceError, open_source
from producer.batch_view import BatchView, summary
from producer.jobs import url_id, url_job_ids
from tests.support.cli_runner import run_module
from tests.support.http_images import ImageServer
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker

pq = pytest.importorskip("pyarrow.parquet")

NULL = {"model": "null", "input_size": 64, "batch_size": 8, "max_wait_ms": 5.0}


def images(folder: Path, names: list[str]) -> None:
    for n, name in enumerate(names):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(jpeg_bytes(24, 16, seed=n, quality=70))


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    if path.suffix == ".parquet":
        rows = pq.read_table(path).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    counts = Counter(r["id"] for r in rows)
    assert set(counts.values()) <= {1}, counts  # every id once
    return {r["id"]: r for r in rows}


def until(check: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def gpufeed(*args: str) -> Any:
    return run_module("producer", *args)


# ---------------------------------------------------------------------- forged answers
async def test_answers_to_no_entry_of_this_run_are_ignored_counted_and_never_written(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A tenant who found the reply stream writes answers carrying the run's outstanding
    ids: naming another job's entry, an entry never added, no entry, and this run's entry
    under another id; and result hashes under a job's id and under its entry reference that
    name another entry or id. None of them becomes a row: each id's row is the worker's."""
    monkeypatch.setattr(batch_runner, "RECHECK_S", 0.2)  # the hash look-up, soon
    folder = tmp_path / "images"
    names = [f"{n}.jpg" for n in range(6)]
    images(folder, names)
    out = tmp_path / "out.parquet"
    seen: list[Progress] = []
    done: list[Progress] = []

    def batch() -> None:
        with Producer(redis_url, priorities="online,bulk") as producer:
            done.append(run_batch(str(folder), out, producer, on_progress=seen.append))

    thread = threading.Thread(target=batch)
    thread.start()
    jobs = "gpufeed:jobs:bulk"
    await asyncio.to_thread(until, lambda: redis_client.xlen(jobs) == 6)
    entries = {f[b"id"].decode(): (e.decode(), f) for e, f in redis_client.xrange(jobs)}
    reply_to = entries["0.jpg"][1][b"reply_to"].decode()
    # Unguessable: 128 random bits after the output's digest.
    assert len(reply_to.rsplit(":", 1)[1]) == 32 and reply_to.count(":batch:") == 1
    ref = {job_id: f"bulk:{e}" for job_id, (e, _) in entries.items()}
    forged = {"status": "ok", "model": "forged", "label": "forged", "score": "1.0"}
    for fields in (
        {"id": "0.jpg", "entry": ref["1.jpg"]},  # another job's entry
        {"id": "0.jpg", "entry": "bulk:9999999999999-0"},  # an entry never added
        {"id": "2.jpg"},  # no entry at all
        {"id": "3.jpg", "entry": ref["3.jpg"].replace("bulk:", "online:")},  # another level
        {"id": "someone-else", "entry": ref["4.jpg"]},  # this run's entry, another id
    ):
        redis_client.xadd(reply_to, {**forged, **fields})
    # Result hashes: under the id, another entry's answer; under the entry reference, an
    # answer for another id (a job whose id was chosen to be that reference).
    redis_client.hset("gpufeed:result:5.jpg", mapping={**forged, "id": "5.jpg", "entry": "1-1"})
    redis_client.hset(
        f"gpufeed:result:{ref['5.jpg']}", mapping={**forged, "id": ref["5.jpg"], "entry": "2-2"}
    )
    await asyncio.to_thread(until, lambda: bool(seen) and seen[-1].ignored == 5)
    await asyncio.sleep(0.6)  # quiet spells: the hashes were looked at
    assert seen[-1].answered == 0 and seen[-1].in_flight == 6
    async with running_worker(redis_url, tiny_weights, priorities="online,bulk", **NULL):
        await asyncio.to_thread(thread.join, 60)
    assert not thread.is_alive()

    (progress,) = done
    rows = read_rows(out)
    assert set(rows) == set(names)
    assert {r["model"] for r in rows.values()} == {"null"}  # the worker's, every one
    assert (progress.ok, progress.ignored) == (6, 5)
    assert progress.to_dict()["ignored_answers"] == 5
    assert redis_client.exists(reply_to) == 0  # the run's stream goes with it
    shown = io.StringIO()
    summary(progress, Console(file=shown, width=120))
    assert "answers ignored (to no job of this run)" in shown.getvalue()


# ---------------------------------------------------------------------- exit codes
async def test_the_exit_code_and_summary_follow_the_whole_output_and_progress_counts_this_run(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    """A re-run with nothing to do still exits 1 while the output holds an error row; the
    progress of a resumed run counts only its own work, with the folder's total from the
    start; once the error row is mended, exit 0."""
    folder = tmp_path / "images"
    images(folder, ["a.jpg", "b.jpg", "c.jpg"])
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg " * 4)
    out = tmp_path / "out.jsonl"
    command = ("batch", str(folder), "--out", str(out), "--redis-url", redis_url)
    seen: list[dict[str, Any]] = []

    def resume() -> Progress:
        with Producer(redis_url) as producer:
            view = BatchView(Console(file=io.StringIO(), force_terminal=True), json_lines=False)
            with view as update:

                def both(p: Progress) -> None:
                    seen.append(p.to_dict())
                    update(p)

                progress = run_batch(str(folder), out, producer, on_progress=both)
                assert view._bar is not None
                task = view._bar.tasks[0]
                assert (task.completed, task.total) == (2, 2)  # this run's, not 6/6
            return progress

    async with running_worker(redis_url, tiny_weights, **NULL):
        first = await asyncio.to_thread(gpufeed, *command, "--json")
        images(folder, ["new/d.jpg", "new/e.jpg"])
        resumed = await asyncio.to_thread(resume)
        again = await asyncio.to_thread(gpufeed, *command)
        (folder / "broken.jpg").write_bytes(jpeg_bytes(24, 16, seed=9))
        mended = await asyncio.to_thread(gpufeed, *command, "--retry-failed", "--json")

    assert first.returncode == 1, first.stderr
    one = json.loads(first.stdout.splitlines()[-1])["summary"]
    assert one["in_output"]["ok"] == 3 and one["in_output"]["errors"] == 1
    assert one["in_output"]["from_this_run"] == 4
    # The resumed run: the total (6) from its first report, its own work 2 of it.
    assert seen[0]["total"] == 6
    assert {p["todo"] for p in seen} == {2}
    assert (resumed.skipped, resumed.answered, resumed.todo) == (4, 2, 2)
    assert resumed.output_errors == 1 and resumed.output_ok == 5
    # Nothing to do, and the output still holds the error row: exit 1, saying so.
    assert again.returncode == 1, again.stderr
    assert f"1 row(s) of {out} are errors (0 from this run)" in again.stderr
    assert "from this run" in again.stdout and "Traceback" not in again.stderr
    assert mended.returncode == 0, mended.stderr
    last = json.loads(mended.stdout.splitlines()[-1])["summary"]
    assert last["in_output"] == {"ok": 6, "errors": 0, "error_codes": {}, "from_this_run": 1}
    assert all(r["status"] == "ok" for r in read_rows(out).values())


# ---------------------------------------------------------------------- odd sources
def odd_folder(folder: Path) -> dict[str, str]:
    """Good images, and entries named like images that must not be read: what the run
    must say of each passed-over one."""
    images(folder, ["a.jpg", "sub/b.png"])
    os.mkfifo(folder / "pipe.jpg")
    (folder / "zero.jpg").symlink_to("/dev/zero")
    (folder / "gone.jpg").symlink_to(folder / "nowhere.jpg")
    (folder / "alias.jpg").symlink_to(folder / "a.jpg")  # a link to a regular file: taken
    (folder / "scan.tif").write_bytes(b"II*\x00" + bytes(64))  # not decoded: not a job
    (folder / "big.jpg").write_bytes(b"\xff\xd8" + bytes(8000))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "s.jpg"))
    sock.close()
    return {
        "pipe.jpg": "a FIFO",
        "zero.jpg": "a character device",
        "gone.jpg": "a broken symbolic link",
        "s.jpg": "a socket",
    }


async def test_odd_files_are_passed_over_or_error_rows_and_never_read_and_url_ids_keep_queries(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "f"
    passed_over = odd_folder(folder)
    target = tmp_path / "real" / "out.jsonl"
    target.parent.mkdir()
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    manifest = tmp_path / "list.txt"
    manifest.write_text(f"/dev/zero\n{folder / 'pipe.jpg'}\n{folder / 'a.jpg'}\n")
    server = ImageServer().start()
    server.images["x"] = jpeg_bytes(32, 24, seed=1)
    urls = [server.url(f"/img/x?id={n}") for n in range(1, 6)]
    url_list = tmp_path / "urls.txt"
    url_list.write_text("".join(u + "\n" for u in urls))
    seen: list[Progress] = []

    def run(source: Path, out: Path, **options: Any) -> Progress:
        with Producer(redis_url) as producer:
            return run_batch(
                str(source), out, producer, BatchOptions(**options), on_progress=seen.append
            )

    try:
        async with running_worker(redis_url, tiny_weights, url_allow="127.0.0.1", **NULL):
            walked = await asyncio.wait_for(
                asyncio.to_thread(run, folder, link, max_image_bytes=4096), 60
            )
            first_total = seen[0].total
            listed = await asyncio.wait_for(
                asyncio.to_thread(run, manifest, tmp_path / "m.parquet"), 60
            )
            by_url = await asyncio.wait_for(
                asyncio.to_thread(run, url_list, tmp_path / "u.parquet"), 60
            )
    finally:
        server.stop()

    # The folder: regular image files only, the link to one among them; the total from
    # the start; the oversized file an error row naming the limit.
    assert link.is_symlink() and link.resolve() == target  # written through the link
    rows = read_rows(target)
    assert set(rows) == {"a.jpg", "sub/b.png", "alias.jpg", "big.jpg"}
    assert first_total == 4
    assert rows["big.jpg"]["error_code"] == "payload_too_large"
    assert "over the limit of 4096 bytes" in rows["big.jpg"]["error"]
    assert all(rows[i]["status"] == "ok" for i in ("a.jpg", "sub/b.png", "alias.jpg"))
    assert walked.not_regular == 4
    assert sorted(walked.not_regular_files) == sorted(
        f"{folder / name}: {why}" for name, why in passed_over.items()
    )
    assert walked.to_dict()["not_regular"] == 4
    # A manifest naming a device and a FIFO: an error row each, its neighbour answered.
    named = read_rows(tmp_path / "m.parquet")
    assert named["/dev/zero"]["error_code"] == "path_not_found"
    assert "not a regular file (a character device)" in named["/dev/zero"]["error"]
    assert "(a FIFO)" in named[str(folder / "pipe.jpg")]["error"]
    assert named[str(folder / "a.jpg")]["status"] == "ok"
    assert listed.output_errors == 2
    # URLs that differ in their query only: five ids, five rows, as `submit --urls` gives.
    got = read_rows(tmp_path / "u.parquet")
    assert sorted(got) == sorted(urls) == sorted(url_job_ids(urls))
    assert by_url.ok == 5 and by_url.skipped == 0


# ---------------------------------------------------------------------- manifests
@pytest.mark.parametrize(
    ("name", "text", "line", "says"),
    [
        ("wide.csv", "id,url\na,http://x/a.jpg\nb," + "y" * 140_000 + "\n", 3, "field larger"),
        ("deep.jsonl", '{"url": "http://x/a.jpg"}\n' + "[" * 100_000 + "\n", 2, "too deeply"),
    ],
)
def test_a_malformed_manifest_line_exits_2_with_one_line_naming_it(
    redis_url: str, tmp_path: Path, name: str, text: str, line: int, says: str
) -> None:
    manifest = tmp_path / name
    manifest.write_text(text)
    done = gpufeed("batch", str(manifest), "--out", str(tmp_path / "o.jsonl"), "--redis-url",
                   redis_url)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (message,) = done.stderr.strip().splitlines()
    assert message.startswith(f"error: {manifest} line {line}: ") and says in message


def test_a_line_without_end_and_a_manifest_that_is_a_device_are_refused_unread(
    tmp_path: Path,
) -> None:
    endless = tmp_path / "one.txt"
    endless.write_bytes(b"a" * (3 << 20))  # no line break: refused at 1 MiB
    with pytest.raises(SourceError, match=r"one.txt line 1: longer than 1048576 bytes"):
        list(open_source(str(endless)).pages())
    with pytest.raises(SourceError, match="is a character device"):
        open_source("/dev/zero")
    os.mkfifo(tmp_path / "m.txt")
    with pytest.raises(SourceError, match="is a FIFO"):
        open_source(str(tmp_path / "m.txt"))


MANIFEST_DIR: list[Path] = []


def _manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not MANIFEST_DIR:
        MANIFEST_DIR.append(tmp_path_factory.mktemp("manifests"))
    return MANIFEST_DIR[0]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
lines = (
    st.binary(max_size=200)
    | st.text(max_size=200).map(str.encode)
    | st.builds(
        lambda d: json.dumps(d).encode(),
        st.dictionaries(st.sampled_from(["url", "path", "id", "x"]), json_values, max_size=3),
    )
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(line=lines, fmt=st.sampled_from(["txt", "csv", "jsonl"]))
@example(line=b'"' + b"y" * 140_000, fmt="csv")
@example(line=b"[" * 50_000, fmt="jsonl")
@example(line=b'{"id": ' + b"9" * 5000 + b"}", fmt="jsonl")
@example(line=b'{"path": "a\\u0000b"}', fmt="jsonl")
@example(line=b"\xff\xfe", fmt="txt")
def test_any_manifest_line_gives_its_items_or_one_source_error(
    tmp_path_factory: pytest.TempPathFactory, line: bytes, fmt: str
) -> None:
    manifest = _manifest(tmp_path_factory) / f"m.{fmt}"
    head = b"id,url,path\n" if fmt == "csv" else b""
    manifest.write_bytes(head + line + b"\n")
    try:
        items = [i for page in open_source(str(manifest)).pages() for i in page]
    except SourceError as exc:
        assert str(exc).startswith(str(manifest)) or str(exc).startswith("cannot read")
        assert "\n" not in str(exc)
        return
    for item in items:
        assert len(item.id.encode()) <= 128
        assert (item.url, item.file, item.path).count(None) == 2


# ---------------------------------------------------------------------- URL ids
def test_url_ids_keep_the_query_but_not_what_signs_it() -> None:
    assert url_id("http://h/get?id=1") != url_id("http://h/get?id=2")
    assert url_id("http://h/get?id=1#top") == "http://h/get?id=1"
    s3 = "https://b.s3.amazonaws.com/k.jpg?v=2&X-Amz-Signature={}&X-Amz-Date=2026{}"
    assert (
        url_id(s3.format("ab", "01"))
        == url_id(s3.format("cd", "02"))
        == ("https://b.s3.amazonaws.com/k.jpg?v=2")
    )
    sas = "https://a.blob.core.windows.net/c/k.jpg?sv=2024&se=2026&sp=r&sig={}"
    assert (
        url_id(sas.format("x"))
        == url_id(sas.format("y"))
        == ("https://a.blob.core.windows.net/c/k.jpg")
    )
    # Without a signature, `sp` and its kin are the URL's own parameters.
    assert url_id("http://h/i?sp=3") == "http://h/i?sp=3"
    # `submit --urls` and `batch` share the rule; submit numbers a repeat.
    given = ["http://h/get?id=1", "http://h/get?id=2", "http://h/get?id=1"]
    assert url_job_ids(given) == [url_id(given[0]), url_id(given[1]), "http://h/get?id=1#2"]


def test_a_killed_runs_reply_stream_is_deleted_by_the_run_that_finishes_the_output(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    parts = tmp_path / "o.jsonl.parts"
    parts.mkdir()
    old = "gpufeed:results:batch:0123456789abcdef:" + "0" * 32
    redis_client.xadd(old, {"id": "late", "entry": "1-1", "status": "ok"})
    redis_client.xadd("elsewhere", {"x": "1"})
    # Noted by the killed run; a name no run gives its stream is never deleted.
    (parts / "reply-streams").write_text(f"{old}\nelsewhere\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    with Producer(redis_url) as producer:
        progress = run_batch(str(empty), out, producer)
    assert progress.rows == 0 and not parts.exists()
    assert redis_client.exists(old) == 0 and redis_client.exists("elsewhere") == 1


def test_the_client_reads_no_more_than_the_workers_default_image_limit() -> None:
    from producer import wire
    from worker.config.settings import WorkerConfig

    assert WorkerConfig().max_image_bytes == wire.DEFAULT_MAX_IMAGE_BYTES
