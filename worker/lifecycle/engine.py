"""What a worker serves with, built before it joins the group: the model side (the model
compiled and warmed up on its batch shapes, the launch thread around it and its output
slots) and the feed side (the staging ring, the copies to the device and the decoders that
fill the ring).

`warm_up` reads as its steps (`_WarmUp`'s methods: load the model, shape the feed, build
the feed memory, start the launch thread, build the degraded model, compile on the launch
thread, build the decoders) and returns what they built as one `Engine` of the two sides;
each part that holds threads registers its teardown on the worker's exit stack as it is
built, so a start-up that fails half-way releases what it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import structlog
import torch

from worker.base.device import DeviceContext, make_context
from worker.base.errors import ConfigError
from worker.config import table
from worker.config.settings import WorkerConfig, gpu_decode_share
from worker.decode.arena import ArenaLayout, SharedArena
from worker.decode.cache import DecodeCache
from worker.decode.codecs import GpuDecodeUnavailable, IntoCodec
from worker.decode.cpu import DecodeSpec
from worker.decode.executor import DecodeExecutor
from worker.decode.gpu import setup_gpu_decode
from worker.decode.gpu_packed import DecodeRates, PackedGpuDecoder, measure_rates
from worker.decode.nvimgcodec import NvImgCodec, nvimgcodec_available
from worker.decode.packed import packed_side
from worker.decode.payloads import PayloadMemory, payload_bytes
from worker.decode.pool import DecodePool
from worker.decode.processes import DecodeProcessesFailed, ProcessDecodePool
from worker.decode.rows import row_side
from worker.decode.split import DecodeSplit
from worker.delivery.in_flight import in_flight_places
from worker.jobs import Job
from worker.lifecycle.feed_plan import FeedPlan, decode_processes_for, plan_feed, usable_cores
from worker.model.compiler import CompileReport, compile_step, mode_uses_cudagraphs, time_sizes
from worker.model.degraded import DegradedModel, build_degraded
from worker.model.loaded import LoadedModel
from worker.model.loader import load_configured
from worker.model.precision import (
    AgreementReport,
    PrecisionReport,
    merge_reports,
    output_agreement,
    precision_check,
)
from worker.model.resample import choose_placement, ring_budget, use_packed, use_rows
from worker.model.sizes import (
    BatchSizes,
    SizeReport,
    keep_faster,
    parse_batch_sizes,
    planned_sizes,
)
from worker.model.step import (
    InferenceStep,
    StepFn,
    build_step,
    check_step,
    pick_dtype,
    resolve_compile_mode,
)
from worker.observe.health import Health
from worker.pipeline.gpu_decode import GpuDecodeStage
from worker.pipeline.launch import ModelRunner
from worker.pipeline.staging import (
    InputRing,
    OutputRing,
    PinError,
    register_pinned,
    unregister_pinned,
)
from worker.pipeline.transfer import DeviceTransfer

log = structlog.get_logger("gpufeed.worker")

DecodeHook = Callable[[Job], None]


def default_batch_size(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 8


def default_decode_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


@dataclass
class ModelSide:
    """The model compiled for its batch shapes, the launch thread that runs it and the
    output slots it writes; with GPUFEED_DEGRADE_AFTER_S, the cheaper model beside it."""

    ctx: DeviceContext
    batch_size: int
    loaded: LoadedModel
    dtype: torch.dtype
    runner: ModelRunner
    compile_report: CompileReport
    precision: PrecisionReport | AgreementReport | None
    out_ring: OutputRing
    # Degrade under backlog (GPUFEED_DEGRADE_AFTER_S): the cheaper model, its compiled step
    # and its output slots (the main ones where its outputs have the same shape).
    degraded: DegradedModel | None = None
    degraded_step: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None
    degraded_out_ring: OutputRing | None = None


@dataclass
class FeedSide:
    """What brings images to the model: the decoders, the staging ring they fill and the
    copies to the device, as the feed plan chose them."""

    # Where images are resized (`device` or `host`) and, on the device, the side of the rows
    # that hold the decoded pixels and their geometry (0 on the host).
    placement: str
    row_side: int
    ring: InputRing
    transfer: DeviceTransfer
    ring_budget: dict[str, Any]
    # The stage between the batcher and the launch: the rows left for the GPU decoded, and
    # (GPU decode into packed rows) the split of each batch with the decode processes.
    gpu_decode: GpuDecodeStage
    decoder: DecodeExecutor
    decode_cache: DecodeCache
    decode_threads: int
    plan: FeedPlan
    # With the intake's process: the memory it reads image bytes into, which the decode
    # processes read them from (worker/decode/payloads.py).
    payloads: PayloadMemory | None = None


@dataclass
class Engine:
    """The compiled step (`model`) and what feeds it (`feed`), ready to serve."""

    model: ModelSide
    feed: FeedSide

    def staged_bytes_per_image(self) -> int:
        """Bytes staged (and copied to the device) per image: with packed rows, what the
        batches so far took (their pixels and a record each); else a whole row or image."""
        ring = self.feed.ring
        packed = ring.arena.packed if ring.arena is not None else None
        measured = packed.staged_bytes_per_image() if packed is not None else None
        if measured is not None:
            return round(measured)
        return int(self.feed.ring_budget["h2d_bytes_per_batch"]) // self.model.batch_size


def choose_sizes(
    fn: StepFn,
    example: torch.Tensor,
    planned: tuple[int, ...],
    report: CompileReport,
    *,
    auto: bool,
) -> BatchSizes:
    """Time each compiled size (start-up: it waits for the device) and keep those that run
    faster than the next larger one (`auto`) or all of them (listed by the operator); the
    report gets one SizeReport per size."""
    ms = time_sizes(fn, example, planned, cudagraphs=report.cudagraphs)
    kept = keep_faster(ms) if auto else planned
    report.batch_sizes = [
        SizeReport(
            size=size,
            compile_s=report.size_costs.get(size, (0.0, 0))[0],
            step_ms=ms[size],
            graph_bytes=report.size_costs.get(size, (0.0, 0))[1],
            kept=size in kept,
        )
        for size in planned
    ]
    return BatchSizes(kept)


@dataclass
class _Model:
    """The model loaded and its step in the serving dtype (eager until compiled)."""

    loaded: LoadedModel
    dtype: torch.dtype
    step: InferenceStep


@dataclass
class _FeedShape:
    """Where images are resized, and the rows the ring stages them in."""

    plan: FeedPlan
    placement: str
    placement_why: str
    # The staging size the decoders resize to (the model's).
    size: int
    # Device placement: rows of side `rows` hold the decoded pixels and their geometry (0 on
    # the host); decode processes pack them (worker/decode/packed.py) in the memory of rows
    # of side `side`, packed_side(rows).
    rows: int
    packed: bool
    side: int

    def read_rows(self, step: InferenceStep) -> None:
        """Make `step` read the ring's rows (device placement; on the host it reads images
        already at its staging size)."""
        if self.rows:
            (use_packed if self.packed else use_rows)(step, self.rows, self.size)


@dataclass
class _FeedMemory:
    """The memory batches are staged in, copied through and read back from."""

    # Shared with the decode processes (None with decode threads).
    arena: SharedArena | None
    ring: InputRing
    out_ring: OutputRing
    transfer: DeviceTransfer
    budget: dict[str, Any]


@dataclass
class _Degraded:
    """The cheaper model (GPUFEED_DEGRADE_AFTER_S) and its output slots."""

    model: DegradedModel
    out_ring: OutputRing


@dataclass
class _Compiled:
    """What the launch thread hands back from compiling and checking the steps."""

    sizes_why: str
    report: CompileReport | None = None
    precision: PrecisionReport | AgreementReport | None = None
    degraded_step: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None


@dataclass
class _Decoders:
    """What fills the ring: the decode threads or processes, and their cache."""

    decoder: DecodeExecutor
    cache: DecodeCache
    threads: int
    payloads: PayloadMemory | None
    # The plan with the GPU decode's share filled in where it was measured.
    plan: FeedPlan


async def warm_up(
    cfg: WorkerConfig,
    device: torch.device,
    *,
    health: Health,
    exit_stack: contextlib.AsyncExitStack,
    decode_hook: DecodeHook | None,
    gpu_backend: Callable[[], IntoCodec] | None = None,
) -> Engine:
    """Load the model, allocate the rings, compile and warm up the batch shapes, then
    start the decode threads (GPU decode where GPUFEED_DECODE asks for it). `gpu_backend`:
    the JPEG decoder the GPU decode into packed rows builds (None: nvImageCodec on the
    device; the tests give its CPU-only backend, which also runs off CUDA)."""
    start = _WarmUp(
        cfg,
        device,
        health=health,
        exit_stack=exit_stack,
        decode_hook=decode_hook,
        gpu_backend=gpu_backend,
    )
    model = start.load_model()
    shape = start.shape_the_feed(model)
    memory = start.build_feed_memory(shape, model.step)
    runner, gpu_decode = start.start_launch_thread(model.step, memory.transfer)
    degraded = start.build_degraded_model(model, shape, memory.out_ring)
    compiled = await start.compile_on_launch_thread(model, shape, runner, degraded)
    report = start.log_model_ready(model, shape, runner, compiled)
    decoders = start.build_decoders(model.loaded, shape, memory.arena, gpu_decode)
    log.info("feed_plan", plan=decoders.plan.line(), **decoders.plan.as_dict())
    return Engine(
        model=ModelSide(
            ctx=start.ctx,
            batch_size=start.batch_size,
            loaded=model.loaded,
            dtype=model.dtype,
            runner=runner,
            compile_report=report,
            precision=compiled.precision,
            out_ring=memory.out_ring,
            degraded=degraded.model if degraded is not None else None,
            degraded_step=compiled.degraded_step,
            degraded_out_ring=degraded.out_ring if degraded is not None else None,
        ),
        feed=FeedSide(
            placement=shape.placement,
            row_side=shape.rows,
            ring=memory.ring,
            transfer=memory.transfer,
            ring_budget=memory.budget,
            gpu_decode=gpu_decode,
            decoder=decoders.decoder,
            decode_cache=decoders.cache,
            decode_threads=decoders.threads,
            plan=decoders.plan,
            payloads=decoders.payloads,
        ),
    )


class _WarmUp:
    """The steps of a warm-up, in the order `warm_up` takes them, and what each reads: the
    settings, the device, the batch size and the exit stack the parts that hold threads or
    memory register their teardown on."""

    def __init__(
        self,
        cfg: WorkerConfig,
        device: torch.device,
        *,
        health: Health,
        exit_stack: contextlib.AsyncExitStack,
        decode_hook: DecodeHook | None,
        gpu_backend: Callable[[], IntoCodec] | None,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.health = health
        self.exit_stack = exit_stack
        self.decode_hook = decode_hook
        self.gpu_backend = gpu_backend
        # The device and the sizes: what every later step is shaped by.
        self.ctx = make_context(device)
        self.batch_size = cfg.batch_size or default_batch_size(device)
        self.pin = self.ctx.is_cuda
        self.mode = resolve_compile_mode(cfg.compile, device)

    def load_model(self) -> _Model:
        cfg, device = self.cfg, self.device
        # Fixed shapes make cudnn's per-shape tuning useless; turning it off keeps the
        # first batches from stalling on benchmark runs.
        torch.backends.cudnn.benchmark = False
        loaded = load_configured(
            cfg.model, cfg.weights, input_size=cfg.input_size, batch_size=self.batch_size
        )
        dtype = pick_dtype(cfg.precision, device)
        step = build_step(loaded, device=device, dtype=dtype, top_k=cfg.top_k)
        return _Model(loaded, dtype, step)

    def shape_the_feed(self, model: _Model) -> _FeedShape:
        """Where images are resized and who decodes them (the feed plan), and the rows the
        ring holds; the step reads those rows from here on."""
        cfg, hook = self.cfg, self.decode_hook
        thread_only_hook = hook is not None and not isinstance(hook, SleepHook)
        processes, _ = decode_processes_for(cfg, usable_cores(), thread_only_hook=thread_only_hook)
        placement, why = choose_placement(cfg.resize, self.device, cfg.decode, processes)
        plan = plan_feed(
            cfg,
            placement=placement,
            placement_why=why,
            thread_only_hook=thread_only_hook,
            default_threads=default_decode_threads(),
        )
        size = model.loaded.resize_size
        rows = row_side(size) if placement == "device" else 0
        packed = bool(rows) and plan.packed
        side = packed_side(rows) if packed else rows or size
        shape = _FeedShape(plan, placement, why, size, rows, packed, side)
        shape.read_rows(model.step)
        return shape

    def build_feed_memory(self, shape: _FeedShape, step: InferenceStep) -> _FeedMemory:
        """The input ring (in memory shared with the decode processes where they decode),
        the output slots and the copies to the device."""
        slots, batch, side, pin = self.cfg.ring_slots, self.batch_size, shape.side, self.pin
        arena = _shared_arena(
            shape.plan, batch, side, packed=shape.packed, pin=pin, exit_stack=self.exit_stack
        )
        budget: dict[str, Any] = {
            "resize_placement_why": shape.placement_why,
            "ring_pinned": pin,
            **ring_budget(batch, side, slots),
        }
        log.info("resize_placement", placement=shape.placement, **budget)
        return _FeedMemory(
            arena=arena,
            ring=InputRing(slots, batch, side, pin=pin, arena=arena),
            out_ring=OutputRing(slots, batch, step.layout, pin=pin),
            transfer=DeviceTransfer(self.ctx, slots, batch, side),
            budget=budget,
        )

    def start_launch_thread(
        self, step: InferenceStep, transfer: DeviceTransfer
    ) -> tuple[ModelRunner, GpuDecodeStage]:
        """The launch thread (copy in, step, copy out) and the GPU decode stage before it,
        with /live watching the launches."""
        ctx, exit_stack = self.ctx, self.exit_stack
        graphs = mode_uses_cudagraphs(self.mode) and ctx.is_cuda
        runner = ModelRunner(ctx, step, transfer, cudagraphs=graphs)
        gpu_decode = GpuDecodeStage(transfer)
        # Callbacks run last first: the launch thread ends before the GPU decoders it may wait on.
        exit_stack.callback(gpu_decode.shutdown)
        exit_stack.callback(runner.shutdown)
        self.health.watch_launches(
            lambda: runner.launch_started_s, self.cfg.ring_slots, device=self.device
        )
        return runner, gpu_decode

    def build_degraded_model(
        self, model: _Model, shape: _FeedShape, out_ring: OutputRing
    ) -> _Degraded | None:
        """The cheaper model GPUFEED_DEGRADE_AFTER_S serves under backlog (None: off),
        reading the same rows as the main step."""
        cfg = self.cfg
        if cfg.degrade_after_s <= 0:
            return None
        degraded = build_degraded(
            cfg,
            model.loaded,
            model.step,
            device=self.device,
            dtype=model.dtype,
            batch_size=self.batch_size,
        )
        shape.read_rows(degraded.step)
        layout = degraded.step.layout
        # Outputs of another shape (another model's classes) need slots of their own.
        if layout != model.step.layout:
            out_ring = OutputRing(cfg.ring_slots, self.batch_size, layout, pin=self.pin)
        return _Degraded(degraded, out_ring)

    async def compile_on_launch_thread(
        self, model: _Model, shape: _FeedShape, runner: ModelRunner, degraded: _Degraded | None
    ) -> _Compiled:
        """Check, compile and time the step (and the degraded one) on the launch thread:
        CUDA-graph trees are per thread, so they are recorded where launches happen."""
        try:
            sizes_setting = parse_batch_sizes(self.cfg.batch_sizes)
            planned, sizes_why = planned_sizes(sizes_setting, self.batch_size)
        except ValueError as exc:
            raise ConfigError(f"{table.BY_NAME['batch_sizes'].label}: {exc}") from None
        side = shape.side
        example = torch.zeros(
            (self.batch_size, side, side, 3), dtype=torch.uint8, device=self.device
        )
        compiled = _Compiled(sizes_why)
        steps = partial(
            self._compile_steps,
            compiled,
            model,
            runner,
            degraded=degraded.model if degraded is not None else None,
            example=example,
            planned=planned,
            auto=sizes_setting is None,
        )
        await asyncio.get_running_loop().run_in_executor(None, runner.run_sync, steps)
        return compiled

    def _compile_steps(
        self,
        out: _Compiled,
        model: _Model,
        runner: ModelRunner,
        *,
        degraded: DegradedModel | None,
        example: torch.Tensor,
        planned: tuple[int, ...],
        auto: bool,
    ) -> None:
        """On the launch thread: the step checked, compiled and timed on each planned size,
        its precision checked, then the degraded step's turn."""
        step, ctx = model.step, self.ctx
        # One eager batch first: a model that fails in the serving dtype or gives
        # outputs of the wrong shape is a configuration error, not a compile failure.
        check_step(step, example, what=f"GPUFEED_MODEL: {model.loaded.name}")
        fn, report = compile_step(
            step,
            example,
            mode=self.mode,
            allow_eager_fallback=self.cfg.allow_eager_fallback,
            sizes=planned[:-1],
        )
        runner.step = fn
        out.report = report
        runner.sizes = choose_sizes(fn, example, planned, report, auto=auto)
        if ctx.is_cuda:
            # Start-up only (it waits for the GPU): the serving dtype against fp32 eager,
            # on each size that runs.
            check = precision_check if step.layout[0].name == "indices" else output_agreement
            graphs = report.cudagraphs
            out.precision = merge_reports(
                [
                    check(step, fn, batch=size, batches=1, cudagraphs=graphs)
                    for size in runner.sizes.sizes
                ]
            )
        if degraded is not None:
            out.degraded_step = _compile_degraded(
                degraded,
                example,
                self.mode,
                report,
                cfg=self.cfg,
                ctx=ctx,
                batch_size=self.batch_size,
            )
        # The fp32 copy served only as the check's reference: give its memory back.
        step.fp32_weights = ()

    def log_model_ready(
        self, model: _Model, shape: _FeedShape, runner: ModelRunner, compiled: _Compiled
    ) -> CompileReport:
        """The batch sizes kept, the model ready and its precision check, in the log; the
        compile report they came from."""
        report, precision, loaded = compiled.report, compiled.precision, model.loaded
        assert report is not None
        log.info(
            "batch_sizes",
            sizes=list(runner.sizes.sizes),
            why=compiled.sizes_why,
            compiled=[r.as_dict() for r in report.batch_sizes],
        )
        log.info(
            "model_ready",
            model=self.cfg.model,
            weights=loaded.weights_label,
            kind=loaded.output.kind,
            device=self.ctx.name,
            dtype=str(model.dtype).removeprefix("torch."),
            batch_size=self.batch_size,
            staging_size=shape.size,
            input_size=loaded.crop_size,
            outputs={f.name: [*f.shape] for f in model.step.layout},
            **report.as_dict(),
        )
        if precision is not None:
            log.info("precision_check", **precision.as_dict())
        return report

    def build_decoders(
        self,
        loaded: LoadedModel,
        shape: _FeedShape,
        arena: SharedArena | None,
        gpu_decode: GpuDecodeStage,
    ) -> _Decoders:
        """The decode threads, or the decode processes (with the intake's payload memory
        and the GPU decode into packed rows where the plan asks for them)."""
        cfg, plan, exit_stack = self.cfg, shape.plan, self.exit_stack
        threads = plan.decode_processes or plan.decode_threads
        cache_bytes = cfg.decode_cache_mb * 1024 * 1024
        # With decode processes, half the cache is theirs (rows by their bytes), half the
        # worker's (`url` jobs' rows by their URL), so the two stay within the setting.
        cache = DecodeCache(cache_bytes // 2 if arena is not None else cache_bytes)
        if arena is None:
            pool_of_threads = _decode_pool(
                cfg,
                loaded,
                device=self.device,
                gpu_decode=gpu_decode,
                threads=threads,
                cache=cache,
                rows=shape.rows,
                hook=self.decode_hook,
                exit_stack=exit_stack,
            )
            return _Decoders(pool_of_threads, cache, threads, None, plan)
        payloads = None
        if plan.intake == "process":
            payloads = _payload_memory(cfg, self.batch_size, exit_stack)
        pool = _process_pool(
            cfg,
            loaded,
            plan,
            arena,
            rows=shape.rows,
            hook=self.decode_hook,
            cache=cache,
            payloads=payloads,
        )
        exit_stack.callback(pool.shutdown)
        if plan.packed and cfg.decode != "cpu":
            split, share_why = _packed_gpu_decode(
                cfg,
                loaded,
                self.device,
                pool,
                gpu_decode,
                rows=shape.rows,
                make_backend=self.gpu_backend,
            )
            share = split.share if split is not None else 0.0
            plan = replace(plan, gpu_decode_share=share, gpu_decode_why=share_why)
        return _Decoders(pool, cache, threads, payloads, plan)


def _compile_degraded(
    degraded: DegradedModel,
    example: torch.Tensor,
    mode: str,
    main: CompileReport,
    *,
    cfg: WorkerConfig,
    ctx: DeviceContext,
    batch_size: int,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Check, compile and warm up the degraded step on the launch thread, beside the main
    one (start-up only). Its graph is not a recompile of the main step's: the main
    report's baseline moves past it."""
    dstep, loaded = degraded.step, degraded.loaded
    check_step(dstep, example, what=f"{degraded.setting}: {loaded.name}")
    # A main step that fell back to eager (allowed) has a degraded step in eager too.
    dmode = "off" if main.fell_back_to_eager else mode
    fn, report = compile_step(dstep, example, mode=dmode, allow_eager_fallback=False, reset=False)
    if report.baseline is not None:
        main.baseline = report.baseline
    precision: PrecisionReport | AgreementReport | None = None
    if ctx.is_cuda:
        graphs = report.cudagraphs
        check = precision_check if dstep.layout[0].name == "indices" else output_agreement
        precision = check(dstep, fn, batch=batch_size, batches=1, cudagraphs=graphs)
    dstep.fp32_weights = ()
    log.info(
        "degraded_step_ready",
        model=loaded.name,
        weights=loaded.weights_label,
        staging_size=dstep.staging_size,
        input_size=dstep.crop_size,
        resized_from=dstep.input_side,
        after_s=cfg.degrade_after_s,
        outputs={f.name: [*f.shape] for f in dstep.layout},
        **report.as_dict(),
        **({"precision": precision.as_dict()} if precision is not None else {}),
    )
    return fn


def _shared_arena(
    plan: FeedPlan,
    batch_size: int,
    side: int,
    *,
    packed: bool,
    pin: bool,
    exit_stack: contextlib.AsyncExitStack,
) -> SharedArena | None:
    """The ring's memory shared with the decode processes (None with decode threads),
    registered with CUDA as pinned on a CUDA host."""
    if not plan.decode_processes:
        return None
    layout = ArenaLayout(
        rows=plan.ring_slots * batch_size,
        side=side,
        processes=plan.decode_processes,
        batch=batch_size if packed else 0,
    )
    try:
        arena = SharedArena.create(layout)
    except OSError as exc:
        raise ConfigError(
            f"GPUFEED_DECODE_PROCESSES: cannot allocate {layout.size:,} bytes of shared "
            f"staging memory ({exc}) for {plan.ring_slots} batches in flight ({plan.ring_why}); "
            "lower GPUFEED_BATCH_SIZE, or set GPUFEED_DECODE_PROCESSES=0"
        ) from None
    exit_stack.callback(arena.close)
    if pin:
        try:
            register_pinned(arena)
        except PinError as exc:
            raise ConfigError(f"GPUFEED_DECODE_PROCESSES: {exc}; set it to 0") from None
        exit_stack.callback(unregister_pinned, arena)
    return arena


def _payload_memory(
    cfg: WorkerConfig, batch_size: int, exit_stack: contextlib.AsyncExitStack
) -> PayloadMemory:
    size = payload_bytes(in_flight_places(batch_size, cfg.ring_slots))
    try:
        memory = PayloadMemory(size)
    except OSError as exc:
        raise ConfigError(
            f"the intake's process ({table.given('intake', cfg.intake)}): cannot allocate "
            f"{size:,} bytes of shared payload memory ({exc}); lower GPUFEED_BATCH_SIZE, or set "
            "GPUFEED_DECODE_PROCESSES=0 (decode threads, which read jobs on the event loop)"
        ) from None
    exit_stack.callback(memory.close)
    return memory


def _process_pool(
    cfg: WorkerConfig,
    loaded: LoadedModel,
    plan: FeedPlan,
    arena: SharedArena,
    *,
    rows: int,
    hook: DecodeHook | None,
    cache: DecodeCache,
    payloads: PayloadMemory | None,
) -> ProcessDecodePool:
    try:
        return ProcessDecodePool(
            _decode_spec(cfg, loaded),
            plan.decode_processes,
            cfg.path_root,
            arena=arena,
            budget_s=cfg.decode_budget_ms / 1000,
            row_side=rows,
            cache_bytes=cfg.decode_cache_mb * 1024 * 1024 // 2,
            cache_counts=cache,
            delay_s=hook.delay_s if isinstance(hook, SleepHook) else 0.0,
            max_image_pixels=cfg.max_image_pixels,
            payloads=payloads,
        )
    except DecodeProcessesFailed as exc:
        raise ConfigError(f"GPUFEED_DECODE_PROCESSES: {exc}; set it to 0") from None


def _packed_gpu_decode(
    cfg: WorkerConfig,
    loaded: LoadedModel,
    device: torch.device,
    pool: ProcessDecodePool,
    gpu_decode: GpuDecodeStage,
    *,
    rows: int,
    make_backend: Callable[[], IntoCodec] | None,
) -> tuple[DecodeSplit | None, str]:
    """GPU decode into packed rows (GPUFEED_DECODE=gpu|auto with decode processes): the
    decoder the GPU decode stage uses, and the split of each batch's rows between it and the
    processes, with why. (None, why) where it cannot run: an error for `gpu`, a log line
    for `auto`."""
    mode = cfg.decode
    spec = _decode_spec(cfg, loaded)

    def without(reason: str) -> tuple[DecodeSplit | None, str]:
        if mode == "gpu":
            raise ConfigError(f"GPUFEED_DECODE=gpu: {reason}")
        log.warning("gpu_decode_unavailable", decode=mode, reason=reason, using="cpu decode")
        return None, f"GPUFEED_DECODE=auto: {reason}; the decode processes decode every row"

    if make_backend is None:
        if device.type != "cuda":
            return without("the GPU decoder needs a CUDA device")
        missing = nvimgcodec_available()
        if missing is not None:
            return without(
                f"{missing}: with decode processes the GPU decodes through nvImageCodec "
                "(pip install 'gpufeed[gpu]'); GPUFEED_DECODE_PROCESSES=0 decodes from "
                "threads through torchvision instead"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()

        def make_backend() -> IntoCodec:
            return NvImgCodec(torch.device("cuda", index))

    packed = pool.arena.packed
    assert packed is not None
    try:
        decoder = PackedGpuDecoder(packed, make_backend, device=device)
    except Exception as exc:  # noqa: BLE001 - whatever the library raised: no GPU decoder
        return without(f"nvImageCodec could not build a decoder: {type(exc).__name__}: {exc}")
    setting = gpu_decode_share(cfg)
    if setting is None:
        try:
            rates = measure_rates(decoder, spec, rows, pool.processes)
        except Exception as exc:  # noqa: BLE001 - a decoder that fails its own samples
            decoder.shutdown()
            return without(f"the GPU decoder failed its start-up measurement: {exc}")
        share, why = rates.share, _measured_why(rates)
        pool.gpu_thumbnail_accept = rates.thumbnail_accept
        log.info("gpu_decode_rates", **rates.as_dict())
    else:
        share, why = setting, table.given("gpu_decode_share", cfg.gpu_decode_share)

    def set_share(value: float) -> None:
        pool.gpu_share = value

    split = DecodeSplit(share, tune=setting is None, on_change=set_share)
    gpu_decode.use_packed(decoder, pool.redecode, split)
    log.info("gpu_decode", decode=mode, gpu_decoder=decoder.backend_name, share=round(share, 3))
    return split, why


def _measured_why(rates: DecodeRates) -> str:
    """Why the GPU decodes the share it starts with, as the feed plan says it."""
    return (
        f"auto: measured on {rates.sample} JPEGs, the GPU {rates.gpu_images_per_s:,.0f} "
        f"images/s against {rates.processes} decode processes' "
        f"{rates.cpu_images_per_s:,.0f}; on 64x64 ones "
        f"{rates.thumbnail_gpu_images_per_s:,.0f} against "
        f"{rates.thumbnail_cpu_images_per_s:,.0f}, so {rates.thumbnail_share:.0%} of "
        "thumbnails; tuned while running"
    )


def _decode_spec(cfg: WorkerConfig, loaded: LoadedModel) -> DecodeSpec:
    return DecodeSpec(
        size=loaded.resize_size,
        max_bytes=cfg.max_image_bytes,
        max_pixels=cfg.max_image_pixels,
        dct_scaling=cfg.dct_scaling,
        max_decode_bytes=cfg.max_decode_mb * 1024 * 1024,
        geometry=loaded.resize_mode,
    )


def _decode_pool(
    cfg: WorkerConfig,
    loaded: LoadedModel,
    *,
    device: torch.device,
    gpu_decode: GpuDecodeStage,
    threads: int,
    cache: DecodeCache,
    rows: int,
    hook: DecodeHook | None,
    exit_stack: contextlib.AsyncExitStack,
) -> DecodePool:
    """The decode thread pool, and GPU decode where GPUFEED_DECODE asks for it."""
    spec = _decode_spec(cfg, loaded)
    decode = cfg.decode
    if rows and decode == "auto":
        # Rows at their own size (device placement): the threads' GPU decoder writes resized
        # rows, so `auto` decodes on the CPU (choose_placement says so in the plan).
        decode = "cpu"
    if spec.geometry != "shorter-crop" and decode != "cpu":
        # The GPU decoder resizes shorter-side-and-crop only.
        if decode == "gpu":
            raise ConfigError(
                f"GPUFEED_DECODE=gpu: the GPU decoder does resize = shorter-crop only; "
                f"{loaded.name} uses {spec.geometry} (decode on the CPU)"
            )
        decode = "cpu"
    try:
        # Falls back to CPU decode, logged, on any failure to build a GPU decoder.
        gpu = setup_gpu_decode(decode, device, spec, threads)
    except GpuDecodeUnavailable as exc:
        raise ConfigError(f"GPUFEED_DECODE=gpu: {exc}") from None
    router = None
    if gpu is not None:
        router, gpu_decoder, fields = gpu
        log.info("gpu_decode", **fields)
    decoder = DecodePool(
        spec,
        threads,
        cfg.path_root,
        delay_hook=hook,
        gpu_router=router,
        cache=cache,
        budget_s=cfg.decode_budget_ms / 1000,
        row_side=rows,
    )
    exit_stack.callback(decoder.shutdown)
    if gpu is not None:
        gpu_decode.use_rows(gpu_decoder, decoder.decode_on_cpu)
    return decoder


class SleepHook:
    """A decode hook that sleeps `delay_s` before each decode (a slow decoder): threads call
    it, decode processes sleep as long themselves."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, job: Job) -> None:
        time.sleep(self.delay_s)


def sleep_hook(delay_s: float) -> DecodeHook | None:
    """A decode hook that sleeps `delay_s` before each decode (a slow decoder); None for 0."""
    return SleepHook(delay_s) if delay_s else None
