"""What each stage costs on its own, and the throughput those costs allow together.

Decode rates are images/s of one method over an image set, on one thread and on N threads
(N = the worker's decode threads), with nothing else running. The model rates are the
direct-feed ceiling (worker/model/ceiling.py) at the worker's batch, and the naive worker's
forward at batch 1. From them:

- ideal gpufeed throughput: where the model runs on its own device (CUDA), the slowest of
  decode capacity, the model ceiling and the queue ceiling (gpufeed's Redis work alone for
  the same jobs, worker/tools/harness/queue_ceiling.py). On a CPU-only host decode and model
  share the same cores, so the bound is also the sum of their costs, each measured on all cores:
  1 / (1/decode_N + 1/model);
- ideal naive throughput: one job after another on one thread,
  1 / (t_decode_full + t_transforms + t_model_batch_1);
- pipeline efficiency = measured / ideal; ideal ratio = ideal gpufeed / ideal naive.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import simplejpeg  # type: ignore[import-untyped]
import torch
from PIL import Image

from measure.bench.ablations import CpuPreprocess
from measure.bench.naive import NaivePreprocess
from worker.decode.cpu import DecodeSpec, dct_scale, decode_to_array, sniff_format
from worker.decode.rows import decode_row, row_side, write_decoded_row
from worker.model.resample import RowResampler

DecodeFn = Callable[[bytes], object]

# Method name -> what it measures (the names are part of the report's schema).
DECODE_METHODS: dict[str, str] = {
    "pil_full_decode": "PIL full-resolution decode (Image.open().convert('RGB'))",
    "naive_cpu": "full decode + torchvision Resize, CenterCrop, ToTensor, Normalize (naive)",
    "decode_into_dct": "gpufeed decode: DCT-scaled JPEG decode + resize/crop into a row",
    "decode_into_full": "gpufeed decode with DCT scaling off",
    "cpu_preprocess": "gpufeed decode + torchvision transforms on the CPU (ablation)",
    "decoder_alone": "the decoder alone at the DCT scale, no checks, no resize: libjpeg-turbo "
    "(simplejpeg) for JPEGs, Pillow for the rest",
    "decode_rows": "gpufeed decode for the device placement (resize in the step): checks + "
    "DCT-scaled decode into a row at its own size",
    "rows_resized_on_cpu": "decode_rows + the step's resampling run on the CPU, batches of 8 "
    "(what the device placement costs a CPU host; auto picks host there)",
}


@dataclass(frozen=True)
class Rate:
    images_per_s: float
    images: int
    wall_s: float
    threads: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "images_per_s": round(self.images_per_s, 2),
            "images": self.images,
            "wall_s": round(self.wall_s, 3),
            "threads": self.threads,
        }


def decode_methods(
    *,
    staging_size: int,
    crop_size: int,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    geometry: str = "shorter-crop",
) -> dict[str, DecodeFn]:
    """The per-image work of each decode method, exactly as the runs do it."""
    naive = NaivePreprocess(
        resize=staging_size, crop=crop_size, mean=mean, std=std, geometry=geometry
    )
    dct = DecodeSpec(size=staging_size, dct_scaling=True, geometry=geometry)
    side = row_side(staging_size)
    full = DecodeSpec(size=staging_size, dct_scaling=False, geometry=geometry)
    cpu = CpuPreprocess(dct, crop=crop_size, mean=mean, std=std)
    return {
        "pil_full_decode": NaivePreprocess.decode,
        "naive_cpu": naive,
        "decode_into_dct": lambda data: decode_to_array(data, dct),
        "decode_into_full": lambda data: decode_to_array(data, full),
        "cpu_preprocess": cpu.to_array,
        "decoder_alone": decoder_alone(staging_size),
        "decode_rows": lambda data: decode_row(data, dct, side),
        "rows_resized_on_cpu": RowsOnCpu(dct, side, crop_size),
    }


def decoder_alone(size: int) -> DecodeFn:
    """What the decoder itself costs: the floor the decode stage is measured against."""

    def decode(data: bytes) -> object:
        if sniff_format(data) == "JPEG":
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            scale = dct_scale(width, height, size)
            return simplejpeg.decode_jpeg(
                data, min_height=-(-height // scale), min_width=-(-width // scale)
            )
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (size, size))
            im.load()
            return im

    return decode


class RowsOnCpu:
    """The device placement run wholly on the CPU: rows decoded, then resampled eagerly by
    the step's RowResampler in batches of 8 (the cost is per image)."""

    batch = 8

    def __init__(self, spec: DecodeSpec, side: int, crop: int) -> None:
        self.spec, self.side = spec, side
        self.resampler = RowResampler(side, spec.size, spec.size, crop)
        self._local = threading.local()

    def __call__(self, data: bytes) -> object:
        local = self._local
        if not hasattr(local, "rows"):
            local.rows = np.zeros((self.batch, self.side, self.side, 3), dtype=np.uint8)
            local.filled = 0
        row, _ = decode_row(data, self.spec, self.side)
        write_decoded_row(local.rows[local.filled], row)
        local.filled += 1
        if local.filled == self.batch:
            local.filled = 0
            with torch.inference_mode():
                return self.resampler(torch.from_numpy(local.rows))
        return row


def measure(
    fn: DecodeFn,
    images: Sequence[bytes],
    *,
    threads: int,
    min_time_s: float = 1.0,
    trials: int = 3,
) -> Rate:
    """Images/s of `fn` over `images`: the median of `trials` trials, each of whole passes
    over the images until `min_time_s / trials` has passed (a stall on a shared host moves
    one trial, not the figure)."""
    if not images:
        raise ValueError("no images to measure")
    fn(images[0])  # warm caches, lazy imports, libjpeg tables
    trial_s = min_time_s / max(1, trials)
    rates: list[Rate] = []
    if threads <= 1:
        for _ in range(max(1, trials)):
            rates.append(_trial(lambda: [fn(d) for d in images], len(images), trial_s, 1))
    else:
        # Enough work per pass that every thread has several images.
        work = list(images) * max(1, -(-2 * threads // len(images)))
        with ThreadPoolExecutor(threads, thread_name_prefix="bench-decode") as pool:
            list(pool.map(fn, images[:threads]))  # start the threads before timing
            for _ in range(max(1, trials)):
                rates.append(_trial(lambda: list(pool.map(fn, work)), len(work), trial_s, threads))
    rates.sort(key=lambda r: r.images_per_s)
    return rates[len(rates) // 2]


def _trial(one_pass: Callable[[], object], per_pass: int, min_s: float, threads: int) -> Rate:
    done = 0
    t0 = time.perf_counter()
    while True:
        one_pass()
        done += per_pass
        wall = time.perf_counter() - t0
        if wall >= min_s:
            return Rate(done / max(wall, 1e-9), done, wall, threads)


def decode_rates(
    images: Sequence[bytes],
    methods: dict[str, DecodeFn],
    thread_counts: Sequence[int],
    *,
    min_time_s: float = 1.0,
) -> dict[str, dict[str, Rate]]:
    """{method: {threads (as text): Rate}}."""
    out: dict[str, dict[str, Rate]] = {}
    for name, fn in methods.items():
        out[name] = {
            str(t): measure(fn, images, threads=t, min_time_s=min_time_s)
            for t in sorted(set(thread_counts))
        }
    return out


@dataclass(frozen=True)
class Ideal:
    images_per_s: float
    limited_by: str  # "decode", "model", "shared CPU (decode + model)" or "queue (Redis)"
    bounds: dict[str, float]


def ideal_pipeline(
    *,
    decode_run: float,
    decode_all_cores: float,
    model: float,
    shared_cpu: bool,
    queue: float | None = None,
) -> Ideal:
    """The throughput the isolated stage costs allow a pipelined worker.

    decode_run: decode images/s with the run's own decode threads; decode_all_cores: with
    one thread per core; model: the direct-feed ceiling at the run's batch; queue: the queue
    ceiling (worker/tools/harness/queue_ceiling.py) for the same jobs and batch, when measured.
    """
    bounds = {"decode": decode_run, "model": model}
    if queue is not None:
        bounds["queue (Redis)"] = queue
    if shared_cpu:
        bounds["shared CPU (decode + model)"] = 1.0 / (1.0 / decode_all_cores + 1.0 / model)
    limited_by = min(bounds, key=lambda k: bounds[k])
    return Ideal(bounds[limited_by], limited_by, {k: round(v, 2) for k, v in bounds.items()})


def ideal_sequential(*, cpu_per_image: float, model_batch_1: float) -> float:
    """One job after the other: the naive worker's bound (rates in images/s)."""
    return 1.0 / (1.0 / cpu_per_image + 1.0 / model_batch_1)
