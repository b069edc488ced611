"""The decode thread pool: reads a job's bytes and decodes them into a staging row.

PIL releases the GIL while it decodes and resizes, so threads give real parallelism here
without the cost of shipping pixels between processes.

With GPU decode on, a JPEG the router picks for the GPU is only probed here (header,
limits, orientation): its row is marked deferred and the runner decodes it on the GPU
straight into the device copy of the slot. Anything else, and any JPEG the GPU fails on,
is decoded here as usual.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from producer.wire import ErrorCode
from worker.decode_cache import DecodeCache, cache_key
from worker.decoder import DecodeError, DecodeInfo, DecodeSpec, decode_into
from worker.gpu_decode import GpuDecodeRouter, GpuRow
from worker.job_path import read_job_path
from worker.jobs import Job


@dataclass(frozen=True)
class DecodeResult:
    info: DecodeInfo | None
    error: DecodeError | None
    decode_ms: float
    # Set when the row was left for the GPU: the row in the pinned slot is not written.
    gpu: GpuRow | None = None
    # The row came from the decode cache (the same bytes were decoded before).
    cached: bool = False


class DecodePool:
    def __init__(
        self,
        spec: DecodeSpec,
        threads: int,
        path_root: Path | None,
        *,
        delay_hook: Callable[[], None] | None = None,
        gpu_router: GpuDecodeRouter | None = None,
        cache: DecodeCache | None = None,
    ) -> None:
        self.spec = spec
        self.threads = threads
        self.path_root = path_root
        # Lets the doctor and tests simulate a slow decoder without touching the real one.
        self._delay_hook = delay_hook
        self.gpu_router = gpu_router
        self.cache = cache if cache is not None and cache.enabled else None
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="gpufeed-decode")

    def submit(self, job: Job, out: npt.NDArray[np.uint8]) -> asyncio.Future[DecodeResult]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, self._decode, job, out, True)

    async def decode_on_cpu(self, job: Job, out: npt.NDArray[np.uint8]) -> DecodeResult:
        """Decode on a CPU thread whatever the router says (the GPU fallback)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._decode, job, out, False)

    def _decode(self, job: Job, out: npt.NDArray[np.uint8], may_defer: bool) -> DecodeResult:
        start = time.perf_counter()
        try:
            if self._delay_hook is not None:
                self._delay_hook()
            if job.cached_row is not None:
                # A `url` job the server said had not changed: its row from the cache.
                row, row_info = job.cached_row
                np.copyto(out, row)
                return DecodeResult(
                    row_info, None, (time.perf_counter() - start) * 1000, cached=True
                )
            if job.image is not None:
                data = job.image
            elif job.path is not None:
                data = read_job_path(job.path, self.path_root, self.spec.max_bytes)
            else:
                raise DecodeError(ErrorCode.INVALID_JOB, "nothing to decode")
            key = None
            if self.cache is not None and data:
                key = job.cache_key or cache_key(data)
            if key is not None and self.cache is not None:
                cached = self.cache.get_into(key, out)
                if cached is not None:
                    ms = (time.perf_counter() - start) * 1000
                    return DecodeResult(cached, None, ms, cached=True)
            if may_defer and self.gpu_router is not None:
                row = self.gpu_router.route(data, self.spec)
                if row is not None:
                    ms = (time.perf_counter() - start) * 1000
                    return DecodeResult(row.info, None, ms, gpu=row)
            info = decode_into(data, out, self.spec)
            if key is not None and self.cache is not None:
                self.cache.put(key, out, info)
            return DecodeResult(info, None, (time.perf_counter() - start) * 1000)
        except DecodeError as exc:
            return DecodeResult(None, exc, (time.perf_counter() - start) * 1000)
        except Exception as exc:  # noqa: BLE001 - one bad job must never take down its batch
            err = DecodeError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
            return DecodeResult(None, err, (time.perf_counter() - start) * 1000)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
