"""The sizing figures of docs/batch.md: what one batch client, one Redis and one null-model
worker carry, for inline, path and url jobs, on one host's loopback.

`python -m measure.bench.batch_sizing [JOBS] [OUT.json]` (default 6,000 jobs). For each
run, a private redis-server, one null-model worker process and
`python -m producer batch --json` over JOBS photo-like JPEGs, every file's bytes unique so
the decode cache serves none of them:

- `inline`: a folder, each file's bytes carried in its job: 640x480 (the GPU host's
  shape, ~84 KB) and 64x64 (a thumbnail), since the bytes are what Redis carries;
- `path`: a folder of 64x64 files with `--path-root` (the worker reads the file);
- `url`: a manifest of loopback URLs of 64x64 images, answered by a threaded HTTP server
  of this process.

A path or url job costs Redis and the client the same whatever the image's size (the job
names it, the result is the model's), and 64x64 images let the one worker answer fast, as
a GPU host does; the slower it answers, the fewer results each read returns and the more
each costs.

Per run: Redis's command thread's CPU (`INFO cpu`'s main thread) per job over the client's
run (the XADD, the worker's read, ack and result, the client's read of the result), less
what the thread spends a second with the worker idle; 1e6 / that is the jobs/s one Redis
shard carries with that thread busy all the time. The client's CPU per job (`cpu_s` of its
summary) and 1e6 / that; the worker's CPU per job (its process and children, every thread)
and its jobs/s here. Every process shares this host's cores, so only the CPU figures carry
to other hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RUNS = (("inline", 640, 480), ("inline", 64, 64), ("path", 64, 64), ("url", 64, 64))
BATCH_SIZE = 256  # the null model's, as the bench's batch section
IDLE_S = 3.0
WORKER_READY_S = 120.0
CLIENT_TIMEOUT_S = 900.0


def _redis_cpu_s(client: Any) -> float:
    from worker.observe.redis_cpu import cpu_of_info

    cpu = cpu_of_info(client.info("cpu"))
    if cpu is None or not cpu[1]:
        raise RuntimeError("redis-server does not report its main thread's CPU (Redis 6+)")
    return cpu[0]


@contextmanager
def _worker(url: str, root: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFEED_", "REDIS_"))}
    env.update(
        REDIS_URL=url,
        GPUFEED_MODEL="null",
        GPUFEED_WEIGHTS="none",
        GPUFEED_DEVICE="cpu",
        GPUFEED_PATH_ROOT=str(root),
        GPUFEED_URL_ALLOW="127.0.0.1",
        GPUFEED_DECODE_CACHE_MB="0",
        GPUFEED_BATCH_SIZE=str(BATCH_SIZE),
        GPUFEED_FETCH_PER_HOST="64",
        GPUFEED_LOG_FORMAT="json",
        GPUFEED_LOG_LEVEL="warning",
    )
    with log.open("ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "worker"], env=env, stdin=subprocess.DEVNULL,
                                stdout=f, stderr=f)  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(client: Any, proc: subprocess.Popen[bytes], log: Path) -> None:
    from producer import wire

    deadline = time.monotonic() + WORKER_READY_S
    while not client.keys(f"{wire.DEFAULT_WORKER_PREFIX}*"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not start: {log.read_text()[-600:]}")
        time.sleep(0.2)


def _one_run(kind: str, jobs: int, work: Path, folder: Path, urls: Path) -> dict[str, Any]:
    import redis

    from worker.tools.harness.probe import process_tree_cpu_s
    from worker.tools.harness.redis_env import bench_redis

    name = f"{kind}-{folder.name}"
    with bench_redis(None, work / f"redis-{name}") as url:
        client = redis.Redis.from_url(url)
        log = work / f"worker-{name}.log"
        with _worker(url, folder, log) as proc:
            _wait_ready(client, proc, log)
            idle_before = _redis_cpu_s(client)
            time.sleep(IDLE_S)
            idle_per_s = (_redis_cpu_s(client) - idle_before) / IDLE_S
            source = [str(urls)] if kind == "url" else [str(folder)]
            if kind == "path":
                source += ["--path-root", str(folder)]
            command = [sys.executable, "-m", "producer", "batch", *source,
                       "--out", str(work / f"{name}.parquet"), "--json"]  # fmt: skip
            redis_before, worker_before = _redis_cpu_s(client), process_tree_cpu_s(proc.pid)
            t0 = time.perf_counter()
            done = subprocess.run(command, env={**os.environ, "REDIS_URL": url},
                                  capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                                  check=False)  # fmt: skip
            wall = time.perf_counter() - t0
            redis_s = _redis_cpu_s(client) - redis_before
            worker_s = process_tree_cpu_s(proc.pid) - worker_before
        client.close()
    if done.returncode != 0:
        raise RuntimeError(f"{kind}: producer batch exited {done.returncode}: {done.stderr[-600:]}")
    summary = next(json.loads(line)["summary"] for line in done.stdout.splitlines()
                   if line.startswith('{"summary"'))  # fmt: skip
    answered = int(summary["ok"]) + int(summary["errors"])
    redis_us = 1e6 * max(0.0, redis_s - idle_per_s * wall) / answered
    client_us = 1e6 * float(summary["cpu_s"]) / answered
    return {
        "jobs": jobs,
        "ok": int(summary["ok"]),
        "errors": int(summary["errors"]),
        "wall_s": round(wall, 2),
        "jobs_per_s_here": round(answered / float(summary["elapsed_s"]), 1),
        "redis_idle_cpu_share": round(idle_per_s, 4),
        "redis_cpu_us_per_job": round(redis_us, 1),
        "redis_shard_jobs_per_s": round(1e6 / redis_us),
        "client_cpu_us_per_job": round(client_us, 1),
        "client_jobs_per_s": round(1e6 / client_us),
        "worker_cpu_us_per_job": round(1e6 * worker_s / answered, 1),
    }


def run_sizing(jobs: int, echo: Any = print) -> dict[str, Any]:
    from worker.tools.harness.image_server import ImageServer
    from worker.tools.harness.images import ImageSetSpec, load_image_set
    from worker.tools.harness.redis_env import job_image

    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpufeed-sizing-") as tmp:
        work = Path(tmp)
        for kind, width, height in RUNS:
            spec = ImageSetSpec(f"sizing-{width}x{height}", width, height, 32, quality=90,
                                seed=11, portrait_every=0)  # fmt: skip
            images = load_image_set(spec).images
            folder = work / spec.label.split()[0]
            served: dict[str, bytes] = {}
            for i in range(jobs):
                data = job_image(images, i, f"sizing-{kind}-{i}", unique=True)
                if kind == "url":
                    served[f"/img/{i}"] = data
                else:
                    folder.mkdir(exist_ok=True)
                    (folder / f"{i:07d}.jpg").write_bytes(data)
            with ImageServer(served) as server:
                urls = work / "urls.txt"
                urls.write_text("".join(f"{server.url(p)}\n" for p in served))
                folder.mkdir(exist_ok=True)
                run = _one_run(kind, jobs, work, folder, urls)
            run["images"] = spec.label
            run["mean_bytes"] = round(
                sum(len(job_image(images, i, "x", unique=True)) for i in range(32)) / 32
            )
            runs[f"{kind} {spec.label.split()[0]}"] = run
            echo(f"sizing {kind} {spec.label}: {json.dumps(run)}")
    return {
        "worker": f"null model at batch {BATCH_SIZE}, one process, GPUFEED_DECODE_CACHE_MB=0",
        "images_repeat": False,
        "runs": runs,
    }


def main() -> int:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 6000
    report = run_sizing(jobs)
    text = json.dumps(report, indent=2)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
