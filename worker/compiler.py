"""Compile the step for its one shape, warm it up, and prove it did not fall back to eager.

torch.compile fails soft by design: a graph break silently splits the step into pieces run
partly in eager mode, a guard failure silently recompiles, and CUDA graphs are silently
skipped for some inputs. Any of those gives back the launch overhead the compile was meant
to remove, so the worker checks for each at start-up and refuses to run (or, when the
operator allows it, runs plain eager and says so loudly).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from worker.device import mark_cudagraph_step
from worker.step import InferenceStep

log = structlog.get_logger("gpufeed.compiler")

StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class CompileRefused(RuntimeError):
    """The compiled step is not what was asked for; the message says why."""


@dataclass
class CompileReport:
    mode: str
    compiled: bool
    compile_s: float = 0.0
    warmup_s: float = 0.0
    graph_breaks: int = 0
    recompiles: int = 0
    cudagraph_skips: list[str] = field(default_factory=list)
    fell_back_to_eager: bool = False
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "compiled": self.compiled,
            "compile_s": round(self.compile_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "graph_breaks": self.graph_breaks,
            "recompiles": self.recompiles,
            "cudagraph_skips": self.cudagraph_skips,
            "fell_back_to_eager": self.fell_back_to_eager,
            "reason": self.reason,
        }


def _counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return counters


def _sync(x: torch.Tensor) -> None:
    # Start-up only: the warm-up must really have run before its time is reported.
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def _cudagraph_skips() -> list[str]:
    skips = _counters().get("inductor", {}).get("cudagraph_skips", 0)
    return [f"{skips} cudagraph skip(s) reported by inductor"] if skips else []


def compile_step(
    step: InferenceStep,
    example: torch.Tensor,
    *,
    mode: str,
    allow_eager_fallback: bool,
    warmup_iters: int = 3,
) -> tuple[StepFn, CompileReport]:
    """Returns the function to launch and a report. Runs the step `1 + warmup_iters` times on
    `example` (which must have the production shape, dtype and device)."""
    if mode == "off":
        report = CompileReport(mode="off", compiled=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(max(1, warmup_iters)):
                out = step(example)
        _sync(out[0])
        report.warmup_s = time.perf_counter() - t0
        return step, report

    torch._dynamo.reset()
    _counters().clear()
    report = CompileReport(mode=mode, compiled=True)
    # fullgraph=True turns any graph break into an exception right here, at start-up,
    # instead of a step that silently runs partly in eager mode.
    compiled: StepFn = torch.compile(step, mode=mode, fullgraph=True, dynamic=False)
    cudagraphs = mode == "reduce-overhead" and example.is_cuda
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            if cudagraphs:
                mark_cudagraph_step()
            out = compiled(example)
        _sync(out[0])
    except Exception as exc:  # noqa: BLE001 - dynamo raises many kinds; all mean "not compiled"
        report.compiled = False
        report.graph_breaks = max(1, _graph_break_count())
        report.reason = _first_line(exc)
        return _refuse_or_fall_back(step, example, report, allow_eager_fallback, warmup_iters)
    report.compile_s = time.perf_counter() - t0

    frames_after_compile = _unique_graphs()
    t1 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(max(1, warmup_iters)):
            if cudagraphs:
                mark_cudagraph_step()
            out = compiled(example)
    _sync(out[0])
    report.warmup_s = time.perf_counter() - t1
    report.graph_breaks = _graph_break_count()
    report.recompiles = max(0, _unique_graphs() - frames_after_compile)
    if cudagraphs:
        report.cudagraph_skips = _cudagraph_skips()

    problems = []
    if report.graph_breaks:
        problems.append(f"{report.graph_breaks} graph break(s)")
    if report.recompiles:
        problems.append(f"{report.recompiles} recompile(s) on a fixed shape")
    if report.cudagraph_skips:
        problems.append("; ".join(report.cudagraph_skips))
    if problems:
        report.compiled = False
        report.reason = ", ".join(problems)
        return _refuse_or_fall_back(step, example, report, allow_eager_fallback, warmup_iters)
    return compiled, report


def _refuse_or_fall_back(
    step: InferenceStep,
    example: torch.Tensor,
    report: CompileReport,
    allow_eager_fallback: bool,
    warmup_iters: int,
) -> tuple[StepFn, CompileReport]:
    message = (
        f"torch.compile(mode={report.mode!r}) did not produce one fixed-shape graph: "
        f"{report.reason}"
    )
    if not allow_eager_fallback:
        raise CompileRefused(
            message + ". Fix the model, set GPUFEED_COMPILE=off, or start with "
            "--allow-eager-fallback to run eager anyway."
        )
    log.error("compile_fell_back_to_eager", reason=report.reason, mode=report.mode)
    torch._dynamo.reset()
    eager, eager_report = compile_step(
        step, example, mode="off", allow_eager_fallback=True, warmup_iters=warmup_iters
    )
    report.fell_back_to_eager = True
    report.warmup_s = eager_report.warmup_s
    return eager, report


def _graph_break_count() -> int:
    breaks = _counters().get("graph_break", {})
    return int(sum(breaks.values())) if breaks else 0


def _unique_graphs() -> int:
    return int(_counters().get("stats", {}).get("unique_graphs", 0))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
