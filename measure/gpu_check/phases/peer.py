"""Phase `peer`: the worker's model fed by a torch DataLoader over the same JPEGs, as a user
writes it (gpu_check/peer.py). Its model is compiled as the worker's was, for one shape:
about the first shape the worker compiled (the batch's), not the worker's every shape."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from measure.gpu_check.peer import dataloader_rate
from measure.gpu_check.phases.budgets import PEER_S
from measure.gpu_check.phases.state import Run
from worker.decode.samples import synthetic_jpeg


def _mode(run: Run) -> str:
    report = run.compile_report
    return report.mode if report.compiled else "off"


def seconds_needed(run: Run) -> float:
    compile_s = run.one_compile_s if _mode(run) != "off" else 0
    return run.args.peer_seconds + PEER_S + compile_s


def _peer(run: Run, eager: Any, compile_mode: str) -> dict[str, Any]:
    """The DataLoader peer on the pipeline's images, written as files."""
    facts, args = run.worker.report(), run.args
    with tempfile.TemporaryDirectory(prefix="gpu-check-peer-") as folder:
        files = []
        for i in range(32):
            path = Path(folder) / f"{i}.jpg"
            path.write_bytes(synthetic_jpeg(args.width, args.height, seed=i, quality=85))
            files.append(path)
        model = eager.model
        found = dataloader_rate(
            model,
            files,
            batch=facts.batch_size,
            resize=facts.staging_size,
            crop=facts.input_size,
            mean=facts.mean,
            std=facts.std,
            dtype=next(model.parameters()).dtype,
            device=facts.device,
            seconds=args.peer_seconds,
            workers=args.peer_workers or None,
            compile_mode=compile_mode,
        )
    found["images"] = f"{args.width}x{args.height} JPEG q85, 32 files"
    return found


async def peer(run: Run, entry: dict[str, Any]) -> None:
    run.report["peer"] = await run.in_thread(_peer, run, run.eager, _mode(run))
