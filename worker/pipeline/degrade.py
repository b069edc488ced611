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
served, not waiting.

How old the first waiting entry is (`WaitingClock`): an auto-generated entry ID is its
enqueue time in the Redis server's milliseconds, but anyone may XADD an explicit ID, and
one from the future (`XADD s 9999999999999-0 ...`) makes every later ID number after it:
its age would read 0, for everybody, for ever. So the ID is believed only within what the
worker saw itself: at every check it notes, by the server's TIME, the stream's
last-generated-id. An entry whose ID is at most an ID noted at time T existed at T (its age
is at least now - T); one whose ID is above an ID noted at T came after T (its age is at
most now - T). The ID's own time is clamped between those bounds, so the two checks around
an entry's arrival bound its age: the first that saw its ID and the last that did not, which
may be a later check than the one that first noted that last ID (the stream stood still
between them). A future ID so counts from
the first check that saw it (at most one check interval late), and an ID from the past
(only possible on a new stream) cannot make an entry older than the checks allow. One
script call per stream and check, whatever the backlog's size.

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
from typing import Any

import redis.asyncio as aioredis
import structlog

from worker.delivery import redis_errors
from worker.delivery.redis_scripts import WAITING_HEAD
from worker.model.readers import OutputReader
from worker.model.step import StepFn
from worker.pipeline.staging import OutputRing

log = structlog.get_logger("gpufeed.degrade")


@dataclass(frozen=True, eq=False)
class Serving:
    """One step a batch can be launched on, and what reads and names its outputs."""

    model: str  # the result's `model`
    weights: str  # the result's `weights`
    degraded: bool
    out_ring: OutputRing
    reader: OutputReader
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
        clock = WaitingClock()
        while True:
            try:
                age = await clock.oldest_waiting_s(client, streams, group)
            except redis_errors.ANY as exc:
                # Keep the current step: Redis trouble says nothing about the backlog.
                if not failing:
                    log.warning("degrade_check_failed", error=str(exc))
                    failing = True
            else:
                failing = False
                self.observe(age)
            await asyncio.sleep(interval)


EntryId = tuple[int, int]


def parse_entry_id(text: bytes | str) -> EntryId | None:
    """`<ms>-<seq>` as a pair that orders as Redis orders IDs; None for '' (no entry)."""
    raw = text.decode() if isinstance(text, bytes) else str(text)
    if not raw:
        return None
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Sample:
    """One last-generated-id and the checks that saw it: the first (its entry existed by
    then) and the latest (any entry numbered after it came later)."""

    first_ms: float
    latest_ms: float
    last: EntryId


class WaitingClock:
    """The age of the oldest waiting entry of some job streams, bounded by what the checks
    saw (module docstring): per stream, one sample per last-generated-id the checks saw,
    kept back to the last one below the first waiting entry."""

    def __init__(self, max_samples: int = 2048) -> None:
        self.max_samples = max_samples
        self._samples: dict[str, list[_Sample]] = {}
        self._script: Any = None

    async def oldest_waiting_s(
        self, client: aioredis.Redis, streams: Sequence[str], group: str
    ) -> float:
        """Seconds the oldest entry not yet delivered to `group` has waited, over
        `streams` (0.0 when none waits)."""
        if self._script is None:
            self._script = client.register_script(WAITING_HEAD)
        oldest = 0.0
        for stream in streams:
            seconds, micros, last, head = await self._script(keys=[stream], args=[group])
            now_ms = int(seconds) * 1000 + int(micros) / 1000
            oldest = max(
                oldest, self.observe(stream, now_ms, parse_entry_id(last), parse_entry_id(head))
            )
        return oldest

    def observe(
        self, stream: str, now_ms: float, last: EntryId | None, head: EntryId | None
    ) -> float:
        """Note one check of `stream` and return its first waiting entry's age in seconds."""
        samples = self._samples.setdefault(stream, [])
        if last is not None:
            if samples and last < samples[-1].last:
                samples.clear()  # the stream was recreated: its old IDs say nothing now
            if samples and last == samples[-1].last:
                # Still no entry after it: whatever numbers after it came after this check.
                # Without this, an entry forged one past a last ID noted long ago could
                # read as old as that first noting.
                samples[-1].latest_ms = now_ms
            else:
                samples.append(_Sample(now_ms, now_ms, last))
        if head is None or not samples:
            del samples[:-1]
            return 0.0
        # The first check whose last ID reached the entry: it existed then.
        lower = next((now_ms - s.first_ms for s in samples if s.last >= head), 0.0)
        # The last check whose last ID was below it: it came after that one.
        below = [i for i, s in enumerate(samples) if s.last < head]
        upper = now_ms - samples[below[-1]].latest_ms if below else None
        age = max(now_ms - head[0], lower)
        if upper is not None:
            age = min(age, upper)
        # Waiting entries only move on: the checks before the last one below are not needed.
        if below:
            del samples[: below[-1]]
        if len(samples) > self.max_samples:
            # Thinning only widens the bounds (a later check for "existed by", an earlier
            # one for "came after"): the age stays within what is known.
            samples[:] = samples[:-1:2] + samples[-1:]
        return max(0.0, age) / 1000


async def oldest_waiting_s(client: aioredis.Redis, streams: Sequence[str], group: str) -> float:
    """One check of a new WaitingClock: the entry IDs bounded by this check alone."""
    return await WaitingClock().oldest_waiting_s(client, streams, group)
