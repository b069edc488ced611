"""`batch(source, module, out, input_size=...)`: `producer batch SOURCE --out FILE --local` from
Python, with a model that lives in the caller's process.

The module (or an exported program) becomes a model directory in a temporary folder
(model/from_module.py: exported with torch.export, checked as a worker checks it), which the
local service's workers load as GPUFEED_MODEL; the batch then runs as `--local` runs it
(producer/local_run.py, producer/batch_runner.py), with a progress bar, and the output file's
rows come back as a pyarrow Table. The folder is removed however the call ends.

    from worker.notebook import batch
    table = batch("photos/", net, "out.parquet", input_size=224, mean=..., std=...)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from producer import wire
from producer.batch_output import output_format
from producer.batch_runner import BatchOptions, run_batch
from producer.batch_runner import Progress as RunProgress
from producer.batch_sources import open_source
from producer.client import Producer
from producer.local_run import LocalRunError, LocalService, local_service
from worker.model.from_module import EXAMPLE_BATCH, ModuleInput, ModuleOutput, write_model_dir

if TYPE_CHECKING:
    import pyarrow as pa
    import torch
    from torch import nn

__all__ = ["LocalRunError", "batch"]

# The workers' settings a call fixes, whatever the environment says: the service is the
# call's own, so its stream names are the client's defaults and no tenant or shard applies.
PRIVATE = {
    "GPUFEED_STREAM": wire.DEFAULT_STREAM,
    "GPUFEED_GROUP": wire.DEFAULT_GROUP,
    "GPUFEED_RESULTS_STREAM": wire.DEFAULT_RESULTS_STREAM,
    "GPUFEED_RESULT_PREFIX": wire.DEFAULT_RESULT_PREFIX,
    "GPUFEED_DEAD_STREAM": wire.DEFAULT_DEAD_STREAM,
    "GPUFEED_PRIORITIES": "",
    "GPUFEED_TENANTS": "",
    "GPUFEED_SHARDS": "1",
}


def batch(
    source: str | os.PathLike[str],
    model: nn.Module | torch.export.ExportedProgram,
    out: str | os.PathLike[str],
    *,
    input_size: int,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    resize: str = "shorter-crop",
    resize_size: int | None = None,
    kind: str = "embed",
    normalize: bool = False,
    dtype: str = "float32",
    activation: str | None = None,
    top_k: int | None = None,
    labels: Sequence[str] | None = None,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    retry_failed: bool = False,
    progress: bool = True,
) -> pa.Table:
    """Run every image of `source` (a folder, a manifest, an s3:// gs:// az:// prefix: what
    `producer batch` takes) through `model` on a private local service and return the rows
    of `out` (.parquet or .jsonl), one per image, as a pyarrow Table.

    `input_size`, `mean`, `std`, `resize`, `resize_size`: the [preprocess] of a model
    directory (docs/own-model.md). `kind`: "embed" (one vector per image, `embedding`
    column; `normalize` for L2), "classify" (`labels`, `activation`, `top_k`) or "raw" (any
    output shape: `output` bytes, `shape`, `dtype`). `env`: worker settings
    (GPUFEED_DEVICE, GPUFEED_BATCH_SIZE, GPUFEED_COMPILE, ...) over this process's
    environment. Like `producer batch`, a second call with the same `out` resumes.

    A module that cannot be exported raises ModuleNotExportable, a model that does not fit
    its kind ConfigError, a bad source or output ValueError, all before any service starts;
    a local service that fails raises LocalRunError."""
    out_path = Path(out)
    output_format(out_path)
    src = open_source(os.fspath(source))
    settings = {**os.environ, **(env or {})}
    folder = Path(tempfile.mkdtemp(prefix="gpufeed-model-"))
    try:
        write_model_dir(
            model,
            folder,
            preprocess=ModuleInput(
                input_size=input_size,
                mean=_triple(mean, "mean"),
                std=_triple(std, "std"),
                resize=resize,
                resize_size=resize_size,
            ),
            output=ModuleOutput(
                kind=kind,
                normalize=normalize,
                dtype=dtype,
                activation=activation,
                top_k=top_k,
                labels=labels,
            ),
            name=name,
            batch_size=_batch_size(settings),
        )
        worker_env = {**(env or {}), "GPUFEED_MODEL": str(folder), **PRIVATE}
        with _bar(enabled=progress) as bar:
            task = bar.add_task("starting the local service", total=None, ok=0, errors=0)

            def on_state(svc: LocalService) -> None:
                states = ", ".join(f"{w.device}: {w.state}" for w in svc.workers)
                bar.update(task, description=f"starting {states}")

            def on_progress(p: RunProgress) -> None:
                bar.update(
                    task,
                    description="batch",
                    completed=p.answered,
                    total=p.todo,
                    ok=p.ok,
                    errors=p.errors,
                )

            with local_service(env=worker_env, on_state=on_state) as service:
                try:
                    with Producer(service.redis_url) as producer:
                        options = BatchOptions(retry_failed=retry_failed)
                        run_batch(src, out_path, producer, options, on_progress=on_progress)
                except KeyboardInterrupt:
                    if service.ended is None:
                        raise
                    raise LocalRunError(
                        f"{service.ended_message()}; {out_path} keeps the rows written so "
                        "far: call again with the same output to go on"
                    ) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return read_output(out_path)


def read_output(path: Path) -> pa.Table:
    """The output file's rows, as the file holds them."""
    if output_format(path).suffix == ".jsonl":
        import pyarrow.json as pj  # noqa: PLC0415 - only for a .jsonl output

        return pj.read_json(path)
    import pyarrow.parquet as pq  # noqa: PLC0415 - pyarrow loads in a second

    return pq.read_table(path)


def _triple(values: Sequence[float] | None, what: str) -> tuple[float, float, float] | None:
    if values is None:
        return None
    numbers = [float(v) for v in values]
    if len(numbers) != 3:
        raise ValueError(f"{what}: three numbers (red, green, blue), got {len(numbers)}")
    return (numbers[0], numbers[1], numbers[2])


def _batch_size(settings: Mapping[str, str]) -> int:
    value = settings.get("GPUFEED_BATCH_SIZE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else EXAMPLE_BATCH


@contextlib.contextmanager
def _bar(*, enabled: bool) -> Iterator[Progress]:
    """A progress bar on stderr (a Jupyter cell's output where there is one); without
    a terminal it is drawn once, at the end."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ok {task.fields[ok]}  errors {task.fields[errors]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
    with bar:
        yield bar
