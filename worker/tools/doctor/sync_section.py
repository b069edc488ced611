"""(c) host syncs on the launch path: launches of the real hot path under CUDA sync-debug
mode, each sync counted with where it happened (CUDA only)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.lifecycle.service import Worker


async def _wait_done(event: Any, timeout_s: float = 60.0) -> None:
    # A CUDA event has nothing to await: poll it, as the completion watcher does.
    for _ in range(int(timeout_s * 1000)):
        if event.query():
            return
        await asyncio.sleep(0.001)


async def sync_section(worker: Worker, launches: int) -> dict[str, Any]:
    report = worker.report()
    out: dict[str, Any] = {
        "measured": False,
        "applicable": report.cuda,
        "launches": 0,
        "count": None,
        "where": [],
        "pipeline_count": None,
        "not_measured": [],
    }
    if not report.cuda:
        out["not_measured"].append("not applicable (no device syncs on CPU)")
        return out
    from worker.decode.executor import DecodeResult
    from worker.pipeline.batcher import Batch
    from worker.tools.harness.instruments import count_host_syncs

    model = worker.engine.model
    rows = [DecodeResult(None, None, 0.0)] * report.batch_size
    inputs, outputs = worker.engine.feed.ring.slots, model.out_ring.slots
    last = None
    # The real launch path (copy in on the side stream, step, copy out, events), on the
    # launch thread, fed from the staging slots as the dispatcher would feed it.
    with count_host_syncs() as syncs:
        for i in range(launches):
            batch = Batch(
                seq=i, slot=inputs[i % len(inputs)], jobs=[], futures=[], opened_s=time.monotonic()
            )
            batch.results = list(rows)
            last = await model.runner.launch(batch, outputs[i % len(outputs)])
    if last is not None:
        await _wait_done(last.done)  # outside the counted window
    detail = syncs.as_dict()
    out.update(
        measured=True,
        launches=launches,
        count=syncs.total,
        where=[*detail["examples"], *(f"{k} x{n}" for k, n in detail["explicit_calls"].items())],
    )
    return out
