"""`producer batch` over folders whose names are not UTF-8 and whose trees are deeper than
Python's recursion limit (or than a path may be long): every image is served under an id
and a source of UTF-8 text, what cannot be listed is passed over and counted, and the run
never ends for either. A real null-model worker and redis-server; a property over
arbitrary name bytes for the folder source itself."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from producer.batch_output import Output
from producer.batch_rows import Rows, error_fields
from producer.batch_sources import SourceError, open_source
from producer.wire import ErrorCode
from tests.support.cli_runner import ROOT, clean_env, run_module
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker

NULL = {"model": "null", "input_size": 64, "batch_size": 8, "max_wait_ms": 5.0}
# The longest path the system takes, its terminating NUL included (Linux: 4,096 bytes).
PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096


def put(path: bytes, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def batch(source: bytes, out: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    # argv takes the name's own bytes: os.fsdecode gives them as the str subprocess encodes.
    args = ("batch", os.fsdecode(source), "--out", str(out), "--redis-url", redis_url, "--json")
    return run_module("producer", *args)


def rows_of(out: Path) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert set(Counter(r["id"] for r in rows).values()) == {1}  # every id once
    return {r["id"]: r for r in rows}


def summary_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])["summary"]
    return summary


def shown(raw: bytes) -> str:
    """A path as the output shows it: each byte that is not UTF-8 as `\\xNN`."""
    return raw.decode("utf-8", "backslashreplace")


def remove_tree(top: Path) -> None:
    """Remove a tree of any depth and path length: shutil.rmtree recurses once a folder on
    Python 3.11 and names what it removes by path. One descriptor open at a time."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    below: list[str] = []
    while True:
        sub = None
        with os.scandir(fd) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    sub = entry.name
                else:
                    os.unlink(entry.name, dir_fd=fd)
        if sub is not None:
            child = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd, below = child, [*below, sub]
            continue
        if not below:
            break
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = parent
        os.rmdir(below.pop(), dir_fd=fd)
    os.close(fd)
    os.rmdir(top)


# ---------------------------------------------------------------------- names
async def test_names_that_are_not_utf8_are_served_under_ids_of_utf8_text(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    """Latin-1 and other bytes in file names, a folder's name and the source folder's own:
    each image gets its row, the ids are UTF-8 text apart from each other (and from a name
    spelled with a backslash the way another is shown), and a second run finds them done."""
    top = os.path.join(os.fsencode(tmp_path), b"photos-\xe9t\xe9")
    names = [
        b"ok.jpg",
        b"caf\xe9.jpg",  # Latin-1
        b"caf\\xe9.jpg",  # UTF-8, spelled as the Latin-1 one is shown
        b"\xff\xfe/inner.png",  # a folder whose name is not UTF-8
        b"\xed\xa0\x80.jpg",  # a surrogate encoded as UTF-8 would (CESU-8): not UTF-8
    ]
    for n, name in enumerate(names):
        put(os.path.join(top, name), jpeg_bytes(24, 16, seed=n, quality=70))
    put(os.path.join(top, b"empty-\xe9.jpg"), b"")
    out = tmp_path / "out.jsonl"

    async with running_worker(redis_url, tiny_weights, **NULL):
        first = await asyncio.to_thread(batch, top, out, redis_url)
        again = await asyncio.to_thread(batch, top, out, redis_url)

    # The empty file is an error row, which makes the exit status 1; nothing else is wrong.
    assert first.returncode == 1, first.stderr
    assert "Traceback" not in first.stderr
    summary = summary_of(first)
    assert (summary["ok"], summary["errors"], summary["not_regular"]) == (5, 1, 0)
    assert summary["source"] == shown(top)
    rows = rows_of(out)
    assert len(rows) == 6
    by_id = {job_id: row for job_id, row in rows.items()}
    # A UTF-8 name keeps its path as its id; one that is not gets a digest of its bytes,
    # then the path as shown.
    assert by_id["ok.jpg"]["status"] == by_id["caf\\xe9.jpg"]["status"] == "ok"
    for raw in (b"caf\xe9.jpg", b"\xff\xfe/inner.png", b"\xed\xa0\x80.jpg", b"empty-\xe9.jpg"):
        job_id = f"{hashlib.sha1(raw).hexdigest()[:16]}~{shown(raw)}"
        assert job_id in by_id, sorted(by_id)
        assert by_id[job_id]["source"] == shown(os.path.join(top, raw))
    empty_digest = hashlib.sha1(b"empty-\xe9.jpg").hexdigest()[:16]
    empty = by_id[f"{empty_digest}~empty-\\xe9.jpg"]
    assert (empty["status"], empty["error_code"]) == ("error", "empty_image")
    assert empty["error"] == f"empty_image: {shown(top)}/empty-\\xe9.jpg: image is empty"
    assert sum(r["status"] == "ok" for r in rows.values()) == 5
    assert all(r["model"] == "null" for r in rows.values() if r["status"] == "ok")

    # The same ids on the next run: nothing is submitted again.
    assert again.returncode == 1, again.stderr
    resumed = summary_of(again)
    assert (resumed["submitted"], resumed["done_before"]) == (0, 6)


def test_a_path_root_run_sends_a_name_that_is_not_utf8_inline(tmp_path: Path) -> None:
    """A path job names its file in UTF-8 text for the workers: a file whose name has none
    is read here and sent inline instead; its neighbours are path jobs as asked."""
    top = os.fsencode(tmp_path / "photos")
    put(os.path.join(top, b"a.jpg"), jpeg_bytes(24, 16, seed=1))
    put(os.path.join(top, b"b\xe9.jpg"), jpeg_bytes(24, 16, seed=2))
    source = open_source(os.fsdecode(top), path_root=os.fsdecode(top))
    items = {i.source: i for page in source.pages() for i in page}
    plain, odd = items[os.fsdecode(top) + "/a.jpg"], items[shown(top) + "/b\\xe9.jpg"]
    assert (plain.path, plain.file) == ("a.jpg", None)
    assert odd.path is None and odd.file is not None
    assert odd.fields()[1] == jpeg_bytes(24, 16, seed=2)


NAME_BYTES = st.binary(min_size=1, max_size=120).map(
    lambda b: b.replace(b"/", b"_").replace(b"\0", b"_")
)


@settings(max_examples=60)
@given(
    names=st.lists(NAME_BYTES, min_size=1, max_size=4, unique=True),
    folder=st.one_of(st.none(), NAME_BYTES),
    ext=st.sampled_from([b".jpg", b".PNG", b".webp"]),
)
@example(names=[b"caf\xe9", b"caf\\xe9"], folder=None, ext=b".jpg")
@example(names=[b"\xed\xa0\x80", b"\xff"], folder=b"\x80\x81", ext=b".jpg")
def test_any_name_bytes_give_items_of_utf8_text_that_read_their_own_file(
    names: list[bytes], folder: bytes | None, ext: bytes
) -> None:
    """Whatever bytes the names hold (but the two no name can: `/` and NUL): the folder
    source lists every file once, under a distinct id of at most 128 bytes of UTF-8 text
    and a source of UTF-8 text, reads each item's own bytes, and its rows are written."""
    with tempfile.TemporaryDirectory(prefix="gpufeed-names-") as tmp:
        top = os.path.join(os.fsencode(tmp), b"src")
        paths = []
        for n, name in enumerate(names):
            path = os.path.join(top, *([folder] if folder else []), name + ext)
            put(path, f"image {n}".encode())
            paths.append(path)
        source = open_source(os.fsdecode(top))
        items = [item for page in source.pages() for item in page]

        assert source.total == len(items) == len(paths)
        ids = [item.id for item in items]
        assert len(set(ids)) == len(ids)
        assert all(0 < len(i.encode()) <= 128 for i in ids)
        assert sorted(item.source for item in items) == sorted(shown(p) for p in paths)
        contents = {bytes(item.fields()[1]) for item in items}
        assert contents == {f"image {n}".encode() for n in range(len(paths))}
        # The output takes the rows as they are: ids, sources and messages naming them.
        rows = Rows()
        for item in items:
            message = f"{item.source} is not an image"
            rows.add(error_fields(item.id, ErrorCode.DECODE_ERROR, message), item.source)
        out = os.path.join(tmp, "out.parquet")
        output = Output(out)
        existing = output.start(retry_failed=False)
        try:
            output.write(rows)
            assert output.finish(existing.contested) == len(items)
        finally:
            output.release()
        written = pq.read_table(out).to_pylist()
        assert sorted((r["id"], r["source"]) for r in written) == sorted(
            (item.id, item.source) for item in items
        )


# ---------------------------------------------------------------------- manifests
def test_a_json_manifest_cell_with_a_lone_surrogate_names_its_line(tmp_path: Path) -> None:
    """JSON can spell what is not UTF-8 text (`"\\ud800"`): in a path, a url or an id the
    run ends with one message naming the line, as for any line it cannot read; in a kept
    column, the row keeps it as text."""
    manifest = tmp_path / "list.jsonl"
    manifest.write_text('{"path": "a.jpg", "note": "x\\udc80y"}\n{"path": "b\\ud800.jpg"}\n')
    source = open_source(str(manifest), keep_columns=["note"])
    with pytest.raises(SourceError, match=r"list\.jsonl line 2: path is not UTF-8 text"):
        list(source.pages())
    manifest.write_text('{"path": "a.jpg", "note": "x\\udc80y"}\n')
    (item,) = next(open_source(str(manifest), keep_columns=["note"]).pages())
    assert item.extra == ("x\\x80y",)


# ---------------------------------------------------------------------- depth
def deep_tree(top: Path) -> Path:
    """`top/top.jpg`; 1,100 folders `d` below it, an image at the bottom (returned: that
    folder); and beside them a chain of 200-byte names that goes past PATH_MAX, an image at
    its end."""
    deep = top
    for _ in range(1100):  # a level at a time: Path.mkdir(parents=True) recurses
        deep /= "d"
        deep.mkdir(parents=True)
    (top / "top.jpg").write_bytes(jpeg_bytes(24, 16, seed=1))
    (deep / "deep.jpg").write_bytes(jpeg_bytes(24, 16, seed=2))
    # Made a level at a time, relative to the last: past PATH_MAX no path names it.
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    length = len(os.fsencode(top))
    try:
        while length < PATH_MAX + 300:
            os.mkdir("l" * 200, dir_fd=fd)
            child = os.open("l" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, length = child, length + 201
        image = os.open("x.jpg", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(image, jpeg_bytes(24, 16, seed=3))
        os.close(image)
    finally:
        os.close(fd)
    return deep


async def test_a_tree_of_any_depth_is_walked_and_what_cannot_be_listed_is_counted(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    """1,100 folders deep (past Python's recursion limit): the image at the bottom is served.
    A chain whose path grows past PATH_MAX: the first folder that cannot be listed is passed
    over and named in the summary; every image before it is served."""
    top = tmp_path / "tree"
    deep = deep_tree(top)
    out = tmp_path / "out.jsonl"
    try:
        async with running_worker(redis_url, tiny_weights, **NULL):
            done = await asyncio.to_thread(batch, os.fsencode(top), out, redis_url)
    finally:
        remove_tree(top)

    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    rows = rows_of(out)
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["top.jpg"]["source"] == str(top / "top.jpg")
    (bottom,) = (r for r in rows.values() if r["source"] == str(deep / "deep.jpg"))
    assert bottom["id"].endswith("/d/d/deep.jpg") and len(bottom["id"].encode()) <= 128
    summary = summary_of(done)
    assert summary["not_regular"] == 1
    (passed_over,) = summary["not_regular_files"]
    assert passed_over.endswith(": cannot list it: File name too long")
    assert len(passed_over.split(":")[0].encode()) >= PATH_MAX
    assert summary["ok"] == len(rows) == 2


def test_a_folder_found_inside_itself_is_passed_over_not_walked_again(tmp_path: Path) -> None:
    """A bind mount of a folder below itself: the same folder again, by device and inode.
    It is reported and not listed, instead of a second copy of every id below it."""
    if shutil.which("unshare") is None or sys.platform != "linux":
        pytest.skip("needs unshare(1) on Linux")
    top = tmp_path / "top"
    (top / "again").mkdir(parents=True)
    (top / "a.jpg").write_bytes(b"x")
    script = (
        "import json, sys; from producer.batch_sources import open_source; skipped = []; "
        "items = [i.id for p in open_source(sys.argv[1]).pages(lambda p, r: "
        "skipped.append([p, r])) for i in p]; print(json.dumps([items, skipped]))"
    )
    command = (
        f"mount --bind {shlex.quote(str(top))} {shlex.quote(str(top / 'again'))} && "
        f"{shlex.quote(sys.executable)} -c {shlex.quote(script)} {shlex.quote(str(top))}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"cannot bind-mount here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    items, skipped = json.loads(done.stdout)
    assert items == ["a.jpg"]
    assert skipped == [
        [str(top / "again"), "the same folder as one it is in (a bind mount): not listed again"]
    ]
