"""The worker's lifecycle: startup() -> main_loop() -> shutdown(), and the stage wiring.

    reader -> [fetch stage, `url` jobs] -> jobs queue -> batcher (row in a staging slot)
           -> decode threads
           -> sealed queue -> dispatcher (launch thread: copy in, step, copy out)
           -> completion watcher (events) -> result writer (publish + ack)

Every queue is bounded, every task is owned here and awaited or cancelled on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

import redis.asyncio as aioredis
import structlog
import torch
from PIL import Image
from redis.asyncio.cluster import RedisCluster

from producer import shards
from producer.backoff import Backoff
from producer.reach import unreachable
from producer.wire import ErrorCode
from worker.config.errors import ConfigError
from worker.config.lanes import Lanes
from worker.config.settings import WorkerConfig
from worker.decode.cache import DecodeCache
from worker.decode.cpu import DecodeError, DecodeSpec
from worker.decode.gpu import GpuDecodeUnavailable, setup_gpu_decode
from worker.decode.pool import DecodePool
from worker.decode.rows import row_side
from worker.delivery.cluster_node import ShardNodeClient
from worker.delivery.in_flight import InFlight
from worker.delivery.reader import Reader, ensure_group
from worker.delivery.reclaimer import Reclaimer
from worker.delivery.redis_check import (
    RedisUnavailable,
    check_keys,
    is_cluster_node,
    make_client,
)
from worker.delivery.redis_errors import ANY, NO_REDIS, UNREACHABLE
from worker.delivery.replicas import ReplicaWait
from worker.delivery.sharding import ShardedWriter, ShardHeld, reply_to_problem, wrong_shard_problem
from worker.delivery.writer import ResultWriter, WriterSettings
from worker.fetch.stage import FetchSettings, FetchStage
from worker.jobs import Job, Outcome, past_deadline
from worker.model.compiler import (
    CompileReport,
    compile_step,
    mode_uses_cudagraphs,
    still_compiled,
)
from worker.model.degraded import DegradedModel, build_degraded
from worker.model.loaded import LoadedModel
from worker.model.loader import load_configured
from worker.model.precision import (
    AgreementReport,
    PrecisionReport,
    output_agreement,
    precision_check,
)
from worker.model.readers import make_reader
from worker.model.resample import choose_placement, ring_budget, use_rows
from worker.model.step import build_step, check_step, pick_dtype, resolve_compile_mode
from worker.observe.health import Health
from worker.observe.observer import Observer, heartbeat_key
from worker.pipeline.batcher import Batch, Batcher
from worker.pipeline.completion import CompletionWatcher
from worker.pipeline.degrade import DegradeSwitch, Serving
from worker.pipeline.device import DeviceContext, make_context, resolve_device
from worker.pipeline.job_queue import JobQueue
from worker.pipeline.launch import Launched, LaunchFailed, ModelRunner
from worker.pipeline.staging import InputRing, OutputRing
from worker.pipeline.transfer import DeviceTransfer

log = structlog.get_logger("gpufeed.worker")


def default_batch_size(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 8


def default_decode_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        *,
        decode_delay_s: float = 0.0,
        decode_hook: Callable[[Job], None] | None = None,
    ) -> None:
        self.config = config
        self._decode_delay_s = decode_delay_s
        # Tests only: runs in the decode thread before each decode (a slow decoder).
        self._decode_hook = decode_hook
        self.observer = Observer(
            worker_name=config.worker_name,
            batch_size=config.batch_size or 8,
            stats_interval_s=config.stats_interval_s,
        )
        self.counters = self.observer.counters
        self.health = Health(
            loop_stall_s=config.live_loop_stall_s,
            launch_stall_s=config.live_launch_stall_s,
            writer_stall_s=config.live_writer_stall_s,
        )
        self.should_exit = asyncio.Event()
        self.force_exit = False
        self.ready = False
        self.compile_report: CompileReport | None = None
        self.precision: PrecisionReport | AgreementReport | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        # Entries read and not yet answered, by (job stream, entry ID): the keep-alive
        # refreshes them. Two streams (priority levels, shards) may hold the same entry ID.
        self._held: dict[tuple[str, str], Job] = {}
        self._node_clients: list[ShardNodeClient] = []
        # The keys of each shard (GPUFEED_SHARDS; one: the names as set).
        self.shards = config.shard_layout()
        # The job streams each shard's reader reads: one per priority level, or the shard's
        # stream. `lanes` is the first shard's (the stats task reports on it).
        self.lanes = config.lanes_of(self.shards[0].stream)
        self.streams = [st for sh in self.shards for st in config.lanes_of(sh.stream).streams]
        # Redis Cluster: decided by GPUFEED_REDIS_CLUSTER, or asked once (auto).
        self.cluster = config.redis_cluster == "on"
        self._cluster_known = config.redis_cluster != "auto"
        # Degrade under backlog (GPUFEED_DEGRADE_AFTER_S): the cheaper step and its switch.
        self.degraded: DegradedModel | None = None
        self.degrade_switch: DegradeSwitch | None = None
        self._degraded_step: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None

    # ----------------------------------------------------------------------- startup
    async def startup(self, *, wait_for_redis: bool = True, redis_first: bool = False) -> None:
        """Model first, Redis last: a worker joins the group only once it can serve.
        `redis_first`: fail at once when Redis does not answer, before loading the model
        (tools that measure the model without Redis leave it off)."""
        cfg = self.config
        log.info("starting", **cfg.summary())
        # /live answers from here on; /ready only once the worker reads.
        self.observer.serve_http(cfg.metrics_port, self.health, cfg.metrics_host)
        self.redis = self._client()
        if redis_first:
            # Fail in a second, not after minutes of loading and compiling the model.
            await self._wait_for_redis(False)
            await self._find_cluster()
            await self._check_keys()
        # GPUFEED_MAX_IMAGE_PIXELS, checked from the header before any pixel is decoded, is
        # the decompression-bomb guard; PIL's own would refuse or warn below an operator's
        # higher limit.
        Image.MAX_IMAGE_PIXELS = max(cfg.max_image_pixels, Image.MAX_IMAGE_PIXELS or 0)
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        device = resolve_device(cfg.device)
        self.ctx: DeviceContext = make_context(device)
        self.batch_size = cfg.batch_size or default_batch_size(device)
        self.observer.batch_size = self.batch_size
        await self._prepare_model(device)
        self._prepare_decode(device)
        await self._wait_for_redis(wait_for_redis)
        await self._find_cluster()
        await self._check_keys()
        for stream in self.streams:
            await ensure_group(self.redis, stream, cfg.group)
        self._build_stages(device)
        self._announce_ready(device)

    def _client(self) -> aioredis.Redis:
        return make_client(self.config, cluster=self.cluster)

    async def _find_cluster(self) -> None:
        """GPUFEED_REDIS_CLUSTER=auto: ask the node once whether it is a cluster node, and
        switch to the cluster client if so. A cluster with one shard needs its four key
        names in one slot."""
        cfg = self.config
        if not self._cluster_known:
            self._cluster_known = True
            if await is_cluster_node(self.redis):
                await self.redis.aclose()
                self.cluster = True
                self.redis = self._client()
        if self.cluster:
            cfg.check_cluster_keys()
            log.info("redis_cluster", shards=[s.stream for s in self.shards])

    async def _prepare_model(self, device: torch.device) -> None:
        """Load the model, allocate the rings, compile and warm up the one batch shape."""
        cfg = self.config
        # Fixed shapes make cudnn's per-shape tuning useless; turning it off keeps the
        # first batches from stalling on benchmark runs.
        torch.backends.cudnn.benchmark = False
        self.loaded: LoadedModel = load_configured(
            cfg.model, cfg.weights, input_size=cfg.input_size, batch_size=self.batch_size
        )
        self.dtype = pick_dtype(cfg.precision, device)
        step = build_step(self.loaded, device=device, dtype=self.dtype, top_k=cfg.top_k)
        size = self.loaded.resize_size
        pin = self.ctx.is_cuda
        self.placement, why = choose_placement(cfg.resize, device, cfg.decode)
        # Device placement: rows of side R hold the decoded pixels and their geometry.
        self.row_side = row_side(size) if self.placement == "device" else 0
        side = self.row_side or size
        if self.row_side:
            use_rows(step, side, size)
        self.ring = InputRing(cfg.ring_slots, self.batch_size, side, pin=pin)
        self.out_ring = OutputRing(cfg.ring_slots, self.batch_size, step.layout, pin=pin)
        self.transfer = DeviceTransfer(self.ctx, cfg.ring_slots, self.batch_size, side)
        self.ring_budget: dict[str, Any] = {
            "resize_placement_why": why,
            "ring_pinned": pin,
            **ring_budget(self.batch_size, side, cfg.ring_slots),
        }
        log.info("resize_placement", placement=self.placement, **self.ring_budget)
        mode = resolve_compile_mode(cfg.compile, device)
        self.runner = ModelRunner(
            self.ctx,
            step,
            self.transfer,
            cudagraphs=mode_uses_cudagraphs(mode) and self.ctx.is_cuda,
        )
        self.health.watch_launches(
            lambda: self.runner.launch_started_s, cfg.ring_slots, device=device
        )
        example = torch.zeros((self.batch_size, side, side, 3), dtype=torch.uint8, device=device)
        if cfg.degrade_after_s > 0:
            self.degraded = build_degraded(
                cfg, self.loaded, step, device=device, dtype=self.dtype, batch_size=self.batch_size
            )
            if self.row_side:
                use_rows(self.degraded.step, side, size)
            layout = self.degraded.step.layout
            # Outputs of another shape (another model's classes) need slots of their own.
            self.degraded_out_ring = (
                self.out_ring
                if layout == step.layout
                else OutputRing(cfg.ring_slots, self.batch_size, layout, pin=pin)
            )

        def compile_on_launch_thread() -> None:
            # One eager batch first: a model that fails in the serving dtype or gives
            # outputs of the wrong shape is a configuration error, not a compile failure.
            check_step(step, example, what=f"GPUFEED_MODEL: {self.loaded.name}")
            # CUDA-graph trees are per thread: compile and warm up where launches happen.
            fn, report = compile_step(
                step, example, mode=mode, allow_eager_fallback=cfg.allow_eager_fallback
            )
            self.runner.step = fn
            self.compile_report = report
            if self.ctx.is_cuda:
                # Start-up only (it waits for the GPU): the serving dtype against fp32 eager.
                graphs = report.cudagraphs
                check = precision_check if step.layout[0].name == "indices" else output_agreement
                self.precision = check(
                    step, fn, batch=self.batch_size, batches=1, cudagraphs=graphs
                )
            if self.degraded is not None:
                self._compile_degraded(example, mode, report)
            # The fp32 copy served only as the check's reference: give its memory back.
            step.fp32_weights = ()

        await asyncio.get_running_loop().run_in_executor(
            None, self.runner.run_sync, compile_on_launch_thread
        )
        assert self.compile_report is not None
        log.info(
            "model_ready",
            model=cfg.model,
            weights=self.loaded.weights_label,
            kind=self.loaded.output.kind,
            device=self.ctx.name,
            dtype=str(self.dtype).removeprefix("torch."),
            batch_size=self.batch_size,
            staging_size=size,
            input_size=self.loaded.crop_size,
            outputs={f.name: [*f.shape] for f in step.layout},
            **self.compile_report.as_dict(),
        )
        if self.precision is not None:
            log.info("precision_check", **self.precision.as_dict())

    def _compile_degraded(self, example: torch.Tensor, mode: str, main: CompileReport) -> None:
        """Check, compile and warm up the degraded step on the launch thread, beside the main
        one (start-up only). Its graph is not a recompile of the main step's: the main
        report's baseline moves past it."""
        assert self.degraded is not None
        dstep, loaded = self.degraded.step, self.degraded.loaded
        check_step(dstep, example, what=f"{self.degraded.setting}: {loaded.name}")
        # A main step that fell back to eager (allowed) has a degraded step in eager too.
        dmode = "off" if main.fell_back_to_eager else mode
        fn, report = compile_step(
            dstep, example, mode=dmode, allow_eager_fallback=False, reset=False
        )
        if report.baseline is not None:
            main.baseline = report.baseline
        self._degraded_step = fn
        precision: PrecisionReport | AgreementReport | None = None
        if self.ctx.is_cuda:
            graphs = report.cudagraphs
            check = precision_check if dstep.layout[0].name == "indices" else output_agreement
            precision = check(dstep, fn, batch=self.batch_size, batches=1, cudagraphs=graphs)
        dstep.fp32_weights = ()
        log.info(
            "degraded_step_ready",
            model=loaded.name,
            weights=loaded.weights_label,
            staging_size=dstep.staging_size,
            input_size=dstep.crop_size,
            resized_from=dstep.input_side,
            after_s=self.config.degrade_after_s,
            outputs={f.name: [*f.shape] for f in dstep.layout},
            **report.as_dict(),
            **({"precision": precision.as_dict()} if precision is not None else {}),
        )

    def _prepare_decode(self, device: torch.device) -> None:
        """The decode thread pool, and GPU decode where GPUFEED_DECODE asks for it."""
        cfg = self.config
        self.decode_threads = cfg.decode_threads or default_decode_threads()
        spec = DecodeSpec(
            size=self.loaded.resize_size,
            max_bytes=cfg.max_image_bytes,
            max_pixels=cfg.max_image_pixels,
            dct_scaling=cfg.dct_scaling,
            max_decode_bytes=cfg.max_decode_mb * 1024 * 1024,
            geometry=self.loaded.resize_mode,
        )
        delay = self._decode_delay_s

        def sleep(job: Job) -> None:
            time.sleep(delay)

        hook = self._decode_hook or (sleep if delay else None)
        self.decode_cache = DecodeCache(cfg.decode_cache_mb * 1024 * 1024)
        decode = cfg.decode
        if spec.geometry != "shorter-crop" and decode != "cpu":
            # The GPU decoder resizes shorter-side-and-crop only.
            if decode == "gpu":
                raise ConfigError(
                    f"GPUFEED_DECODE=gpu: the GPU decoder does resize = shorter-crop only; "
                    f"{self.loaded.name} uses {spec.geometry} (decode on the CPU)"
                )
            decode = "cpu"
        try:
            # Falls back to CPU decode, logged, on any failure to build a GPU decoder.
            gpu = setup_gpu_decode(decode, device, spec, self.decode_threads)
        except GpuDecodeUnavailable as exc:
            raise ConfigError(f"GPUFEED_DECODE=gpu: {exc}") from None
        router = None
        if gpu is not None:
            router, gpu_decoder, fields = gpu
            log.info("gpu_decode", **fields)
        self.decoder = DecodePool(
            spec,
            self.decode_threads,
            cfg.path_root,
            delay_hook=hook,
            gpu_router=router,
            cache=self.decode_cache,
            budget_s=cfg.decode_budget_ms / 1000,
            row_side=self.row_side,
        )
        if gpu is not None:
            self.runner.use_gpu_decode(gpu_decoder, self.decoder.decode_on_cpu)

    def _build_stages(self, device: torch.device) -> None:
        """The bounded queues and the stages between them."""
        cfg = self.config
        self.in_flight = InFlight(self.batch_size * (cfg.ring_slots + 2))
        # Lists of jobs (one per read), bounded by the jobs they hold.
        self.jobs_q = JobQueue(self.batch_size)
        self.sealed_q: asyncio.Queue[Batch | None] = asyncio.Queue(cfg.ring_slots)
        self.replica_wait = (
            ReplicaWait(
                cfg.wait_replicas,
                cfg.wait_replicas_timeout_ms,
                on_short=lambda n: self.observer.delivery_event("replica_wait_timeout", n),
            )
            if cfg.wait_replicas
            else None
        )
        writers = {
            shard.stream: ResultWriter(
                self._writer_client(shard),
                WriterSettings(
                    stream=shard.stream,
                    group=cfg.group,
                    result_prefix=shard.result_prefix,
                    result_ttl_s=cfg.result_ttl_s,
                    results_maxlen=cfg.results_maxlen,
                    worker_name=cfg.worker_name,
                    model_name=self.loaded.name,
                    weights=self.loaded.weights_label,
                    device=str(device),
                    dead_stream=shard.dead_stream,
                    default_reply_to=shard.results_stream,
                    degraded_model=self.degraded.loaded.name if self.degraded else "",
                    degraded_weights=(self.degraded.loaded.weights_label if self.degraded else ""),
                    max_result_bytes=cfg.max_result_bytes,
                ),
                max_queued=cfg.ring_slots * 2,
                on_published=self._on_published,
                replicas=self.replica_wait,
            )
            for shard in self.shards
        }
        # One shard: its writer as it is; several: the router in front of theirs, which
        # knows each shard's level streams.
        self.writer: ResultWriter | ShardedWriter = (
            ShardedWriter(
                {
                    stream: writers[shard.stream]
                    for shard in self.shards
                    for stream in cfg.lanes_of(shard.stream).streams
                }
            )
            if len(writers) > 1
            else next(iter(writers.values()))
        )
        self.health.watch_writer(self.writer.stalled)
        self.batcher = Batcher(
            self.ring,
            self.decoder,
            batch_size=self.batch_size,
            max_wait_s=cfg.max_wait_ms / 1000,
            jobs=self.jobs_q,
            sealed=self.sealed_q,
        )
        reader = make_reader(self.loaded.output, self.loaded.categories)
        self.serving = Serving(
            self.loaded.name, self.loaded.weights_label, False, self.out_ring, reader
        )
        self.degraded_serving: Serving | None = None
        if self.degraded is not None:
            d = self.degraded.loaded
            self.degraded_serving = Serving(
                d.name,
                d.weights_label,
                True,
                self.degraded_out_ring,
                make_reader(d.output, d.categories),
                self._degraded_step,
            )
            self.degrade_switch = DegradeSwitch(
                after_s=cfg.degrade_after_s, on_change=self._degrade_changed
            )
        self.watcher = CompletionWatcher(
            self.out_ring,
            self.writer.put,
            reader=reader,
            on_batch_done=self._on_batch_done,
        )
        # `url` jobs: their bytes arrive here, then they join the jobs queue like the rest.
        self.fetcher = FetchStage(
            FetchSettings.from_config(cfg),
            ready=self.jobs_q.put,
            fail=self.writer.put,
            cache=self.decode_cache,
            metrics=self.observer.metrics,
            # A job waiting for a fetch slot lends its in-flight place back meanwhile.
            give_back_place=self.in_flight.give_back,
            take_place=self.in_flight.take,
        )
        self.readers: list[Reader] = []
        self.reclaimers: list[Reclaimer] = []
        for shard in self.shards:
            deliver = self._shard_deliver(shard)
            self.readers.append(
                Reader(
                    self.redis,
                    lanes=cfg.lanes_of(shard.stream),
                    group=cfg.group,
                    consumer=cfg.worker_name,
                    default_reply_to=shard.results_stream,
                    in_flight=self.in_flight,
                    deliver=deliver,
                    max_per_read=self.batch_size * 2,
                    max_meta_bytes=cfg.max_meta_bytes,
                )
            )
            lanes = cfg.lanes_of(shard.stream)
            self.reclaimers.append(
                Reclaimer(
                    self.redis,
                    replace(
                        cfg,
                        stream=shard.stream,
                        results_stream=shard.results_stream,
                        result_prefix=shard.result_prefix,
                        dead_stream=shard.dead_stream,
                    ),
                    in_flight=self.in_flight,
                    lanes=lanes,
                    held=ShardHeld(self._held, lanes.streams),
                    deliver=deliver,
                    publish_now=writers[shard.stream].publish_now,
                    on_event=self.observer.delivery_event,
                )
            )
        self.reader = self.readers[0]
        self.reclaimer = self.reclaimers[0]

    def _writer_client(self, shard: shards.Shard) -> aioredis.Redis:
        """The client a shard's writer publishes with: on a cluster, the shard's master
        itself (a cluster pipeline takes no scripts, and WAIT needs the writes' connection)."""
        if not self.cluster:
            return self.redis
        node = ShardNodeClient(cast(RedisCluster, self.redis), self.config.redis_url, shard.stream)
        self._node_clients.append(node)
        return cast(aioredis.Redis, node)

    def _shard_deliver(self, shard: shards.Shard) -> Callable[[list[Job]], Awaitable[None]]:
        """The hand-over of one shard's reader and reclaimer. A job whose own id belongs to
        another shard is answered `invalid_job` naming that shard's stream, computed
        nowhere. On a cluster, a reply_to in another slot than the shard's cannot be written
        by its publish script: such a job is answered `invalid_job` on the shard's results
        stream."""
        layout = self.shards

        async def deliver(jobs: list[Job]) -> None:
            if self.cluster or len(layout) > 1:
                for job in jobs:
                    if job.rejected is None:
                        problem = wrong_shard_problem(job, shard, layout)
                        if problem is None and self.cluster:
                            problem = reply_to_problem(job, shard)
                        if problem is not None:
                            job.reply_to = shard.results_stream
                            job.rejected = (ErrorCode.INVALID_JOB, problem)
            await self._deliver(jobs)

        return deliver

    def _announce_ready(self, device: torch.device) -> None:
        cfg = self.config
        report = self.compile_report
        assert report is not None
        self.observer.start_sampler(device.index if self.ctx.is_cuda else None)
        self.observer.watch(
            jobs=self.jobs_q.qsize,
            fetching=lambda: self.fetcher.in_progress,
            sealed=self.sealed_q.qsize,
            results=lambda: self.writer.queued,
            in_flight=lambda: self.in_flight.count,
        )
        self.observer.info = {
            "model": cfg.model,
            "weights": self.loaded.weights_label,
            "device": self.ctx.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch_size": self.batch_size,
            "compile": report.mode,
            "compiled": report.compiled,
            "stream": cfg.stream,
            "group": cfg.group,
            "priorities": ",".join(lane.level for lane in self.lanes if lane.level),
            "shards": len(self.shards),
        }
        self.observer.compile_check = lambda: still_compiled(report)
        # torch, its compiler and the model leave some million long-lived objects: a full
        # collection walks them all (about half a second here), stalling the event loop
        # mid-batch and the process's exit. What exists now lives as long as the worker.
        gc.freeze()
        self.health.warm = True
        self.ready = True
        log.info(
            "worker_ready",
            worker=cfg.worker_name,
            streams=self.streams,
            group=cfg.group,
            decode_threads=self.decode_threads,
            in_flight_limit=self.in_flight.limit,
        )

    async def _check_keys(self) -> None:
        await check_keys(self.redis, self.config, cluster=self.cluster)

    async def _wait_for_redis(self, wait: bool) -> None:
        backoff = Backoff(0.2, 5.0)
        logged = False
        while True:
            try:
                await self.redis.ping()
                if logged:
                    log.info("redis_reachable", url=self.config.redacted_url())
                return
            except NO_REDIS as exc:
                message = unreachable(self.config.redacted_url(), exc)
                if not wait:
                    raise RedisUnavailable(message) from None
                if not logged:
                    log.warning("redis_unreachable_retrying", error=message)
                    logged = True
                if self.should_exit.is_set():
                    raise RedisUnavailable(message) from None
                await backoff.sleep()

    # ----------------------------------------------------------------------- main loop
    async def main_loop(self) -> None:
        self._tasks = {
            "writer": asyncio.create_task(self.writer.run(), name="writer"),
            "watcher": asyncio.create_task(self.watcher.run(), name="watcher"),
            "dispatcher": asyncio.create_task(self._dispatch(), name="dispatcher"),
            "batcher": asyncio.create_task(self.batcher.run(), name="batcher"),
            **{
                _shard_task("reader", i): asyncio.create_task(
                    r.run(), name=_shard_task("reader", i)
                )
                for i, r in enumerate(self.readers)
            },
            "stats": asyncio.create_task(
                self.observer.run(
                    self.redis,
                    key=heartbeat_key(self.config.worker_name),
                    # Every shard's streams: the lag and pending gauges are the worker's.
                    lanes=Lanes(
                        [ln for sh in self.shards for ln in self.config.lanes_of(sh.stream)]
                    ),
                    group=self.config.group,
                    in_flight=lambda: self.in_flight.count,
                ),
                name="stats",
            ),
            **{
                _shard_task(duty, i): asyncio.create_task(run(), name=_shard_task(duty, i))
                for i, rc in enumerate(self.reclaimers)
                for duty, run in (
                    ("keepalive", rc.run_keepalive),
                    ("reclaim", rc.run_reclaim),
                    ("trim", rc.run_trim),
                )
            },
            # /live and /ready: proof that the loop runs, and whether Redis answers.
            "beat": asyncio.create_task(self.health.beat(), name="beat"),
            "redis_probe": asyncio.create_task(
                self.health.probe_redis(self.redis), name="redis_probe"
            ),
        }
        if self.degrade_switch is not None:
            self._tasks["degrade"] = asyncio.create_task(
                self.degrade_switch.run(self.redis, streams=self.streams, group=self.config.group),
                name="degrade",
            )
        stop = asyncio.create_task(self.should_exit.wait(), name="should_exit")
        waiting: set[asyncio.Task[Any]] = {stop, *self._tasks.values()}
        try:
            while True:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    return
                # A duty with nothing to do (trimming turned off) may end; a failure may not.
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        exc = task.exception()
                        log.error("stage_failed", stage=task.get_name(), error=repr(exc))
                        raise exc  # type: ignore[misc]
        finally:
            stop.cancel()

    async def _deliver(self, jobs: list[Job]) -> None:
        """What one read (or one reclaim) returned: answered at once (rejected, late), to the
        fetch stage (`url` jobs), or to the batcher as one queue item."""
        now_ms = time.time() * 1000
        answered: list[Outcome] = []
        ready: list[Job] = []
        for job in jobs:
            self._held[(job.stream, job.entry_id)] = job
            if job.enqueued_ms > now_ms:
                # An entry ID from the future (chosen by whoever added it, or numbered after
                # such an entry) says nothing of when the job came: its time counts from
                # this read, so the latency metrics are not all zero behind it.
                job.enqueued_ms = int(now_ms)
            if job.enqueued_ms:
                # Time in Redis before this worker read it (server and worker clocks may
                # differ a little; never negative).
                job.timings_ms["redis_wait"] = max(0.0, now_ms - job.enqueued_ms)
            if job.rejected is not None:
                code, message = job.rejected
                answered.append(Outcome.failure(job, code, message))
            elif (late := past_deadline(job, now_ms)) is not None:
                answered.append(late)
            elif job.url is not None:
                # Fetched in the background: the reader goes on, and the job joins a batch
                # only once its bytes are here.
                self.fetcher.submit(job)
            else:
                ready.append(job)
        if answered:
            await self.writer.put(answered)
        if ready:
            await self.jobs_q.put(ready)

    async def _dispatch(self) -> None:
        while True:
            batch = await self.sealed_q.get()
            if batch is None:
                self.watcher.track(None)
                return
            results = await batch.decoded()
            expire_rows(batch)
            if not batch.valid_rows:
                self.ring.release_now(batch.slot)
                await self.writer.put(
                    [
                        Outcome.failure(job, r.error.code, r.error.message)
                        for job, r in zip(batch.jobs, results, strict=True)
                        if r.error is not None
                    ]
                )
                continue
            # Chosen once per batch: a batch runs whole on one step.
            serving = self._serving()
            out = await serving.out_ring.acquire()
            try:
                launched = await self.runner.launch(batch, out, serving)
            except Exception as exc:  # noqa: BLE001 - the batch fails, the worker goes on
                log.error(
                    "batch_failed",
                    batch=batch.seq,
                    error=repr(exc),
                    job_ids=[j.job_id for j in batch.jobs],
                )
                serving.out_ring.release(out)
                if isinstance(exc, LaunchFailed):
                    # Device work queued before the failure may still read the slot.
                    batch.slot.copy_done = exc.fence
                    self.ring.release_after_copy(batch.slot)
                else:
                    self.ring.release_now(batch.slot)
                await self.writer.put(
                    [
                        Outcome.failure(job, r.error.code, r.error.message)
                        if r.error is not None
                        else _failed_on(
                            serving, Outcome.failure(job, ErrorCode.INFERENCE_ERROR, f"{exc}")
                        )
                        for job, r in zip(batch.jobs, results, strict=True)
                    ]
                )
                continue
            self.health.launched(launched)
            batch.slot.copy_done = launched.copied
            self.ring.release_after_copy(batch.slot)
            self.watcher.track(launched)

    def _serving(self) -> Serving:
        """The step the next batch runs on: the degraded one while the switch is on."""
        switch = self.degrade_switch
        if switch is not None and switch.on and self.degraded_serving is not None:
            return self.degraded_serving
        return self.serving

    def _degrade_changed(self, on: bool, age_s: float) -> None:
        metrics = self.observer.metrics
        metrics.degraded.set(1 if on else 0)
        metrics.degrade_switches.labels("on" if on else "off").inc()

    def _on_batch_done(self, launched: Launched, gpu_ms: float) -> None:
        self.observer.batch_done(launched, gpu_ms)

    def _on_published(self, outcomes: list[Outcome], states: list[int]) -> None:
        for outcome in outcomes:
            self._held.pop((outcome.job.stream, outcome.job.entry_id), None)
        self.observer.published(outcomes, states)
        self.in_flight.give_back(len(outcomes))

    # ----------------------------------------------------------------------- shutdown
    async def shutdown(self) -> None:
        self.health.draining = True
        grace = self.config.shutdown_grace_s
        # A start-up that failed says why once (the CLI's line); "stopped" after it would
        # speak of a worker that never served. One asked to stop while starting says so.
        announce = self.ready or self.should_exit.is_set()
        if announce:
            log.info(
                "shutting_down",
                in_flight=getattr(self, "in_flight", InFlight(0)).count,
                grace_s=grace,
            )
        tasks = self._tasks
        # 0. No more reclaiming or trimming; the keep-alive goes on while we drain.
        for name, task in tasks.items():
            if name.partition("-")[0] in ("reclaim", "trim", "stats", "redis_probe", "degrade"):
                task.cancel()
        # 1. Stop reading: nothing new is taken from the streams.
        readers = [t for name, t in tasks.items() if name.partition("-")[0] == "reader"]
        if readers:
            for reader in self.readers:
                reader.stop()
            # A reader hands over what its last XREADGROUP returned before it exits.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*readers)), grace)
            for task in readers:
                if not task.done():
                    task.cancel()
        # 2. Drain: fetches in progress hand their jobs on (or fail them), then the
        #    sentinel flows batcher -> dispatcher -> watcher; then the writer publishes
        #    what is left.
        drain = [tasks[n] for n in ("batcher", "dispatcher", "watcher") if n in tasks]
        if drain and not self.force_exit:
            if not await self.fetcher.drain(grace):
                log.warning(
                    "fetches_unfinished",
                    count=self.fetcher.in_progress,
                    note="their jobs stay pending in Redis for other workers",
                )
                await self.fetcher.close()
            await self.jobs_q.put(None)
            try:
                await asyncio.wait_for(asyncio.gather(*drain), grace)
                await self.writer.close()
                await asyncio.wait_for(tasks["writer"], grace)
            except (TimeoutError, asyncio.CancelledError):
                log.warning(
                    "grace_period_over",
                    note="unfinished jobs stay pending in "
                    "Redis and will be reclaimed by other workers",
                )
            except Exception as exc:  # noqa: BLE001 - shutdown must go on to release resources
                log.error("drain_failed", error=repr(exc))
        # 3. Cancel whatever is left, with the reason in the log above.
        for task in tasks.values():
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        if hasattr(self, "fetcher"):
            await self.fetcher.close()
        # 4. Leave the group tidy: this consumer goes if it holds nothing (otherwise its
        #    entries stay pending for others to reclaim, and it is removed after that).
        if tasks and hasattr(self, "reclaimers"):
            try:
                still_held = sum(
                    [
                        await asyncio.wait_for(rc.leave(self.config.worker_name), 5)
                        for rc in self.reclaimers
                    ]
                )
                if still_held:
                    log.warning(
                        "left_pending_jobs",
                        note="they will be reclaimed after "
                        "GPUFEED_VISIBILITY_TIMEOUT_S by the other workers",
                    )
            except UNREACHABLE as exc:  # wait_for's TimeoutError among them (an OSError)
                log.warning("could_not_leave_group", error=str(exc))
        if hasattr(self, "decoder"):
            self.decoder.shutdown()
        if hasattr(self, "runner"):
            self.runner.shutdown()
        if hasattr(self, "redis"):
            # Any Redis error: what answers may not even be a Redis server.
            with contextlib.suppress(*ANY):
                await asyncio.wait_for(self.redis.delete(heartbeat_key(self.config.worker_name)), 2)
            await self.redis.aclose()
        for node in self._node_clients:
            await node.aclose()
        self.observer.close()
        if announce:
            log.info(
                "stopped",
                results_ok=self.counters.results_ok,
                results_error=self.counters.results_error,
            )

    # ----------------------------------------------------------------------- serve
    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.handle_exit, sig)

    def handle_exit(self, sig: int | None = None) -> None:
        # A second signal skips the drain: in-flight jobs stay pending for other workers.
        if self.should_exit.is_set():
            self.force_exit = True
            log.warning("forced_exit", signal=sig)
        # /ready says 503 from the first signal on: this worker takes nothing new.
        self.health.draining = True
        self.should_exit.set()

    async def serve(self, *, wait_for_redis: bool = True, install_signals: bool = True) -> None:
        if install_signals:
            self.install_signal_handlers()
        try:
            # --no-wait: a worker that would exit for want of Redis does so before the model.
            await self.startup(wait_for_redis=wait_for_redis, redis_first=not wait_for_redis)
            if not self.should_exit.is_set():
                await self.main_loop()
        finally:
            await self.shutdown()


def _failed_on(serving: Serving, outcome: Outcome) -> Outcome:
    """An inference_error of the degraded step names that step, as its results would."""
    if serving.degraded:
        outcome.extra["degraded"] = True
    return outcome


def _shard_task(name: str, shard: int) -> str:
    """Task names: `reader`, `trim`, ... for the first shard, `reader-1`, ... after it."""
    return name if shard == 0 else f"{name}-{shard}"


def expire_rows(batch: Batch) -> None:
    """Rows whose job's deadline passed while it was decoded are not computed: they become
    failed rows, answered `deadline_exceeded` with the batch's other failures."""
    now_ms = time.time() * 1000
    for row, job in enumerate(batch.jobs):
        if job.deadline_ms is None or batch.results[row].error is not None:
            continue
        late = past_deadline(job, now_ms)
        if late is not None and late.error_code is not None:
            batch.results[row] = replace(
                batch.results[row],
                info=None,
                gpu=None,
                error=DecodeError(late.error_code, late.error_message),
            )


__all__ = ["ConfigError", "RedisUnavailable", "Worker"]
