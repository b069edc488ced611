"""The GPU check's peer: the worker's own model fed the way a user writes it with PyTorch.

A `torch.utils.data.DataLoader` with worker processes (one per core but one), pinned
batches and a prefetch of four batches per worker reads the pipeline's JPEG files from
disk, each decoded anew by Pillow and resized and cropped by torchvision's eval transforms
(Resize to the staging size, CenterCrop to the input size); the loop copies each batch to
the device without blocking and runs the model, normalised on the device. The model is the
worker's, in the worker's dtype and memory format, compiled with the worker's mode
(`torch.compile`; with `reduce-overhead` its CUDA graphs take each batch into one static
input, as they would from a user's loop): the same weights, arithmetic and compiler as
gpufeed's step, so what the comparison shows is the feed. Its own rate on a batch already
on the device is measured beside it, so the report says whether the loader or the model
bound the peer. A model the compiler refuses runs eager, and the report says so.

The loader's processes are spawned (not forked): the check's process holds CUDA state and
threads by then. Nothing here is on gpufeed's serving path: it waits for the device where
a timed loop must.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import functional as tf

from worker.base.device import mark_cudagraph_step
from worker.model.compiler import changes_since, compile_step, snapshot

# Batches each loader process keeps ready (torch's default is 2).
PREFETCH = 4


class JpegFiles(Dataset[torch.Tensor]):
    """`paths` over and over (`length` items): each item decoded and transformed anew."""

    def __init__(self, paths: Sequence[str], resize: int, crop: int, length: int) -> None:
        self.paths = list(paths)
        self.resize = resize
        self.crop = crop
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        with Image.open(self.paths[index % len(self.paths)]) as image:
            rgb = image.convert("RGB")
        rgb = tf.resize(rgb, [self.resize])
        rgb = tf.center_crop(rgb, [self.crop])
        out: torch.Tensor = tf.pil_to_tensor(rgb)  # [3, C, C] uint8
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dataloader_rate(
    model: nn.Module,
    files: Sequence[Path],
    *,
    batch: int,
    resize: int,
    crop: int,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype,
    device: torch.device,
    seconds: float,
    workers: int | None = None,
    warmup_batches: int = 4,
    compile_mode: str = "off",
) -> dict[str, Any]:
    """images/s of `model` fed by a DataLoader over `files` for `seconds` (after the loader's
    processes started and `warmup_batches` ran), and of `model` alone on a batch already on
    the device; `compile_mode` as GPUFEED_COMPILE (`off`: eager). Call on one thread
    throughout: CUDA-graph trees belong to the thread that recorded them."""
    workers = workers if workers is not None else max(1, (os.cpu_count() or 2) - 1)
    pin = device.type == "cuda"
    loader = DataLoader(
        JpegFiles([str(f) for f in files], resize, crop, length=batch * 1_000_000),
        batch_size=batch,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
        drop_last=True,
        multiprocessing_context="spawn",
    )
    scale = torch.tensor([255.0 * s for s in std], device=device).view(1, 3, 1, 1)
    shift = torch.tensor([255.0 * m for m in mean], device=device).view(1, 3, 1, 1)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = (x.float() - shift) / scale
        out: torch.Tensor = model(y.to(dtype).contiguous(memory_format=torch.channels_last))
        return out

    # Made outside inference mode, as the compiler's guards expect of the step's input.
    static = torch.zeros((batch, 3, crop, crop), dtype=torch.uint8, device=device)
    step, compiled, why, compile_s, graphs = _compiled(forward, static, compile_mode)

    def run(x: torch.Tensor) -> None:
        static.copy_(x, non_blocking=True)
        if graphs:
            mark_cudagraph_step()
        step(static)

    t_start = time.perf_counter()
    images = 0
    with torch.inference_mode():
        batches = iter(loader)
        for _ in range(warmup_batches):
            run(next(batches))
        _sync(device)
        started_s = time.perf_counter() - t_start
        baseline = snapshot()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            run(next(batches))
            images += batch
        _sync(device)
        elapsed = time.perf_counter() - t0
        # A compiled peer that recompiled in its window was not timed at its best.
        recompiles = changes_since(baseline)["recompiles"]
        del batches
        alone = _model_alone(run, batch, crop, device)
    rate = images / max(elapsed, 1e-9)
    return {
        "images_per_s": round(rate, 1),
        "model_alone_images_per_s": round(alone, 1),
        # The model ran near its own rate: the loader kept up, the comparison is the model's.
        "bound": "model" if rate >= 0.9 * alone else "loader",
        "loader_workers": workers,
        "prefetch_factor": PREFETCH,
        "pin_memory": pin,
        "batch": batch,
        "window_s": round(elapsed, 2),
        "loader_start_s": round(started_s, 2),
        "files": len(files),
        "compile_mode": compile_mode,
        "compiled": compiled,
        "compile_s": round(compile_s, 2),
        "recompiles_in_window": recompiles,
        **({"compile_refused": why} if why else {}),
        "how": (
            f"torch DataLoader ({workers} spawned processes, pin_memory={pin}, prefetch "
            f"{PREFETCH}) over the same JPEG files, Pillow decode, Resize({resize}) + "
            f"CenterCrop({crop}); the worker's model "
            f"{f'compiled ({compile_mode})' if compiled else 'eager'} in "
            f"{str(dtype).removeprefix('torch.')}, channels_last, normalised on the device"
        ),
    }


def _compiled(forward: Any, example: torch.Tensor, mode: str) -> tuple[Any, bool, str, float, bool]:
    """(the function to run, whether it is compiled, why the compiler refused it, seconds
    spent, whether it replays CUDA graphs). The worker's own compiled step stays as it is
    (no reset of dynamo's caches)."""
    if mode == "off":
        return forward, False, "", 0.0, False
    t0 = time.perf_counter()
    try:
        fn, report = compile_step(
            forward, example, mode=mode, allow_eager_fallback=False, reset=False
        )
    except Exception as exc:  # noqa: BLE001 - any refusal means the peer runs eager
        why = f"{type(exc).__name__}: {exc}"[:300]
        return forward, False, why, time.perf_counter() - t0, False
    return fn, True, "", time.perf_counter() - t0, report.uses_cudagraphs


def _model_alone(run: Any, batch: int, crop: int, device: torch.device, iters: int = 10) -> float:
    """images/s of the peer's loop on one uint8 batch already in memory (pinned on CUDA)."""
    x = torch.randint(0, 256, (batch, 3, crop, crop), dtype=torch.uint8)
    if device.type == "cuda":
        x = x.pin_memory()
    run(x)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        run(x)
    _sync(device)
    return batch * iters / max(time.perf_counter() - t0, 1e-9)
