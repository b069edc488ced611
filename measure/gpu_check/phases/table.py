"""The GPU check's phases as one table, in run order: each phase's name (the report's), its
budget (the seconds the plan gives it, from the options alone), its needs (what must have
run or be there before it; the first one missing is the reason it is skipped), the time it
checks is left when its turn comes, and the function that runs it.

The check (measure/gpu_check/check.py) runs the table in a loop that does each phase's
shape once, and plans the run's budget from it. The rows without a function are the plan's
alone: parts of the phases around them (the pipeline's drain, the run's end)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from measure.gpu_check.phases import decode, extras, light, peer, pipeline, startup, windows
from measure.gpu_check.phases.budgets import (
    CEILING_S,
    CUDNN_S,
    DECODE_S,
    DRAIN_S,
    GPU_DECODE_RATE_S,
    H2D_S,
    LIGHT_CEILING_S,
    LIGHT_S,
    LIGHT_START_EAGER_S,
    LIGHT_START_S,
    ONE_COMPILE_S,
    PEER_S,
    PROCESSES_RUN_S,
    SHUTDOWN_S,
    STARTUP_EAGER_S,
    STARTUP_S,
    SYNCS_S,
    WINDOW_S,
    before_process_counts,
)
from measure.gpu_check.phases.state import Run
from measure.gpu_check.rules import JUDGED_PHASES
from worker.model.step import resolve_compile_mode

if TYPE_CHECKING:
    from measure.gpu_check.check import CheckArgs


@dataclass(frozen=True)
class Estimate:
    """What the plan knows of the run before anything ran: the options' consequences."""

    compiled: bool
    one_compile_s: float  # the model compiled at one shape, where the step is compiled

    @classmethod
    def of(cls, args: CheckArgs) -> Estimate:
        compiled = resolve_compile_mode(args.compile, torch.device(args.device)) != "off"
        return cls(compiled, ONE_COMPILE_S if compiled else 0.0)


@dataclass(frozen=True)
class Runs:
    """A budget of separate runs, `each_s` seconds each: the plan keeps as many as fit."""

    count: int
    each_s: float


Budget = Callable[["CheckArgs", Estimate], "float | Runs"]
Room = Callable[[Run, str], "str | None"]  # the phase's name: why its time is not left
Body = Callable[[Run, dict[str, Any]], Awaitable[None]]  # the phase's report entry


def _none(args: CheckArgs) -> str | None:
    return None


@dataclass(frozen=True)
class Need:
    """What must have run or be there before a phase: `now` says why it is missing when the
    phase's turn comes (None: it is there), `planned` what the options alone say of it, for
    the plan. A need that is not `reported` leaves the phase out of the report: the run
    never reached it."""

    what: str
    now: Callable[[Run], str | None]
    planned: Callable[[CheckArgs], str | None] = _none
    reported: bool = True


def _from_options(what: str, why: Callable[[CheckArgs], str | None]) -> Need:
    return Need(what, lambda run: why(run.args), why)


def _option(name: str, off: str) -> Need:
    """An option that turns the phase off at 0."""
    return _from_options(name, lambda args: off if getattr(args, name) <= 0 else None)


def ran(name: str, *, failed: str = "it failed", reported: bool = True) -> Need:
    """Phase `name` done: where it is not, its reason is this phase's."""

    def why(run: Run) -> str | None:
        entry = run.report["phases"].get(name)
        if entry is None:
            return f"phase {name} did not run"
        if entry.get("status") == "done":
            return None
        return str(entry.get("why") or f"{failed}: {entry.get('error')}")

    return Need(f"phase {name} done", why, reported=reported)


CUDA = _from_options(
    "a CUDA device",
    lambda args: None if torch.device(args.device).type == "cuda" else "not a CUDA device",
)
WAIT_FOR = Need("--wait-for", lambda run: None if run.args.wait_for else "", reported=False)
LIGHT_MODEL = _option("light_seconds", "--light-seconds 0")
GPU_DECODE = Need(
    "GPU decode in this run",
    windows.gpu_decode_running,
    lambda args: "--decode cpu: no GPU decode in this run" if args.decode == "cpu" else None,
)
PIPELINE_RATE = Need("a pipeline rate", windows.pipeline_rate)
BEFORE_PROCESSES = _from_options(
    "before_processes",
    lambda args: (
        None if before_process_counts(args.before_processes) else "--before-processes empty"
    ),
)
# The windows after the pipeline's run on its worker: without its window, not at all.
PIPELINE_SERVED = ran("pipeline", reported=False)


def _left_below(need: Callable[[Run], float], *, margin: float = 0.0, say: bool = False) -> Room:
    """Skipped with less than `need` (and `margin`) seconds left; `say`: how many it needs."""

    def room(run: Run, name: str) -> str | None:
        left, seconds = run.deadline.left(), need(run)
        if left >= seconds + margin:
            return None
        return f"{left:.0f} s left, about {seconds:.0f} needed" if say else f"{left:.0f} s left"

    return room


def _seconds(value: float) -> Callable[[Run], float]:
    return lambda run: value


def _planned(room: Room) -> Room:
    """An extra: run only where the plan kept time for it, and that time is still left."""
    return lambda run, name: run.plan.skipped.get(name) or room(run, name)


def _between_judged(run: Run, name: str) -> str | None:
    """No rule reads it: run only where the judged phases after it keep their time."""
    return run.plan.why_not(name, run.deadline.left())


@dataclass(frozen=True)
class Session:
    """A worker serving that consecutive phases share: opened before the first of them that
    runs, closed once the table moves past them (or the run ends)."""

    name: str
    opens: Callable[[Run], AbstractAsyncContextManager[None]]


PHOTOS = Session("the pipeline's worker serving the photo jobs", pipeline.serving_photos)
LIGHT = Session("the light model's worker", light.light_worker)


@dataclass(frozen=True)
class Phase:
    """A row of the table (the module's docstring says what each field is)."""

    name: str
    budget: Budget | None  # None: not planned (the wait for the CUDA tests)
    needs: tuple[Need, ...] = ()
    runs: Body | None = None  # None: a row of the plan alone
    room: Room | None = None
    session: Session | None = None
    goes_on: bool = False  # a failure is recorded in its entry and the run goes on

    @property
    def judged(self) -> bool:
        # The plan-only rows are parts of the judged phases around them.
        return self.name in JUDGED_PHASES or self.runs is None

    def planned_out(self, args: CheckArgs) -> str | None:
        """Why the options alone leave it out of the plan (None: they do not)."""
        return next((why for need in self.needs if (why := need.planned(args))), None)

    def why_not(self, run: Run) -> tuple[str, bool] | None:
        """Why it does not run now, and whether the report says so (None: it runs)."""
        for need in self.needs:
            if (why := need.now(run)) is not None:
                return why, need.reported
        if self.room is not None and (why := self.room(run, self.name)) is not None:
            return why, True
        return None


PHASES: tuple[Phase, ...] = (
    Phase(
        "startup",
        lambda args, est: STARTUP_S if est.compiled else STARTUP_EAGER_S,
        runs=startup.startup,
    ),
    Phase(
        "light_startup",
        lambda args, est: LIGHT_START_S if est.compiled else LIGHT_START_EAGER_S,
        (LIGHT_MODEL,),
        light.light_startup,
        room=_left_below(light.seconds_to_start, say=True),
        goes_on=True,  # the main phases go on without the light model
    ),
    Phase("wait_for_tests", None, (WAIT_FOR,), startup.wait_for_tests),
    Phase("ceiling", lambda args, est: CEILING_S, (ran("startup"),), startup.ceiling),
    Phase(
        "pipeline",
        lambda args, est: args.warmup_seconds + args.seconds + WINDOW_S,
        (ran("ceiling"),),
        pipeline.pipeline,
        room=lambda run, name: pipeline.room_for_window(run),
        session=PHOTOS,
    ),
    Phase(
        "syncs",
        lambda args, est: args.sync_seconds + SYNCS_S,
        (ran("pipeline"),),
        pipeline.syncs,
        session=PHOTOS,
    ),
    Phase(
        "latency",
        lambda args, est: args.latency_seconds + WINDOW_S,
        (PIPELINE_SERVED, _option("latency_seconds", "--latency-seconds 0"), PIPELINE_RATE),
        windows.latency,
        room=_between_judged,
        session=PHOTOS,
    ),
    Phase(
        "thumbnails",
        lambda args, est: args.thumbnail_seconds + WINDOW_S,
        (PIPELINE_SERVED, _option("thumbnail_seconds", "--thumbnail-seconds 0")),
        windows.thumbnails,
        session=PHOTOS,
    ),
    Phase(
        "before",
        lambda args, est: args.before_seconds + WINDOW_S,
        (PIPELINE_SERVED, _option("before_seconds", "--before-seconds 0"), GPU_DECODE),
        windows.before,
        room=_between_judged,
        session=PHOTOS,
    ),
    # The pipeline's worker answering its backlog and stopping: its session closes here.
    Phase("drain", lambda args, est: DRAIN_S),
    Phase(
        "decode",
        lambda args, est: DECODE_S,
        runs=decode.decode,
        room=_left_below(_seconds(15.0)),
    ),
    Phase(
        "peer",
        lambda args, est: args.peer_seconds + PEER_S + est.one_compile_s,
        (_option("peer_seconds", "--peer-seconds 0"),),
        peer.peer,
        room=_left_below(peer.seconds_needed, say=True),
    ),
    Phase(
        "light_ceiling",
        lambda args, est: LIGHT_CEILING_S,
        (LIGHT_MODEL, ran("light_startup", failed="its start-up failed")),
        light.light_ceiling,
        room=_left_below(light.seconds_to_measure, say=True),
        session=LIGHT,
    ),
    Phase(
        "light",
        lambda args, est: args.light_seconds + LIGHT_S,
        (LIGHT_MODEL, ran("light_ceiling")),
        light.light,
        session=LIGHT,
    ),
    Phase(
        "gpu_decode_rate",
        lambda args, est: GPU_DECODE_RATE_S,
        (CUDA,),
        decode.gpu_decode_rate,
        room=_planned(_left_below(_seconds(GPU_DECODE_RATE_S))),
    ),
    Phase(
        "decode_processes",
        lambda args, est: decode.decode_processes_s(args),
        (_option("decode_rate_seconds", "--decode-rate-seconds 0"),),
        decode.decode_processes,
        room=_planned(
            _left_below(lambda run: decode.decode_processes_s(run.args), margin=10, say=True)
        ),
    ),
    Phase(
        "h2d",
        lambda args, est: H2D_S,
        (CUDA,),
        extras.h2d,
        room=_planned(_left_below(_seconds(H2D_S))),
    ),
    Phase(
        "before_processes",
        lambda args, est: Runs(
            len(before_process_counts(args.before_processes)),
            PROCESSES_RUN_S + args.before_processes_seconds,
        ),
        (BEFORE_PROCESSES,),
        extras.before_processes,
        room=lambda run, name: extras.room_for_processes(run),
    ),
    Phase(
        "cudnn",
        lambda args, est: CUDNN_S + est.one_compile_s,
        (CUDA,),
        extras.cudnn,
        room=_planned(_left_below(_seconds(10.0))),
    ),
    # The workers shut down and the report written, after the loop
    # (measure/gpu_check/check.py's `run`).
    Phase("shutdown", lambda args, est: SHUTDOWN_S),
)
