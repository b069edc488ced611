"""(a) the direct-feed ceiling: images/s with a random batch already on the device, eager
and compiled."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from worker.model.ceiling import direct_feed_ceiling
from worker.model.step import StepFn
from worker.tools.doctor.options import DoctorOptions
from worker.tools.harness.serving_step import eager_of, random_batch

if TYPE_CHECKING:
    from worker.lifecycle.service import Worker


def timed_ceiling(
    step_fn: StepFn, example: torch.Tensor, *, seconds: float, cudagraphs: bool = False
) -> dict[str, Any]:
    """direct_feed_ceiling with as many iterations as fit in about `seconds`: one probe
    batch sizes the run, so a slow CPU model is not run 50 times."""
    probe = direct_feed_ceiling(step_fn, example, iters=1, warmup=1, cudagraphs=cudagraphs)
    per_batch_s = max(float(probe["ms_per_batch"]) / 1000.0, 1e-6)
    iters = int(min(200, max(3, seconds / per_batch_s)))
    return direct_feed_ceiling(step_fn, example, iters=iters, warmup=1, cudagraphs=cudagraphs)


def ceiling_section(worker: Worker, options: DoctorOptions) -> dict[str, Any]:
    from worker.model.compiler import compile_step

    facts, runner = worker.report(), worker.engine.model.runner
    report, device = facts.compile_report, facts.device
    cuda = facts.cuda
    serving = runner.step
    eager = eager_of(serving)
    serving_cudagraphs = bool(report.cudagraphs and cuda)
    out: dict[str, Any] = {
        "measured": False,
        "serving": "compiled" if report.compiled else "eager",
        "eager": None,
        "compiled": None,
        "not_measured": [],
    }

    def on_launch_thread() -> None:
        x = random_batch(facts.batch_size, facts.ring_side, device)
        run = timed_ceiling(eager, x, seconds=options.ceiling_seconds)
        out["eager"] = {**run, "mode": "off", "compile_s": None}
        if report.compiled:
            run = timed_ceiling(
                serving, x, seconds=options.ceiling_seconds, cudagraphs=serving_cudagraphs
            )
            out["compiled"] = {**run, "mode": report.mode, "compile_s": round(report.compile_s, 1)}
            return
        if not (cuda or options.compile_ceiling):
            out["not_measured"].append(
                "compiled: not measured (compile is off on CPU; --compile-ceiling to measure)"
            )
            return
        # The serving step is eager: compile a copy for this measurement only.
        mode = "reduce-overhead" if cuda else ("default" if report.mode == "off" else report.mode)
        fn, compiled = compile_step(eager, x, mode=mode, allow_eager_fallback=True)
        if not compiled.compiled:
            out["not_measured"].append(f"compiled: torch.compile fell back: {compiled.reason}")
            return
        run = timed_ceiling(
            fn,
            x,
            seconds=options.ceiling_seconds,
            cudagraphs=compiled.cudagraphs,
        )
        out["compiled"] = {**run, "mode": mode, "compile_s": round(compiled.compile_s, 1)}

    runner.run_sync(on_launch_thread)
    out["measured"] = out["eager"] is not None or out["compiled"] is not None
    return out
