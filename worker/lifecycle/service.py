"""The worker's lifecycle: serve() -> startup() -> main_loop() -> shutdown().

startup() warms the model side up first (lifecycle/engine.py: the model compiled, the
staging rings, the launch and decode threads), then, once Redis answers, wires the stages
between Redis and the model (lifecycle/wiring.py): a worker joins the group only once it can
serve. main_loop() runs the stages' duties until a signal or a failure; shutdown() stops
them by their role (reading first, then the drain), leaves the group tidy and releases what
each stage registered on the exit stack as it was built.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import warnings
from collections.abc import Callable
from typing import Any

import structlog
import torch
from PIL import Image

from worker.base.device import resolve_device
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.decode.codecs import IntoCodec
from worker.decode.executor import DecodeExecutor
from worker.delivery.reader import ensure_group
from worker.delivery.redis_check import RedisLink, RedisUnavailable
from worker.delivery.redis_errors import UNREACHABLE
from worker.lifecycle.engine import (
    DecodeHook,
    Engine,
    default_batch_size,
    default_decode_threads,
    sleep_hook,
    warm_up,
)
from worker.lifecycle.report import WorkerReport, report_of
from worker.lifecycle.warm_start import WarmReport, warm_start
from worker.lifecycle.wiring import Role, Stages, hot_list_off, observe, wire
from worker.observe.health import Health
from worker.observe.observer import Observer

log = structlog.get_logger("gpufeed.worker")


class Worker:
    def __init__(self, config: WorkerConfig, *, decode_delay_s: float = 0.0) -> None:
        self.config = config
        # doctor's --decode-delay-ms: a sleep in every decode (a slow decoder).
        self.decode_delay_s = decode_delay_s
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
        # What the stages hold, released last built first: each registers as it is built.
        self._exit = contextlib.AsyncExitStack()
        self._exit.callback(self.observer.close)
        self._link: RedisLink | None = None
        self._engine: Engine | None = None
        self._stages: Stages | None = None
        self._duties: dict[Role, list[asyncio.Task[Any]]] = {role: [] for role in Role}
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        # What the warm start did (worker/lifecycle/warm_start.py); set by startup().
        self.warm: WarmReport | None = None
        # The keys of each shard (GPUFEED_SHARDS; one: the names as set).
        self.shards = config.shard_layout()
        # The job streams each shard's reader reads: one per priority level, or the shard's
        # stream. `lanes` is the first shard's (the stats task reports on it).
        self.lanes = config.lanes_of(self.shards[0].stream)
        self.streams = [st for sh in self.shards for st in config.lanes_of(sh.stream).streams]

    # ----------------------------------------------------------------------- serve
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

    async def startup(self, *, wait_for_redis: bool = True, redis_first: bool = False) -> None:
        """Model first, Redis last: a worker joins the group only once it can serve.
        `redis_first`: fail at once when Redis does not answer, before loading the model
        (tools that measure the model without Redis leave it off)."""
        cfg = self.config
        log.info("starting", **cfg.summary())
        # /live answers from here on; /ready only once the worker reads.
        self.observer.serve_http(cfg.metrics_port, self.health, cfg.metrics_host)
        link = self._link = RedisLink(cfg)
        self._exit.push_async_callback(link.close)
        if redis_first:
            # Fail in a second, not after minutes of loading and compiling the model.
            await link.ready(wait=False, stop=self.should_exit)
        allow_large_images(cfg.max_image_pixels)
        device = resolve_device(cfg.device)
        self._engine = await warm_up(
            cfg,
            device,
            health=self.health,
            exit_stack=self._exit,
            decode_hook=self.decode_hook(),
            gpu_backend=self.gpu_backend(),
        )
        self.observer.batch_size = self._engine.model.batch_size
        await link.ready(wait=wait_for_redis, stop=self.should_exit)
        for stream in self.streams:
            await ensure_group(link.client, stream, cfg.group)
        self._stages = wire(
            cfg,
            self._engine,
            link,
            observer=self.observer,
            health=self.health,
            device=device,
            exit_stack=self._exit,
        )
        for reader in self._stages.readers:
            if reader.intake is not None:
                await reader.intake.start()
        await self._warm_start()
        self._announce_ready(device)

    async def main_loop(self) -> None:
        for duty in self.stages.duties:
            task = asyncio.create_task(duty.run(), name=duty.name)
            self._tasks[duty.name] = task
            self._duties[duty.role].append(task)
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

    async def shutdown(self) -> None:
        self.health.draining = True
        # A start-up that failed says why once (the CLI's line); "stopped" after it would
        # speak of a worker that never served. One asked to stop while starting says so.
        announce = self.ready or self.should_exit.is_set()
        if announce:
            held = self._stages.in_flight.count if self._stages is not None else 0
            log.info("shutting_down", in_flight=held, grace_s=self.config.shutdown_grace_s)
        await self._stop_duties()
        if self._tasks:
            await self._leave_group()
        await self._exit.aclose()
        if announce:
            log.info(
                "stopped",
                results_ok=self.counters.results_ok,
                results_error=self.counters.results_error,
            )

    # ----------------------------------------------------------------------- signals
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

    # ----------------------------------------------------------------------- the steps
    def gpu_backend(self) -> Callable[[], IntoCodec] | None:
        """The JPEG decoder GPU decode into packed rows builds; None: nvImageCodec on the
        worker's CUDA device (the tests give its CPU-only backend)."""
        return None

    def decode_hook(self) -> DecodeHook | None:
        """What runs in a decode thread before each decode: a sleep of `decode_delay_s`, or
        nothing."""
        return sleep_hook(self.decode_delay_s)

    async def _warm_start(self) -> None:
        """Decode the fleet's hot list into the cache before the readers start."""
        cfg, stages = self.config, self.stages
        hot = stages.hot
        if hot is None:
            self.warm = WarmReport(why_not=f"no hot list: {hot_list_off(cfg)}")
        elif cfg.warm_start_s <= 0:
            self.warm = WarmReport(why_not=f"GPUFEED_TUNING warm_start_s={cfg.warm_start_s:g}")
        else:
            engine = self.engine
            self.warm = await warm_start(
                hot,
                budget_s=cfg.warm_start_s,
                fetcher=stages.fetcher,
                decoder=engine.feed.decoder,
                ring=engine.feed.ring,
                cache=engine.feed.decode_cache,
            )
        warm = self.warm
        log.info("warm_start", hot_list=hot.key if hot else None, **warm.as_dict())
        metrics = self.observer.metrics
        for state in ("listed", "warmed", "failed"):
            metrics.warm_start_images.labels(state).set(getattr(warm, state))
        metrics.warm_start_seconds.set(warm.seconds)

    def _announce_ready(self, device: torch.device) -> None:
        cfg = self.config
        observe(self.observer, self.stages, cfg, self.lanes, device)
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
            decode_threads=self.engine.feed.decode_threads,
            in_flight_limit=self.stages.in_flight.limit,
        )

    async def _stop_duties(self) -> None:
        """Stop the main loop's tasks by their role (the reason for each in the log)."""
        grace = self.config.shutdown_grace_s
        # 0. No more reclaiming or trimming; the keep-alive goes on while we drain.
        for task in self._duties[Role.HOUSEKEEPING]:
            task.cancel()
        # 1. Stop reading: nothing new is taken from the streams.
        readers = self._duties[Role.READ]
        if readers:
            for reader in self.stages.readers:
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
        drain = self._duties[Role.PIPELINE]
        if drain and not self.force_exit:
            stages = self.stages
            if not await stages.fetcher.drain(grace):
                log.warning(
                    "fetches_unfinished",
                    count=stages.fetcher.in_progress,
                    note="their jobs stay pending in Redis for other workers",
                )
                await stages.fetcher.close()
            await stages.jobs_q.put(None)
            try:
                await asyncio.wait_for(asyncio.gather(*drain), grace)
                await stages.writer.close()
                await asyncio.wait_for(asyncio.gather(*self._duties[Role.PUBLISH]), grace)
            except (TimeoutError, asyncio.CancelledError):
                log.warning(
                    "grace_period_over",
                    note="unfinished jobs stay pending in "
                    "Redis and will be reclaimed by other workers",
                )
            except Exception as exc:  # noqa: BLE001 - shutdown must go on to release resources
                log.error("drain_failed", error=repr(exc))
        # 3. The hits counted since the last flush go to the hot list: the next worker to
        #    start warms what this one served.
        built = self._stages
        if built is not None and built.hot is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(built.hot.flush(), 5)
        # 4. Cancel whatever is left, with the reason in the log above.
        tasks = self._tasks.values()
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _leave_group(self) -> None:
        """This consumer goes if it holds nothing (otherwise its entries stay pending for
        others to reclaim, and it is removed after that)."""
        try:
            still_held = sum(
                [
                    await asyncio.wait_for(rc.leave(self.config.worker_name), 5)
                    for rc in self.stages.reclaimers
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

    # ----------------------------------------------------------------------- built parts
    # What start-up built, the owners of what tools and tests read, instrument or swap; an
    # AttributeError before it is built.
    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise AttributeError("the model side is built by startup()")
        return self._engine

    @property
    def stages(self) -> Stages:
        if self._stages is None:
            raise AttributeError("the stages are built by startup() once Redis answers")
        return self._stages

    @property
    def link(self) -> RedisLink:
        if self._link is None:
            raise AttributeError("the Redis link is made by startup()")
        return self._link

    def use_decoder(self, pool: DecodeExecutor) -> None:
        """Decode through `pool` in place of the feed's decoders (the bench's ablations): the
        batcher hands it every batch from here on, and the exit shuts it down as it would
        have the feed's own (the caller shuts down the pool it replaces)."""
        self.engine.feed.decoder = pool
        self.stages.batcher.decoder = pool
        self._exit.callback(pool.shutdown)

    def report(self) -> WorkerReport:
        """What the worker runs as, for the tools: its model side's figures once it warmed
        up, its stages' once Redis answered (worker/lifecycle/report.py)."""
        return report_of(self.engine, self._stages)


def allow_large_images(max_pixels: int) -> None:
    """GPUFEED_MAX_IMAGE_PIXELS, checked from the header before any pixel is decoded, is
    the decompression-bomb guard; PIL's own would refuse or warn below an operator's
    higher limit."""
    Image.MAX_IMAGE_PIXELS = max(max_pixels, Image.MAX_IMAGE_PIXELS or 0)
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


__all__ = [
    "ConfigError",
    "RedisUnavailable",
    "Worker",
    "default_batch_size",
    "default_decode_threads",
]
