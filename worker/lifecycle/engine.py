"""The model side of a worker, built before it joins the group: the model loaded, compiled
and warmed up on its batch shapes, the staging rings and the launch thread around it,
and the decode threads that fill the rings.

`warm_up` returns it as one object; each part that holds threads registers its teardown on
the worker's exit stack as it is built, so a start-up that fails half-way releases what it
had.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import structlog
import torch

from worker.base.device import DeviceContext, make_context
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig, gpu_decode_share
from worker.decode.arena import ArenaLayout, SharedArena
from worker.decode.cache import DecodeCache
from worker.decode.codecs import GpuDecodeUnavailable, IntoCodec
from worker.decode.cpu import DecodeSpec
from worker.decode.executor import DecodeExecutor
from worker.decode.gpu import setup_gpu_decode
from worker.decode.gpu_packed import PackedGpuDecoder, measure_rates
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
from worker.model.step import StepFn, build_step, check_step, pick_dtype, resolve_compile_mode
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
class Engine:
    """The compiled step and what feeds it, ready to serve."""

    ctx: DeviceContext
    batch_size: int
    loaded: LoadedModel
    dtype: torch.dtype
    # Where images are resized (`device` or `host`) and, on the device, the side of the rows
    # that hold the decoded pixels and their geometry (0 on the host).
    placement: str
    row_side: int
    ring: InputRing
    out_ring: OutputRing
    transfer: DeviceTransfer
    ring_budget: dict[str, Any]
    runner: ModelRunner
    # The stage between the batcher and the launch: the rows left for the GPU decoded, and
    # (GPU decode into packed rows) the split of each batch with the decode processes.
    gpu_decode: GpuDecodeStage
    compile_report: CompileReport
    precision: PrecisionReport | AgreementReport | None
    decoder: DecodeExecutor
    decode_cache: DecodeCache
    decode_threads: int
    plan: FeedPlan
    # With the intake's process: the memory it reads image bytes into, which the decode
    # processes read them from (worker/decode/payloads.py).
    payloads: PayloadMemory | None = None
    # Degrade under backlog (GPUFEED_DEGRADE_AFTER_S): the cheaper model, its compiled step
    # and its output slots (the main ones where its outputs have the same shape).
    degraded: DegradedModel | None = None
    degraded_step: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None
    degraded_out_ring: OutputRing | None = None

    def staged_bytes_per_image(self) -> int:
        """Bytes staged (and copied to the device) per image: with packed rows, what the
        batches so far took (their pixels and a record each); else a whole row or image."""
        packed = self.ring.arena.packed if self.ring.arena is not None else None
        measured = packed.staged_bytes_per_image() if packed is not None else None
        if measured is not None:
            return round(measured)
        return int(self.ring_budget["h2d_bytes_per_batch"]) // self.batch_size


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
class _Compiled:
    """What the launch thread hands back from compiling and checking the steps."""

    report: CompileReport | None = None
    precision: PrecisionReport | AgreementReport | None = None
    degraded_step: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None


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
    ctx = make_context(device)
    batch_size = cfg.batch_size or default_batch_size(device)
    # Fixed shapes make cudnn's per-shape tuning useless; turning it off keeps the
    # first batches from stalling on benchmark runs.
    torch.backends.cudnn.benchmark = False
    loaded = load_configured(
        cfg.model, cfg.weights, input_size=cfg.input_size, batch_size=batch_size
    )
    dtype = pick_dtype(cfg.precision, device)
    step = build_step(loaded, device=device, dtype=dtype, top_k=cfg.top_k)
    size = loaded.resize_size
    pin = ctx.is_cuda
    thread_only_hook = decode_hook is not None and not isinstance(decode_hook, SleepHook)
    processes, _ = decode_processes_for(cfg, usable_cores(), thread_only_hook=thread_only_hook)
    placement, why = choose_placement(cfg.resize, device, cfg.decode, processes)
    plan = plan_feed(
        cfg,
        placement=placement,
        placement_why=why,
        thread_only_hook=thread_only_hook,
        default_threads=default_decode_threads(),
    )
    # Device placement: rows of side R hold the decoded pixels and their geometry; decode
    # processes pack them (worker/decode/packed.py) in the memory of rows of side R + 1.
    rows = row_side(size) if placement == "device" else 0
    packed = bool(rows) and plan.packed
    side = packed_side(rows) if packed else rows or size
    use_input = use_packed if packed else use_rows
    if rows:
        use_input(step, rows, size)
    arena = _shared_arena(plan, batch_size, side, packed=packed, pin=pin, exit_stack=exit_stack)
    ring = InputRing(cfg.ring_slots, batch_size, side, pin=pin, arena=arena)
    out_ring = OutputRing(cfg.ring_slots, batch_size, step.layout, pin=pin)
    transfer = DeviceTransfer(ctx, cfg.ring_slots, batch_size, side)
    budget: dict[str, Any] = {
        "resize_placement_why": why,
        "ring_pinned": pin,
        **ring_budget(batch_size, side, cfg.ring_slots),
    }
    log.info("resize_placement", placement=placement, **budget)
    mode = resolve_compile_mode(cfg.compile, device)
    runner = ModelRunner(ctx, step, transfer, cudagraphs=mode_uses_cudagraphs(mode) and ctx.is_cuda)
    gpu_decode = GpuDecodeStage(transfer)
    # Callbacks run last first: the launch thread ends before the GPU decoders it may wait on.
    exit_stack.callback(gpu_decode.shutdown)
    exit_stack.callback(runner.shutdown)
    health.watch_launches(lambda: runner.launch_started_s, cfg.ring_slots, device=device)
    example = torch.zeros((batch_size, side, side, 3), dtype=torch.uint8, device=device)
    degraded: DegradedModel | None = None
    degraded_out_ring: OutputRing | None = None
    if cfg.degrade_after_s > 0:
        degraded = build_degraded(
            cfg, loaded, step, device=device, dtype=dtype, batch_size=batch_size
        )
        if rows:
            use_input(degraded.step, rows, size)
        layout = degraded.step.layout
        # Outputs of another shape (another model's classes) need slots of their own.
        degraded_out_ring = (
            out_ring
            if layout == step.layout
            else OutputRing(cfg.ring_slots, batch_size, layout, pin=pin)
        )
    compiled = _Compiled()

    try:
        sizes_setting = parse_batch_sizes(cfg.batch_sizes)
        planned, sizes_why = planned_sizes(sizes_setting, batch_size)
    except ValueError as exc:
        raise ConfigError(f"GPUFEED_BATCH_SIZES: {exc}") from None

    def compile_on_launch_thread() -> None:
        # One eager batch first: a model that fails in the serving dtype or gives
        # outputs of the wrong shape is a configuration error, not a compile failure.
        check_step(step, example, what=f"GPUFEED_MODEL: {loaded.name}")
        # CUDA-graph trees are per thread: compile and warm up where launches happen.
        fn, report = compile_step(
            step,
            example,
            mode=mode,
            allow_eager_fallback=cfg.allow_eager_fallback,
            sizes=planned[:-1],
        )
        runner.step = fn
        compiled.report = report
        graphs = report.cudagraphs
        runner.sizes = choose_sizes(fn, example, planned, report, auto=sizes_setting is None)
        if ctx.is_cuda:
            # Start-up only (it waits for the GPU): the serving dtype against fp32 eager,
            # on each size that runs.
            check = precision_check if step.layout[0].name == "indices" else output_agreement
            compiled.precision = merge_reports(
                [
                    check(step, fn, batch=size, batches=1, cudagraphs=graphs)
                    for size in runner.sizes.sizes
                ]
            )
        if degraded is not None:
            compiled.degraded_step = _compile_degraded(
                degraded, example, mode, report, cfg=cfg, ctx=ctx, batch_size=batch_size
            )
        # The fp32 copy served only as the check's reference: give its memory back.
        step.fp32_weights = ()

    await asyncio.get_running_loop().run_in_executor(
        None, runner.run_sync, compile_on_launch_thread
    )
    report, precision = compiled.report, compiled.precision
    assert report is not None
    log.info(
        "batch_sizes",
        sizes=list(runner.sizes.sizes),
        why=sizes_why,
        compiled=[r.as_dict() for r in report.batch_sizes],
    )
    log.info(
        "model_ready",
        model=cfg.model,
        weights=loaded.weights_label,
        kind=loaded.output.kind,
        device=ctx.name,
        dtype=str(dtype).removeprefix("torch."),
        batch_size=batch_size,
        staging_size=size,
        input_size=loaded.crop_size,
        outputs={f.name: [*f.shape] for f in step.layout},
        **report.as_dict(),
    )
    if precision is not None:
        log.info("precision_check", **precision.as_dict())
    threads = plan.decode_processes or plan.decode_threads
    cache_bytes = cfg.decode_cache_mb * 1024 * 1024
    # With decode processes, half the cache is theirs (rows by their bytes), half the
    # worker's (`url` jobs' rows by their URL), so the two stay within the setting.
    cache = DecodeCache(cache_bytes // 2 if arena is not None else cache_bytes)
    decoder: DecodeExecutor
    payloads: PayloadMemory | None = None
    if arena is not None:
        if plan.intake == "process":
            payloads = _payload_memory(cfg, batch_size, exit_stack)
        decoder = _process_pool(
            cfg, loaded, plan, arena, rows=rows, hook=decode_hook, cache=cache, payloads=payloads
        )
        exit_stack.callback(decoder.shutdown)
        if plan.packed and cfg.decode != "cpu":
            split, share_why = _packed_gpu_decode(
                cfg, loaded, device, decoder, gpu_decode, rows=rows, make_backend=gpu_backend
            )
            share = split.share if split is not None else 0.0
            plan = replace(plan, gpu_decode_share=share, gpu_decode_why=share_why)
    else:
        decoder = _decode_pool(
            cfg,
            loaded,
            device=device,
            gpu_decode=gpu_decode,
            threads=threads,
            cache=cache,
            rows=rows,
            hook=decode_hook,
            exit_stack=exit_stack,
        )
    log.info("feed_plan", plan=plan.line(), **plan.as_dict())
    return Engine(
        ctx=ctx,
        batch_size=batch_size,
        loaded=loaded,
        dtype=dtype,
        placement=placement,
        row_side=rows,
        ring=ring,
        out_ring=out_ring,
        transfer=transfer,
        ring_budget=budget,
        runner=runner,
        gpu_decode=gpu_decode,
        compile_report=report,
        precision=precision,
        decoder=decoder,
        decode_cache=cache,
        decode_threads=threads,
        plan=plan,
        payloads=payloads,
        degraded=degraded,
        degraded_step=compiled.degraded_step,
        degraded_out_ring=degraded_out_ring,
    )


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
            f"staging memory ({exc}); lower GPUFEED_RING_SLOTS or GPUFEED_BATCH_SIZE, or set "
            "GPUFEED_DECODE_PROCESSES=0"
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
            f"GPUFEED_INTAKE: cannot allocate {size:,} bytes of shared payload memory ({exc}); "
            "set GPUFEED_INTAKE=loop"
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
        share = rates.share
        pool.gpu_thumbnail_accept = rates.thumbnail_accept
        why = (
            f"auto: measured on {rates.sample} JPEGs, the GPU {rates.gpu_images_per_s:,.0f} "
            f"images/s against {rates.processes} decode processes' "
            f"{rates.cpu_images_per_s:,.0f}; on 64x64 ones "
            f"{rates.thumbnail_gpu_images_per_s:,.0f} against "
            f"{rates.thumbnail_cpu_images_per_s:,.0f}, so {rates.thumbnail_share:.0%} of "
            "thumbnails; tuned while running"
        )
        log.info("gpu_decode_rates", **rates.as_dict())
    else:
        share, why = setting, f"GPUFEED_GPU_DECODE_SHARE={cfg.gpu_decode_share}"

    def set_share(value: float) -> None:
        pool.gpu_share = value

    split = DecodeSplit(share, tune=setting is None, on_change=set_share)
    gpu_decode.use_packed(decoder, pool.redecode, split)
    log.info("gpu_decode", decode=mode, gpu_decoder=decoder.backend_name, share=round(share, 3))
    return split, why


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
