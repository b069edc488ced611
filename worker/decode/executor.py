"""The decode contract: what decodes a batch's rows on the CPU, as the batcher, the GPU
decode stage, the warm start and the tools use it.

Two executors keep it, side by side: decode threads in the worker's process
(worker/decode/pool.py, `DecodePool`) and decode processes writing into memory shared with
it (worker/decode/processes.py, `ProcessDecodePool`). Both run each row through the same
steps (worker/decode/row_policy.py). Each checks itself against `DecodeExecutor` for mypy
at its end; tests/decode/test_decode_contract.py runs the same tests on both.

The life of a batch's rows: `submit_rows` hands a group of rows over as they are taken
(what one read gave the batch) and returns its `DecodeGroup`; `settle` waits for the groups
of a batch and gives their results in row order, answering `decode_timeout` for a row past
the decode budget (DECODE_BUDGET_MS); `redecode` decodes on the CPU the rows the GPU
decoder failed; `shutdown` ends it, cancelling the rows not answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from producer.wire import ErrorCode
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec

if TYPE_CHECKING:
    # For annotations only: the GPU decoders import torch, and the jobs are a layer above.
    from worker.decode.gpu import GpuRow
    from worker.decode.gpu_packed import DeferredRow
    from worker.jobs import Job


class DecodeResult(NamedTuple):
    """A row's decode: what it holds, or why it holds nothing (a named tuple, as
    DecodeInfo: one per image)."""

    info: DecodeInfo | None
    error: DecodeError | None
    decode_ms: float
    # Set when the row was left for the GPU: the row in the pinned slot is not written
    # (GpuRow: decode threads; DeferredRow: decode processes, packed rows).
    gpu: GpuRow | DeferredRow | None = None
    # The row came from a cache (the same bytes, or a `url` job's unchanged image, decoded
    # before).
    cached: bool = False


class DecodeGroup(Protocol):
    """Rows of one batch handed to an executor together (`submit_rows`); only the executor
    that made it settles it. A future of one row's result is one too (a row decoded alone,
    or one a test made)."""

    def done(self) -> bool:
        """Every row has its result, or the group was cancelled."""
        ...


class DecodeExecutor(Protocol):
    """What decodes a batch's rows on the CPU into its staging rows."""

    @property
    def kind(self) -> str:
        """`threads` or `processes`: what the feed plan, the health report and the bench
        call it."""
        ...

    @property
    def spec(self) -> DecodeSpec: ...

    @property
    def path_root(self) -> Path | None:
        """Where `path` jobs' files are read (None: path jobs are refused)."""
        ...

    @property
    def threads(self) -> int:
        """How many rows it decodes at once (the doctor, bench and GPU check count decode
        processes as threads)."""
        ...

    @property
    def given_up(self) -> int:
        """Rows answered `decode_timeout` so far."""
        ...

    @property
    def reduced(self) -> int:
        """Rows for the device placement too large for a row, fitted to S x S on the host."""
        ...

    @property
    def reduced_ms(self) -> float: ...

    def submit_rows(
        self,
        jobs: Sequence[Job],
        rows: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]],
        *,
        gpu: bool = True,
        until: float | None = None,
    ) -> DecodeGroup:
        """Start decoding `jobs` into `rows` (rows[i] for jobs[i]), staging rows of the ring
        it was built for. `gpu`: rows may be left for the GPU decoder (False: all decoded
        here). `until`: a time.monotonic() past which every row not decoded is answered
        `decode_timeout`, started or not. On the event loop: work per group, not per row."""
        ...

    async def settle(self, groups: Sequence[DecodeGroup]) -> list[DecodeResult]:
        """The results of `groups` (what `submit_rows` returned) in row order, once each row
        has one: its decode's, or `decode_timeout` past the budget."""
        ...

    async def redecode(
        self, jobs: Sequence[Job], rows: Sequence[npt.NDArray[np.uint8]]
    ) -> list[DecodeResult]:
        """Decode `jobs` into `rows` here, none left for the GPU (the rows the GPU decoder
        failed)."""
        ...

    def shutdown(self) -> None:
        """Stop: rows not answered are cancelled, running decodes end within the budget."""
        ...


def over_budget(budget_ms: int) -> DecodeError:
    """The error of a row given up over the decode budget (every executor's)."""
    return DecodeError(
        ErrorCode.DECODE_TIMEOUT,
        f"decoding took longer than the budget of {budget_ms} ms; "
        "the batch went on without this image",
    )
