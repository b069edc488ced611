"""A private Redis Cluster on loopback ports: 3 masters with one replica each.

Six `redis-server --cluster-enabled yes` processes, joined by `redis-cli --cluster create
--cluster-replicas 1 --cluster-yes`. A short node timeout lets a replica take over from a
killed master within seconds, so a failover run stays short. The tests, the soak and the
benchmark share it; tests/support/redis_cluster.py re-exports it for the tests.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

NODE_TIMEOUT_MS = 1500


class ClusterNode:
    """One node: a `redis-server` child on a fixed loopback port that keeps nothing on disk
    but its cluster config, so it can be killed and started again as the same node."""

    def __init__(self, workdir: Path, *extra_args: str, port: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make setup`")
        self.port = port
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self._args = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 30) -> ClusterNode:
        """Start the node (again, after `stop()` or `kill()`: same port, same folder) and
        return once it answers PING."""
        self.proc = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()  # BusyLoadingError (still loading) is a ConnectionError
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
            finally:
                client.close()
        return self

    def stop(self) -> None:
        """SIGTERM: a clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: what a crashed master looks like to its replica."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


class RedisCluster:
    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 1) -> None:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed: run `make setup`")
        self.masters = masters
        self.replicas = replicas
        self.nodes: list[ClusterNode] = []
        for i in range(masters * (1 + replicas)):
            folder = workdir / f"node-{i}"
            port = _cluster_port()
            self.nodes.append(
                ClusterNode(
                    folder,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(folder / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(NODE_TIMEOUT_MS),
                    # A replica may take over even if it lost touch with its master a while.
                    "--cluster-replica-validity-factor",
                    "0",
                    port=port,
                )
            )

    @property
    def url(self) -> str:
        """Any node: the cluster client discovers the rest."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 60) -> RedisCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout_s,
        )
        self.wait_ok(timeout_s)
        self.wait_replicas_online(timeout_s)
        return self

    def wait_replicas_online(self, timeout_s: float = 60) -> None:
        """Until every running master has its replicas attached and in sync: a write made
        before that could vanish on a failover, which is not what a test means to show."""
        deadline = time.monotonic() + timeout_s
        while True:
            online = 0
            for node in self.nodes:
                if not node.running:
                    continue
                try:
                    info = redis.Redis(port=node.port, socket_timeout=2).info("replication")
                except (redis.RedisError, OSError):
                    continue
                if info.get("role") == "master":
                    online += sum(
                        1
                        for k, v in info.items()
                        if k.startswith("slave")
                        and isinstance(v, dict)
                        and v.get("state") == "online"
                    )
            if online >= self.masters * self.replicas:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the private cluster's replicas did not come online")
            time.sleep(0.1)

    def wait_ok(self, timeout_s: float = 60) -> None:
        """Until every running node says cluster_state:ok and every slot has a master."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._state_ok(n) for n in self.nodes if n.running):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the private cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    @staticmethod
    def _state_ok(node: ClusterNode) -> bool:
        try:
            info = redis.Redis(port=node.port, socket_timeout=2).cluster("INFO")
        except (redis.RedisError, OSError):
            return False
        # redis-py parses CLUSTER INFO into a dict of strings.
        return bool(
            info.get("cluster_state") == "ok" and str(info.get("cluster_slots_ok")) == "16384"
        )

    def master_of(self, key: str) -> ClusterNode:
        """The running node that serves `key`'s slot as a master."""
        slot = key_slot(key.encode())
        for node in self.nodes:
            if not node.running:
                continue
            client = redis.Redis(port=node.port, socket_timeout=2)
            try:
                role = client.role()[0]
            except (redis.RedisError, OSError):
                continue
            if role not in (b"master", "master"):
                continue
            for start, end, *_ in client.cluster("SLOTS"):
                if start <= int(slot) <= end and _port(_) == node.port:
                    return node
        raise LookupError(f"no running master serves {key!r}")

    def kill_master_of(self, key: str, timeout_s: float = 60) -> ClusterNode:
        """SIGKILL the master serving `key` and wait until its replica took over."""
        node = self.master_of(key)
        node.kill()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.master_of(key)
                break
            except LookupError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no replica took over {key!r}'s slot") from None
                time.sleep(0.1)
        self.wait_ok(timeout_s)
        return node

    def _any_running(self) -> ClusterNode:
        return next(n for n in self.nodes if n.running)

    def stop(self) -> None:
        for node in self.nodes:
            if node.running:
                node.stop()


def _port(node_entries: list[object]) -> int:
    # CLUSTER SLOTS: start, end, [ip, port, id], [replica...]: the first is the master.
    master = node_entries[0]
    assert isinstance(master, list | tuple)
    return int(master[1])


def _cluster_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def results_by_id(client: ClusterClient, streams: list[str]) -> dict[str, list[str]]:
    """Every result entry of the results streams, by job id."""
    out: dict[str, list[str]] = {}
    for stream in streams:
        entries: Any = client.xrange(stream)
        for entry_id, fields in entries:
            out.setdefault(fields[b"id"].decode(), []).append(f"{stream}/{entry_id.decode()}")
    return out


class ResultWatcher:
    """Reads the results streams every few ms during a run, as a client would, and keeps
    every result entry it saw: a result seen once and gone at the end was lost (written on a
    master that died before replicating it); an id seen with two entries was answered twice.
    """

    def __init__(self, url: str, streams: list[str]) -> None:
        self.client = ClusterClient.from_url(url)
        self.streams = streams
        self.seen: dict[str, set[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ResultWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for job_id, entries in results_by_id(self.client, self.streams).items():
                    self.seen.setdefault(job_id, set()).update(entries)
            except (redis.RedisError, OSError):
                pass  # the failover: read again
            time.sleep(0.02)

    def report(self) -> dict[str, int]:
        final = results_by_id(self.client, self.streams)
        kept = {e for entries in final.values() for e in entries}
        return {
            "results": sum(len(v) for v in final.values()),
            "duplicates": sum(1 for v in self.seen.values() if len(v) > 1),
            "lost": sum(1 for v in self.seen.values() for e in v if e not in kept),
            "ids_answered_twice_at_the_end": sum(1 for v in final.values() if len(v) > 1),
        }
