"""Jobs/s of one worker process and of several (GPUFEED_PROCESSES) on the same backlog.

The overhead section's jobs (64x64 JPEGs, 64 distinct images repeated, the decode cache
hitting; `--every-job-decoded` for unique bytes), the null model, batch 256, on a private
redis-server. Each run starts `python -m worker --processes N`, waits until every process
has joined the group, queues the backlog, and times it from the first XADD to the last
result. The runs alternate (1, 2, 1, 2 with the defaults) so that what else the machine is
doing weighs on both alike.

    python scripts/bench_processes.py --jobs 20000 --processes 1,2 --rounds 2
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import click  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402

from tests.support.images import jpeg_bytes  # noqa: E402
from tests.support.process_harness import RESULTS, WorkerProcess, submit, worker_env  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from worker.tools.command_line import CONTEXT_SETTINGS, parse  # noqa: E402
from worker.tools.harness.probe import process_tree_cpu_s  # noqa: E402


def backlog(n: int, *, unique: bool) -> list[dict[str, bytes | str]]:
    images = [jpeg_bytes(64, 64, seed=i) for i in range(64)]
    jobs: list[dict[str, bytes | str]] = []
    for i in range(n):
        image = images[i % len(images)]
        # A trailer after the JPEG's end marker changes the bytes (and the cache key), not
        # the picture.
        jobs.append({"id": f"j{i}", "image": image + i.to_bytes(4, "big") if unique else image})
    return jobs


def one_run(
    server: RedisServer, processes: int, jobs: list[dict[str, bytes | str]], log_path: Path
) -> dict[str, Any]:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    env = worker_env(
        server.url,
        "none",
        GPUFEED_MODEL="null",
        GPUFEED_BATCH_SIZE="256",
        GPUFEED_PROCESSES=str(processes),
    )
    # The worker's own decode threads (not the tests' two); a summary line now and then.
    env["GPUFEED_TUNING"] = "stats_interval_s=600"
    env.pop("GPUFEED_INPUT_SIZE")
    # A log of its own: readiness is counted in it.
    worker = WorkerProcess(f"bench-p{processes}", env, log_path).start()
    try:
        started = time.monotonic()
        deadline = started + 300
        while worker.event_count("worker_ready") < processes:
            worker.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the worker processes did not all join the group")
            time.sleep(0.2)
        ready_s = time.monotonic() - started
        time.sleep(2)  # every process blocked in its XREADGROUP
        cpu0 = process_tree_cpu_s(worker.pid)
        host0 = psutil.cpu_times()
        t0 = time.monotonic()
        submit(client, jobs)
        while client.xlen(RESULTS) < len(jobs):
            worker.check_alive()
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        cpu_s = process_tree_cpu_s(worker.pid) - cpu0
        host1 = psutil.cpu_times()
        host_busy = (sum(host1) - host1.idle - host1.iowait) - (
            sum(host0) - host0.idle - host0.iowait
        )
        code = worker.terminate(timeout_s=120)
    finally:
        if worker.alive:
            worker.kill()
    return {
        "processes": processes,
        "jobs": len(jobs),
        "seconds": round(elapsed, 2),
        "jobs_per_s": round(len(jobs) / elapsed),
        "worker_cpu_us_per_job": round(cpu_s * 1e6 / len(jobs)),
        # Of all the host's cores, busy with anything (the worker, Redis, other work).
        "host_busy": round(host_busy / (elapsed * (os.cpu_count() or 1)), 2),
        "ready_s": round(ready_s, 1),
        "exit_code": code,
    }


@dataclass(frozen=True)
class Args:
    jobs: int
    processes: str
    rounds: int
    every_job_decoded: bool


@click.command(help=__doc__.split("\n\n")[0], context_settings=CONTEXT_SETTINGS)
@click.option("--jobs", type=int, default=20_000)
@click.option("--processes", default="1,2", help="comma-separated, run in turn")
@click.option("--rounds", type=int, default=2)
@click.option("--every-job-decoded", is_flag=True)
def command(**options: Any) -> Args:
    return Args(**options)


def main(argv: list[str] | None = None) -> int:
    args = parse(command, argv, Args)
    counts = [int(p) for p in args.processes.split(",")]
    jobs = backlog(args.jobs, unique=args.every_job_decoded)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpufeed-procs-") as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            for r in range(args.rounds):
                for n in counts:
                    run = one_run(server, n, jobs, Path(tmp) / f"round{r}-p{n}.log")
                    runs.append(run)
                    print(json.dumps(run), flush=True)
        finally:
            server.stop()
    print(json.dumps({"cores": os.cpu_count(), "runs": runs}))
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
