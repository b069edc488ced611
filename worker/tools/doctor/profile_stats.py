"""Trace statistics for `doctor`: pure functions over (start_us, duration_us) events.

A profile of one forward is reduced to the few figures that tell launch overhead from real
work: how many kernels (on the CPU: operators) ran, how much of the forward's wall time they
kept the device busy, the idle gaps between one ending and the next starting, and the share
of them that are tiny. Hundreds of kernels under 10 µs each, with the device idle between
them, is the signature of a step limited by launches rather than by arithmetic.

Nothing here imports the profiler: the doctor turns a torch.profiler trace into a list of
events, and tests build such lists by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.observe.gpu_sampler import percentile

# A kernel shorter than this does too little work to hide its own launch cost (each CUDA
# launch costs the host microseconds), so a step made mostly of them is launch-bound.
TINY_US = 10.0

Event = tuple[float, float]  # (start_us, duration_us)


@dataclass(frozen=True)
class GapStats:
    """Idle time between consecutive events: the next one started after every earlier one
    had ended. Overlapping events (concurrent streams) leave no gap."""

    count: int
    mean_us: float | None
    p50_us: float | None
    max_us: float | None
    total_us: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean_us": _round(self.mean_us),
            "p50_us": _round(self.p50_us),
            "max_us": _round(self.max_us),
            "total_us": round(self.total_us, 1),
        }


@dataclass(frozen=True)
class TraceStats:
    count: int
    busy_us: float  # the union of the events' intervals: time anything was running
    wall_us: float  # the forward's wall time (the events' span when not given)
    span_us: float  # first start to last end
    busy_ratio: float | None  # busy_us / wall_us
    gaps: GapStats
    tiny_share: float | None  # share of events shorter than tiny_threshold_us
    tiny_threshold_us: float
    median_us: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "busy_us": round(self.busy_us, 1),
            "wall_us": round(self.wall_us, 1),
            "span_us": round(self.span_us, 1),
            "busy_ratio": _round(self.busy_ratio, 3),
            "gaps": self.gaps.as_dict(),
            "tiny_share": _round(self.tiny_share, 3),
            "tiny_threshold_us": self.tiny_threshold_us,
            "median_us": _round(self.median_us),
        }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _ordered(events: Iterable[Event]) -> list[Event]:
    # Negative durations come from clock skew in traces; they count as instants.
    return sorted((float(s), max(0.0, float(d))) for s, d in events)


def busy_time_us(events: Iterable[Event]) -> float:
    """Length of the union of the events' intervals (overlaps counted once)."""
    total = 0.0
    cur_start: float | None = None
    cur_end = 0.0
    for start, dur in _ordered(events):
        end = start + dur
        if cur_start is None or start > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_start is not None:
        total += cur_end - cur_start
    return total


def gaps_us(events: Iterable[Event]) -> list[float]:
    """Idle gaps between consecutive events, in start order (only positive ones)."""
    gaps: list[float] = []
    latest_end: float | None = None
    for start, dur in _ordered(events):
        if latest_end is not None and start > latest_end:
            gaps.append(start - latest_end)
        end = start + dur
        latest_end = end if latest_end is None else max(latest_end, end)
    return gaps


def gap_stats(events: Iterable[Event]) -> GapStats:
    gaps = sorted(gaps_us(events))
    if not gaps:
        return GapStats(0, None, None, None, 0.0)
    return GapStats(
        count=len(gaps),
        mean_us=sum(gaps) / len(gaps),
        p50_us=percentile(gaps, 50),
        max_us=gaps[-1],
        total_us=sum(gaps),
    )


def tiny_share(events: Iterable[Event], threshold_us: float = TINY_US) -> float | None:
    """Share of events shorter than `threshold_us` (None when there are none)."""
    durations = [d for _, d in events]
    if not durations:
        return None
    return sum(1 for d in durations if d < threshold_us) / len(durations)


def trace_stats(
    events: Sequence[Event], *, wall_us: float | None = None, tiny_us: float = TINY_US
) -> TraceStats:
    """All figures at once. `wall_us` is the forward's own wall time, measured around it;
    without it the span of the events stands in (which hides the time before the first
    event and after the last)."""
    ordered = _ordered(events)
    if ordered:
        span = max(s + d for s, d in ordered) - ordered[0][0]
        durations = sorted(d for _, d in ordered)
        median: float | None = percentile(durations, 50)
    else:
        span, median = 0.0, None
    wall = span if wall_us is None else float(wall_us)
    busy = busy_time_us(ordered)
    return TraceStats(
        count=len(ordered),
        busy_us=busy,
        wall_us=wall,
        span_us=span,
        busy_ratio=min(1.0, busy / wall) if ordered and wall > 0 else None,
        gaps=gap_stats(ordered),
        tiny_share=tiny_share(ordered, tiny_us),
        tiny_threshold_us=tiny_us,
        median_us=median,
    )


def top_names(named: Iterable[tuple[str, float]], n: int = 5) -> list[dict[str, Any]]:
    """The `n` names with the most total time: [{name, count, total_us}], largest first."""
    by_name: dict[str, list[float]] = {}
    for name, dur in named:
        by_name.setdefault(name, []).append(max(0.0, float(dur)))
    totals = sorted(
        ((sum(d), name, len(d)) for name, d in by_name.items()), key=lambda t: (-t[0], t[1])
    )
    return [
        {"name": name, "count": count, "total_us": round(total, 1)}
        for total, name, count in totals[:n]
    ]
