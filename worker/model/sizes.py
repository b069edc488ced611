"""The batch shapes the step is compiled for, and which of them a sealed batch runs on.

A batch sealed with few jobs (a lone job at low load) would otherwise run the full batch
shape, padded: on a heavy model that is the whole batch's step time for one image. The step
is therefore compiled for a few shapes (1, B/8, B/2 and B by default) and each batch runs on
the smallest one that holds its rows. Every shape is compiled and checked at start-up as the
one shape was (no graph break, no recompile later, one replay per batch); a shape that would
not be faster than the next larger one (its step time, measured at start-up, is at least
KEEP_BELOW of that one's) is dropped, so only sizes that shorten a batch are kept.

No torch here: settings validation imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# At most this many shapes: each is one entry in dynamo's cache for the step's code, whose
# default limit is 8 (past it dynamo stops compiling and runs eager), and the degraded step
# shares that code object.
MAX_SIZES = 6
# A smaller shape is kept only when its measured step time is under this share of the next
# larger kept shape's: a batch that runs barely faster does not pay for the compile.
KEEP_BELOW = 0.85


def parse_batch_sizes(raw: str) -> tuple[int, ...] | None:
    """The tuning constant BATCH_SIZES: `auto` (None: chosen at start-up), `off` (() : the
    batch size alone), or whole numbers separated by commas. ValueError says what is wrong."""
    text = raw.strip().lower()
    if text in ("", "auto"):
        return None
    if text == "off":
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and len(p) <= 5 for p in parts):
        raise ValueError(f"expected auto, off, or whole numbers separated by commas, got {raw!r}")
    sizes = tuple(sorted({int(p) for p in parts}))
    if sizes[0] < 1:
        raise ValueError("each size must be 1 or more")
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"{len(sizes)} sizes: at most {MAX_SIZES}")
    return sizes


def candidate_sizes(batch: int) -> tuple[int, ...]:
    """The shapes `auto` compiles for batch size `batch`: 1, B/8, B/2 and B."""
    return tuple(sorted({1, max(1, batch // 8), max(1, batch // 2), batch}))


def planned_sizes(setting: tuple[int, ...] | None, batch: int) -> tuple[tuple[int, ...], str]:
    """(the shapes to compile, ascending, always ending with `batch`; why). Raises
    ValueError for a listed size over the batch size."""
    if setting is None:
        return candidate_sizes(batch), f"auto: 1, B/8, B/2 and B for B = {batch}"
    if not setting:
        return (batch,), "GPUFEED_TUNING batch_sizes=off: the batch size alone"
    over = [s for s in setting if s > batch]
    if over:
        raise ValueError(
            f"{', '.join(map(str, over))} over the batch size {batch} (GPUFEED_BATCH_SIZE)"
        )
    sizes = tuple(sorted({*setting, batch}))
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"{len(sizes)} sizes with the batch size {batch}: at most {MAX_SIZES}")
    return sizes, "GPUFEED_TUNING batch_sizes, with the batch size"


def keep_faster(step_ms: dict[int, float]) -> tuple[int, ...]:
    """The sizes worth running, ascending: the largest always, then each smaller one whose
    step time is under KEEP_BELOW of the next larger size kept."""
    kept = [max(step_ms)]
    for size in sorted(step_ms, reverse=True)[1:]:
        if step_ms[size] < KEEP_BELOW * step_ms[kept[-1]]:
            kept.append(size)
    return tuple(sorted(kept))


@dataclass(frozen=True)
class SizeReport:
    """One compiled shape as start-up measured it."""

    size: int
    compile_s: float  # the first call (the compile); 0 in eager
    step_ms: float  # one step, measured after warm-up
    graph_bytes: int  # device memory the shape's compile and warm-up reserved (0 off CUDA)
    kept: bool  # False: measured no faster than the next larger size, never run

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "size": self.size,
            "compile_s": round(self.compile_s, 3),
            "step_ms": round(self.step_ms, 3),
            "graph_mib": round(self.graph_bytes / 2**20, 1),
            "kept": self.kept,
        }


class BatchSizes:
    """Which shape a batch runs on: the smallest kept size that holds its rows."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be distinct, ascending and at least 1: {sizes}")
        self.sizes = sizes
        self.batch = sizes[-1]
        # rows needed -> size, looked up once per batch.
        self._by_rows = [next(s for s in sizes if s >= n) for n in range(self.batch + 1)]

    def pick(self, rows: int) -> int:
        """The size for a batch whose data takes its first `rows` rows (at most B)."""
        return self._by_rows[min(max(rows, 0), self.batch)]

    def __repr__(self) -> str:
        return f"BatchSizes({', '.join(map(str, self.sizes))})"


def batch_shapes_line(shapes: list[Mapping[str, Any]]) -> str:
    """Each compiled batch shape: its step time and compile, and whether it runs."""
    parts = []
    for shape in shapes:
        compiled = f", compiled in {shape['compile_s']:.1f} s" if shape["compile_s"] else ""
        graph = f", {shape['graph_mib']:.0f} MiB" if shape["graph_mib"] else ""
        dropped = "" if shape["kept"] else " (dropped: no faster than the next larger)"
        parts.append(f"{shape['size']}: {shape['step_ms']:.1f} ms{compiled}{graph}{dropped}")
    return "; ".join(parts) or "none"
