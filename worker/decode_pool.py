"""The decode thread pool: reads a job's bytes and decodes them into a staging row.

PIL releases the GIL while it decodes and resizes, so threads give real parallelism here
without the cost of shipping pixels between processes.
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
from worker.decoder import DecodeError, DecodeInfo, DecodeSpec, decode_into
from worker.job_path import read_job_path
from worker.jobs import Job


@dataclass(frozen=True)
class DecodeResult:
    info: DecodeInfo | None
    error: DecodeError | None
    decode_ms: float


class DecodePool:
    def __init__(
        self,
        spec: DecodeSpec,
        threads: int,
        path_root: Path | None,
        *,
        delay_hook: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self.threads = threads
        self.path_root = path_root
        # Lets the doctor and tests simulate a slow decoder without touching the real one.
        self._delay_hook = delay_hook
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="gpufeed-decode")

    def submit(self, job: Job, out: npt.NDArray[np.uint8]) -> asyncio.Future[DecodeResult]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, self._decode, job, out)

    def _decode(self, job: Job, out: npt.NDArray[np.uint8]) -> DecodeResult:
        start = time.perf_counter()
        try:
            if self._delay_hook is not None:
                self._delay_hook()
            if job.image is not None:
                data = job.image
            elif job.path is not None:
                data = read_job_path(job.path, self.path_root, self.spec.max_bytes)
            else:
                raise DecodeError(ErrorCode.INVALID_JOB, "nothing to decode")
            info = decode_into(data, out, self.spec)
            return DecodeResult(info, None, (time.perf_counter() - start) * 1000)
        except DecodeError as exc:
            return DecodeResult(None, exc, (time.perf_counter() - start) * 1000)
        except Exception as exc:  # noqa: BLE001 - one bad job must never take down its batch
            err = DecodeError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
            return DecodeResult(None, err, (time.perf_counter() - start) * 1000)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
