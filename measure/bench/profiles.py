"""Benchmark profiles: which models, image sets, job counts and extras one invocation runs.

- `tiny`: seconds; the test suite's profile (mobilenet_v3_small at input 64, a dozen small
  images and a few larger ones, every variant, a short max-wait curve, the decode-cache
  pair on the larger set).
- `quick`: a few minutes on a 2-core CPU host; the default of `make bench` on CPU hosts;
  the decode-cache pair on the 4000x3000 set only.
- every profile: the overhead section (measure/bench/overhead.py): 64x64 JPEGs, the
  null model at batch 256 (32 in tiny), cache hitting and every job decoded, beside the
  queue ceiling; 10,000 jobs per run in quick on the CPU, 20,000 otherwise (192 in tiny).
- every profile: the priority section (measure/bench/priority.py): the first model,
  a burst of low-priority jobs three times what it serves while a trickle of high-priority
  ones arrives for 0.5 s (tiny), 2 s (quick) or 5 s (full), with and without levels.
- every profile: the tenants section (measure/bench/tenants.py): the priority
  section's workload told by tenant: the `bulk` tenant's burst (as the priority burst, and
  at least 2,000 jobs in quick and full) on its own stream beside the `live` tenant's
  trickle on another, with tenants and with both on one stream.
- every profile: the batch section (measure/bench/batch.py): `producer batch` over a
  folder of unique 64x64 JPEGs against one null-model worker at batch 256 (32 in tiny),
  beside the same images pushed inline; 256 images (tiny), 30,000 (quick), 40,000 (full).
- every profile: the warm-start section (measure/bench/warm_start.py): the last model,
  a restarted worker's first jobs over Zipf-popular 640x480 `path` images, started cold
  and warm from the hot list its predecessor left; 1,200 jobs over 300 images in quick on
  the CPU (6,000 on CUDA), 6,000 over 1,000 in full (20,000 on CUDA), 48 small ones in tiny.
- `full`: more jobs, the compile variant on the CPU too, the decode-cache pair on both
  sets, and the latency/throughput curve for three batcher max waits; the default on CUDA
  hosts.

Each job's bytes are unique (worker/tools/harness/redis_env.py `job_image`) except in the cache
pair, whose jobs cycle through the distinct images, `jobs / count` times each.

On CUDA the models are resnet50 at batch 64 in fp16 (the GPU target's configuration) and
mobilenet_v3_small; on the CPU resnet18 (model-bound there) and mobilenet_v3_small (light
enough that the decode gains show in full), at the worker's CPU default batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from worker.tools.harness.images import ImageSetSpec

PROFILE_NAMES = ("tiny", "quick", "full")


@dataclass(frozen=True)
class ModelPlan:
    model: str
    batch_size: int = 0  # 0: the worker's default for the device (64 CUDA, 8 CPU)
    precision: str = "auto"
    input_size: int = 0  # 0: the weights' own (224)


@dataclass(frozen=True)
class SetPlan:
    spec: ImageSetSpec
    jobs: int  # jobs per run; they cycle through the set's distinct images
    role: str  # "photo" (~640x480) or "large" (4000x3000)


@dataclass(frozen=True)
class CurvePlan:
    max_waits_ms: tuple[float, ...] = (2.0, 10.0, 50.0)
    loads: tuple[float, ...] = (0.25, 0.5, 0.75, 0.95)  # fractions of the measured capacity
    seconds: float = 8.0  # offered-load window per point


@dataclass(frozen=True)
class LoadLatencyPlan:
    """Latency under load (measure/bench/load_latency.py): seconds of offered load per
    point, at 80% of the naive worker's capacity and of gpufeed's."""

    seconds: float


@dataclass(frozen=True)
class OverheadPlan:
    """The overhead section (measure/bench/overhead.py): tiny JPEGs, the null model."""

    jobs: int  # per run, and for the queue ceiling
    batch_size: int = 256
    distinct: int = 64  # distinct images (the cache-hit run repeats them)
    side: int = 64
    # How long the live-producer run's producer pushes (live_producer.py).
    live_s: float = 4.0


@dataclass(frozen=True)
class PriorityPlan:
    """The priority section (measure/bench/priority.py): urgent jobs behind a burst."""

    seconds: float  # how long the high-priority trickle lasts; the burst is 3x that much work


@dataclass(frozen=True)
class TenantsPlan:
    """The tenants section (measure/bench/tenants.py): one tenant's backlog beside
    another's trickle."""

    seconds: float  # how long the live tenant's trickle lasts; the burst is 3x that much work
    min_burst: int = 0  # the bulk tenant's burst, at least (a backlog of thousands)


@dataclass(frozen=True)
class WarmStartPlan:
    """The warm-start section (measure/bench/warm_start.py): a restarted worker's
    first `jobs` jobs over `images` distinct images, cold and warm."""

    jobs: int
    images: int
    side: tuple[int, int] = (640, 480)


@dataclass(frozen=True)
class BatchPlan:
    """The batch section (measure/bench/batch.py): `producer batch` over a folder."""

    jobs: int  # images in the folder, and jobs of the inline run
    batch_size: int = 256
    distinct: int = 64
    side: int = 64
    # The sharded run (measure/bench/batch_fleet.py): jobs of its manifest; 0: none.
    fleet_jobs: int = 0


@dataclass(frozen=True)
class Profile:
    name: str
    models: tuple[ModelPlan, ...]
    sets: tuple[SetPlan, ...]
    compile_variant_on_cpu: bool  # compiling is slow on the CPU (docs/benchmarks.md)
    curve: CurvePlan | None
    ceiling_s: float  # timed part of each direct-feed measurement
    stage_min_s: float  # least time per decode-rate measurement
    stage_images: int  # distinct images per decode-rate measurement (at most)
    timeline_bin_s: float = 0.5
    time_limit_s: float | None = None  # a soft limit, reported when exceeded
    # Roles of the image sets ("photo", "large") that get the decode-cache pair (jobs
    # repeating the distinct images, cache on and off), for every model.
    cache_roles: tuple[str, ...] = ()
    overhead: OverheadPlan | None = None
    priority: PriorityPlan | None = None
    tenants: TenantsPlan | None = None
    batch: BatchPlan | None = None
    load_latency: LoadLatencyPlan | None = None
    warm_start: WarmStartPlan | None = None

    def with_models(self, models: tuple[ModelPlan, ...]) -> Profile:
        return replace(self, models=models)


def photo_set(count: int, jobs: int) -> SetPlan:
    spec = ImageSetSpec("photo-640x480", 640, 480, count, quality=85, seed=1)
    return SetPlan(spec, jobs, "photo")


def large_set(count: int, jobs: int) -> SetPlan:
    spec = ImageSetSpec("large-4000x3000", 4000, 3000, count, quality=90, seed=2)
    return SetPlan(spec, jobs, "large")


def make_profile(name: str, *, cuda: bool) -> Profile:
    if name not in PROFILE_NAMES:
        raise ValueError(f"unknown profile {name!r}; use one of {', '.join(PROFILE_NAMES)}")
    if name == "tiny":
        return Profile(
            name="tiny",
            models=(ModelPlan("mobilenet_v3_small", batch_size=4, input_size=64),),
            sets=(
                SetPlan(
                    ImageSetSpec("tiny-320x240", 320, 240, 12, quality=85, seed=3), 16, "photo"
                ),
                SetPlan(
                    ImageSetSpec("tiny-1600x1200", 1600, 1200, 4, quality=90, seed=4), 8, "large"
                ),
            ),
            compile_variant_on_cpu=False,
            curve=CurvePlan(loads=(0.5, 1.0), seconds=0.6),
            ceiling_s=0.3,
            stage_min_s=0.15,
            stage_images=4,
            timeline_bin_s=0.25,
            cache_roles=("large",),
            overhead=OverheadPlan(jobs=192, batch_size=32, distinct=8, live_s=1.0),
            priority=PriorityPlan(seconds=0.5),
            tenants=TenantsPlan(seconds=0.5),
            batch=BatchPlan(jobs=256, batch_size=32, distinct=8),
            load_latency=LoadLatencyPlan(seconds=1.0),
            warm_start=WarmStartPlan(jobs=48, images=16, side=(160, 120)),
        )
    if cuda:
        models = (
            ModelPlan("resnet50", batch_size=64, precision="fp16"),
            ModelPlan("mobilenet_v3_small", batch_size=64, precision="fp16"),
        )
    else:
        models = (ModelPlan("resnet18"), ModelPlan("mobilenet_v3_small"))
    if name == "quick":
        sets = (
            (photo_set(128, 1024), large_set(32, 128))
            if cuda
            else (photo_set(48, 192), large_set(24, 96))
        )
        return Profile(
            name="quick",
            models=models,
            sets=sets,
            compile_variant_on_cpu=False,
            curve=None,
            ceiling_s=2.0,
            stage_min_s=1.0,
            stage_images=8,
            time_limit_s=None if cuda else 300.0,
            # Where decode dominates; the photo set too would push it past its time limit
            # on 2 cores.
            cache_roles=("large",),
            overhead=OverheadPlan(jobs=20_000 if cuda else 10_000),
            priority=PriorityPlan(seconds=2.0),
            tenants=TenantsPlan(seconds=2.0, min_burst=2000),
            # Enough images that the run's start and end (listing the first page, opening
            # the output, the final rename) weigh little in the client's CPU per job.
            batch=BatchPlan(jobs=30_000, fleet_jobs=30_000),
            load_latency=LoadLatencyPlan(seconds=5.0),
            warm_start=WarmStartPlan(jobs=6000 if cuda else 1200, images=300),
        )
    sets = (
        (photo_set(256, 4096), large_set(64, 512))
        if cuda
        else (photo_set(96, 384), large_set(48, 192))
    )
    return Profile(
        name="full",
        models=models,
        sets=sets,
        compile_variant_on_cpu=True,
        curve=CurvePlan(),
        ceiling_s=5.0,
        stage_min_s=2.0,
        stage_images=16,
        cache_roles=("photo", "large"),
        overhead=OverheadPlan(jobs=20_000, live_s=8.0),
        priority=PriorityPlan(seconds=5.0),
        tenants=TenantsPlan(seconds=5.0, min_burst=2000),
        batch=BatchPlan(jobs=40_000, fleet_jobs=30_000),
        load_latency=LoadLatencyPlan(seconds=10.0),
        warm_start=WarmStartPlan(jobs=20_000 if cuda else 6000, images=1000),
    )
