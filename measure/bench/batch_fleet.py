"""The sharded batch run: `producer batch` at fleet scale, on one host's loopback.

A private Redis Cluster of 3 masters with a replica each (the harness in
`worker/tools/harness/redis_cluster.py`), `workers` null-model worker processes on
GPUFEED_SHARDS=3, and a manifest of `jobs` path jobs (64x64 JPEG files, each file's bytes
unique: a trailer after the end-of-image marker, so the decode cache serves none of them).
Runs one after the other, on the same cluster and workers:

- `one client`: `python -m producer batch MANIFEST --path-root ROOT --out ONE.parquet`
  over the whole manifest (ids under `solo/`, so the fleet's ids are new to the workers),
  before the parts alone and again after them (`solo2/`): what a run leaves in Redis makes
  the next a little dearer, and the two runs bracket the parts';
- `parts alone`: `clients` processes, `--part I/N` each, one after another with no
  fault (ids under `alone/`): each part's cost as on a machine of its own, as the one
  client ran;
- `fleet`: the same parts into one dataset `--out DATASET/`, started together. Mid-run,
  when a share of the jobs is answered, one client is killed (SIGKILL) and started again
  with the same command (it resumes from its committed segments, `--checkpoint 1`), and
  later the master of one shard is killed (its replica takes over).

It checks what a user would: every id of the manifest once in the dataset, `_SUCCESS`
with the counts, every client's exit status 0. A client's capacity is 1 / (its CPU
seconds per answered job, `cpu_s` of its JSON lines: every thread of its process from the
start of its run, listing the manifest included); the fleet's is the sum of its parts'
alone (on a fleet each has a machine of its own), reported beside the one client's, and
the sum of the side-by-side run's (the killed client's runs, the failover waited out).
On a host with few cores every process shares them, so wall-clock rates say little, and
clients side by side each pay more CPU per job than alone (fewer answers per read, caches
shared): the parts alone are the fleet's figure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

CAPACITY_TARGET = 2.5  # the fleet's clients' capacity over one client's, with 3 clients
CLIENT_TIMEOUT_S = 900.0
WORKER_READY_S = 180.0


@dataclass(frozen=True)
class FleetPlan:
    jobs: int = 30_000
    shards: int = 3
    workers: int = 3
    clients: int = 3
    side: int = 64
    distinct: int = 64
    batch_size: int = 64
    # Shares of the jobs answered (over all clients) when client 0 is killed, and when the
    # master of shard 1 is.
    kill_client_at: float = 0.25
    failover_at: float = 0.5
    checkpoint_s: float = 1.0


class FleetError(RuntimeError):
    """The sharded run could not be made or did not hold (one line)."""


class _Client:
    """One `python -m producer batch --json` process and its last progress line."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.log = log
        self.last: dict[str, Any] = {}
        self.summary: dict[str, Any] | None = None
        self.killed: list[dict[str, Any]] = []  # the last progress of each killed run
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.last = {}
        err = self.log.open("a")
        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        err.close()
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            if "progress" in message:
                self.last = message["progress"]
            elif "summary" in message:
                self.summary = message["summary"]

    @property
    def answered(self) -> int:
        done = sum(int(k.get("ok", 0)) + int(k.get("errors", 0)) for k in self.killed)
        now = self.summary or self.last
        return done + int(now.get("ok", 0)) + int(now.get("errors", 0))

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        self.killed.append(dict(self.last))

    def wait(self, deadline: float) -> int:
        assert self.proc is not None
        code = self.proc.wait(max(1.0, deadline - time.monotonic()))
        if self._reader is not None:
            self._reader.join(5)
        return code

    def capacity(self) -> dict[str, float]:
        """Answers and CPU seconds over every run of this client (a killed run's from its
        last progress line), and the jobs a second one core could carry at that cost."""
        runs = [*self.killed, self.summary or {}]
        answered = sum(int(r.get("ok", 0)) + int(r.get("errors", 0)) for r in runs)
        cpu_s = sum(float(r.get("cpu_s", 0.0)) for r in runs)
        return {
            "answered": answered,
            "cpu_s": round(cpu_s, 3),
            "cpu_us_per_job": round(1e6 * cpu_s / max(answered, 1), 1),
            "capacity_per_s": round(answered / cpu_s, 1) if cpu_s > 0 else 0.0,
        }


def _images(plan: FleetPlan, root: Path) -> list[str]:
    """`plan.jobs` unique JPEG files under `root` and their paths relative to it."""
    from worker.tools.harness.images import ImageSetSpec, load_image_set
    from worker.tools.harness.redis_env import job_image

    spec = ImageSetSpec(
        f"fleet-{plan.side}", plan.side, plan.side, plan.distinct, quality=85, seed=9,
        portrait_every=0,
    )  # fmt: skip
    images = load_image_set(spec).images
    names = []
    for i in range(plan.jobs):
        name = f"{i // 1000:03d}/{i:07d}.jpg"
        path = root / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(job_image(images, i, f"fleet-{i}", unique=True))
        names.append(name)
    return names


def _worker_env(url: str, root: Path, plan: FleetPlan, name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFEED_", "REDIS_"))}
    # The workers share the host's cores with the cluster and the clients.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        REDIS_URL=url,
        GPUFEED_WORKER_NAME=name,
        GPUFEED_MODEL="null",
        GPUFEED_WEIGHTS="none",
        GPUFEED_DEVICE="cpu",
        GPUFEED_SHARDS=str(plan.shards),
        GPUFEED_PATH_ROOT=str(root),
        GPUFEED_BATCH_SIZE=str(plan.batch_size),
        GPUFEED_MAX_WAIT_MS="5",
        GPUFEED_LOG_FORMAT="json",
        GPUFEED_LOG_LEVEL="warning",
    )
    return env


def _wait_ready(procs: list[subprocess.Popen[bytes]], logs: list[Path], url: str, n: int) -> None:
    """Until `n` workers have a heartbeat (or one of them exited: FleetError)."""
    from redis.cluster import RedisCluster as ClusterClient

    from producer import wire

    client = ClusterClient.from_url(url)
    deadline = time.monotonic() + WORKER_READY_S
    try:
        while True:
            for proc, log in zip(procs, logs, strict=True):
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-600:]
                    raise FleetError(f"a worker exited {proc.returncode} at start: {tail}")
            beats = client.keys(f"{wire.DEFAULT_WORKER_PREFIX}*", target_nodes="primaries")
            if len(beats) >= n:
                return
            if time.monotonic() > deadline:
                raise FleetError(f"{len(beats)} of {n} workers ready after {WORKER_READY_S} s")
            time.sleep(0.2)
    finally:
        client.close()


def run_fleet(
    plan: FleetPlan, echo: Callable[[str], None] = print, workdir: Path | None = None
) -> dict[str, Any]:
    """The sharded run of `plan`; its report (see the module's docstring)."""
    from worker.tools.harness.redis_cluster import RedisCluster

    with tempfile.TemporaryDirectory(prefix="gpufeed-fleet-", dir=workdir) as tmp:
        work = Path(tmp)
        root = work / "images"
        root.mkdir()
        t0 = time.perf_counter()
        names = _images(plan, root)
        manifest = work / "manifest.txt"
        manifest.write_text("".join(f"{n}\n" for n in names))
        echo(f"fleet: {plan.jobs} files written in {time.perf_counter() - t0:.1f} s")
        cluster = RedisCluster(work / "redis", masters=plan.shards, replicas=1).start()
        workers: list[subprocess.Popen[bytes]] = []
        try:
            logs = [work / f"worker-{i}.log" for i in range(plan.workers)]
            for i, log in enumerate(logs):
                with log.open("ab") as f:
                    workers.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "worker"],
                            env=_worker_env(cluster.url, root, plan, f"fleet-{i}"),
                            stdin=subprocess.DEVNULL,
                            stdout=f,
                            stderr=f,
                        )
                    )
            _wait_ready(workers, logs, cluster.url, plan.workers)
            echo(f"fleet: {plan.workers} null-model workers on {plan.shards} shards ready")
            return _runs(plan, cluster, work=work, manifest=manifest, root=root, echo=echo)
        finally:
            for proc in workers:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in workers:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            cluster.stop()


def _client_env(url: str, plan: FleetPlan) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFEED_", "REDIS_"))}
    env.update(REDIS_URL=url, GPUFEED_SHARDS=str(plan.shards))
    return env


def _runs(
    plan: FleetPlan,
    cluster: Any,
    *,
    work: Path,
    manifest: Path,
    root: Path,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    base = [
        sys.executable, "-m", "producer", "batch", str(manifest), "--path-root", str(root),
        "--json", "--checkpoint", str(plan.checkpoint_s),
    ]  # fmt: skip
    env = _client_env(cluster.url, plan)

    def alone(name: str, args: list[str], log: str) -> dict[str, float]:
        client = _Client(name, [*base, *args], env, work / log)
        client.start()
        if client.wait(time.monotonic() + CLIENT_TIMEOUT_S) != 0:
            raise FleetError(f"{name} exited {client.proc and client.proc.returncode}: "
                             f"{client.log.read_text(errors='replace')[-600:]}")  # fmt: skip
        return client.capacity()

    # One client over the whole manifest, before the parts and again after them: the state
    # a run leaves (result hashes, streams) makes the next a little dearer, and the two
    # bracket the parts'.
    t0 = time.perf_counter()
    solo = [alone("one client", ["--out", str(work / "one.parquet"), "--id-prefix", "solo/"],
                  "solo.log")]  # fmt: skip
    solo_wall = time.perf_counter() - t0
    # Each part alone, one after another and with no fault: the cost of a client of a
    # fleet, each on a machine of its own, as the one client ran alone.
    parts: dict[str, dict[str, float]] = {}
    for i in range(plan.clients):
        name = f"part {i}/{plan.clients}"
        out = ["--out", f"{work / 'alone'}/", "--part", f"{i}/{plan.clients}"]
        parts[name] = alone(name, [*out, "--id-prefix", "alone/"], f"alone-{i}.log")
    solo.append(alone("one client again", ["--out", str(work / "two.parquet"), "--id-prefix",
                                            "solo2/"], "solo2.log"))  # fmt: skip
    answered = sum(int(r["answered"]) for r in solo)
    cpu_s = sum(float(r["cpu_s"]) for r in solo)
    one: dict[str, Any] = {
        "answered": answered,
        "cpu_s": round(cpu_s, 3),
        "cpu_us_per_job": round(1e6 * cpu_s / max(answered, 1), 1),
        "capacity_per_s": round(answered / cpu_s, 1) if cpu_s > 0 else 0.0,
        "runs": solo,
    }
    aggregate = sum(c["capacity_per_s"] for c in parts.values())
    ratio = aggregate / one["capacity_per_s"] if one["capacity_per_s"] else 0.0
    echo(f"fleet: one client {one['capacity_per_s']} jobs/s of capacity "
         f"({one['cpu_us_per_job']} µs of CPU a job; runs before and after the parts: "
         f"{solo[0]['cpu_us_per_job']}, {solo[1]['cpu_us_per_job']} µs); {plan.clients} parts "
         f"alone {aggregate:.0f} jobs/s together, {ratio:.2f}x")  # fmt: skip

    dataset = work / "dataset"
    clients = [
        _Client(
            f"part {i}/{plan.clients}",
            [*base, "--out", f"{dataset}/", "--part", f"{i}/{plan.clients}"],
            env,
            work / f"client-{i}.log",
        )
        for i in range(plan.clients)
    ]
    victim_key = _shard_stream(plan, 1)
    failover: dict[str, Any] = {}
    killed_client: dict[str, Any] = {}
    failover_thread: threading.Thread | None = None

    def fail_over() -> None:
        t = time.perf_counter()
        node = cluster.kill_master_of(victim_key)
        failover["port"] = node.port
        failover["took_over_s"] = round(time.perf_counter() - t, 2)

    t0 = time.perf_counter()
    for c in clients:
        c.start()
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while any(c.proc is not None and c.proc.poll() is None for c in clients):
        answered = sum(c.answered for c in clients)
        if not killed_client and answered >= plan.kill_client_at * plan.jobs:
            victim = clients[0]
            if victim.proc is not None and victim.proc.poll() is None:
                victim.kill()
                killed_client.update(
                    client=victim.name,
                    at_answered=answered,
                    its_answers_then=victim.killed[-1].get("ok", 0),
                )
                echo(f"fleet: {victim.name} killed (SIGKILL) at {answered} answered; "
                     "started again")  # fmt: skip
                victim.start()
        if failover_thread is None and answered >= plan.failover_at * plan.jobs:
            failover["at_answered"] = answered
            failover_thread = threading.Thread(target=fail_over, daemon=True)
            failover_thread.start()
            echo(f"fleet: the master of shard 1 killed at {answered} answered")
        if time.monotonic() > deadline:
            raise FleetError("the fleet's clients did not finish")
        time.sleep(0.05)
    codes = [c.wait(deadline) for c in clients]
    wall = time.perf_counter() - t0
    if failover_thread is not None:
        failover_thread.join(60)
    logs = {c.name: c.log.read_text(errors="replace")[-400:] for c in clients}
    if any(codes):
        raise FleetError(f"fleet clients exited {codes}: {logs}")
    check = _check_dataset(dataset, manifest)
    per_client = {c.name: c.capacity() for c in clients}
    together = sum(c["capacity_per_s"] for c in per_client.values())
    summaries = [c.summary or {} for c in clients]
    report: dict[str, Any] = {
        "plan": asdict(plan),
        "cluster": {"masters": plan.shards, "replicas_per_master": 1},
        "source": "manifest of path jobs",
        # Every file's bytes unique: the decode cache serves none.
        "images_repeat": False,
        "one_client": {
            **one,
            "wall_s": round(solo_wall, 2),
            "jobs_per_s": round(plan.jobs / solo_wall, 1),
        },
        "clients": parts,
        "aggregate_capacity_per_s": round(aggregate, 1),
        "capacity_ratio": round(ratio, 2),
        "target_ratio": CAPACITY_TARGET,
        "side_by_side": {
            "clients": per_client,
            "aggregate_capacity_per_s": round(together, 1),
            "capacity_ratio": round(together / one["capacity_per_s"], 2)
            if one["capacity_per_s"]
            else 0.0,
        },
        "fleet_wall_s": round(wall, 2),
        "fleet_jobs_per_s": round(plan.jobs / wall, 1),
        "killed_client": killed_client,
        "failover": {
            **failover,
            "waited_out": sum(int(s.get("failovers", 0)) for s in summaries),
            "jobs_submitted_again": sum(int(s.get("resubmitted", 0)) for s in summaries),
        },
        "ignored_answers": sum(int(s.get("ignored_answers", 0)) for s in summaries),
        "duplicates": sum(int(s.get("duplicates", 0)) for s in summaries),
        **check,
    }
    report["met"] = bool(check["every_id_once"] and ratio >= CAPACITY_TARGET)
    echo(
        f"fleet: {plan.clients} clients, {report['rows']} rows, every id once: "
        f"{check['every_id_once']}; side by side {together:.0f} jobs/s of capacity; "
        f"{plan.jobs / wall:.0f} jobs/s on this host's wall clock"
    )
    return report


def _shard_stream(plan: FleetPlan, index: int) -> str:
    from producer import shards, wire

    return shards.layout(plan.shards, stream=wire.DEFAULT_STREAM)[index].stream


def _check_dataset(dataset: Path, manifest: Path) -> dict[str, Any]:
    """What the dataset holds against the manifest."""
    import pyarrow.dataset as ds

    table = ds.dataset(dataset, format="parquet").to_table(columns=["id", "status"])
    ids = table.column("id").to_pylist()
    expected = manifest.read_text().split()
    marker_path = dataset / "_SUCCESS"
    marker = json.loads(marker_path.read_text()) if marker_path.is_file() else None
    return {
        "rows": len(ids),
        "distinct_ids": len(set(ids)),
        "ok": sum(1 for s in table.column("status").to_pylist() if s == "ok"),
        "every_id_once": len(ids) == len(set(ids)) and set(ids) == set(expected),
        "part_files": sorted(p.name for p in dataset.glob("*.parquet")),
        "success_marker": marker,
    }


def fleet_problems(s: Any) -> list[str]:
    """What is wrong with a report's `sharded` entry of the batch section."""
    if s is None:
        return []
    if not isinstance(s, Mapping):
        return ["batch.sharded must be an object or null"]
    problems = [
        f"batch.sharded.{key} is missing"
        for key in ("one_client", "clients", "aggregate_capacity_per_s", "capacity_ratio",
                    "side_by_side", "every_id_once", "rows", "failover", "killed_client",
                    "met")
        if key not in s
    ]  # fmt: skip
    if not problems and not s["every_id_once"]:
        problems.append("batch.sharded: the dataset does not hold every id exactly once")
    return problems


def main() -> int:
    """`python -m measure.bench.batch_fleet [JOBS] [OUT.json]`: the sharded run alone."""
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else FleetPlan.jobs
    report = run_fleet(FleetPlan(jobs=jobs))
    text = json.dumps(report, indent=2)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(text + "\n")
    print(text)
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
