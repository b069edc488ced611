"""`Bench`: what one `python -m measure bench` invocation shares across its runs (the
profile, the device, the Redis clients, the image sets) and collects from them."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import redis
import redis.asyncio as aioredis
import torch

from measure.bench.ablations import Variant
from measure.bench.profiles import ModelPlan, Profile
from worker.base.errors import GpufeedError
from worker.config.settings import WorkerConfig
from worker.tools.harness.images import ImageSet
from worker.tools.harness.redis_env import RunKeys, delete_run

# Settings a profile decides per model; an explicit flag (--batch-size, ...) wins. The
# models themselves are chosen with --model / --models (see worker/cli.py).
MODEL_SETTINGS = ("weights", "batch_size", "precision", "input_size")


class BenchError(GpufeedError, RuntimeError):
    """A run could not be measured; the message says which and why."""


@dataclass
class Bench:
    profile: Profile
    base: WorkerConfig
    explicit: dict[str, Any]
    device: torch.device
    decode_threads: int
    redis_url: str
    sets: dict[str, ImageSet]
    echo: Callable[[str], None]
    client: redis.Redis
    aclient: aioredis.Redis
    redis_pid: int | None = None
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    seq: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)
    # The `url` job runs, apart: they mirror runs above with the images fetched by URL.
    url_runs: list[dict[str, Any]] = field(default_factory=list)
    model_rates: list[dict[str, Any]] = field(default_factory=list)
    curves: list[dict[str, Any]] = field(default_factory=list)
    # Latency under load (measure/bench/load_latency.py); None: not run.
    load_latency: dict[str, Any] | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    # The queue ceiling per (image set, batch size), measured before the set's runs.
    queue_ceilings: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    # The overhead section (overhead.py), when the profile has one.
    overhead: dict[str, Any] | None = None
    # The priority section (priority.py), when the profile has one.
    priority: dict[str, Any] | None = None
    # The warm-start section (warm_start.py), when the profile has one.
    warm_start: dict[str, Any] | None = None
    # Decode rates by number of decode processes, per image set
    # (worker/tools/harness/process_scaling.py).
    process_scaling: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def keys(self, *parts: str) -> RunKeys:
        self.seq += 1
        slug = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
        return RunKeys(f"{os.getpid()}-{self.seq:03d}-{slug}")

    def model_settings(self, plan: ModelPlan) -> dict[str, Any]:
        values: dict[str, Any] = {
            "model": plan.model,
            "weights": "none",
            "batch_size": plan.batch_size,
            "precision": plan.precision,
            "input_size": plan.input_size,
        }
        values.update({k: v for k, v in self.explicit.items() if k in MODEL_SETTINGS})
        return values

    def worker_config(
        self, plan: ModelPlan, variant: Variant, keys: RunKeys, **extra: Any
    ) -> WorkerConfig:
        values = {f.name: getattr(self.base, f.name) for f in fields(WorkerConfig)}
        values.update(self.model_settings(plan))
        values.update(
            redis_url=self.redis_url,
            stream=keys.jobs,
            group="bench",
            results_stream=keys.results,
            result_prefix=keys.result_prefix,
            dead_stream=keys.dead,
            worker_name=f"bench-{keys.run_id}",
            metrics_port=0,
            result_ttl_s=3600,
            results_maxlen=max(self.base.results_maxlen, 1_000_000),
            # Runs feed one stream; the priority section asks for levels in `extra`.
            priorities="",
            priority_weights="",
        )
        values.update(variant.settings())
        values.update(extra)
        return WorkerConfig.load(env={}, overrides=values)

    def timeout_s(self, jobs: int) -> float:
        return 120.0 + 2.0 * jobs

    async def cleanup(self, keys: RunKeys) -> None:
        await delete_run(self.aclient, keys)
