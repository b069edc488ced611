"""The decode rate table: each image set's decode rates at the sizes the runs used,
measured alone after the runs, and the look-ups into it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from measure.bench.context import Bench
from measure.bench.stage_rates import Rate, decode_methods, decode_rates

# Decode rates: (image set, staging size, input size) -> method -> threads -> Rate.
RateTable = dict[tuple[str, int, int], dict[str, dict[str, Rate]]]


def stage_rates(b: Bench) -> RateTable:
    """Decode rates per image set and (staging, input) size the runs used, measured with
    nothing else running (after the runs, so the sizes are those the workers really used)."""
    out: RateTable = {}
    for run in b.runs:
        s = run["settings"]
        key = (run["image_set"], int(s["staging_size"]), int(s["input_size"]))
        if key in out:
            continue
        images = b.sets[key[0]].images[: b.profile.stage_images]
        methods = decode_methods(
            staging_size=key[1],
            crop_size=key[2],
            mean=_triple(s["mean"]),
            std=_triple(s["std"]),
            geometry=str(s.get("resize", "shorter-crop")),
        )
        b.echo(f"stage rates: {key[0]}, {key[2]} px input ({len(methods)} decode methods)")
        out[key] = decode_rates(
            images, methods, (1, b.decode_threads), min_time_s=b.profile.stage_min_s
        )
    return out


def _triple(values: Sequence[float]) -> tuple[float, float, float]:
    return (float(values[0]), float(values[1]), float(values[2]))


def decode_rate(
    rates: RateTable,
    run: Mapping[str, Any],
    method: str,
    threads: int,
) -> float:
    s = run["settings"]
    table = rates[(run["image_set"], int(s["staging_size"]), int(s["input_size"]))]
    return table[method][str(threads)].images_per_s


def decode_method(run: Mapping[str, Any]) -> str:
    s = run["settings"]
    if s.get("cpu_preprocess"):
        return "cpu_preprocess"
    if s.get("resize_placement") == "device":
        return "decode_rows"
    return "decode_into_dct" if s.get("dct_scaling") else "decode_into_full"
