"""Decode-only rates of the CPU decode processes on the host the check runs on: one, eight
and as many as it has cores, for thumbnails, photos and large JPEGs. Splitting each batch
between the GPU's JPEG engines and the CPU needs the CPU's side measured where it runs;
each rate is worker/tools/harness/process_scaling.py's (every image decoded into a shared
ring, rows for the device placement, nothing else running)."""

from __future__ import annotations

from typing import Any

from worker.decode.samples import synthetic_jpeg
from worker.tools.harness.process_scaling import process_scaling

# (width, height, distinct images): a large JPEG takes a while to make, and its decode
# dominates whatever repeats.
SIZES: tuple[tuple[int, int, int], ...] = ((64, 64, 32), (640, 480, 16), (4000, 3000, 4))


def process_counts(cores: int) -> list[int]:
    """1, 8 and every core (fewer where the host has fewer)."""
    return sorted({1, min(8, cores), max(1, cores)})


def decode_process_rates(
    staging_size: int,
    cores: int,
    *,
    seconds: float,
    sizes: tuple[tuple[int, int, int], ...] = SIZES,
) -> dict[str, Any]:
    """images/s per number of decode processes, per image size; call from a thread without
    a running event loop."""
    counts = process_counts(cores)
    out: dict[str, Any] = {"staging_size": staging_size, "cores": cores, "processes": counts}
    rows = []
    for width, height, distinct in sizes:
        images = [synthetic_jpeg(width, height, seed=i, quality=85) for i in range(distinct)]
        rates = process_scaling(
            images,
            staging_size=staging_size,
            device_rows=True,
            counts=counts,
            min_time_s=seconds,
        )
        by_count = {r["processes"]: r["images_per_s"] for r in rates}
        one = by_count[1]
        rows.append(
            {
                "image": f"{width}x{height}",
                "mean_bytes": int(sum(map(len, images)) / len(images)),
                "images_per_s": {str(k): v for k, v in by_count.items()},
                "scaling": {
                    str(k): round(v / one, 2) if one else None for k, v in by_count.items()
                },
            }
        )
    out["sizes"] = rows
    return out
