"""`python -m worker top`: a live terminal dashboard of all workers of one group.

Everything comes from Redis, read as `producer stats` reads it (XLEN, XINFO GROUPS, SCAN of
the `gpufeed:worker:*` heartbeat hashes, never KEYS), so it can watch a production
deployment from any host that reaches Redis, without touching the workers.

Per worker (from its heartbeat, refreshed every 2 s): jobs/s, p50/p99 latency, the mean time
per stage, GPU and CPU utilisation, batch fill, errors. Above them: the stream's length, the
group's lag (`unknown` where Redis cannot tell, never a made-up 0) and pending count, the
consumers, and the group's total jobs/s; with GPUFEED_PRIORITIES, each level's length, lag
and pending count instead of the one stream's. Below them, the legend (worker/observe/metrics.py's
stage meanings, which /metrics' HELP gives too; `l` toggles it), and what a narrow terminal
left out: the table fits the terminal by shorter headers, then by leaving out columns in
DROP_ORDER, rather than by cutting every cell.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from producer import shards
from producer.reach import UNREACHABLE, unreachable
from producer.stats import collect_stats
from worker.config.settings import WorkerConfig
from worker.observe.metrics import STAGE_INFO, STAGES

EXIT_REDIS = 3


def _float(value: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def worker_row(fields: Mapping[str, Any]) -> dict[str, Any]:
    """One worker's figures from its heartbeat hash: the msgpack snapshot where there is
    one, else the plain fields (strings)."""
    snap = fields.get("snapshot")
    data: Mapping[str, Any] = snap if isinstance(snap, Mapping) else fields
    stage_ms = data.get("stage_ms") if isinstance(data.get("stage_ms"), Mapping) else {}
    assert isinstance(stage_ms, Mapping)
    return {
        "name": str(data.get("name", "?")),
        "device": str(data.get("device", "?")),
        "stream": data.get("stream"),
        "group": data.get("group"),
        "jobs_per_s": _float(data.get("jobs_per_s")) or 0.0,
        "results_ok": int(_float(data.get("results_ok")) or 0),
        "results_error": int(_float(data.get("results_error")) or 0),
        "p50_ms": _float(data.get("p50_ms")),
        "p99_ms": _float(data.get("p99_ms")),
        "stage_ms": {s: _float(stage_ms.get(s)) for s in STAGES},
        "gpu_util_pct": _float(data.get("gpu_util_pct")),
        "cpu_pct": _float(data.get("process_cpu_pct")),
        "batch_fill": _float(data.get("batch_fill")),
        "in_flight": int(_float(data.get("in_flight")) or 0),
        "errors_by_code": dict(data.get("errors_by_code") or {}),
    }


def connect(config: WorkerConfig) -> redis.Redis:
    """A client for REDIS_URL; on a Redis Cluster the cluster client (same commands)."""
    timeouts: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 5}
    if shards.is_cluster(config.redis_url, config.redis_cluster):
        return cast(redis.Redis, redis.RedisCluster.from_url(config.redis_url, **timeouts))
    return redis.Redis.from_url(config.redis_url, **timeouts)


def collect(client: redis.Redis, config: WorkerConfig) -> dict[str, Any]:
    """The dashboard's data: the group's backlog and the workers of this stream and group;
    with shards, the backlog of all of them."""
    per_shard = [
        collect_stats(
            client,
            shard.stream,
            config.group,
            shard.results_stream,
            dead_stream=shard.dead_stream,
            priorities=config.priorities,
        )
        for shard in config.shard_layout()
    ]
    stats = per_shard[0] if len(per_shard) == 1 else _summed(per_shard)
    rows = []
    for w in stats["workers"]:
        row = worker_row(w["fields"])
        # A heartbeat names its stream and group; workers of other groups are not ours.
        if row["stream"] not in (None, config.stream) or row["group"] not in (None, config.group):
            continue
        rows.append(row)
    rows.sort(key=lambda r: r["name"])
    group = stats["group"]
    return {
        "stream": stats["stream"],
        "group": group,
        "levels": stats["levels"],
        "dead_length": stats["dead_stream"]["length"],
        "workers": rows,
        "jobs_per_s": sum(r["jobs_per_s"] for r in rows),
    }


def _ms(value: float | None) -> str:
    # Compact: one decimal only where it says something (a 3-second p99 needs none).
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _pct(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.0f}%"


def shown_stages(workers: list[Mapping[str, Any]]) -> tuple[str, ...]:
    """STAGES, less `fetch` where no worker fetched anything (no `url` jobs)."""
    fetched = any(w["stage_ms"].get("fetch") is not None for w in workers)
    return tuple(s for s in STAGES if fetched or s != "fetch")


def _length(stream: Mapping[str, Any]) -> str:
    if not stream["exists"]:
        return "no such stream"
    if stream["length"] is None:
        return str(stream.get("error", "not a stream"))
    return f"{stream['length']:,}"


def _backlog(group: Mapping[str, Any]) -> str:
    lag = "unknown" if group["lag"] is None else f"{group['lag']:,}"
    return f"lag {lag}, pending {group['pending']:,}"


def header(view: Mapping[str, Any], config: WorkerConfig, width: int | None = None) -> Text:
    """The backlog line; on a terminal narrower than it, its parts packed into lines that
    break between parts, never inside one."""
    stream, group = view["stream"], view["group"]
    parts: list[str] = []
    if view.get("levels"):
        # One part per priority level, highest first: which backlog is growing.
        for lv in view["levels"]:
            g = lv["group"]
            backlog = _backlog(g) if g is not None else "no group yet"
            parts.append(f"{lv['level']}: length {_length(lv['stream'])}, {backlog}")
        parts.append(f"group {config.group}")
    else:
        parts.append(f"stream {config.stream}: length {_length(stream)}")
        if group is None:
            parts.append(f"group {config.group}: none yet")
        else:
            parts.append(f"group {group['name']}: {_backlog(group)}")
            parts.append(f"consumers {group['consumers']}")
    parts.append(f"workers {len(view['workers'])}")
    parts.append(f"{view['jobs_per_s']:,.1f} jobs/s")
    if view.get("dead_length"):
        parts.append(f"dead letters {view['dead_length']:,}")
    lines = [parts[0]]
    for part in parts[1:]:
        if width is not None and len(lines[-1]) + 3 + len(part) > width:
            lines.append(part)
        else:
            lines[-1] += f" | {part}"
    return Text("\n".join(lines), style="bold")


# The legend: a line per column that needs one, from the one source /metrics' HELP uses.
OTHER_COLUMNS = (
    ("p50/p99", "ms from XADD to the published result (recent results)"),
    ("fill", "real rows per batch over GPUFEED_BATCH_SIZE"),
    ("GPU/CPU", "device busy; the process's CPU, 100% = one core"),
)


def legend_lines(stages: tuple[str, ...] = STAGES) -> list[str]:
    """What each column says: a line per stage (mean ms per job) with what moves it."""
    lines = ["stages: mean ms per job | what moves it"]
    renamed: list[str] = []
    for st in STAGE_INFO:
        if st.name in stages:
            lines.append(f"  {st.shown:<10} {st.measures} | {st.moved_by}")
            if st.shown != st.name:
                renamed.append(f"{st.shown} is {st.name}")
    lines.extend(f"  {name:<10} {meaning}" for name, meaning in OTHER_COLUMNS)
    if renamed:
        lines.append(f"  ({', '.join(renamed)} in /metrics and results)")
    return lines


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    short: str  # the header where the full ones do not fit
    justify: Literal["left", "right"] = "right"


def columns(stages: tuple[str, ...]) -> list[Column]:
    # Stage columns keep the names the legend explains.
    shown = {st.name: st.shown for st in STAGE_INFO}
    return [
        Column("worker", "worker", "worker", "left"),
        Column("device", "device", "dev", "left"),
        Column("jobs_per_s", "jobs/s", "j/s"),
        Column("ok", "ok", "ok"),
        Column("errors", "errors", "err"),
        Column("p50", "p50 ms", "p50"),
        Column("p99", "p99 ms", "p99"),
        *(Column(s, shown[s], shown[s]) for s in stages),
        Column("gpu", "GPU", "GPU"),
        Column("cpu", "CPU", "CPU"),
        Column("fill", "fill", "fill"),
        Column("in_flight", "in flight", "infl"),
    ]


# Where the table is wider than the terminal: short headers first, then these columns
# left out one by one, least telling first (the footer names what is left out).
# The figures that say where time goes (decode, model_wait, compute) and the rate stay; a
# worker's name is never cut: it folds onto a second line at the very last.
DROP_ORDER = (
    "in_flight", "ok", "device", "p50", "fill", "cpu", "write", "queue", "fetch", "errors",
    "redis_wait",
)  # fmt: skip


def _cells(r: Mapping[str, Any], stages: tuple[str, ...]) -> dict[str, str]:
    return {
        "worker": r["name"],
        "device": r["device"],
        "jobs_per_s": f"{r['jobs_per_s']:,.1f}",
        "ok": f"{r['results_ok']:,}",
        "errors": f"{r['results_error']:,}",
        "p50": _ms(r["p50_ms"]),
        "p99": _ms(r["p99_ms"]),
        **{s: _ms(r["stage_ms"].get(s)) for s in stages},
        "gpu": _pct(r["gpu_util_pct"]),
        "cpu": _pct(r["cpu_pct"]),
        "fill": _pct(r["batch_fill"], 100),
        "in_flight": str(r["in_flight"]),
    }


def _build(rows: list[dict[str, str]], cols: list[Column], *, short: bool, empty: bool) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for c in cols:
        if c.key == "worker":
            t.add_column(c.header, no_wrap=False, overflow="fold")
        else:
            t.add_column(c.short if short else c.header, justify=c.justify, no_wrap=True)
    for row in rows:
        t.add_row(*(row[c.key] for c in cols))
    if empty:
        t.add_row("no live worker on this stream and group", *[""] * (len(cols) - 1))
    return t


def table(view: Mapping[str, Any], width: int | None = None) -> tuple[Table, list[Column]]:
    """The workers' table at `width` columns (None: as wide as it needs), and the columns
    left out to fit."""
    stages = shown_stages(view["workers"])
    cols = columns(stages)
    rows = [_cells(r, stages) for r in view["workers"]]
    empty = not view["workers"]
    t = _build(rows, cols, short=False, empty=empty)
    if width is None or _width(t) <= width:
        return t, []
    dropped: list[Column] = []
    t = _build(rows, cols, short=True, empty=empty)
    for key in DROP_ORDER:
        if _width(t) <= width:
            break
        gone = next((c for c in cols if c.key == key), None)
        if gone is None:
            continue
        cols.remove(gone)
        dropped.append(gone)
        t = _build(rows, cols, short=True, empty=empty)
    return t, dropped


def _width(t: Table) -> int:
    console = Console(width=10_000)
    return Measurement.get(console, console.options, t).maximum


def footer(
    view: Mapping[str, Any],
    *,
    interval_s: float | None = None,
    legend: bool = True,
    dropped: list[Column] | None = None,
) -> Text:
    """The legend (or how to show it), errors by code, the columns left out to fit, and how
    to leave: `interval_s` None for a single frame."""
    codes: dict[str, int] = {}
    for r in view["workers"]:
        for code, n in r["errors_by_code"].items():
            codes[code] = codes.get(code, 0) + int(n)
    gone = [c.key for c in dropped or ()]
    stages = tuple(s for s in shown_stages(view["workers"]) if s not in gone)
    lines = legend_lines(stages) if legend else []
    if dropped:
        names = ", ".join(c.header for c in dropped)
        lines.append(f"left out to fit the terminal: {names} (a wider one shows them)")
    if codes:
        ranked = sorted(codes.items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append("errors by code: " + ", ".join(f"{c} {n:,}" for c, n in ranked))
    if interval_s is None:
        how = "one frame; without --once it refreshes until q or Ctrl+C quits"
    else:
        shown = "hides" if legend else "shows"
        how = f"refreshes every {interval_s:g} s; l {shown} the legend; q or Ctrl+C quits"
    lines.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  ({how})")
    return Text("\n".join(lines), style="dim")


def _summed(per_shard: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' figures added up: lengths, pending and lag (unknown if one is)."""
    first = per_shard[0]

    def total(values: list[Any]) -> Any:
        return None if any(v is None for v in values) else sum(values)

    groups = [s["group"] for s in per_shard]
    group = None
    if all(g is not None for g in groups):
        group = {
            **groups[0],
            "pending": total([g["pending"] for g in groups]),
            "lag": total([g["lag"] for g in groups]),
        }
    return {
        **first,
        "stream": {
            **first["stream"],
            "name": ", ".join(s["stream"]["name"] for s in per_shard),
            "length": total([s["stream"]["length"] for s in per_shard]),
        },
        "group": group,
        "dead_stream": {
            **first["dead_stream"],
            "length": total([s["dead_stream"]["length"] for s in per_shard]),
        },
    }


def frame(
    client: redis.Redis,
    config: WorkerConfig,
    *,
    interval_s: float | None = None,
    width: int | None = None,
    legend: bool = True,
) -> RenderableType:
    view = collect(client, config)
    workers, dropped = table(view, width)
    return Group(
        header(view, config, width),
        workers,
        footer(view, interval_s=interval_s, legend=legend, dropped=dropped),
    )


def _error_frame(config: WorkerConfig, exc: Exception) -> RenderableType:
    return Text(f"{unreachable(config.redacted_url(), exc)}; retrying", style="red")


def run_top(config: WorkerConfig, *, interval_s: float = 2.0, once: bool = False) -> int:
    """Draw the dashboard until q or Ctrl+C (or one frame with `once`); returns the exit code."""
    try:
        client = connect(config)
    except UNREACHABLE as exc:
        if once:
            print(f"gpufeed: {unreachable(config.redacted_url(), exc)}", file=sys.stderr)
            return EXIT_REDIS
        # Not there yet: the frames say so and retry (as a single Redis: GPUFEED_REDIS_CLUSTER
        # =on for a cluster that is still starting).
        client = redis.Redis.from_url(config.redis_url, socket_connect_timeout=5, socket_timeout=5)
    # A frame for a file or a README is not cut to any width: its table is as wide as it
    # needs, its lines as long; a terminal's fits the terminal.
    tty = sys.stdout.isatty()
    console = Console(width=None if tty else 1000, highlight=False)
    try:
        if once:
            try:
                console.print(frame(client, config, width=console.width if tty else None))
            except UNREACHABLE as exc:
                print(f"gpufeed: {unreachable(config.redacted_url(), exc)}", file=sys.stderr)
                return EXIT_REDIS
            return 0
        legend = True
        with Keys() as keys, Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                try:
                    shown = frame(
                        client, config, interval_s=interval_s, width=console.width, legend=legend
                    )
                    live.update(shown, refresh=True)
                except UNREACHABLE as exc:
                    live.update(_error_frame(config, exc), refresh=True)
                key = keys.wait(interval_s)
                if key in ("q", "Q"):
                    return 0
                if key in ("l", "L", "?"):
                    legend = not legend
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


class Keys:
    """Single key presses on a terminal (cbreak mode, restored on the way out); elsewhere
    a plain wait."""

    def __init__(self) -> None:
        self._saved: list[Any] | None = None
        self._fd = -1

    def __enter__(self) -> Keys:
        if sys.stdin.isatty():
            import termios
            import tty

            self._fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def wait(self, timeout_s: float) -> str | None:
        """The key pressed within `timeout_s` (returning at once), or None."""
        if self._saved is None:
            time.sleep(timeout_s)
            return None
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        return os.read(self._fd, 1).decode(errors="replace") if ready else None
