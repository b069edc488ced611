"""The warm-start section: a restarted worker's first window of jobs, started cold and warm.

One model (the profile's last, its lighter one), a folder of distinct 640x480 JPEGs asked
for as `path` jobs whose popularity follows Zipf's law (the k-th image about 1/k as often as
the first, a seeded draw), and three workers in turn on one stream, as a fleet whose worker
restarts:

- `learn`: a worker serves `jobs` jobs and leaves its cache hits on the fleet's hot list
  when it stops (worker/delivery/hot_list.py);
- `cold`: a new worker with warm_start_s=0 (GPUFEED_TUNING) serves the next `jobs` jobs (another
  draw of the same popularity);
- `warm`: a new worker that decoded the hot list before it joined the group serves the same
  `jobs` jobs as `cold`.

Reported per run: its hit rate (results answered `cached` / ok results) over its window,
the window's seconds and jobs/s, and for `warm` what the warm start did. The window is the
first `jobs` jobs a restarted worker serves: on this host's pace about `window_s`; the
profile sizes it to be the first minute or what the profile can afford. Every repeat in the
window is a real repeat of the same bytes: the decode cache serves them (that is what is
measured), and no trailer makes jobs unique here.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from measure.bench.ablations import Variant
from measure.bench.context import Bench
from measure.bench.gpufeed_run import stop_worker, watch
from measure.bench.profiles import WarmStartPlan
from worker.lifecycle.service import Worker
from worker.tools.harness.images import ImageSetSpec, load_image_set
from worker.tools.harness.redis_env import RunKeys, read_answers, wait_for_results

ZIPF_S = 1.0


def popular_draw(images: int, jobs: int, seed: int) -> list[int]:
    """`jobs` image indexes drawn with weights 1/k^ZIPF_S (k = 1 .. images)."""
    weights = 1.0 / np.arange(1, images + 1) ** ZIPF_S
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(images, size=jobs, p=weights / weights.sum())]


async def warm_start_section(b: Bench, plan: WarmStartPlan) -> dict[str, Any]:
    spec = ImageSetSpec(
        f"warm-start-{plan.side[0]}x{plan.side[1]}", *plan.side, plan.images, quality=85, seed=8
    )
    if spec.name not in b.sets:
        b.sets[spec.name] = load_image_set(spec)
    image_set = b.sets[spec.name]
    model = b.profile.models[-1]
    keys = b.keys(model.model, "warm-start")
    with tempfile.TemporaryDirectory(prefix="gpufeed-bench-warm-") as folder:
        root = Path(folder)
        for i, data in enumerate(image_set.images):
            (root / f"{i:05d}.jpg").write_bytes(data)
        learn = popular_draw(plan.images, plan.jobs, seed=1)
        window = popular_draw(plan.images, plan.jobs, seed=2)
        runs: dict[str, dict[str, Any]] = {}
        try:
            for mode, draw in (("learn", learn), ("cold", window), ("warm", window)):
                runs[mode] = await _run(b, model, keys, root, draw, mode=mode)
                b.echo(
                    f"warm start {mode}: hit rate {runs[mode]['hit_rate']:.0%} over "
                    f"{runs[mode]['jobs']} jobs ({runs[mode]['window_s']} s)"
                )
        finally:
            await b.aclient.delete(f"{keys.jobs}:hot")
            await b.cleanup(keys)
    cold, warm = runs["cold"], runs["warm"]
    return {
        "model": model.model,
        "image_set": image_set.describe(),
        "images": plan.images,
        "jobs": plan.jobs,
        "zipf_s": ZIPF_S,
        "distinct_in_window": len(set(window)),
        "runs": runs,
        "hit_rate_cold": cold["hit_rate"],
        "hit_rate_warm": warm["hit_rate"],
        "hit_rate_gain": round(warm["hit_rate"] - cold["hit_rate"], 3),
        "window_speedup": (
            round(cold["window_s"] / warm["window_s"], 2) if warm["window_s"] else None
        ),
    }


async def _run(
    b: Bench, model: Any, keys: RunKeys, root: Path, draw: list[int], *, mode: str
) -> dict[str, Any]:
    extra: dict[str, Any] = {"path_root": root, "warm_start_s": 0 if mode == "cold" else 120}
    cfg = b.worker_config(model, Variant(f"warm-start-{mode}", mode, ""), keys, **extra)
    worker = Worker(cfg)
    main: asyncio.Task[None] | None = None
    try:
        await worker.startup(wait_for_redis=False)
        main = asyncio.create_task(worker.main_loop(), name=f"bench-warm-start-{mode}")
        alive = watch(main, keys)
        before = await b.aclient.xlen(keys.results)
        t0 = time.perf_counter()
        await asyncio.to_thread(_push_paths, b, keys.jobs, draw, mode)
        expected = before + len(draw)
        await wait_for_results(
            b.aclient, keys.results, expected, alive=alive, timeout_s=b.timeout_s(len(draw))
        )
        seconds = time.perf_counter() - t0
        answers = (await read_answers(b.aclient, keys.results))[before:]
        ok = [a for a in answers if a.ok]
        hits = sum(1 for a in ok if a.cached)
        warm = worker.warm
        return {
            "mode": mode,
            "jobs": len(draw),
            "results_ok": len(ok),
            "hits": hits,
            "hit_rate": round(hits / len(ok), 3) if ok else 0.0,
            "window_s": round(seconds, 2),
            "jobs_per_s": round(len(draw) / seconds, 1) if seconds else None,
            "warm_start": warm.as_dict() if warm is not None else None,
        }
    finally:
        await stop_worker(worker, main)


def _push_paths(b: Bench, stream: str, draw: list[int], mode: str) -> None:
    for start in range(0, len(draw), 64):
        pipe = b.client.pipeline(transaction=False)
        for i in range(start, min(len(draw), start + 64)):
            pipe.xadd(stream, {"id": f"{mode}-{i}", "path": f"{draw[i]:05d}.jpg"})
        pipe.execute()
