"""The gpufeed variants the benchmark runs: the defaults, each optimisation switched off, and
the decode-cache pair (repeated images, cache on and off).

Most switches are plain worker settings (`dct_scaling`, `decode_threads`, `compile`). GPU
preprocessing has no switch in the worker, so it is emulated here, without touching the
pipeline: `CpuPreprocessPool` replaces the worker's decode pool and does, per image on a
decode thread, what a CPU-preprocessing design does (the same decode, DCT-scaled when
`dct_scaling` is on, then torchvision's Resize, CenterCrop, ToTensor and Normalize to a float
tensor). The staging slots hold uint8 pixels, so the normalised tensor is turned back into
uint8 and written into the centre of the slot row, where the step's crop finds it; the step
then normalises once more on the device. The emulation therefore pays one extra elementwise
pass per image on the CPU (about what Normalize costs), and slightly overstates what GPU
preprocessing is worth; the stage-rate table measures its per-image cost in isolation.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from measure.bench.naive import NaivePreprocess
from producer.wire import ErrorCode
from worker.config.settings import WorkerConfig
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, sniff_format
from worker.decode.executor import DecodeResult
from worker.decode.pool import DecodePool, RowTicket
from worker.jobs import Job


@dataclass(frozen=True)
class Variant:
    name: str  # the run's name in the report
    label: str  # what it is, for people
    switch: str  # the optimisation it turns off ("" for the defaults)
    overrides: tuple[tuple[str, Any], ...] = ()
    cpu_preprocess: bool = False
    # The cache pair: the jobs repeat the distinct images as they are (no per-job trailer,
    # worker/tools/harness/redis_env.py `job_image`), and `cache` names the run in the schema.
    repeats: bool = False
    cache: str = ""  # "cache_on_repeats" or "cache_off_repeats"; "" for every other run
    # "url": the jobs name URLs on a loopback HTTP server instead of carrying their bytes
    # (measure/bench/url_jobs.py); reported apart, next to the inline runs they mirror.
    source: str = "image"

    def settings(self) -> dict[str, Any]:
        return dict(self.overrides)


DEFAULTS = Variant("gpufeed", "gpufeed, defaults", "")
NO_DCT = Variant(
    "gpufeed-no-dct", "DCT-scaled decode off", "dct_scaling", (("dct_scaling", False),)
)
ONE_DECODE_THREAD = Variant(
    "gpufeed-1-decode-thread",
    "parallel decode off (1 thread)",
    "parallel_decode",
    (("decode_processes", "0"), ("decode_threads", 1)),
)
ONE_DECODE_PROCESS = Variant(
    "gpufeed-1-decode-process",
    "parallel decode off (1 decode process)",
    "parallel_decode",
    (("decode_processes", "1"),),
)
# Decode processes, where the defaults decode on threads (hosts under 4 cores).
DECODE_PROCESSES = Variant(
    "gpufeed-decode-processes",
    "decode processes on (2, instead of threads)",
    "decode_processes",
    (("decode_processes", "2"),),
)
# The switch back: decode threads in the worker's process, as before decode processes.
DECODE_THREADS = Variant(
    "gpufeed-decode-threads",
    "decode processes off (threads in the worker)",
    "decode_processes",
    (("decode_processes", "0"),),
)
CPU_PREPROCESS = Variant(
    "gpufeed-cpu-preprocess",
    "GPU preprocessing off (CPU transforms)",
    "gpu_preprocess",
    # The emulation writes resized S x S rows: the host placement's ring.
    (("resize", "host"),),
    cpu_preprocess=True,
)
DEVICE_RESIZE_OFF = Variant(
    "gpufeed-host-resize",
    "resize on the device off (Pillow on the decode threads)",
    "device_resize",
    (("resize", "host"),),
)
NO_COMPILE = Variant("gpufeed-no-compile", "compile off (eager)", "compile", (("compile", "off"),))
# On the CPU the default is eager (GPUFEED_COMPILE=auto): there the compile variant turns
# it on, to show what it would be worth.
COMPILED = Variant(
    "gpufeed-compiled",
    "compile on (default mode)",
    "compile",
    (("compile", "default"),),
)


# The decode cache (worker/decode/cache.py) is an optimisation only a workload with repeated
# images can use; every other run makes each job's bytes unique, so it never hits there.
# This pair runs the same jobs, repeating the distinct images, with the cache on and off;
# neither is comparable with the stage-rate ideal (which decodes every image).
CACHE_VARIANTS = ("cache_on_repeats", "cache_off_repeats")
CACHE_OFF_REPEATS = Variant(
    "gpufeed-cache-off-repeats",
    "repeated images (cache off)",
    "decode_cache",
    (("decode_cache_mb", 0),),
    repeats=True,
    cache="cache_off_repeats",
)


def cache_on_repeats(cache_mb: int) -> Variant:
    """The "cache on" run, with the worker's cache size (`cache_mb`; its default if 0)."""
    return Variant(
        "gpufeed-cache-on-repeats",
        "repeated images (cache on)",
        "",
        (("decode_cache_mb", cache_mb or WorkerConfig().decode_cache_mb),),
        repeats=True,
        cache="cache_on_repeats",
    )


class CpuPreprocess:
    """Decode (DCT-scaled when the spec says so) and torchvision transforms on the CPU, packed
    into a uint8 staging row of `spec.size`, centred for the step's crop."""

    def __init__(
        self,
        spec: DecodeSpec,
        *,
        crop: int,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
    ) -> None:
        if crop > spec.size:
            raise ValueError(f"crop {crop} is larger than the staging size {spec.size}")
        self.spec = spec
        self.crop = crop
        self.transforms = NaivePreprocess(
            resize=spec.size, crop=crop, mean=mean, std=std, geometry=spec.geometry
        )
        self._mean = torch.tensor(mean).view(3, 1, 1)
        self._std = torch.tensor(std).view(3, 1, 1)

    def into(self, data: bytes, out: npt.NDArray[np.uint8]) -> DecodeInfo:
        fmt = sniff_format(data)
        if fmt is None:
            raise DecodeError(ErrorCode.UNSUPPORTED_FORMAT, "not a supported image")
        s = self.spec.size
        try:
            with Image.open(io.BytesIO(data), formats=[fmt]) as im:
                width, height = im.size
                scale = 1
                if fmt == "JPEG" and self.spec.dct_scaling:
                    drafted = im.draft("RGB", (s, s))
                    if drafted is not None:
                        scale = max(1, round(width / drafted[1][2]))
                rgb = im.convert("RGB")
            # x: [3, crop, crop] float32, normalised, as a CPU-preprocessing design ships it.
            x = self.transforms.transform(rgb)
        except Exception as exc:  # noqa: BLE001 - one bad image fails alone
            raise DecodeError(ErrorCode.DECODE_ERROR, f"{type(exc).__name__}: {exc}") from None
        # Back to uint8 pixels for the staging slot (the emulation's extra pass).
        pixels = (x * self._std + self._mean).mul_(255.0).round_().clamp_(0, 255)
        off = (s - self.crop) // 2
        row = pixels.to(torch.uint8).permute(1, 2, 0).numpy()
        out[off : off + self.crop, off : off + self.crop] = row
        return DecodeInfo(format=fmt, width=width, height=height, draft_scale=scale)

    def to_array(self, data: bytes) -> npt.NDArray[np.uint8]:
        out = np.zeros((self.spec.size, self.spec.size, 3), dtype=np.uint8)
        self.into(data, out)
        return out


class CpuPreprocessPool(DecodePool):
    """A decode pool whose threads run `CpuPreprocess` instead of gpufeed's decode (the same
    threads, groups of rows and decode budget as the real pool)."""

    def __init__(
        self,
        spec: DecodeSpec,
        threads: int,
        path_root: Path | None,
        *,
        crop: int,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
    ) -> None:
        super().__init__(spec, threads, path_root)
        self.preprocess = CpuPreprocess(spec, crop=crop, mean=mean, std=std)

    def _decode(
        self, job: Job, out: npt.NDArray[np.uint8], may_defer: bool, ticket: RowTicket
    ) -> DecodeResult:
        start = time.perf_counter()
        try:
            if job.image is None:
                raise DecodeError(ErrorCode.INVALID_JOB, "the benchmark sends image jobs only")
            row = np.zeros_like(out)
            info = self.preprocess.into(bytes(job.image), row)
            ticket.write(out, row)
            return DecodeResult(info, None, (time.perf_counter() - start) * 1000)
        except DecodeError as exc:
            return DecodeResult(None, exc, (time.perf_counter() - start) * 1000)


# `url` jobs (worker/fetch/): the same images served by a loopback HTTP server. The first
# mirrors the defaults (unique bytes: every job a download and a decode); the second the
# cache-on pair (the distinct images' URLs repeated: after the first round, a 304 and a
# decode-cache hit each).
URL_VARIANTS = ("url_unique", "url_repeats")
URL_UNIQUE = Variant(
    "gpufeed-url", "by URL (unique images)", "", (("url_allow", "127.0.0.1"),), source="url"
)


def url_repeats(cache_mb: int) -> Variant:
    return Variant(
        "gpufeed-url-repeats",
        "by URL (repeated URLs, cache on)",
        "",
        (
            ("url_allow", "127.0.0.1"),
            ("decode_cache_mb", cache_mb or WorkerConfig().decode_cache_mb),
        ),
        repeats=True,
        source="url",
    )
