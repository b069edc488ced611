"""One row's decode, decided once for every decode executor (worker/decode/executor.py).

`RowPolicy.run` takes a row through these steps, in this order, and stops at the first that
answers it:

1. the delay hook (tests and the doctor simulate a slow decoder with it);
2. a row kept by the fetch stage (a `url` job whose server said the image had not changed),
   copied as it is;
3. the job's bytes, or the file a `path` job names, read under the path root; neither is
   `invalid_job`;
4. the decode cache, looked up under the bytes' key (with the reply stream in it, or a `url`
   job's own key);
5. the GPU, offered the row where the executor lets it (`offer`);
6. the decode: pixels at their own size into a row for the device placement (`row_side`,
   worker/decode/rows.py), or fitted to the host's S x S square; kept in the cache.

Whatever a row raises is its answer: a DecodeError as it is, a full slot as an internal
error that says so, anything else as an internal error naming the exception.

What differs between executors is theirs, in the methods a subclass writes: how a row is
written and answered (decode threads: into a staging row under its ticket, answered by a
DecodeResult; decode processes: into the shared ring and its record), and when the GPU is
offered a row. Threads offer it after the cache look-up; processes as soon as its bytes are
at hand (`offer_on_arrival`: before the delay for the bytes a job brought, right after
reading a path's, which they stage for the GPU), their offer declining what the cache holds.

No torch here, and no executor: the decode processes import this module.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from producer.wire import ErrorCode
from worker.decode.cache import DecodeCache, cache_key
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, decode_pixels
from worker.decode.job_path import read_job_path
from worker.decode.packed import SlotFull
from worker.decode.rows import DecodedRow, decode_row

Row = TypeVar("Row")  # how the executor names a row it decodes into
Answer = TypeVar("Answer")  # what it makes of a row's outcome
# A row a cache kept: the row as it was written, and its image's info.
Kept = tuple[npt.NDArray[np.uint8], DecodeInfo]


class RowPolicy(ABC, Generic[Row, Answer]):
    """The steps of one row's decode (the module's docstring); a subclass says how a row
    is written and answered."""

    # True: the GPU is offered a row as soon as its bytes are at hand; False: after the
    # decode cache missed.
    offer_on_arrival = False

    def __init__(
        self,
        spec: DecodeSpec,
        *,
        row_side: int,
        path_root: Path | None,
        cache: DecodeCache | None,
        delay: Callable[[Any], None] | None = None,
    ) -> None:
        """`row_side`: rows for the device placement of that side (0: the host's S x S);
        `cache`: None, or an enabled cache; `delay`: called with each row's `subject`
        before anything else (a slow decoder, for tests)."""
        self.spec = spec
        self.row_side = row_side
        self.path_root = path_root
        self.cache = cache
        self.delay = delay

    def run(
        self,
        row: Row,
        data: bytes | memoryview | None,
        path: bytes | None,
        *,
        namespace: str | None,
        key: bytes | None = None,
        kept: Kept | None = None,
        gpu: bool,
        subject: object = None,
    ) -> Answer:
        """Decode one row. `data`: the job's bytes (None: a `path` job, `path` names its
        file); `namespace`: the reply stream the cache key includes (None: not cached
        here); `key`: a `url` job's own cache key; `kept`: the row the fetch stage kept;
        `gpu`: the GPU may be offered the row; `subject`: what the delay hook is given."""
        start = time.perf_counter()
        if gpu and self.offer_on_arrival and data is not None and kept is None:
            left = self.offer(row, data, namespace, start, staged=False)
            if left is not None:
                return left
        try:
            if self.delay is not None:
                self.delay(subject)
            if kept is not None:
                self.copy_kept(row, kept[0])
                return self.answer(row, kept[1], start, cached=True, reduced=False)
            if data is None:
                if path is None:
                    raise DecodeError(ErrorCode.INVALID_JOB, "nothing to decode")
                data = read_job_path(path, self.path_root, self.spec.max_bytes)
                if gpu and self.offer_on_arrival:
                    # The bytes are here, not in the worker: the offer stages them.
                    left = self.offer(row, data, namespace, start, staged=True)
                    if left is not None:
                        return left
            blob = data if isinstance(data, bytes) else bytes(data)
            cache = self.cache
            if cache is not None and blob:
                key = key or (cache_key(blob, namespace) if namespace is not None else None)
                entry = cache.get(key) if key is not None else None
                if entry is not None:
                    self.copy_kept(row, entry[0])
                    return self.answer(row, entry[1], start, cached=True, reduced=False)
            else:
                key = None
            if gpu and not self.offer_on_arrival:
                left = self.offer(row, blob, namespace, start, staged=False)
                if left is not None:
                    return left
            self.check(row)
            decoded: DecodedRow | npt.NDArray[np.uint8]
            if self.row_side:
                decoded, info = decode_row(blob, self.spec, self.row_side)
                reduced = decoded.reduced
            else:
                decoded, info = decode_pixels(blob, self.spec)
                reduced = False
            if self.write(row, decoded) and key is not None and cache is not None:
                # The row is the executor's until this answer is read: nothing moves it.
                cache.put(key, self.entry(row), info)
            return self.answer(row, info, start, cached=False, reduced=reduced)
        except DecodeError as exc:
            return self.fail(row, exc, start)
        except SlotFull as exc:
            return self.fail(row, DecodeError(ErrorCode.INTERNAL_ERROR, str(exc)), start)
        except Exception as exc:  # noqa: BLE001 - one bad image fails its row alone
            error = DecodeError(ErrorCode.INTERNAL_ERROR, described(exc))
            return self.fail(row, error, start)

    def offer(
        self,
        row: Row,
        data: bytes | memoryview,
        namespace: str | None,
        start: float,
        *,
        staged: bool,
    ) -> Answer | None:
        """Leave `row` for the GPU decoder if it takes it: the row's answer, or None to
        decode it here. `staged`: the bytes were read here (a `path` job's), the worker
        does not hold them. Without a GPU decoder: None."""
        return None

    def check(self, row: Row) -> None:
        """Raise ValueError where `row` cannot take a decode (a caller's mistake)."""

    @abstractmethod
    def copy_kept(self, row: Row, kept: npt.NDArray[np.uint8]) -> None:
        """Copy a row a cache kept (as `entry` gave it) into `row`."""

    @abstractmethod
    def write(self, row: Row, decoded: DecodedRow | npt.NDArray[np.uint8]) -> bool:
        """Write what the decode gave (a DecodedRow for the device placement, the S x S
        pixels for the host's) into `row`; False: the row is no longer the decode's."""

    @abstractmethod
    def entry(self, row: Row) -> npt.NDArray[np.uint8]:
        """What the decode cache keeps of `row`, just written."""

    @abstractmethod
    def answer(
        self, row: Row, info: DecodeInfo, start: float, *, cached: bool, reduced: bool
    ) -> Answer:
        """The answer of a row decoded (`cached`: copied from a cache; `reduced`: too large
        for a row of the device placement, fitted to S x S here); `start`: its
        time.perf_counter() when it began."""

    @abstractmethod
    def fail(self, row: Row, error: DecodeError, start: float) -> Answer:
        """The answer of a row that cannot be decoded."""


def described(exc: Exception) -> str:
    """An exception no decode expects, as a row's error message names it."""
    return f"{type(exc).__name__}: {exc}"
