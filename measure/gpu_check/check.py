"""python -m measure.gpu_check.check: a short benchmark of the real pipeline on this GPU.

Phases, each written to `report.json` in $GPU_CHECK_OUT (default .gpu-check/out) as it
ends, so a run cut short still reports what it measured:

1. start-up: a real Worker in-process (compile, warm-up, precision check, start-up checks);
   with --wait-for it runs beside the CUDA tests, and the phases below wait for that file
   (the tests' end), so they measure alone on the GPU; `light_startup`, the light model's
   worker started (compiled) there too;
2. ceiling: the direct-feed ceiling, a random uint8 batch already on the device through
   the compiled step and through the eager step, on the launch thread (images/s), with
   cudnn.benchmark off as the worker runs;
3. pipeline: photo-like ~640x480 JPEGs, bytes unique per job and the decode cache off (every
   job decoded), pushed into Redis as fast as the worker takes them. A throughput window
   (results, NVML utilisation, launches of the step and the CUDA-graph replays inside
   each), then a sync window under the profiler (every thread's blocking CUDA calls and
   pageable copies, C++ and libraries included) and sync-debug mode, per batch;
   then, after the latency phase, `thumbnails`: a second window on 64x64 JPEGs;
4. decode: RGB, grey and CMYK JPEGs decoded by each GPU decoder against the CPU path;
5. peer: the worker's model, compiled with the worker's mode, fed by a torch DataLoader
   over the same JPEGs, as a user writes it (gpu_check/peer.py);
6. light_ceiling and light: the light model's ceiling, then a window of the photo JPEGs;
7. extras when time is left, judged by no rule: the GPU's JPEG decoder alone, the decode
   processes alone, the link, gpufeed before its JPEG engines with GPUFEED_PROCESSES=1,2,3
   (gpu_check/processes_run.py), and cudnn, the ceiling again with cudnn.benchmark on
   (eager, and compiled and captured afresh).

The phases are the rows of one table (phases/table.py: each one's name, budget, needs and
the function that runs it; the bodies are the other modules of phases/), which the loop
here runs in turn and `budget_plan` reads the budgets from.

The run has a deadline (--deadline-s). Before anything runs, a budget plan (`budget_plan` in
the report) gives each phase its seconds, every phase a rule needs first, the others while
they fit, and says what it left out and why, and which judged phase cannot fit. Phases that
do not fit when their turn comes are skipped and say so ("not measured"), and when the
deadline passes (or SIGTERM arrives) the report is written with what was measured and the
process ends at once, even with a compile still running on another thread. The verdict is
the rules' (measure/gpu_check/rules.py); the script's last step adds the CUDA tests'
results and judges again.

No network: weights are random (`none`), images are made here, Redis is whatever REDIS_URL
points at (scripts/gpu-check.sh starts a private one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import structlog
import torch

from measure.gpu_check.phases.budgets import before_process_counts
from measure.gpu_check.phases.state import Deadline, Report, Run, check_config
from measure.gpu_check.phases.table import PHASES, Estimate, Phase, Runs, Session
from measure.gpu_check.report import (
    EXPECTED_TESTS,
    add_verdict,
    tests_summary,
)
from worker.base.logs import configure_logging
from worker.lifecycle.service import Worker
from worker.tools.command_line import CONTEXT_SETTINGS, parse
from worker.tools.harness.environment import environment

log = structlog.get_logger("gpufeed.gpu_check")


@dataclass
class BudgetPlan:
    """Seconds for each phase, in run order, planned up front from the options: every phase
    the rules need (rules.JUDGED_PHASES, with the pipeline's drain and the run's end) first,
    then the others, each while it fits the deadline. Those left out say why; a judged
    phase past the deadline is named."""

    deadline_s: float
    order: list[tuple[str, float, bool]]  # (phase, seconds, judged), run order, planned
    skipped: dict[str, str]
    past_deadline: dict[str, str]

    def seconds(self, phase: str) -> float:
        """Seconds planned for `phase` (0: not planned)."""
        return next((s for name, s, _ in self.order if name == phase), 0.0)

    def judged_after(self, phase: str) -> float:
        """Seconds planned for the judged phases that run after `phase`."""
        names = [name for name, _, _ in self.order]
        after = self.order[names.index(phase) + 1 :] if phase in names else []
        return sum(s for _, s, judged in after if judged)

    def why_not(self, phase: str, left_s: float) -> str | None:
        """Why `phase`, judged by no rule, is not run with `left_s` seconds left (None: it
        runs): planned out up front, or the judged phases after it need the time."""
        if phase in self.skipped:
            return self.skipped[phase]
        need, later = self.seconds(phase), self.judged_after(phase)
        if left_s - need < later:
            return (
                f"{left_s:.0f} s left: about {need:.0f} s for it and {later:.0f} s for the "
                "judged phases after it"
            )
        return None

    def as_dict(self) -> dict[str, Any]:
        total = sum(s for _, s, _ in self.order)
        judged = sum(s for _, s, j in self.order if j)
        before_tests = sum(s for n, s, _ in self.order if n in ("startup", "light_startup"))
        return {
            **{name: round(s, 1) for name, s, _ in self.order},
            "total": round(total, 1),
            "deadline_s": self.deadline_s,
            "judged_total": round(judged, 1),
            # With --wait-for, what the phases after the start-ups need once the tests end
            # (scripts/gpu-check.sh's GPU_CHECK_RESERVE_S keeps it for them).
            "after_tests": round(total - before_tests, 1),
            "judged_after_tests": round(judged - before_tests, 1),
            "fits": not self.past_deadline,
            "past_deadline": self.past_deadline,
            "skipped": self.skipped,
        }


def budget_plan(args: CheckArgs) -> BudgetPlan:
    """The run's phases against --deadline-s, from the options alone (what the compile
    costs is an estimate here; the peer's is measured again once the worker compiled):
    each budget, and each phase the options leave out with why, from the table."""
    est = Estimate.of(args)
    # (phase, seconds or why it does not run, judged), in run order.
    rows: list[tuple[str, float | Runs | str, bool]] = []
    for phase in PHASES:
        if phase.budget is not None:
            why = phase.planned_out(args)
            rows.append((phase.name, phase.budget(args, est) if why is None else why, phase.judged))
    skipped = {name: cost for name, cost, _ in rows if isinstance(cost, str)}
    judged_s = sum(c for _, c, j in rows if j and not isinstance(c, str | Runs))
    room = args.deadline_s - judged_s

    def left() -> str:
        if room <= 0:
            return f"the judged phases alone need {judged_s:.0f} s of {args.deadline_s:.0f}"
        return f"{room:.0f} s left in the plan"

    planned: dict[str, float] = {}
    for name, cost, judged in rows:
        if isinstance(cost, str):
            continue
        if isinstance(cost, Runs):
            # As many runs as fit, in the order given.
            fit = min(cost.count, int(max(room, 0.0) // cost.each_s))
            if fit < cost.count:
                skipped[name] = (
                    f"{cost.count - fit} of {cost.count} runs: about {cost.each_s:.0f} s a run, "
                    f"{left()}"
                )
            if fit:
                planned[name] = fit * cost.each_s
                room -= fit * cost.each_s
        elif judged:
            planned[name] = cost
        elif cost <= room:
            planned[name] = cost
            room -= cost
        else:
            skipped[name] = f"about {cost:.0f} s needed, {left()}"
    order = [(name, planned[name], judged) for name, _, judged in rows if name in planned]
    skipped = {name: skipped[name] for name, _, _ in rows if name in skipped}  # run order
    past: dict[str, str] = {}
    at = 0.0
    for name, cost, judged in order:
        at += cost
        if judged and at > args.deadline_s:
            past[name] = f"ends about {at:.0f} s in, past the deadline of {args.deadline_s:.0f} s"
    return BudgetPlan(args.deadline_s, order, skipped, past)


async def run(args: CheckArgs, report: Report, deadline: Deadline) -> None:
    plan = budget_plan(args)
    # The rules judge a GPU's claims on a CUDA device only.
    report["device_type"] = torch.device(args.device).type
    report["budget_plan"] = plan.as_dict()
    if plan.past_deadline:
        log.warning("budget_plan_past_deadline", phases=plan.past_deadline)
    with contextlib.ExitStack() as stack:
        more: dict[str, Any] = {}
        if args.jobs_by == "path":
            # The images as files, which the decoders read themselves: no bytes in Redis.
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-"))
            more["path_root"] = folder
        cfg = check_config(args, model=args.model, prefix="gpucheck", **more)
        worker = Worker(cfg)
        light: Worker | None = None
        if args.light_seconds > 0:
            # One batch shape: one compile, the one the window runs.
            light_cfg = check_config(
                args,
                model=args.light_model,
                prefix="gpucheck-light",
                batch_sizes=str(args.batch),
                **more,
            )
            light = Worker(light_cfg)
        try:
            await _run_phases(Run(args, report, deadline, plan, worker, light))
        finally:
            if light is not None:
                await light.shutdown()
            await worker.shutdown()


async def _run_phases(run: Run, table: Sequence[Phase] = PHASES) -> None:
    """The table in run order, each phase's shape done once: skipped with its reason where
    a need is missing or its time is not left; otherwise run inside its session (the
    worker serving that the phases around it share) and recorded, the report written as
    it ends. A session closes once the table moves past its phases."""
    async with contextlib.AsyncExitStack() as serving:
        opened: Session | None = None
        for phase in table:
            if opened is not None and phase.session is not opened:
                await serving.aclose()
                opened = None
            if phase.runs is None:
                continue
            if (skip := phase.why_not(run)) is not None:
                why, reported = skip
                if reported:
                    run.report.skip(phase.name, why)
                continue
            if phase.session is not None and opened is None:
                await serving.enter_async_context(phase.session.opens(run))
                opened = phase.session
            try:
                with run.report.phase(phase.name) as entry:
                    await phase.runs(run, entry)
            except Exception:
                if not phase.goes_on:
                    raise


def _counts_option(value: str) -> str:
    try:
        before_process_counts(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: {exc}") from exc
    return value


@dataclass(frozen=True)
class CheckArgs:
    """The benchmark's command line (`command`)."""

    model: str
    batch: int
    precision: str
    compile: str
    decode: str
    resize: str
    device: str
    seconds: float
    warmup_seconds: float
    sync_seconds: float
    latency_seconds: float
    backlog: int
    ceiling_iters: int
    width: int
    height: int
    decode_rate_seconds: float
    thumbnail_seconds: float
    before_seconds: float
    before_processes: str
    before_processes_seconds: float
    light_model: str
    light_seconds: float
    peer_seconds: float
    peer_workers: int
    jobs_by: str
    redis_url: str
    out: str
    wait_for: str | None
    junit: str | None
    tests_rc: int | None
    expected_tests: str
    deadline_s: float


def _env(name: str, default: str) -> Callable[[], str]:
    # Read when the command line is, not when this module is imported.
    return lambda: os.environ.get(name, default)


@click.command(help="GPU benchmark", context_settings=CONTEXT_SETTINGS)
@click.option("--model", default=_env("GPU_CHECK_MODEL", "resnet50"))
@click.option("--batch", type=int, default=_env("GPU_CHECK_BATCH", "64"))
@click.option("--precision", default=_env("GPU_CHECK_PRECISION", "auto"))
@click.option("--compile", default=_env("GPU_CHECK_COMPILE", "auto"))
# GPU decode where nvImageCodec is installed (the carried wheels), the CPU's otherwise.
@click.option("--decode", default=_env("GPU_CHECK_DECODE", "auto"))
@click.option("--resize", default=_env("GPU_CHECK_RESIZE", "auto"))
# Never a silent fallback to the CPU: the check is about the GPU.
@click.option("--device", default=_env("GPU_CHECK_DEVICE", "cuda:0"))
@click.option(
    "--seconds", type=float, default=_env("GPU_CHECK_SECONDS", "20"), help="pipeline window"
)
@click.option("--warmup-seconds", type=float, default=3.0)
@click.option("--sync-seconds", type=float, default=3.0, help="profiled window counting host syncs")
@click.option(
    "--latency-seconds",
    type=float,
    default=4.0,
    help="jobs offered at 80%% of the pipeline's rate, for p50 / p99 (0: no latency phase)",
)
@click.option(
    "--backlog",
    type=int,
    default=2048,
    help="jobs kept ahead of the worker's answers in the window (at least 32 batches)",
)
@click.option("--ceiling-iters", type=int, default=50)
@click.option("--width", type=int, default=640)
@click.option("--height", type=int, default=480)
@click.option(
    "--decode-rate-seconds",
    type=float,
    default=1.0,
    help="timed decode per image size and number of decode processes (phase "
    "decode_processes; 0: not measured)",
)
@click.option(
    "--thumbnail-seconds",
    type=float,
    default=5.0,
    help="a second window on 64x64 JPEGs from the same worker (phase thumbnails; 0: none)",
)
@click.option(
    "--before-seconds",
    type=float,
    default=5.0,
    help="the photo window again with the GPU's JPEG decoder given no rows (phase before; "
    "0: none; only where GPU decode runs)",
)
@click.option(
    "--before-processes",
    default=_env("GPU_CHECK_BEFORE_PROCESSES", "1,2,3"),
    callback=lambda ctx, param, value: _counts_option(value),
    help="GPUFEED_PROCESSES values each run as `python -m worker` with GPU decode off, fed "
    "the photo jobs (phase before_processes, an extra: the best of them is what the JPEG "
    "engines are measured against; empty: none)",
)
@click.option(
    "--before-processes-seconds",
    type=float,
    default=5.0,
    help="each before_processes run's timed window",
)
@click.option(
    "--light-model",
    default=_env("GPU_CHECK_LIGHT_MODEL", "mobilenet_v3_large"),
    help="the light model's pipeline run (phase light, on a worker of its own)",
)
@click.option(
    "--light-seconds",
    type=float,
    default=8.0,
    help="the light model's window on the photo JPEGs (0: no light-model run)",
)
@click.option(
    "--peer-seconds",
    type=float,
    default=8.0,
    help="the worker's model fed by a torch DataLoader over the same JPEGs (phase peer; 0: none)",
)
@click.option(
    "--peer-workers",
    type=int,
    default=0,
    help="the peer's DataLoader processes (0: one per core but one)",
)
@click.option(
    "--jobs-by",
    type=click.Choice(["image", "path"]),
    default=_env("GPU_CHECK_JOBS_BY", "path"),
    help="the photo windows' jobs name files the decoders read (path, what an operator "
    "uses at these rates: the images never pass through Redis) or carry their images "
    "(image: 84 KB each through one Redis)",
)
@click.option("--redis-url", default=_env("REDIS_URL", "redis://127.0.0.1:6379/0"))
@click.option("--out", default=_env("GPU_CHECK_OUT", ".gpu-check/out"))
@click.option(
    "--wait-for",
    default=None,
    help="after start-up (the compile), wait until this file exists before measuring",
)
@click.option("--junit", default=None, help="pytest --junitxml file of the CUDA tests")
@click.option("--tests-rc", type=int, default=None, help="pytest's exit status")
@click.option(
    "--expected-tests",
    default=str(EXPECTED_TESTS),
    help="node ids of every cuda-marked test; each must have run and passed",
)
@click.option(
    "--deadline-s",
    type=float,
    # What scripts/gpu-check.sh gives it by default: GPU_CHECK_BUDGET_S less its set-up.
    default=_env("GPU_CHECK_BENCH_DEADLINE_S", "440"),
    help="write the report and stop after this many seconds, whatever is running",
)
def command(**options: Any) -> CheckArgs:
    return CheckArgs(**options)


def parse_args(argv: list[str] | None) -> CheckArgs:
    return parse(command, argv, CheckArgs, prog_name="python -m measure.gpu_check.check")


def main(argv: list[str] | None = None, *, require_cuda: bool = True) -> int:
    """The command line. `require_cuda=False` lets the test suite run the phases on the CPU;
    the command itself always refuses to run anywhere but on a CUDA device."""
    args = parse_args(argv)
    configure_logging(os.environ.get("GPU_CHECK_LOG_FORMAT", "auto"), "info")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "report.json")
    deadline = Deadline(args.deadline_s)
    report.update(environment=environment(build=True), deadline_s=args.deadline_s)
    if args.junit:
        report["tests"] = tests_summary(Path(args.junit), args.tests_rc, Path(args.expected_tests))

    def give_up(why: str, code: int) -> None:
        # The deadline or a signal: the report says what was measured and where it stopped,
        # and the process ends now, not when a compile on another thread would let it.
        report["error"] = f"{why} during phase {report.phase_now or 'set-up'!r}"
        report["stopped_in"] = report.phase_now
        conclude(report)
        print(f"gpu-check: {report['error']}; report: {report.path}", file=sys.stderr)
        os._exit(code)

    watchdog = threading.Timer(
        args.deadline_s, give_up, (f"time budget of {args.deadline_s:.0f} s spent", 124)
    )
    watchdog.daemon = True
    watchdog.start()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: give_up(f"signal {signum}", 124))
    try:
        on_cuda = args.device.startswith("cuda") and torch.cuda.is_available()
        if require_cuda and not on_cuda:
            raise RuntimeError(
                f"the GPU check needs a CUDA device; --device {args.device}, CUDA available: "
                f"{torch.cuda.is_available()}"
            )
        asyncio.run(run(args, report, deadline))
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the report is written anyway
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["stopped_in"] = report.phase_now
        report["traceback"] = traceback.format_exc(limit=20)
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGTERM, previous)
    ok = conclude(report)
    headline = {k: report.data.get(k) for k in _HEADLINE}
    headline["passed"] = ok
    print(json.dumps(headline, default=str))
    print(f"report: {report.path}", file=sys.stderr)
    return 0 if ok else 1


def conclude(report: Report) -> bool:
    """Judges the report by the rules, writes the verdict into it and prints each rule."""
    with report._lock:
        ok = add_verdict(report.data)
        report.write()
    return ok


_HEADLINE = (
    "device",
    "model",
    "batch",
    "dtype",
    "ceiling_images_per_s",
    "ceiling_images_per_s_cudnn_benchmark",
    "pipeline_images_per_s",
    "ratio",
    "gpu_util_mean",
    "error",
)

if __name__ == "__main__":
    sys.exit(main())
