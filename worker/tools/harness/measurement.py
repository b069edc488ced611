"""What a run measured: throughput, latency and the timeline from its results, and the
timed direct-feed ceiling (or the naive model alone at batch 1)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from worker.lifecycle.service import Worker
from worker.model.ceiling import direct_feed_ceiling
from worker.observe.gpu_sampler import percentile
from worker.tools.harness.redis_env import ReadBack


def summarise(answers: Sequence[ReadBack], t0_ms: float, bin_s: float) -> dict[str, Any]:
    """Throughput, burst latency, service latency, mean stage times and the timeline."""
    finish = sorted(max(0.0, a.ms - t0_ms) for a in answers)
    if not finish:
        return {"images_per_s": 0.0, "duration_s": 0.0}
    duration_s = max(finish[-1], 1.0) / 1000.0
    service = sorted(a.timings["total"] for a in answers if "total" in a.timings)
    stages: dict[str, list[float]] = {}
    for a in answers:
        for stage, ms in a.timings.items():
            if stage not in ("total", "redis_wait", "write"):
                stages.setdefault(stage, []).append(ms)
    bins = max(1, math.ceil(duration_s / bin_s - 1e-9))
    counts = [0] * bins
    for ms in finish:
        counts[min(bins - 1, int(ms / 1000.0 / bin_s))] += 1
    errors: dict[str, int] = {}
    for a in answers:
        if not a.ok:
            code = a.error.split(":", 1)[0] or "unknown"
            errors[code] = errors.get(code, 0) + 1
    return {
        "images_per_s": round(len(answers) / duration_s, 2),
        "duration_s": round(duration_s, 4),
        "p50_ms": round(percentile(finish, 50), 1),
        "p95_ms": round(percentile(finish, 95), 1),
        "p99_ms": round(percentile(finish, 99), 1),
        "service_p50_ms": round(percentile(service, 50), 1) if service else None,
        "service_p99_ms": round(percentile(service, 99), 1) if service else None,
        "stage_ms": {k: round(sum(v) / len(v), 3) for k, v in stages.items()},
        "results_ok": sum(1 for a in answers if a.ok),
        "results_error": sum(1 for a in answers if not a.ok),
        "errors": errors,
        # Results per bin from t0; the last bin may be partial (its rate reads low).
        "timeline": {
            "bin_s": bin_s,
            "results": counts,
            "images_per_s": [round(c / bin_s, 2) for c in counts],
        },
    }


def timed_ceiling(
    run: Callable[[int, int], dict[str, Any]], target_s: float, trials: int = 3
) -> dict[str, Any]:
    """A probe, then `trials` timed direct-feed runs of `target_s / trials` each; returns the
    median one (a stall on a shared host moves one trial, not the figure), with the CPU it
    used per image."""
    probe = run(2, 2)
    per_trial_ms = target_s * 1000 / trials
    iters = max(3, min(2000, round(per_trial_ms / max(probe["ms_per_batch"], 1e-3))))
    results = []
    for _ in range(trials):
        cpu0 = time.process_time()
        result = run(iters, 1)
        cpu_s = time.process_time() - cpu0
        result["core_ms_per_image"] = round(cpu_s * 1000 / (result["batch"] * (iters + 1)), 3)
        results.append(result)
    results.sort(key=lambda r: float(r["images_per_s"]))
    median = results[len(results) // 2]
    median["trials_images_per_s"] = [r["images_per_s"] for r in results]
    return median


async def measure_ceiling(worker: Worker, target_s: float) -> dict[str, Any]:
    """The direct-feed ceiling of the step this worker serves, on its launch thread."""
    report, runner = worker.report(), worker.engine.model.runner
    compiled = report.compile_report
    cudagraphs = bool(compiled.cudagraphs and report.cuda)
    step = runner.step
    device = report.device
    # The ring's side: S x S rows, or R x R rows for the device placement.
    shape = (report.batch_size, report.ring_side, report.ring_side, 3)
    out: dict[str, Any] = {}

    def on_launch_thread() -> None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        # x: [B, S, S, 3] uint8 on the device, random: input that costs nothing.
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)

        def run(iters: int, warmup: int) -> dict[str, Any]:
            return direct_feed_ceiling(step, x, iters=iters, warmup=warmup, cudagraphs=cudagraphs)

        out.update(timed_ceiling(run, target_s))

    await asyncio.get_running_loop().run_in_executor(None, runner.run_sync, on_launch_thread)
    out["compile"] = compiled.mode
    return out
