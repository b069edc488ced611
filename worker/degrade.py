"""Degrade under backlog: which step the next batch is launched on.

A worker started with GPUFEED_DEGRADE_AFTER_S has two compiled steps (worker/model/degraded.py
builds the second): the main one, and a cheaper one (a smaller input side, or a smaller
model). `DegradeSwitch.run` measures, off the hot path, how long the oldest job still
waiting in the job stream has waited, and turns the switch on when that passes the limit
and off when the backlog has cleared. The dispatcher reads `switch.on` once per batch,
before it launches it, so a batch runs whole on one step, and the batch carries the
`Serving` it ran on to the completion watcher, which reads its outputs with that step's
reader from that step's output ring and marks its results `degraded`.

"Waiting" means not yet delivered to any worker of the group: entries after the group's
last-delivered-id. Entries a worker has read and not yet answered (pending) are being
served, not waiting. A stream entry's ID is its enqueue time in the Redis server's
milliseconds, so the age is the server's TIME minus the first undelivered ID: two small
commands per check, whatever the backlog's size.

Hysteresis: on when the oldest waiting job is older than `after_s`; off only once it has
stayed younger than half of that (or nothing waits) for `after_s` on end. A backlog that
hovers around the limit therefore keeps the step it has, and each period lasts at least
`after_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
import torch
from redis.exceptions import RedisError

from worker.model.readers import Reader
from worker.staging import OutputRing

log = structlog.get_logger("gpufeed.degrade")

StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass(frozen=True, eq=False)
class Serving:
    """One step a batch can be launched on, and what reads and names its outputs."""

    model: str  # the result's `model`
    weights: str  # the result's `weights`
    degraded: bool
    out_ring: OutputRing
    reader: Reader
    # The compiled step; None: the runner's own (`ModelRunner.step`, the main step).
    step: StepFn | None = None


def check_interval_s(after_s: float) -> float:
    """How often the backlog is measured: a quarter of the limit, between 50 ms and 1 s."""
    return min(1.0, max(0.05, after_s / 4))


class DegradeSwitch:
    def __init__(
        self,
        *,
        after_s: float,
        on_change: Callable[[bool, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.after_s = after_s
        self.on = False
        self.switches = 0
        self.last_age_s = 0.0
        self._on_change = on_change
        self._clock = clock
        # When the backlog last fell under the "off" mark while on (None: it is above it).
        self._calm_since: float | None = None

    def observe(self, age_s: float) -> bool:
        """Feed one measurement of the oldest waiting job's age; returns whether the switch
        changed."""
        self.last_age_s = age_s
        now = self._clock()
        if not self.on:
            if age_s > self.after_s:
                self._set(True, age_s)
                return True
            return False
        if age_s >= self.after_s / 2:
            self._calm_since = None
            return False
        if self._calm_since is None:
            self._calm_since = now
        if now - self._calm_since >= self.after_s:
            self._set(False, age_s)
            return True
        return False

    def _set(self, on: bool, age_s: float) -> None:
        self.on = on
        self.switches += 1
        self._calm_since = None
        (log.warning if on else log.info)(
            "degrade_on" if on else "degrade_off",
            oldest_waiting_s=round(age_s, 3),
            after_s=self.after_s,
        )
        if self._on_change is not None:
            self._on_change(on, age_s)

    async def run(self, client: aioredis.Redis, *, streams: Sequence[str], group: str) -> None:
        interval = check_interval_s(self.after_s)
        failing = False
        while True:
            try:
                age = await oldest_waiting_s(client, streams, group)
            except (RedisError, OSError) as exc:
                # Keep the current step: Redis trouble says nothing about the backlog.
                if not failing:
                    log.warning("degrade_check_failed", error=str(exc))
                    failing = True
            else:
                failing = False
                self.observe(age)
            await asyncio.sleep(interval)


async def oldest_waiting_s(client: aioredis.Redis, streams: Sequence[str], group: str) -> float:
    """Seconds the oldest entry not yet delivered to `group` has waited, over `streams`
    (0.0 when none waits), by the Redis server's clock."""
    cursors: list[tuple[str, str]] = []
    for stream in streams:
        try:
            groups = await client.xinfo_groups(stream)
        except RedisError:
            continue  # no stream yet: nothing waits in it
        for info in groups:
            name = info.get("name")
            if (name.decode() if isinstance(name, bytes) else name) != group:
                continue
            lag = info.get("lag")
            if lag == 0:
                break  # everything was delivered
            last = info.get("last-delivered-id", b"0-0")
            cursors.append((stream, last.decode() if isinstance(last, bytes) else str(last)))
    if not cursors:
        return 0.0
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for stream, last in cursors:
        # The first entry after the group's cursor: the oldest one no worker has read.
        pipe.xrange(stream, min=f"({last}", max="+", count=1)
    server_time, *firsts = await pipe.execute()
    now_ms = server_time[0] * 1000 + server_time[1] / 1000
    oldest_ms: float | None = None
    for entries in firsts:
        if not entries:
            continue
        entry_id = entries[0][0]
        text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        ms = float(text.split("-", 1)[0])
        oldest_ms = ms if oldest_ms is None else min(oldest_ms, ms)
    if oldest_ms is None:
        return 0.0
    return max(0.0, (float(now_ms) - oldest_ms) / 1000)
