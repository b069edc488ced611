"""GPUFEED_WAIT_REPLICAS: after a flush's publish scripts, WAIT until replicas have them.

Redis replicates asynchronously: a result (and its job's ack) written on a master that dies
before its replica received them is gone after the failover, and the job is served again.
WAIT n timeout blocks until n replicas acknowledged every write made *on the connection that
sends it*, so it goes in the same pipeline as the scripts: on a single Redis that is one
connection; on a cluster, the pipeline sends each node's commands on one connection, and
WAIT is addressed to the node that serves the shard's slot.

On a timeout nothing is undone (a result cannot be unwritten): the flush is logged and
counted (`replica_wait_timeout`), and the job is as safe as without WAIT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("gpufeed.replicas")


class ReplicaWait:
    def __init__(
        self,
        replicas: int,
        timeout_ms: int,
        *,
        on_short: Callable[[int], None] | None = None,
    ) -> None:
        """`on_short(jobs)`: a WAIT that timed out, for the metrics."""
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._on_short = on_short
        self.short = 0

    def queue(self, pipe: Any) -> int:
        """Queue WAIT on `pipe` after its writes; returns how many replies it adds to the
        pipeline's (0 when not waiting)."""
        if self.replicas <= 0:
            return 0
        pipe.execute_command("WAIT", self.replicas, self.timeout_ms)
        return 1

    def check(self, reply: Any, *, jobs: int, key: str) -> None:
        """WAIT's reply: the replicas that acknowledged; fewer than asked is logged."""
        acked = reply if isinstance(reply, int) else -1
        if acked >= self.replicas:
            return
        self.short += 1
        log.warning(
            "replica_wait_timeout",
            key=key,
            jobs=jobs,
            wanted=self.replicas,
            acknowledged=acked if acked >= 0 else None,
            error=None if acked >= 0 else repr(reply),
            timeout_ms=self.timeout_ms,
            note="the results stand; a failover before replication may serve the jobs again",
        )
        if self._on_short is not None:
            self._on_short(jobs)
