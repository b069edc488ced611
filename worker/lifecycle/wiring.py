"""The stages between Redis and the model, built once Redis answers, as one object.

    reader -> [fetch stage, `url` jobs] -> jobs queue -> batcher (row in a staging slot)
           -> decode threads
           -> sealed queue -> dispatcher (launch thread: copy in, step, copy out)
           -> completion watcher (events) -> result writer (publish + ack)

Every queue is bounded. `wire` returns the `Stages` with the duties the main loop runs, each
with its `Role` (how shutdown treats it); each stage that holds something to release
registers its teardown on the worker's exit stack as it is built.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, NamedTuple, cast

import redis.asyncio as aioredis
import structlog
import torch
from redis.asyncio.cluster import RedisCluster

from producer import shards
from producer.priorities import parse_levels
from worker.config import table
from worker.config.lanes import Lanes
from worker.config.settings import WorkerConfig
from worker.delivery.cluster_node import ShardNodeClient
from worker.delivery.hot_list import HotList
from worker.delivery.in_flight import InFlight, in_flight_places
from worker.delivery.intake_process import IntakeProcess
from worker.delivery.reader import Reader
from worker.delivery.reclaimer import Reclaimer
from worker.delivery.redis_check import PREFLIGHT_CONNECT_S, RedisLink, heartbeat_key
from worker.delivery.replicas import ReplicaWait
from worker.delivery.sharding import ShardedWriter, ShardHeld
from worker.delivery.writer import ResultWriter, WriterSettings
from worker.delivery.writer_main import WriterInit
from worker.delivery.writer_process import WriterProcess
from worker.fetch.stage import FetchSettings, FetchStage
from worker.jobs import Job, Outcome
from worker.lifecycle.dispatch import Dispatcher, ReadRouter, Steps
from worker.lifecycle.engine import Engine, FeedSide, ModelSide
from worker.lifecycle.settlement import Settlement
from worker.model.compiler import still_compiled
from worker.model.readers import make_reader
from worker.observe.health import Health
from worker.observe.observer import Observer
from worker.pipeline.batcher import Batch, Batcher
from worker.pipeline.completion import CompletionWatcher
from worker.pipeline.degrade import DegradeSwitch, Serving
from worker.pipeline.device_room import DeviceRoom
from worker.pipeline.job_queue import JobQueue
from worker.pipeline.launch import Launched

log = structlog.get_logger("gpufeed.wiring")


class Role(Enum):
    """How shutdown treats a duty, in the order it comes to them."""

    HOUSEKEEPING = "housekeeping"  # cancelled at once: reclaim, trim, stats, probe, degrade
    READ = "read"  # asked to stop: nothing new is taken from the streams
    PIPELINE = "pipeline"  # drained: the sentinel flows batcher -> dispatcher -> watcher
    PUBLISH = "publish"  # closed once drained: it publishes what is left
    KEEP_ALIVE = "keep_alive"  # on until the end: the held entries' keep-alive, /live's beat


class Duty(NamedTuple):
    """One task of the main loop: its name (`reader`, `reader-1`, ...), role and body."""

    name: str
    role: Role
    run: Callable[[], Coroutine[Any, Any, Any]]


@dataclass
class Stages:
    engine: Engine
    in_flight: InFlight
    # Lists of jobs (one per read), bounded by the jobs they hold.
    jobs_q: JobQueue
    sealed_q: asyncio.Queue[Batch | None]
    # The held entries, and what the writer's published outcomes give back to the readers.
    settlement: Settlement
    # One shard: its writer as it is; several: the router in front of theirs; or the
    # worker's side of the writers' process (the tuning constant RESULT_WRITER).
    writer: Writer
    batcher: Batcher
    steps: Steps
    watcher: CompletionWatcher
    # `url` jobs: their bytes arrive here, then they join the jobs queue like the rest.
    fetcher: FetchStage
    dispatcher: Dispatcher
    readers: list[Reader]
    reclaimers: list[Reclaimer]
    # The fleet's hot list, with the hits counted for it (None: the tuning constant HOT_LIST
    # is 0 or the decode cache is off).
    hot: HotList | None = None
    duties: list[Duty] = field(default_factory=list)


def shard_task(name: str, shard: int) -> str:
    """Task names: `reader`, `trim`, ... for the first shard, `reader-1`, ... after it."""
    return name if shard == 0 else f"{name}-{shard}"


@dataclass
class _Queues:
    """Where the stages meet: the in-flight places, the bounded queues between the stages
    and the room on the device."""

    in_flight: InFlight
    # Lists of jobs (one per read), bounded by the jobs they hold.
    jobs_q: JobQueue
    sealed_q: asyncio.Queue[Batch | None]
    room: DeviceRoom


@dataclass
class _Pipeline:
    """The stages from a job's row to its outcome."""

    batcher: Batcher
    steps: Steps
    watcher: CompletionWatcher
    dispatcher: Dispatcher


def wire(
    cfg: WorkerConfig,
    engine: Engine,
    link: RedisLink,
    *,
    observer: Observer,
    health: Health,
    device: torch.device,
    exit_stack: contextlib.AsyncExitStack,
) -> Stages:
    """The bounded queues and the stages between them, for every shard of GPUFEED_SHARDS."""
    queues = _queues(cfg, engine.model)
    intakes = _intakes(cfg, engine.feed, link, exit_stack)
    settlement = Settlement(queues.in_flight, intakes, observer)
    writer = _writer(
        cfg,
        engine,
        link,
        observer=observer,
        on_published=settlement.on_published,
        device=device,
        exit_stack=exit_stack,
    )
    health.watch_writer(writer.stalled)
    hot = None if hot_list_off(cfg) else HotList(link.client, cfg.stream, cfg.hot_list)
    pipeline = _pipeline(cfg, engine, queues, writer, observer=observer, health=health, hot=hot)
    fetcher = _fetch_stage(
        cfg, engine.feed, queues, writer, observer=observer, exit_stack=exit_stack
    )
    readers, reclaimers = _shard_stages(
        cfg,
        link,
        queues,
        batch_size=engine.model.batch_size,
        intakes=intakes,
        held=settlement.held,
        writer=writer,
        fetcher=fetcher,
        observer=observer,
    )
    stages = Stages(
        engine=engine,
        in_flight=queues.in_flight,
        jobs_q=queues.jobs_q,
        sealed_q=queues.sealed_q,
        settlement=settlement,
        writer=writer,
        batcher=pipeline.batcher,
        steps=pipeline.steps,
        watcher=pipeline.watcher,
        fetcher=fetcher,
        dispatcher=pipeline.dispatcher,
        readers=readers,
        reclaimers=reclaimers,
        hot=hot,
    )
    stages.duties = _duties(cfg, stages, link.client, observer, health)
    return stages


def _queues(cfg: WorkerConfig, model: ModelSide) -> _Queues:
    batch_size = model.batch_size
    jobs_q = JobQueue(batch_size)
    return _Queues(
        in_flight=InFlight(in_flight_places(batch_size, cfg.ring_slots)),
        jobs_q=jobs_q,
        sealed_q=asyncio.Queue(cfg.ring_slots),
        # One batch running and one queued behind it on CUDA; on the CPU the step runs on
        # the launch thread, and a second sealed batch would only wait behind it.
        room=DeviceRoom(2 if model.ctx.is_cuda else 1, on_room=jobs_q.wake),
    )


def _pipeline(
    cfg: WorkerConfig,
    engine: Engine,
    queues: _Queues,
    writer: Writer,
    *,
    observer: Observer,
    health: Health,
    hot: HotList | None,
) -> _Pipeline:
    """The batcher, the dispatcher and the completion watcher, with the step(s) they
    serve."""
    model, feed = engine.model, engine.feed
    batcher = Batcher(
        feed.ring,
        feed.decoder,
        batch_size=model.batch_size,
        max_wait_s=cfg.max_wait_ms / 1000,
        jobs=queues.jobs_q,
        sealed=queues.sealed_q,
        room=queues.room,
    )
    steps = _steps(cfg, model, observer)
    watcher = CompletionWatcher(
        model.out_ring,
        writer.put,
        reader=steps.main.reader,
        on_batch_done=observer.batch_done if hot is None else _counting(observer, hot),
        room=queues.room,
    )
    dispatcher = Dispatcher(
        sealed=queues.sealed_q,
        ring=feed.ring,
        runner=model.runner,
        watcher=watcher,
        steps=steps,
        answer=writer.put,
        on_launched=health.launched,
        room=queues.room,
        gpu_decode=feed.gpu_decode,
    )
    return _Pipeline(batcher, steps, watcher, dispatcher)


def _fetch_stage(
    cfg: WorkerConfig,
    feed: FeedSide,
    queues: _Queues,
    writer: Writer,
    *,
    observer: Observer,
    exit_stack: contextlib.AsyncExitStack,
) -> FetchStage:
    """Where `url` jobs wait for their bytes before they join the jobs queue."""
    in_flight = queues.in_flight
    fetcher = FetchStage(
        FetchSettings.from_config(cfg),
        ready=queues.jobs_q.put,
        fail=writer.put,
        cache=feed.decode_cache,
        metrics=observer.metrics,
        # A job waiting for a fetch slot lends its in-flight place back meanwhile.
        give_back_place=in_flight.give_back,
        take_place=in_flight.take,
    )
    exit_stack.push_async_callback(fetcher.close)
    return fetcher


def _shard_stages(
    cfg: WorkerConfig,
    link: RedisLink,
    queues: _Queues,
    *,
    batch_size: int,
    intakes: dict[str, IntakeProcess],
    held: dict[tuple[str, str], Job],
    writer: Writer,
    fetcher: FetchStage,
    observer: Observer,
) -> tuple[list[Reader], list[Reclaimer]]:
    """Each shard's reader and reclaimer, handing what they read to one router in front of
    the fetch stage and the jobs queue."""
    layout, in_flight = cfg.shard_layout(), queues.in_flight
    router = ReadRouter(
        held=held,
        fetcher=fetcher,
        jobs=queues.jobs_q,
        answer=writer.put,
        shards=layout,
        cluster=link.cluster,
    )
    readers: list[Reader] = []
    reclaimers: list[Reclaimer] = []
    for shard in layout:
        lanes = cfg.lanes_of(shard.stream)
        deliver = router.of_shard(shard, lanes)
        readers.append(
            Reader(
                link.client,
                lanes=lanes,
                group=cfg.group,
                consumer=cfg.worker_name,
                default_reply_to=shard.results_stream,
                in_flight=in_flight,
                deliver=deliver,
                max_per_read=batch_size * 2,
                max_meta_bytes=cfg.max_meta_bytes,
                intake=intakes.get(lanes.streams[0]),
            )
        )
        reclaimers.append(
            Reclaimer(
                link.client,
                replace(
                    cfg,
                    stream=shard.stream,
                    results_stream=shard.results_stream,
                    result_prefix=shard.result_prefix,
                    dead_stream=shard.dead_stream,
                ),
                in_flight=in_flight,
                lanes=lanes,
                held=ShardHeld(held, lanes.streams),
                deliver=deliver,
                publish_now=writer.publish_now,
                on_event=observer.delivery_event,
            )
        )
    return readers, reclaimers


def hot_list_off(cfg: WorkerConfig) -> str:
    """Why this worker keeps no hot list, or ""."""
    if cfg.hot_list == 0:
        return table.given("hot_list", cfg.hot_list)
    if cfg.decode_cache_mb == 0:
        return "the decode cache is off (GPUFEED_DECODE_CACHE_MB is 0)"
    return ""


def _counting(observer: Observer, hot: HotList) -> Callable[[Launched, float], None]:
    """The watcher's per-batch call: the observer's counts, and the batch's cache hits for
    the hot list."""

    def batch_done(launched: Launched, gpu_ms: float) -> None:
        observer.batch_done(launched, gpu_ms)
        batch = launched.batch
        hot.counts.add(
            job
            for job, result in zip(batch.jobs, batch.results, strict=False)
            if result.cached and result.error is None
        )

    return batch_done


Writer = ResultWriter | ShardedWriter | WriterProcess


def _writer(
    cfg: WorkerConfig,
    engine: Engine,
    link: RedisLink,
    *,
    observer: Observer,
    on_published: Callable[[list[Outcome], list[int]], None],
    device: torch.device,
    exit_stack: contextlib.AsyncExitStack,
) -> Writer:
    """What the pipeline hands its outcomes to: each shard's result writer, on the event
    loop or in the writers' process, as the feed plan says."""
    layout = cfg.shard_layout()
    settings = _writer_settings(cfg, engine.model, device)
    if engine.feed.plan.result_writer == "process":
        init = WriterInit.of(
            cfg,
            cluster=link.cluster,
            writers=list(settings.values()),
            routes={
                lane.stream: (lane.keys or shard).stream
                for shard in layout
                for lane in cfg.lanes_of(shard.stream)
            },
            max_queued=cfg.ring_slots * 2,
        )
        proxy = WriterProcess(init, on_published=on_published, on_event=observer.delivery_event)
        exit_stack.callback(proxy.shutdown)
        return proxy
    replica_wait = (
        ReplicaWait(
            cfg.wait_replicas,
            cfg.wait_replicas_timeout_ms,
            on_short=lambda n: observer.delivery_event("replica_wait_timeout", n),
        )
        if cfg.wait_replicas
        else None
    )
    writers: dict[str, ResultWriter] = {}
    for shard in layout:
        # A shard's key sets (the operator's, each tenant's) publish on one client.
        client = _writer_client(cfg, link, shard, exit_stack)
        for keys, _ in cfg.key_sets(shard.index):
            writers[keys.stream] = ResultWriter(
                client,
                settings[keys.stream],
                max_queued=cfg.ring_slots * 2,
                on_published=on_published,
                replicas=replica_wait,
            )
    if len(writers) == 1:
        return next(iter(writers.values()))
    return ShardedWriter(
        {
            lane.stream: writers[(lane.keys or shard).stream]
            for shard in layout
            for lane in cfg.lanes_of(shard.stream)
        }
    )


def _writer_settings(
    cfg: WorkerConfig, model: ModelSide, device: torch.device
) -> dict[str, WriterSettings]:
    """The writer settings of each shard's key sets (the operator's, each tenant's), by
    the key set's job stream."""
    loaded, degraded = model.loaded, model.degraded
    # The rule the settings check applies too: a reply_to among these is refused.
    levels = parse_levels(cfg.priorities)
    owned = tuple(shards.own_keys(cfg.stream, cfg.shard_layout(), levels).rows())
    return {
        shard.stream: WriterSettings(
            stream=shard.stream,
            group=cfg.group,
            result_prefix=shard.result_prefix,
            result_ttl_s=cfg.result_ttl_s,
            results_maxlen=cfg.results_maxlen,
            worker_name=cfg.worker_name,
            model_name=loaded.name,
            weights=loaded.weights_label,
            device=str(device),
            dead_stream=shard.dead_stream,
            default_reply_to=shard.results_stream,
            degraded_model=degraded.loaded.name if degraded else "",
            degraded_weights=degraded.loaded.weights_label if degraded else "",
            max_result_bytes=cfg.max_result_bytes,
            owned=owned,
        )
        for own in cfg.shard_layout()
        for shard, _ in cfg.key_sets(own.index)
    }


def _writer_client(
    cfg: WorkerConfig,
    link: RedisLink,
    shard: shards.Shard,
    exit_stack: contextlib.AsyncExitStack,
) -> aioredis.Redis:
    """The client a shard's writer publishes with: on a cluster, the shard's master
    itself (a cluster pipeline takes no scripts, and WAIT needs the writes' connection)."""
    if not link.cluster:
        return link.client
    node = ShardNodeClient(cast(RedisCluster, link.client), cfg.redis_url, shard.stream)
    exit_stack.push_async_callback(node.aclose)
    return cast(aioredis.Redis, node)


def _intakes(
    cfg: WorkerConfig, feed: FeedSide, link: RedisLink, exit_stack: contextlib.AsyncExitStack
) -> dict[str, IntakeProcess]:
    """Each shard's intake process, by the job streams its reader reads (none: the reads
    run on the event loop). Each shard's ring has its own part of the payload memory; on a
    Redis Cluster each process reads its shard's master."""
    memory = feed.payloads
    if memory is None:
        return {}
    # On a Redis Cluster the URL is one node's: each read names its shard's master.
    layout = cfg.shard_layout()
    share = memory.size // len(layout)
    intakes: dict[str, IntakeProcess] = {}
    for i, shard in enumerate(layout):
        intake = IntakeProcess(
            url=cfg.redis_url,
            group=cfg.group,
            consumer=cfg.worker_name,
            connect_timeout_s=PREFLIGHT_CONNECT_S,
            memory_fd=memory.fd,
            view=memory.view,
            region=(i * share, (i + 1) * share),
        )
        exit_stack.callback(intake.shutdown)
        for stream in cfg.lanes_of(shard.stream).streams:
            intakes[stream] = intake
    return intakes


def _steps(cfg: WorkerConfig, model: ModelSide, observer: Observer) -> Steps:
    """The main step, and the degraded one with its switch where GPUFEED_DEGRADE_AFTER_S
    asks for it."""
    loaded = model.loaded
    main = Serving(
        model=loaded.name,
        weights=loaded.weights_label,
        degraded=False,
        out_ring=model.out_ring,
        reader=make_reader(loaded.output, loaded.categories),
    )
    if model.degraded is None:
        return Steps(main)
    assert model.degraded_out_ring is not None
    d = model.degraded.loaded
    degraded = Serving(
        model=d.name,
        weights=d.weights_label,
        degraded=True,
        out_ring=model.degraded_out_ring,
        reader=make_reader(d.output, d.categories),
        step=model.degraded_step,
    )
    metrics = observer.metrics

    def changed(on: bool, age_s: float) -> None:
        metrics.degraded.set(1 if on else 0)
        metrics.degrade_switches.labels("on" if on else "off").inc()

    return Steps(main, degraded, DegradeSwitch(after_s=cfg.degrade_after_s, on_change=changed))


def _duties(
    cfg: WorkerConfig,
    stages: Stages,
    client: aioredis.Redis,
    observer: Observer,
    health: Health,
) -> list[Duty]:
    in_flight = stages.in_flight
    duties = [
        Duty("writer", Role.PUBLISH, stages.writer.run),
        Duty("watcher", Role.PIPELINE, stages.watcher.run),
        Duty("dispatcher", Role.PIPELINE, stages.dispatcher.run),
        Duty("batcher", Role.PIPELINE, stages.batcher.run),
        *(Duty(shard_task("reader", i), Role.READ, r.run) for i, r in enumerate(stages.readers)),
        Duty(
            "stats",
            Role.HOUSEKEEPING,
            lambda: observer.run(
                client,
                key=heartbeat_key(cfg.worker_name),
                # Every shard's streams: the lag and pending gauges are the worker's.
                lanes=Lanes([ln for sh in cfg.shard_layout() for ln in cfg.lanes_of(sh.stream)]),
                group=cfg.group,
                in_flight=lambda: in_flight.count,
            ),
        ),
    ]
    for i, rc in enumerate(stages.reclaimers):
        duties += [
            # The keep-alive goes on while the pipeline drains: what it holds stays its own.
            Duty(shard_task("keepalive", i), Role.KEEP_ALIVE, rc.run_keepalive),
            Duty(shard_task("reclaim", i), Role.HOUSEKEEPING, rc.run_reclaim),
            Duty(shard_task("trim", i), Role.HOUSEKEEPING, rc.run_trim),
        ]
    if stages.hot is not None:
        duties.append(Duty("hot_list", Role.HOUSEKEEPING, stages.hot.run))
    # /live and /ready: proof that the loop runs, and whether Redis answers.
    duties += [
        Duty("beat", Role.KEEP_ALIVE, health.beat),
        Duty("redis_probe", Role.HOUSEKEEPING, lambda: health.probe_redis(client)),
    ]
    switch = stages.steps.switch
    if switch is not None:
        streams = [st for sh in cfg.shard_layout() for st in cfg.lanes_of(sh.stream).streams]
        duties.append(
            Duty(
                "degrade",
                Role.HOUSEKEEPING,
                lambda: switch.run(client, streams=streams, group=cfg.group),
            )
        )
    return duties


def observe(
    observer: Observer, stages: Stages, cfg: WorkerConfig, lanes: Lanes, device: torch.device
) -> None:
    """The observer's gauges and info, read from the stages."""
    model = stages.engine.model
    report = model.compile_report
    observer.start_sampler(device.index if model.ctx.is_cuda else None)
    observer.watch(
        jobs=stages.jobs_q.qsize,
        fetching=lambda: stages.fetcher.in_progress,
        sealed=stages.sealed_q.qsize,
        results=lambda: stages.writer.queued,
        in_flight=lambda: stages.in_flight.count,
    )
    observer.info = {
        # The model's name as results give it (a directory's name, not the path as typed):
        # one label for the same model in metrics, heartbeats and results.
        "model": model.loaded.name,
        "weights": model.loaded.weights_label,
        "device": model.ctx.name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "batch_size": model.batch_size,
        "compile": report.mode,
        "compiled": report.compiled,
        "stream": cfg.stream,
        "group": cfg.group,
        "priorities": ",".join(lane.level for lane in lanes if lane.level),
        "shards": len(cfg.shard_layout()),
    }
    observer.compile_check = lambda: still_compiled(report)
