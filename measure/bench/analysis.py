"""The analysis: each run's ideal figure and efficiency, the summary per image set, the
targets, and the measured stage that limited a missed one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from measure.bench.ablations import CACHE_VARIANTS, DEFAULTS
from measure.bench.context import Bench
from measure.bench.profiles import SetPlan
from measure.bench.rate_table import RateTable, decode_method, decode_rate
from measure.bench.stage_rates import ideal_pipeline, ideal_sequential

EFFICIENCY_TARGET = 0.85
RATIO_TARGET = 0.85  # of the ideal ratio
CEILING_TARGET = 0.9  # GPU host: gpufeed / direct-feed ceiling
GPU_UTIL_TARGET = 90.0


def analyse(b: Bench, rates: RateTable) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per-run ideals and efficiencies, the summary per image set, and the targets."""
    shared_cpu = not b.is_cuda
    n = b.decode_threads
    ceilings = {
        r["model"]: r["ceiling"] for r in b.runs if r["name"] == DEFAULTS.name and "ceiling" in r
    }
    b1 = {r["model"]: r["model_batch_1"] for r in b.runs if "model_batch_1" in r}
    for model, c in ceilings.items():
        b.model_rates.append({"model": model, "kind": "ceiling", "variant": DEFAULTS.name, **c})
    for r in b.runs:
        if r["name"] != DEFAULTS.name and "ceiling" in r:
            b.model_rates.append(
                {"model": r["model"], "kind": "ceiling", "variant": r["name"], **r["ceiling"]}
            )
    for model, c in b1.items():
        b.model_rates.append({"model": model, "kind": "naive_batch_1", "variant": "naive", **c})

    by_key: dict[tuple[str, str, str], dict[str, Any]] = {
        (r["model"], r["image_set"], r["name"]): r for r in b.runs
    }
    cache_worth = _cache_worth(b.runs)
    for r in b.runs:
        if r.get("variant") in CACHE_VARIANTS:
            # Repeated images: not comparable with the stage-rate ideal (which decodes every
            # image), the naive worker or the ablations; only with each other.
            continue
        ceiling = (r.get("ceiling") or ceilings[r["model"]])["images_per_s"]
        if r["kind"] == "naive":
            cpu = decode_rate(rates, r, "naive_cpu", 1)
            ideal = ideal_sequential(
                cpu_per_image=cpu, model_batch_1=b1[r["model"]]["images_per_s"]
            )
            r["ideal_images_per_s"] = round(ideal, 2)
            r["ideal_limited_by"] = "one job at a time: decode + transforms + model"
        else:
            method = decode_method(r)
            threads = int(r["settings"]["decode_threads"])
            queue = b.queue_ceilings.get((r["image_set"], int(r["settings"]["batch_size"])))
            bound = ideal_pipeline(
                decode_run=decode_rate(rates, r, method, threads),
                decode_all_cores=decode_rate(rates, r, method, n),
                model=ceiling,
                shared_cpu=shared_cpu,
                queue=None if queue is None else float(queue["jobs_per_s"]),
            )
            r["ideal_images_per_s"] = round(bound.images_per_s, 2)
            r["ideal_limited_by"] = bound.limited_by
            r["ideal_bounds"] = bound.bounds
            r["decode_method"] = method
        alone = r.get("ceiling") or ceilings[r["model"]]
        if r["kind"] == "naive":
            alone = b1[r["model"]]
        r["model_core_ms_per_image_alone"] = alone.get("core_ms_per_image")
        r["efficiency"] = round(r["images_per_s"] / r["ideal_images_per_s"], 3)
        r["vs_ceiling"] = round(r["images_per_s"] / ceiling, 3)
        default = by_key.get((r["model"], r["image_set"], DEFAULTS.name))
        if r["kind"] == "gpufeed" and r["name"] != DEFAULTS.name and default is not None:
            # What the switched-off optimisation is worth: defaults / this run.
            r["optimisation_gain"] = round(default["images_per_s"] / r["images_per_s"], 3)
        naive = by_key.get((r["model"], r["image_set"], "naive"))
        r["vs_naive"] = round(r["images_per_s"] / naive["images_per_s"], 3) if naive else None

    summary: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    primary = b.profile.models[0].model
    for sp in b.profile.sets:
        per_model: dict[str, Any] = {}
        for plan in b.profile.models:
            model = plan.model
            g = by_key[(model, sp.spec.name, DEFAULTS.name)]
            nv = by_key[(model, sp.spec.name, "naive")]
            ideal_ratio = g["ideal_images_per_s"] / nv["ideal_images_per_s"]
            entry = {
                "model": model,
                "gpufeed_images_per_s": g["images_per_s"],
                "naive_images_per_s": nv["images_per_s"],
                "ceiling_images_per_s": ceilings[model]["images_per_s"],
                "ideal_images_per_s": g["ideal_images_per_s"],
                "ideal_naive_images_per_s": nv["ideal_images_per_s"],
                "ideal_limited_by": g["ideal_limited_by"],
                "vs_naive": g["vs_naive"],
                "vs_ceiling": g["vs_ceiling"],
                "pipeline_efficiency": g["efficiency"],
                "naive_efficiency": nv["efficiency"],
                "ideal_ratio": round(ideal_ratio, 3),
                "vs_naive_of_ideal_ratio": round(g["vs_naive"] / ideal_ratio, 3),
            }
            entry.update(cache_worth.get((model, sp.spec.name), {}))
            per_model[model] = entry
            targets.extend(_targets(b, sp, entry=entry, g=g, nv=nv, rates=rates))
        main = per_model.get(primary) or next(iter(per_model.values()))
        summary[sp.spec.name] = {**main, "by_model": per_model}
    return summary, targets


def _cache_worth(runs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (model, image set) with the cache pair: what the decode cache is worth on
    repeated images (on / off), with the measured hit ratios; also set on the "on" run."""
    pair: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in runs:
        if r.get("variant") in CACHE_VARIANTS:
            pair.setdefault((r["model"], r["image_set"]), {})[r["variant"]] = r
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, found in pair.items():
        on, off = found.get("cache_on_repeats"), found.get("cache_off_repeats")
        if on is None or off is None or not off["images_per_s"]:
            continue
        worth = round(on["images_per_s"] / off["images_per_s"], 3)
        on["cache_worth"] = worth
        out[key] = {
            "cache_worth": worth,
            "cache_hit_ratio": on.get("cache_hit_ratio"),
            "cache_off_hit_ratio": off.get("cache_hit_ratio"),
            "cache_on_images_per_s": on["images_per_s"],
            "cache_off_images_per_s": off["images_per_s"],
            "cache_repeats": on.get("repeats"),
        }
    return out


def _target(
    name: str, *, sp: SetPlan, model: str, measured: float | None, threshold: float, named: bool
) -> dict[str, Any]:
    met = measured is not None and measured >= threshold
    return {
        "target": name,
        "image_set": sp.spec.name,
        "model": model,
        "measured": measured,
        "threshold": round(threshold, 3),
        "met": met,
        "named_in_issue": named,
        "limiting_stage": None,
        "detail": None,
    }


def _targets(
    b: Bench,
    sp: SetPlan,
    *,
    entry: Mapping[str, Any],
    g: Mapping[str, Any],
    nv: Mapping[str, Any],
    rates: RateTable,
) -> list[dict[str, Any]]:
    model = str(entry["model"])
    named_cpu = not b.is_cuda and model == "resnet18" and sp.role == "large"
    named_gpu = b.is_cuda and model == "resnet50" and sp.role == "photo"
    checks: list[tuple[str, float | None, float, bool]] = [
        ("pipeline efficiency", entry["pipeline_efficiency"], EFFICIENCY_TARGET, named_cpu),
        (
            "gpufeed/naive vs 0.85 x ideal ratio",
            entry["vs_naive"],
            RATIO_TARGET * entry["ideal_ratio"],
            named_cpu,
        ),
    ]
    if b.is_cuda:
        checks.append(("gpufeed/ceiling", entry["vs_ceiling"], CEILING_TARGET, named_gpu))
        checks.append(("GPU utilisation %", g.get("gpu_util_pct"), GPU_UTIL_TARGET, named_gpu))
    out = []
    for name, measured, threshold, named in checks:
        t = _target(name, sp=sp, model=model, measured=measured, threshold=threshold, named=named)
        if not t["met"]:
            t["limiting_stage"], t["detail"] = explain(b, name, g, nv, rates)
        out.append(t)
    return out


def explain(
    b: Bench,
    target: str,
    g: Mapping[str, Any],
    nv: Mapping[str, Any],
    rates: RateTable,
) -> tuple[str, str]:
    """The measured reason a target was missed: which stage costs what, against isolation."""
    eff_g, eff_n = g["efficiency"], nv["efficiency"]
    if target.startswith("gpufeed/naive") and eff_g >= EFFICIENCY_TARGET:
        return (
            "naive worker above its isolated-stage bound" if eff_n > 1 else "gpufeed pipeline",
            f"gpufeed ran at {eff_g:.2f} of its ideal and the naive worker at {eff_n:.2f} of "
            f"its own; the measured ratio is the ideal ratio x {eff_g:.2f}/{eff_n:.2f}",
        )
    if target == "gpufeed/ceiling" and g["ideal_limited_by"] != "model":
        bounds = g.get("ideal_bounds", {})
        return (
            g["ideal_limited_by"],
            f"the isolated stages allow {g['ideal_images_per_s']} images/s (bounds {bounds}); "
            "the direct-feed ceiling is out of reach whatever the pipeline does",
        )
    method = g.get("decode_method", "decode_into_dct")
    decode_iso = 1000.0 / decode_rate(rates, g, method, 1)
    model_iso = float(g.get("model_core_ms_per_image_alone") or 0.0)
    cost = g.get("cpu_core_ms_per_image", {})
    wall_core_ms = b.cores * 1000.0 / max(g["images_per_s"], 1e-9)
    losses = {
        "decode": float(cost.get("decode", 0.0)) - decode_iso,
        "model compute": float(cost.get("model", 0.0)) - model_iso,
        "event loop (Redis I/O, batching, results)": float(cost.get("event_loop", 0.0)),
        "redis-server": float(cost.get("redis_server", 0.0)),
        "other processes on the host": float(cost.get("other_processes", 0.0)),
        "idle cores (pipeline bubbles)": max(
            0.0,
            wall_core_ms - float(cost.get("total", 0.0)) - float(cost.get("other_processes", 0.0)),
        ),
        "other threads": float(cost.get("other", 0.0)),
    }
    if b.is_cuda:
        # The model has its own device: the question is which stage kept it waiting. Each
        # stage's busy fraction: decode threads, the event loop's one thread, the GPU.
        rate = float(g["images_per_s"])
        threads = max(1, int(g["settings"]["decode_threads"]))
        busy = {
            "decode": float(cost.get("decode", 0.0)) * rate / (1000.0 * threads),
            "event loop (Redis I/O, batching, results)": float(cost.get("event_loop", 0.0))
            * rate
            / 1000.0,
            "model (GPU)": float(g.get("gpu_util_pct") or 0.0) / 100.0,
        }
        stage = max(busy, key=lambda k: busy[k])
        return stage, (
            f"efficiency {eff_g:.2f} (ideal {g['ideal_images_per_s']} images/s, bound by "
            f"{g['ideal_limited_by']}); busy fractions: "
            + ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
            + f"; the most saturated stage is {stage}"
        )
    stage = max(losses, key=lambda k: losses[k])
    detail = (
        f"efficiency {eff_g:.2f} (ideal {g['ideal_images_per_s']} images/s, bound by "
        f"{g['ideal_limited_by']}); per image on {b.cores} cores: decode "
        f"{cost.get('decode', 0):.1f} core-ms in the pipeline vs {decode_iso:.1f} alone, "
        f"model {cost.get('model', 0):.1f} vs {model_iso:.1f} alone, event loop "
        f"{cost.get('event_loop', 0):.1f}, redis-server {cost.get('redis_server', 0):.1f}, "
        f"other processes {cost.get('other_processes', 0):.1f}, idle "
        f"{losses['idle cores (pipeline bubbles)']:.1f}, of {wall_core_ms:.1f} core-ms; "
        f"largest loss: {stage}"
    )
    return stage, detail
