"""Compile the step for its one shape, warm it up, and prove it did not fall back to eager.

torch.compile fails soft by design: a graph break silently splits the step into pieces run
partly in eager mode, a guard failure silently recompiles, and CUDA graphs are silently
skipped for some inputs. Any of those gives back the launch overhead the compile was meant
to remove, so the worker checks for each at start-up and refuses to run (or, when the
operator allows it, runs plain eager and says so loudly).

How each failure is seen, in ways that hold from torch 2.11 to 2.14:
- graph breaks: `fullgraph=True` turns the first one into an exception at the first call;
  `torch._dynamo.explain` then counts them all for the message. The dynamo counter
  `graph_break` is read as well.
- recompiles: every graph dynamo produces bumps `counters["stats"]["unique_graphs"]` and
  every converted frame `counters["frames"]["ok"]`; a fixed-shape step produces exactly one.
  `CompileBaseline` snapshots both after the first compile, so a recompile later (another
  shape, a changed global) is visible at any time through `changes_since`.
- CUDA-graph skips: inductor logs "skipping cudagraphs due to ..." and bumps
  `counters["inductor"]["cudagraph_skips"]`; the log line is captured for its reason. As a
  last line of defence the warm-up counts real CUDA-graph replays: with CUDA graphs on
  (reduce-overhead, and max-autotune, whose option list turns `triton.cudagraphs` on too)
  there must be some.
- graph partitions: since torch 2.9 inductor's `graph_partition` is on by default. With it,
  CPU ops (and other CUDA-graph-unsafe ones) are cut out into partitions that run eagerly
  between graphed ones, with no skip logged or counted, and replays still happen. The step
  is therefore compiled with `graph_partition=False` (a CPU op then skips CUDA graphs the
  way it did before partitions, logged and counted), and
  `counters["inductor"]["cudagraph_partitions"]` (bumped when a graph is split) is read as
  well, so a partitioned step is refused whatever the configuration.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from torch import nn

from worker.base.device import mark_cudagraph_step, prepare_graph_thread
from worker.base.errors import EXIT_COMPILE, GpufeedError
from worker.model.sizes import SizeReport
from worker.model.step import StepFn

log = structlog.get_logger("gpufeed.compiler")


class CompileRefused(GpufeedError, RuntimeError):
    """The compiled step is not what was asked for; the message says why."""

    exit_code = EXIT_COMPILE


@dataclass(frozen=True)
class CompileBaseline:
    """Dynamo's counters right after the one expected compile."""

    unique_graphs: int
    frames_ok: int
    graph_breaks: int
    cudagraph_skips: int
    graph_partitions: int = 0


@dataclass
class CompileReport:
    mode: str
    compiled: bool
    compile_s: float = 0.0
    warmup_s: float = 0.0
    graph_breaks: int = 0
    recompiles: int = 0
    cudagraph_skips: list[str] = field(default_factory=list)
    cudagraph_replays: int = 0
    # Partitions inductor cut the step into (0: not split). Any split means some ops run
    # outside the CUDA graph.
    graph_partitions: int = 0
    inductor_options: dict[str, Any] = field(default_factory=dict)
    fell_back_to_eager: bool = False
    # Its options turn CUDA graphs on and it was compiled for a CUDA device.
    uses_cudagraphs: bool = False
    reason: str = ""
    torch_version: str = torch.__version__
    baseline: CompileBaseline | None = None
    # Per batch size compiled (the example's and `sizes`): (first call's seconds, device bytes
    # its compile and warm-up reserved).
    size_costs: dict[int, tuple[float, int]] = field(default_factory=dict)
    # The shapes as start-up measured and chose them (worker/model/sizes.py); set by the
    # engine once it has timed them.
    batch_sizes: list[SizeReport] = field(default_factory=list)

    @property
    def cudagraphs(self) -> bool:
        """The step as compiled replays CUDA graphs (whatever the mode's name)."""
        return self.compiled and self.uses_cudagraphs

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "compiled": self.compiled,
            "cudagraphs": self.cudagraphs,
            "compile_s": round(self.compile_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "graph_breaks": self.graph_breaks,
            "recompiles": self.recompiles,
            "cudagraph_skips": self.cudagraph_skips,
            "cudagraph_replays": self.cudagraph_replays,
            "graph_partitions": self.graph_partitions,
            "inductor_options": self.inductor_options,
            "fell_back_to_eager": self.fell_back_to_eager,
            "reason": self.reason,
            "batch_sizes": [r.as_dict() for r in self.batch_sizes],
        }


def _counters() -> Any:
    # torch's compiler internals load when a step is compiled, not with the worker.
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return counters


def _count(group: str, name: str) -> int:
    value = _counters().get(group, {}).get(name, 0)
    return int(value)


def _graph_break_count() -> int:
    breaks = _counters().get("graph_break", {})
    return int(sum(breaks.values())) if breaks else 0


class _Keeping:
    """How many `keep_compiled_steps` blocks are active, in any thread."""

    def __init__(self) -> None:
        self.depth = 0
        self.lock = threading.Lock()


_KEEPING = _Keeping()


@contextlib.contextmanager
def keep_compiled_steps() -> Iterator[None]:
    """While active, every compile_step in this process, on whichever thread it compiles,
    runs as with reset=False. For a second Worker started in a process whose first step is
    compiled (the GPU check's light model): its start-up asks for a reset, which would
    throw the first step's graphs away (it would recompile at its next launch, inside
    whatever is being measured then) and zero the counters its baseline was taken from."""
    with _KEEPING.lock:
        _KEEPING.depth += 1
    try:
        yield
    finally:
        with _KEEPING.lock:
            _KEEPING.depth -= 1


def snapshot() -> CompileBaseline:
    return CompileBaseline(
        unique_graphs=_count("stats", "unique_graphs"),
        frames_ok=_count("frames", "ok"),
        graph_breaks=_graph_break_count(),
        cudagraph_skips=_count("inductor", "cudagraph_skips"),
        graph_partitions=_count("inductor", "cudagraph_partitions"),
    )


def changes_since(baseline: CompileBaseline) -> dict[str, int]:
    """New graphs (recompiles), graph breaks, CUDA-graph skips and graph partitions since
    `baseline`."""
    now = snapshot()
    return {
        "recompiles": max(
            now.unique_graphs - baseline.unique_graphs, now.frames_ok - baseline.frames_ok, 0
        ),
        "graph_breaks": max(0, now.graph_breaks - baseline.graph_breaks),
        "cudagraph_skips": max(0, now.cudagraph_skips - baseline.cudagraph_skips),
        "graph_partitions": max(0, now.graph_partitions - baseline.graph_partitions),
    }


def step_inductor_options(mode: str) -> dict[str, Any]:
    """The inductor options for `mode` (what torch.compile(mode=...) would apply), with graph
    partitioning off where this torch has it: the step must be one graph or be refused."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415
    from torch._inductor import list_mode_options  # noqa: PLC0415

    options: dict[str, Any] = dict(list_mode_options(mode, False)) if mode != "default" else {}
    if hasattr(inductor_config, "graph_partition"):
        options["graph_partition"] = False
    return options


def options_use_cudagraphs(options: dict[str, Any]) -> bool:
    """Whether inductor will record and replay CUDA graphs under these options. Not only
    reduce-overhead: max-autotune's option list turns `triton.cudagraphs` on as well, and
    a step that replays graphs needs cudagraph_mark_step_begin before each launch and the
    replay gate at start-up, whatever the mode is called."""
    return bool(options.get("triton.cudagraphs", False))


def mode_uses_cudagraphs(mode: str) -> bool:
    """Whether GPUFEED_COMPILE=`mode` compiles a step that replays CUDA graphs (on CUDA)."""
    return mode != "off" and options_use_cudagraphs(step_inductor_options(mode))


def gate_problems(report: CompileReport) -> list[str]:
    """Why the compiled step is not one fixed-shape graph (empty: it is)."""
    problems = []
    if report.graph_breaks:
        problems.append(f"{report.graph_breaks} graph break(s)")
    if report.recompiles:
        problems.append(f"{report.recompiles} recompile(s) on a fixed shape")
    if report.cudagraph_skips:
        problems.append("skipping cudagraphs: " + "; ".join(report.cudagraph_skips))
    if report.graph_partitions:
        problems.append(
            f"the graph was split into {report.graph_partitions} partitions: some ops "
            "(CPU ops, device copies, CUDA-graph-unsafe ops) run outside the CUDA graph"
        )
    return problems


def still_compiled(report: CompileReport) -> list[str]:
    """Problems that appeared after start-up (empty when the step is still one graph).

    Cheap (reads a few counters): meant for the periodic stats line and for benchmarks.
    """
    if not report.compiled or report.baseline is None:
        return []
    changes = changes_since(report.baseline)
    return [f"{n} {what.replace('_', ' ')}" for what, n in changes.items() if n]


class _SkipCapture(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." lines, whatever the logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []
        self._lock_reasons = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            return
        # Inductor's wording since 2.1: "skipping cudagraphs due to <reason>".
        if "skipping cudagraph" in message.lower():
            with self._lock_reasons:
                self.reasons.append(" ".join(message.split())[:300])


def _skip_loggers() -> list[logging.Logger]:
    # The artifact was "perf_hints" up to about torch 2.5 and is "cudagraphs" since; both
    # are off by default (propagate=False), so the handler goes on the loggers themselves.
    with contextlib.suppress(ImportError):
        import torch._inductor.cudagraph_utils  # noqa: F401, PLC0415
    names = [
        name
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith("torch._inductor") and name.endswith(("__cudagraphs", "__perf_hints"))
    ]
    names.append("torch._inductor.cudagraph_trees")
    return [logging.getLogger(n) for n in names]


@contextlib.contextmanager
def _capture_skips() -> Iterator[_SkipCapture]:
    handler = _SkipCapture()
    loggers = _skip_loggers()
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        if lg.level == logging.NOTSET or lg.level > logging.WARNING:
            lg.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        for lg, level in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)


class _ReplayCounter:
    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def count_cudagraph_replays() -> Iterator[_ReplayCounter]:
    """Counts torch.cuda.CUDAGraph.replay calls while active (start-up and tests only:
    it swaps a class attribute, which is not something to do with launches in flight)."""
    counter = _ReplayCounter()
    graph_cls: Any = getattr(torch.cuda, "CUDAGraph", None)
    original = getattr(graph_cls, "replay", None) if graph_cls is not None else None
    if graph_cls is None or original is None:
        yield counter
        return

    def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter.count += 1
        return original(self, *args, **kwargs)

    graph_cls.replay = replay
    try:
        yield counter
    finally:
        graph_cls.replay = original


def _sync(x: torch.Tensor) -> None:
    # Start-up only: the warm-up must really have run before its time is reported.
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def compile_step(
    step: nn.Module | StepFn,
    example: torch.Tensor,
    *,
    mode: str,
    allow_eager_fallback: bool,
    warmup_iters: int = 3,
    inductor_overrides: dict[str, Any] | None = None,
    reset: bool = True,
    sizes: Sequence[int] = (),
) -> tuple[StepFn, CompileReport]:
    """Returns the function to launch and a report. Runs the step `1 + warmup_iters` times on
    `example` (which must have the production shape, dtype and device, and like the
    production buffers must not be an inference tensor: guards check that), then as often on
    its first `size` rows for each of `sizes` (smaller batch shapes the same function
    serves, each its own graph: a later call on any of these shapes is no recompile), on
    the calling thread: with CUDA graphs that must be the thread that launches later (graph
    trees are per thread), under the stream it will launch on. `inductor_overrides` (tests) change
    the inductor options the step is compiled with.

    `reset=False` compiles a second step beside one already compiled (the degraded step):
    dynamo's caches and counters are kept, since resetting them would throw away the first
    step's graphs, and the report counts what changed during this compile only. A refused
    second step is then never explained or replaced by eager (both reset dynamo): it raises.
    Inside `keep_compiled_steps`, every compile is such a second step.
    """
    batch = int(example.shape[0])
    if any(not 1 <= size < batch for size in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"sizes {list(sizes)} must be distinct and under the batch {batch}")
    if mode == "off":
        return _eager(step, example, warmup_iters, sizes)

    if reset and _KEEPING.depth:
        reset = False
    if reset:
        torch._dynamo.reset()
        _counters().clear()
    else:
        allow_eager_fallback = False
    before = snapshot() if not reset else CompileBaseline(0, 0, 0, 0, 0)
    options = {**step_inductor_options(mode), **(inductor_overrides or {})}
    report = CompileReport(mode=mode, compiled=True, inductor_options=options)
    # fullgraph=True turns any graph break into an exception right here, at start-up,
    # instead of a step that silently runs partly in eager mode. dynamic=False: the one
    # batch shape is compiled as constants, and another shape is a (detected) recompile.
    # The mode is given as its options (torch.compile takes one or the other), so that
    # graph partitioning can be turned off for this step alone, for every compile of it.
    compiled: StepFn = torch.compile(step, options=dict(options), fullgraph=True, dynamic=False)
    cudagraphs = options_use_cudagraphs(options) and example.is_cuda
    report.uses_cudagraphs = cudagraphs
    if cudagraphs:
        prepare_graph_thread()
    # The example's batch first, then each smaller size on the first rows of the example,
    # as launches give them (a view of the first rows of a slot's buffer).
    shapes = [example, *(example[:size] for size in sizes)]
    recompiles = 0
    with _capture_skips() as skips, count_cudagraph_replays() as replays:
        for x in shapes:
            reserved = _reserved(x)
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    if cudagraphs:
                        mark_cudagraph_step()
                    out = compiled(x)
                _sync(out[0])
            except Exception as exc:  # noqa: BLE001 - dynamo raises many kinds; all mean "not compiled"
                report.compiled = False
                explained = _explain_breaks(step, example) if reset else 0
                report.graph_breaks = max(1, _graph_break_count() - before.graph_breaks, explained)
                report.reason = f"{report.graph_breaks} graph break(s): {_first_line(exc)}"
                return _refuse_or_fall_back(
                    step, example, report, allow_eager_fallback, warmup_iters, sizes=sizes
                )
            first_s = time.perf_counter() - t0
            report.compile_s += first_s
            # Each shape's first call compiles it; its warm-up must compile nothing more.
            baseline = snapshot()
            t1 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(max(1, warmup_iters)):
                    if cudagraphs:
                        mark_cudagraph_step()
                    out = compiled(x)
            _sync(out[0])
            report.warmup_s += time.perf_counter() - t1
            recompiles += changes_since(baseline)["recompiles"]
            report.size_costs[int(x.shape[0])] = (first_s, _reserved(x) - reserved)
    report.graph_breaks = _graph_break_count() - before.graph_breaks
    report.recompiles = recompiles
    report.cudagraph_replays = replays.count
    report.graph_partitions = _count("inductor", "cudagraph_partitions") - before.graph_partitions
    if cudagraphs:
        n_skips = _count("inductor", "cudagraph_skips") - before.cudagraph_skips
        report.cudagraph_skips = list(dict.fromkeys(skips.reasons))
        if n_skips and not report.cudagraph_skips:
            report.cudagraph_skips = [f"{n_skips} cudagraph skip(s) reported by inductor"]
        if not report.cudagraph_skips and warmup_iters >= 2 and replays.count == 0:
            report.cudagraph_skips = ["no CUDA-graph replay during warm-up"]
    report.baseline = snapshot()

    problems = gate_problems(report)
    if problems:
        report.compiled = False
        report.reason = ", ".join(problems)
        return _refuse_or_fall_back(
            step, example, report, allow_eager_fallback, warmup_iters, sizes=sizes
        )
    return compiled, report


def _eager(
    step: nn.Module | StepFn, example: torch.Tensor, warmup_iters: int, sizes: Sequence[int]
) -> tuple[StepFn, CompileReport]:
    report = CompileReport(mode="off", compiled=False)
    for n, x in enumerate([example, *(example[:size] for size in sizes)]):
        reserved = _reserved(x)
        t0 = time.perf_counter()
        # Eager has nothing to record: the smaller shapes are run once here (time_sizes runs
        # each again), only the batch shape as often as asked.
        with torch.inference_mode():
            for _ in range(max(1, warmup_iters if n == 0 else 1)):
                out = step(x)
        _sync(out[0])
        report.warmup_s += time.perf_counter() - t0
        report.size_costs[int(x.shape[0])] = (0.0, _reserved(x) - reserved)
    return step, report


def _refuse_or_fall_back(
    step: nn.Module | StepFn,
    example: torch.Tensor,
    report: CompileReport,
    allow_eager_fallback: bool,
    warmup_iters: int,
    *,
    sizes: Sequence[int],
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
    eager, eager_report = _eager(step, example, warmup_iters, sizes)
    report.fell_back_to_eager = True
    report.warmup_s = eager_report.warmup_s
    report.size_costs = eager_report.size_costs
    return eager, report


def time_sizes(
    fn: StepFn, example: torch.Tensor, sizes: Sequence[int], *, cudagraphs: bool, iters: int = 3
) -> dict[int, float]:
    """Milliseconds per step of `fn` on the first `size` rows of `example`, for each size
    (the best of `iters`; start-up only: it waits for the device after each step)."""
    out: dict[int, float] = {}
    for size in sizes:
        x = example[:size]
        best = float("inf")
        with torch.inference_mode():
            for _ in range(max(1, iters)):
                t0 = time.perf_counter()
                if cudagraphs:
                    mark_cudagraph_step()
                result = fn(x)
                _sync(result[0])
                best = min(best, time.perf_counter() - t0)
        out[size] = best * 1000
    return out


def _reserved(x: torch.Tensor) -> int:
    return torch.cuda.memory_reserved(x.device) if x.is_cuda else 0


def _explain_breaks(step: nn.Module | StepFn, example: torch.Tensor) -> int:
    """How many graph breaks dynamo finds (for the message; 0 when explain is unusable)."""
    explain = getattr(torch._dynamo, "explain", None)
    if explain is None:
        return 0
    try:
        with torch.inference_mode():
            result = explain(step)(example)
        return int(getattr(result, "graph_break_count", 0))
    except Exception:  # noqa: BLE001 - only a count for the message; the refusal stands
        return 0
    finally:
        torch._dynamo.reset()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
