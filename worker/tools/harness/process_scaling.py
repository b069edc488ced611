"""How decode scales with decode processes: one image set decoded by 1 and by N processes
(worker/decode/processes.py) into a shared ring, as the worker's decoders do, with nothing
else running. Every image is decoded (the processes' cache is off), so the rates compare
like with like with the stage rates of one and N threads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from worker.decode.arena import ArenaLayout, SharedArena
from worker.decode.cpu import DecodeSpec
from worker.decode.processes import ProcessDecodePool
from worker.decode.rows import row_side
from worker.jobs import Job

BATCH = 32
SLOTS = 4


def process_scaling(
    images: Sequence[bytes],
    *,
    staging_size: int,
    device_rows: bool,
    counts: Sequence[int],
    min_time_s: float,
) -> list[dict[str, Any]]:
    """images/s for each number of processes in `counts` (call from a thread without a
    running event loop: each measurement runs its own)."""
    return [
        asyncio.run(
            _rate(images, staging_size=staging_size, device_rows=device_rows, k=k, min_s=min_time_s)
        )
        for k in counts
    ]


async def _rate(
    images: Sequence[bytes], *, staging_size: int, device_rows: bool, k: int, min_s: float
) -> dict[str, Any]:
    side = row_side(staging_size) if device_rows else staging_size
    arena = SharedArena.create(ArenaLayout(rows=SLOTS * BATCH, side=side, processes=k))
    pool = ProcessDecodePool(
        DecodeSpec(size=staging_size),
        k,
        None,
        arena=arena,
        row_side=side if device_rows else 0,
    )
    jobs = [
        Job.new(entry_id=f"{i}-0", job_id=str(i), reply_to="", meta=None, image=data, path=None)
        for i, data in enumerate(images[:BATCH])
    ]
    try:
        # One round first: the processes start cold (imports, first allocations).
        await pool.settle([pool.submit_rows(jobs, arena.rows[: len(jobs)])])
        done = 0
        slot = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < min_s:
            # Two slots in flight, as the batcher keeps the next batch decoding.
            groups = []
            for _ in range(2):
                first = slot * BATCH
                groups.append(pool.submit_rows(jobs, arena.rows[first : first + len(jobs)]))
                slot = (slot + 1) % SLOTS
            results = await pool.settle(groups)
            done += sum(1 for r in results if r.error is None)
        wall = time.perf_counter() - t0
    finally:
        pool.shutdown()
        arena.close()
    return {
        "processes": k,
        "images": done,
        "wall_s": round(wall, 3),
        "images_per_s": round(done / wall, 1),
    }
