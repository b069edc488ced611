"""What a running worker is, as the tools read it: one frozen `WorkerReport`.

The doctor, the bench, the GPU check, the harness and the tests print and compare these
figures and facts (the model, its batch shape, the device, the feed's placement and ring,
the decoders, the processes beside the worker). `Worker.report()` takes it at the call:
the processes are those alive then (one restarted later has a new pid), so a tool that
measures them over a run takes one report before and one after. A value that moves with
every batch (a counter, the in-flight count, the degrade switch's state) is not in it: a
tool reads it from its owner, `worker.engine.model`, `worker.engine.feed` or
`worker.stages`, as it reaches any part it instruments or swaps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from worker.delivery.writer_process import WriterProcess
from worker.lifecycle.engine import Engine
from worker.lifecycle.feed_plan import FeedPlan
from worker.lifecycle.wiring import Stages
from worker.model.compiler import CompileReport
from worker.model.precision import AgreementReport, PrecisionReport


@dataclass(frozen=True)
class WorkerReport:
    """A worker's figures once it warmed up; the processes of its stages (the result
    writer's, the intake's) once Redis answered, none before."""

    # The model, as loaded.
    model: str
    kind: str  # what its outputs are: classify, embed or raw
    weights: str
    input_size: int  # the model's input side
    staging_size: int  # the side images are resized to before the crop
    resize_mode: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # Where and how it runs.
    device: torch.device
    device_name: str  # with the GPU's name on CUDA
    cuda: bool
    dtype: torch.dtype
    batch_size: int
    compile_report: CompileReport
    # The serving dtype against fp32 eager (CUDA only: None on the CPU).
    precision: PrecisionReport | AgreementReport | None
    # The feed: where images are resized (`device` or `host`), the side of the device rows
    # (0 on the host), the side of the ring's slots, and what the ring costs.
    placement: str
    row_side: int
    ring_side: int
    ring_budget: Mapping[str, Any]
    plan: FeedPlan
    decoders: str  # `threads` or `processes`
    decode_threads: int  # decode processes count as threads
    decoder_pids: tuple[int, ...]  # the decode processes (none with decode threads)
    # The stages' processes.
    writer_pids: tuple[int, ...]  # the result writer's one process, where it has one
    intake_pids: tuple[int, ...]  # the intake's processes, where it has them: one per shard
    # GPUFEED_DEGRADE_AFTER_S: the cheaper model the switch serves under backlog.
    degraded_model: str | None


def report_of(engine: Engine, stages: Stages | None) -> WorkerReport:
    """The report of a worker whose model side is `engine` and whose stages (None before
    Redis answered) are `stages`."""
    model, feed = engine.model, engine.feed
    loaded, ctx = model.loaded, model.ctx
    writer = stages.writer if stages is not None else None
    readers = stages.readers if stages is not None else []
    return WorkerReport(
        model=loaded.name,
        kind=loaded.output.kind,
        weights=loaded.weights_label,
        input_size=loaded.crop_size,
        staging_size=loaded.resize_size,
        resize_mode=loaded.resize_mode,
        mean=loaded.mean,
        std=loaded.std,
        device=ctx.device,
        device_name=ctx.name,
        cuda=ctx.is_cuda,
        dtype=model.dtype,
        batch_size=model.batch_size,
        compile_report=model.compile_report,
        precision=model.precision,
        placement=feed.placement,
        row_side=feed.row_side,
        ring_side=feed.ring.size,
        # Read-only: the engine's own budget is what the feed was built from.
        ring_budget=MappingProxyType(dict(feed.ring_budget)),
        plan=feed.plan,
        decoders=feed.decoder.kind,
        decode_threads=feed.decode_threads,
        decoder_pids=tuple(getattr(feed.decoder, "pids", ())),
        writer_pids=(writer.pid,) if isinstance(writer, WriterProcess) else (),
        intake_pids=tuple(r.intake.pid for r in readers if r.intake is not None and r.intake.pid),
        degraded_model=model.degraded.loaded.name if model.degraded is not None else None,
    )
