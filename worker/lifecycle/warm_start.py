"""A worker that starts warm: before it joins the group, it decodes the fleet's hot list
(worker/delivery/hot_list.py) into its decode cache, so the images everyone asks for are
answered from the cache from its first job on, not after each was decoded once more.

The images go the way a job's would, without a model step or an answer: a `url` through the
fetch stage (so its validator is remembered, and the first job that names it is asked for
with If-None-Match and answered from the cache on a 304), a `path` read by the decoder from
GPUFEED_PATH_ROOT, both decoded by the worker's own decoders into a staging slot, which
puts each row in the cache under the key a job for that reply stream will look for (with
decode processes, in the process the image's bytes are routed to).

Bounded three ways: the tuning constant WARM_START_S, half the cache that holds the rows (so warming
never evicts what it warmed), and the list's own size. The time bound holds whatever the
list names: a fetch still running when it passes is cancelled, and so is a decode (its rows
are given up as over budget, a decode process holding them replaced), since warming is only
a head start: what it leaves is decoded by the first job that asks for it. An image that
fails (gone, refused by the URL or object policy, undecodable) is counted and skipped: it
ages out of the list.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import structlog

from worker.decode.cache import DecodeCache
from worker.decode.executor import DecodeExecutor
from worker.delivery.hot_list import HotEntry, HotList
from worker.delivery.redis_errors import ANY, FAILING_OVER
from worker.fetch.stage import FetchStage
from worker.jobs import Job
from worker.pipeline.staging import InputRing

log = structlog.get_logger("gpufeed.warm_start")


@dataclass
class WarmReport:
    """What a worker's warm start did: `listed` images on the hot list, `warmed` decoded
    into the cache, `failed`, in `seconds`, about `bytes` of rows; `stopped`: why it stopped
    before the list's end (`budget`, `cache`), or "" (the whole list, or nothing to do);
    `why_not`: why it did not warm at all, or ""."""

    listed: int = 0
    warmed: int = 0
    failed: int = 0
    seconds: float = 0.0
    bytes: int = 0
    stopped: str = ""
    why_not: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


async def warm_start(
    hot: HotList,
    *,
    budget_s: float,
    fetcher: FetchStage,
    decoder: DecodeExecutor,
    ring: InputRing,
    cache: DecodeCache,
) -> WarmReport:
    """Decode the hot list into the cache, best first, within the bounds above."""
    report = WarmReport()
    start = time.monotonic()
    deadline = start + budget_s
    try:
        entries = await asyncio.wait_for(hot.top(), max(budget_s, 0.1))
    except (*ANY, *FAILING_OVER) as exc:
        report.why_not = f"the hot list could not be read: {exc}"
        return report
    report.listed = len(entries)
    # The hits and misses of warming are no job's: the worker's counts start from zero.
    counted = cache.hits, cache.misses
    limit = cache.max_bytes // 2
    try:
        for first in range(0, len(entries), ring.batch):
            if time.monotonic() >= deadline:
                report.stopped = "budget"
                break
            if report.bytes >= limit:
                report.stopped = "cache"
                break
            batch = entries[first : first + ring.batch]
            cut = await _warm_batch(
                batch, report, deadline, fetcher=fetcher, decoder=decoder, ring=ring
            )
            if cut:
                report.stopped = "budget"
                break
    finally:
        cache.hits, cache.misses = counted
    report.seconds = round(time.monotonic() - start, 3)
    return report


async def _warm_batch(
    entries: Sequence[HotEntry],
    report: WarmReport,
    deadline: float,
    *,
    fetcher: FetchStage,
    decoder: DecodeExecutor,
    ring: InputRing,
) -> bool:
    """Warm `entries`; True when the deadline cut it short."""
    jobs = [_job_of(i, e) for i, e in enumerate(entries)]
    fetched = await _fetch(fetcher, [j for j in jobs if j.url is not None], deadline)
    ready = [j for j in jobs if j.url is None or j in fetched]
    report.failed += len(jobs) - len(ready)
    if not ready or time.monotonic() >= deadline:
        report.failed += len(ready)
        return time.monotonic() >= deadline
    slot = await ring.acquire()
    try:
        # Decoded here, never left for the GPU: the cache keeps what the host holds. What is
        # not decoded by the deadline is given up: the decode budget is a far longer bound.
        group = decoder.submit_rows(ready, slot.array[: len(ready)], gpu=False, until=deadline)
        results = await decoder.settle([group])
        ok = sum(1 for r in results if r.error is None)
        report.warmed += ok
        report.failed += len(ready) - ok
        report.bytes += slot.copy_bytes() if slot.packed is not None else ok * slot.array[0].nbytes
    finally:
        ring.release_now(slot)
    return ok < len(results) and time.monotonic() >= deadline


async def _fetch(fetcher: FetchStage, jobs: list[Job], deadline: float) -> set[Job]:
    """The jobs whose bytes (or cached row) arrived before `deadline`."""
    if not jobs:
        return set()
    tasks = {asyncio.ensure_future(fetcher.prepare(job)): job for job in jobs}
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    # `prepare` answers a failure rather than raising; None: the job has its bytes.
    return {tasks[t] for t in done if t.result() is None}


def _job_of(index: int, entry: HotEntry) -> Job:
    job_id = f"warm-start-{index}"
    return Job.new(
        entry_id="0-0",
        job_id=job_id,
        reply_to=entry.reply_to,
        meta=None,
        image=None,
        path=entry.ref.encode("utf-8") if entry.kind == "path" else None,
        url=entry.ref if entry.kind == "url" else None,
    )
