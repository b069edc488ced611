"""Phases `decode` (RGB, grey and CMYK JPEGs decoded by each GPU decoder against the CPU
path), and two extras: `gpu_decode_rate` (the GPU's JPEG decoder alone against the CPU's
decode threads on large JPEGs, and the JPEG engines per image size) and
`decode_processes` (what the decode processes reach on this host's cores)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from measure.gpu_check.decode_scaling import decode_process_rates
from measure.gpu_check.engine_rates import engine_rates
from measure.gpu_check.phases.state import Run
from worker.decode.codecs import GpuDecodeUnavailable
from worker.decode.cpu import DecodeInfo, DecodeSpec, decode_to_array
from worker.decode.gpu import GpuDecodeFailed, GpuDecoder, GpuRow, make_backend
from worker.decode.samples import synthetic_jpeg
from worker.tools.harness.instruments import count_host_syncs

if TYPE_CHECKING:
    from measure.gpu_check.check import CheckArgs


def _recorded_event(device: torch.device) -> Any:
    """An event recorded on `device`'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def decode_differences(device: torch.device, size: int = 224) -> dict[str, Any]:
    """Where each GPU JPEG decoder differs from the CPU path, per colour mode: mean and
    largest absolute difference per pixel value (0..255), after the same resize and crop.
    The router sends only RGB and grey JPEGs to the GPU; CMYK is measured to show why."""
    spec = DecodeSpec(size=size, dct_scaling=False)
    samples = {
        mode: synthetic_jpeg(640, 480, seed=7, quality=90, mode=mode)
        for mode in ("RGB", "L", "CMYK")
    }
    out: dict[str, Any] = {}
    for prefer in ("nvimgcodec", "torchvision"):
        try:
            decoder = GpuDecoder(device, make_backend(device, prefer))
        except GpuDecodeUnavailable as exc:
            out[prefer] = {"available": False, "reason": str(exc)}
            continue
        per_mode: dict[str, Any] = {}
        try:
            for mode, data in samples.items():
                want, info = decode_to_array(data, spec)
                row = GpuRow(data, DecodeInfo("JPEG", info.width, info.height, 1), 1)
                dest = torch.zeros((1, size, size, 3), dtype=torch.uint8, device=device)
                # The zero-fill runs on this thread's stream, the decode on the decoder's:
                # the decoder waits for the fill, and the read-back for the decode.
                filled = _recorded_event(device)
                try:
                    result = decoder.decode_rows_sync([(0, row)], dest, filled)
                except GpuDecodeFailed as exc:
                    per_mode[mode] = {"decoded": False, "error": str(exc)}
                    continue
                if result.failed:
                    per_mode[mode] = {"decoded": False, "error": "the decoder returned nothing"}
                    continue
                if device.type == "cuda":
                    torch.cuda.current_stream(device).wait_event(result.ready)  # type: ignore[arg-type]
                got = dest[0].cpu().numpy().astype(int)  # measurement: waits for the GPU
                diff = abs(got - want.astype(int))
                per_mode[mode] = {
                    "decoded": True,
                    "mean_abs_diff": round(float(diff.mean()), 3),
                    "max_abs_diff": int(diff.max()),
                    "mean_abs_diff_per_channel": [
                        round(float(diff[..., ch].mean()), 3) for ch in range(3)
                    ],
                }
        finally:
            decoder.shutdown()
        out[prefer] = {"available": True, "modes": per_mode}
    return out


def decode_rates(
    device: torch.device,
    size: int,
    batch: int,
    cpu_threads: int,
    *,
    width: int = 2600,
    height: int = 1950,
    seconds: float = 3.0,
) -> dict[str, Any]:
    """GPU decode (as GPUFEED_DECODE=gpu runs it: batches of `batch` rows into a device
    batch) against the CPU decode pool (`cpu_threads`, DCT scaling on) on large JPEGs, in
    images/s, and the host syncs one GPU-decode batch costs, under the profiler."""
    images = [synthetic_jpeg(width, height, seed=i, quality=90) for i in range(8)]
    out: dict[str, Any] = {"images": f"{width}x{height} JPEG q90", "batch": batch}
    spec = DecodeSpec(size=size, dct_scaling=True)

    # The CPU pool: each thread decodes whole images, as the worker's decode threads do.
    def cpu_one(i: int) -> None:
        decode_to_array(images[i % len(images)], spec)

    with ThreadPoolExecutor(cpu_threads) as pool:
        list(pool.map(cpu_one, range(cpu_threads)))  # warm-up
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            list(pool.map(cpu_one, range(n, n + cpu_threads * 4)))
            n += cpu_threads * 4
        out["cpu_images_per_s"] = round(n / (time.perf_counter() - t0), 1)
    out["cpu_threads"] = cpu_threads

    try:
        decoder = GpuDecoder(device, make_backend(device))
    except GpuDecodeUnavailable as exc:
        out["gpu"] = f"not measured: {exc}"
        return out
    out["backend"] = decoder.backend.name
    info = DecodeInfo("JPEG", width, height, 1)
    rows = [(r, GpuRow(images[r % len(images)], info, 1)) for r in range(batch)]
    dest = torch.zeros((batch, size, size, 3), dtype=torch.uint8, device=device)
    try:
        last = decoder.decode_rows_sync(rows, dest, _recorded_event(device))  # warm-up
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            # Each batch waits for the previous one's writes to dest, on the GPU.
            last = decoder.decode_rows_sync(rows, dest, last.ready)
            n += batch
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # measurement: the queued decodes must finish
        out["gpu_images_per_s"] = round(n / (time.perf_counter() - t0), 1)
        out["gpu_failed_rows"] = len(last.failed)
        with count_host_syncs(profile=True) as syncs:
            for _ in range(2):
                last = decoder.decode_rows_sync(rows, dest, last.ready)
        out["gpu_syncs_per_batch"] = (
            round(syncs.total / 2, 1) if syncs.profile_error is None else syncs.profile_error
        )
        out["gpu_sync_sites"] = syncs.sites[:5]
    finally:
        decoder.shutdown()
    return out


async def decode(run: Run, entry: dict[str, Any]) -> None:
    run.report["gpu_decode_vs_cpu"] = await run.in_thread(
        decode_differences, run.device, run.worker.report().staging_size
    )


async def gpu_decode_rate(run: Run, entry: dict[str, Any]) -> None:
    facts = run.worker.report()
    run.report["gpu_decode_rate"] = rates = await run.in_thread(
        decode_rates,
        facts.device,
        facts.staging_size,
        facts.batch_size,
        facts.decode_threads,
    )
    rates["model_images_per_s"] = run.best
    # The JPEG engines as the worker's packed rows use them, per image size.
    rates["engines"] = await run.in_thread(
        engine_rates, run.device, count_syncs=lambda: count_host_syncs(profile=True)
    )


def decode_processes_s(args: CheckArgs) -> float:
    """The decode processes' phase: each image size and number of processes timed."""
    return 12 * args.decode_rate_seconds + 15


async def decode_processes(run: Run, entry: dict[str, Any]) -> None:
    """The CPU's side of the decode, per image size: what the decode processes reach on
    this host's cores (the split between the GPU's JPEG engines and the CPU is planned on
    it)."""
    run.report["decode_process_rates"] = await run.in_thread(
        decode_process_rates,
        run.worker.report().staging_size,
        os.cpu_count() or 1,
        seconds=run.args.decode_rate_seconds,
    )
