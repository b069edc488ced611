"""A batch run's lanes: one per shard of the deployment, each with its own streams, its own
outstanding jobs and its own flow control.

On a sharded deployment (GPUFEED_SHARDS=N, producer/shards.py) a job goes to the shard of
its id, `crc32(id) % N`, and is answered on a reply stream in that shard's hash slot: Redis
Cluster runs the worker's publish script on one slot only. So a run keeps one lane a
shard: the shard's level stream its jobs go to, its own reply stream, the jobs outstanding
there (entry IDs are a master's own clock and counter: two shards can hand out the same
one), and its share of `--in-flight`. One slow or failing shard fills only its own lane.

A master failing over is ridden out, lane by lane, on a cluster: the lane's calls fail
(connection refused, CLUSTERDOWN, MOVED, READONLY), the lane waits (0.2 s, doubling to 2 s)
while the others go on, the cluster's layout is read again and the lane reconnects to the
new master; after FAILOVER_LIMIT_S the run ends with the error, and the same command
resumes it. A write the old master acknowledged but had not passed to its replica is gone
after the failover: a job whose stream entry is gone without a result is found by the
lane's quiet-spell check (producer/batch_runner.py) and submitted again.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import redis
from redis.exceptions import (
    AskError,
    ClusterError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)

from producer.backoff import Backoff
from producer.batch_redis import RawLink
from producer.batch_sources import Item
from producer.shards import Shard

# The errors of a shard whose master is failing over, or of a call that reached a node the
# slot moved away from: waited out on a cluster, never on a single Redis (whose loss ends
# the run with its message).
FAILOVER_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterError,  # CLUSTERDOWN, MASTERDOWN
    AskError,  # MOVED and ASK
    TryAgainError,
    ReadOnlyError,  # a master that came back as a replica
    RedisClusterException,  # a slot not covered while the layout settles
)
FAILOVER_BACKOFF_S = (0.2, 2.0)
# A shard unreachable this long ends the run: a failover takes the cluster's node timeout
# (cluster-node-timeout) and an election; much longer is an outage, not a failover.
FAILOVER_LIMIT_S = 120.0
REFUSED_BACKOFF_S = (0.1, 2.0)


class InFlight(NamedTuple):
    """What a lane keeps of a job it submitted: the id its entry holds, and its item (to
    write its row, or to submit it again if the job is lost)."""

    id: bytes
    item: Item


class Lane:
    """One shard's share of a run."""

    def __init__(self, shard: Shard, stream: str, reply_to: str, limit: int, chunk: int) -> None:
        self.shard = shard
        self.stream = stream  # the shard's stream of the run's priority level
        self.stream_b = stream.encode()
        self.reply_to = reply_to
        self.reply_b = reply_to.encode()
        self.limit = max(1, limit)
        # entry reference -> the job: an answer counts only where it names an entry this
        # lane added, for the id that entry holds.
        self.in_flight: dict[bytes, InFlight] = {}
        self.ready: list[tuple[Item, list[bytes]]] = []
        self.cursor = b"0-0"
        self.read_at = 0.0  # when its reply stream was last looked at
        self.link: RawLink | None = None
        self.chunk = chunk
        self.least = max(1, min(chunk, self.limit // 4))
        self.fit = chunk
        self.refused_until = 0.0
        self.refused_backoff = Backoff(*REFUSED_BACKOFF_S)
        self.down_since: float | None = None
        self.down_until = 0.0
        self.down_backoff = Backoff(*FAILOVER_BACKOFF_S)
        self.last_result = time.monotonic()
        # Whether the lane may look for lost jobs in its stream (a tenant's user may lack
        # XRANGE on it: then a lost job waits for the run to be resumed).
        self.lost_check = True

    @property
    def index(self) -> int:
        return self.shard.index

    def room(self) -> int:
        return self.limit - len(self.in_flight)

    def due(self) -> bool:
        """Whether the lane's ready jobs go out now: once its room is a quarter of its
        limit (or all of them fit). Each submission is a round trip, and answers come back
        a few at a time on each of several shards: one submission per answer read would
        cost the client more than the jobs."""
        room = self.room()
        return room > 0 and room >= min(self.least, len(self.ready))

    def open(self, now: float) -> bool:
        """Whether the lane may submit now (not refused by admission, not failing over)."""
        return now >= self.refused_until and now >= self.down_until

    def busy(self) -> bool:
        return bool(self.in_flight or self.ready)


def lane_limits(total: int, lanes: int) -> int:
    """Each lane's share of `total` jobs outstanding (ids spread evenly over shards)."""
    return max(1, math.ceil(total / lanes))
