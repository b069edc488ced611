"""A worker over several job streams (GPUFEED_SHARDS): one reader, reclaimer and result
writer per shard, sharing the one in-flight budget and the pipeline between them.

Each shard's keys live in one hash slot (producer/shards.py), so each shard's writer runs the
ack-and-publish script on one node, and each reader blocks on its own shard's node. Jobs
carry the stream they were read from (`Job.stream`); their outcomes are routed back to the
writer of that stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping

from producer.priorities import level_stream
from producer.shards import Shard, hash_tag, shard_of_id, slot_of
from worker.delivery.writer import ResultWriter
from worker.jobs import Job, Outcome


class ShardHeld(Mapping[tuple[str, str], Job]):
    """The held jobs (by job stream and entry ID) of one shard's streams: what that shard's
    reclaimer keeps alive and leaves alone."""

    def __init__(self, held: Mapping[tuple[str, str], Job], streams: Iterable[str]) -> None:
        self._held = held
        self._streams = frozenset(streams)

    def __getitem__(self, key: tuple[str, str]) -> Job:
        if key[0] not in self._streams:
            raise KeyError(key)
        return self._held[key]

    def __contains__(self, key: object) -> bool:
        return (
            isinstance(key, tuple) and len(key) == 2 and key[0] in self._streams
            and key in self._held
        )  # fmt: skip

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return (k for k in list(self._held) if k[0] in self._streams)

    def __len__(self) -> int:
        return sum(1 for k in self._held if k[0] in self._streams)


class ShardedWriter:
    """The per-shard writers behind the one `put` the pipeline calls."""

    def __init__(self, writers: Mapping[str, ResultWriter]) -> None:
        """`writers`: by every job stream the worker reads (a shard's priority levels share
        their shard's writer)."""
        self.writers = dict(writers)
        self._first = next(iter(self.writers.values()))
        # Each writer once: one queue each, counted once, closed and run once.
        self._each = list({id(w): w for w in self.writers.values()}.values())

    def _split(self, outcomes: list[Outcome]) -> dict[str, list[Outcome]]:
        groups: dict[str, list[Outcome]] = {}
        for outcome in outcomes:
            groups.setdefault(outcome.job.stream, []).append(outcome)
        return groups

    def _writer(self, stream: str) -> ResultWriter:
        return self.writers.get(stream, self._first)

    @property
    def queued(self) -> int:
        return sum(w.queued for w in self._each)

    @property
    def published(self) -> int:
        return sum(w.published for w in self._each)

    @property
    def duplicates(self) -> int:
        return sum(w.duplicates for w in self._each)

    def stalled(self) -> tuple[float, str]:
        """The longest stall of the shards' writers, and its reason."""
        return max((w.stalled() for w in self._each), key=lambda s: s[0])

    async def put(self, outcomes: list[Outcome]) -> None:
        for stream, group in self._split(outcomes).items():
            await self._writer(stream).put(group)

    async def publish_now(self, outcomes: list[Outcome]) -> None:
        for stream, group in self._split(outcomes).items():
            await self._writer(stream).publish_now(group)

    async def close(self) -> None:
        for writer in self._each:
            await writer.close()

    async def run(self) -> None:
        tasks = [asyncio.create_task(w.run(), name="writer") for w in self._each]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def reply_to_problem(job: Job, shard: Shard) -> str | None:
    """On a cluster: why the job's reply_to cannot be written by the shard's publish script
    (another slot: Redis refuses a script over keys of two slots); None when it can."""
    if job.reply_to == shard.results_stream or slot_of(job.reply_to) == slot_of(shard.stream):
        return None
    tag = hash_tag(shard.stream)
    where = f"end in ':{{{tag}}}'" if tag else "share the job stream's hash tag"
    return (
        f"reply_to {job.reply_to!r} is in another cluster slot than the job stream "
        f"{shard.stream!r}: it must {where}"
    )


def wrong_shard_problem(job: Job, shard: Shard, layout: list[Shard]) -> str | None:
    """Why a job with its own id cannot be served on `shard`: its id belongs to another
    shard, where its result is looked for and where the id's earlier results are (served
    here, a result would be stored where nobody looks, and the id computed again without
    `duplicate_of` when sent to the right shard). None when it is in its place."""
    if len(layout) <= 1 or not job.has_own_id:
        return None
    right = layout[shard_of_id(job.job_id, len(layout))]
    if right.index == shard.index:
        return None
    return (
        f"id {job.job_id!r} belongs to shard {right.index} of {len(layout)}: add it to "
        f"{level_stream(right.stream, job.level)}, not {job.stream or shard.stream} "
        "(crc32 of the id mod GPUFEED_SHARDS; the producer places it so)"
    )
