"""A manifest of 1,000,000 lines through `python -m producer batch` against a real
null-model worker and redis-server, on a time budget: the client's peak memory stays
bounded (the manifest is streamed, the done ids are 64-bit hashes), and after the client is
killed and run again the output holds each submitted id exactly once so far."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support.cli_runner import ROOT, clean_env
from tests.support.images import jpeg_bytes
from tests.support.process_harness import start_workers, stop_all

pq = pytest.importorskip("pyarrow.parquet")

LINES = 1_000_000
FILES = 64  # distinct image files under the workers' root; every line has its own id
RUN_S = 20.0
# The client's peak resident memory: at most this much past its size at its first progress
# line (imports done, the run started), and at most PEAK_MB in all (about 150 MB measured:
# Python, pyarrow, numpy, redis-py). Reading the manifest whole would cost several hundred
# MB (a million items, or a million row dicts), as would a set of a million id strings,
# before the first progress line or after; the hashes of a million ids are 8 MB.
GROWTH_MB = 80
PEAK_MB = 300


def kib(pid: int, field: str) -> int:
    """VmRSS / VmHWM of `pid` in KiB, from /proc (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def progress_lines(path: Path) -> list[dict[str, object]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x)["progress"] for x in lines if x.startswith('{"progress"')]


def committed(out: Path) -> list[dict[str, object]]:
    """The rows of the committed segments (each a complete Parquet file at any moment)."""
    parts = out.with_name(out.name + ".parts")
    rows: list[dict[str, object]] = []
    for p in sorted(parts.glob("*.parquet")):
        rows += pq.read_table(p, columns=["id", "status", "source"]).to_pylist()
    return rows


@pytest.mark.slow
def test_a_million_line_manifest_streams_in_bounded_memory_and_resumes_exactly_once(
    redis_url: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    for n in range(FILES):
        (root / "img" / f"{n}.jpg").write_bytes(jpeg_bytes(16, 12, seed=n, quality=60))
    manifest = tmp_path / "million.csv"
    with manifest.open("w") as f:
        f.write("id,path\n")
        for start in range(0, LINES, 100_000):
            f.write(
                "".join(f"job-{n:07d},img/{n % FILES}.jpg\n" for n in range(start, start + 100_000))
            )
    out = tmp_path / "million.parquet"
    command = [
        sys.executable, "-m", "producer", "batch", str(manifest), "--out", str(out),
        "--path-root", str(root), "--redis-url", redis_url, "--in-flight", "512",
        "--checkpoint", "1", "--json",
    ]  # fmt: skip
    workers = start_workers(
        ["w1"],
        redis_url,
        "none",
        tmp_path / "logs",
        GPUFEED_MODEL="null",
        GPUFEED_PATH_ROOT=str(root),
        GPUFEED_BATCH_SIZE="256",
    )
    try:
        first_log = tmp_path / "first.jsonl"
        with first_log.open("w") as log:
            proc = subprocess.Popen(command, cwd=ROOT, env=clean_env(), stdout=log)
            started_kib = peak_kib = 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < RUN_S:
                assert proc.poll() is None, f"the client ended early ({proc.returncode})"
                if not started_kib and progress_lines(first_log):
                    started_kib = kib(proc.pid, "VmRSS")
                peak_kib = max(peak_kib, kib(proc.pid, "VmHWM"))
                time.sleep(0.2)
            peak_kib = max(peak_kib, kib(proc.pid, "VmHWM"))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        first = progress_lines(first_log)
        kept = committed(out)

        # The same command again: it skips what the output holds, goes on, and is stopped
        # with ^C, which commits what it has.
        second_log = tmp_path / "second.jsonl"
        with second_log.open("w") as log:
            again = subprocess.Popen(command, cwd=ROOT, env=clean_env(), stdout=log)
            t0 = time.monotonic()
            while len(committed(out)) <= len(kept) and time.monotonic() - t0 < 30:
                assert again.poll() is None, f"the resumed client ended ({again.returncode})"
                time.sleep(0.2)
            time.sleep(1.0)
            again.send_signal(signal.SIGINT)
            assert again.wait(30) == 130
        second = progress_lines(second_log)
    finally:
        stop_all(workers, timeout_s=10)

    growth_mb = (peak_kib - started_kib) / 1024
    print(
        f"1M-line manifest: peak RSS {peak_kib / 1024:.0f} MB, {started_kib / 1024:.0f} MB at "
        f"the first progress line; {first[-1]['submitted']} submitted in {RUN_S:.0f} s"
    )
    assert started_kib > 0 and growth_mb < GROWTH_MB, f"grew {growth_mb:.0f} MB"
    assert peak_kib / 1024 < PEAK_MB
    assert first[0]["total"] == LINES  # counted as the file streamed, not loaded
    # Rows committed before the kill: each id once (the last progress line may predate the
    # last commit by up to a second, so its count bounds nothing).
    assert kept and max(Counter(str(r["id"]) for r in kept).values()) == 1
    assert second[0]["done_before"] == len(kept)  # the rows committed before the kill
    rows = committed(out)
    ids = Counter(str(r["id"]) for r in rows)
    assert len(rows) > len(kept)
    assert max(ids.values()) == 1  # each id exactly once so far
    assert {str(r["id"]) for r in kept} <= set(ids)
    assert all(r["status"] == "ok" for r in rows)
    # The manifest's first lines, in its order: those in flight at the ^C (512 at most) are
    # the only gaps, as the jobs the killed client lost went out again first.
    numbers = sorted(int(i.removeprefix("job-")) for i in ids)
    assert numbers[-1] < len(rows) + 512
