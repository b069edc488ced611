"""Decode-only rates of the GPU's JPEG decoder as the worker runs it (nvImageCodec, one call
per batch into one device buffer, on a stream of its own) for thumbnails, photos and large
JPEGs: the GPU's side of the split whose CPU side is decode_scaling.py's. Each rate is a
run of back-to-back calls, timed until the last call's work is done; the host syncs of one
photo batch are counted under the profiler, each named where it happened (nvImageCodec's
hardware decoder waits for its previous batch once per call)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from worker.decode.codecs import IntoCodec
from worker.decode.nvimgcodec import NvImgCodec, nvimgcodec_available
from worker.decode.samples import synthetic_jpeg

# (width, height, images per call, distinct images): a large JPEG takes a while to make.
SIZES: tuple[tuple[int, int, int, int], ...] = (
    (64, 64, 64, 16),
    (640, 480, 64, 16),
    (4000, 3000, 8, 4),
)


def engine_rates(
    device: torch.device,
    *,
    seconds: float = 0.5,
    sizes: tuple[tuple[int, int, int, int], ...] = SIZES,
    make_backend: Callable[[], IntoCodec] | None = None,
    count_syncs: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """images/s per image size; `count_syncs` (the check's sync counter, entered around one
    photo batch) adds what that batch cost the host. Call from a thread of its own."""
    if make_backend is None:
        why = nvimgcodec_available()
        if why is not None:
            return {"status": f"not measured: {why}"}
        on = torch.device("cuda", device.index or 0) if device.type == "cuda" else None
        make_backend = lambda: NvImgCodec(on)  # noqa: E731 - one line, one use
    backend = make_backend()
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
    handle = int(stream.cuda_stream) if stream is not None else 0
    out: dict[str, Any] = {"backend": backend.name, "sizes": []}

    @contextlib.contextmanager
    def on_stream() -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def finish() -> None:
        if stream is not None:
            stream.synchronize()  # measurement: the queued decodes must have run

    for width, height, count, distinct in sizes:
        made = [synthetic_jpeg(width, height, seed=i, quality=85) for i in range(distinct)]
        images = [made[i % distinct] for i in range(count)]
        size = width * height * 3
        buffer = torch.empty(count * size, dtype=torch.uint8, device=device)
        places = [(i * size, height, width) for i in range(count)]
        with on_stream():
            ok = backend.decode_into(images, buffer, places, handle)  # builds its state
            finish()
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                backend.decode_into(images, buffer, places, handle)
                calls += 1
            finish()
            elapsed = time.perf_counter() - t0
        row: dict[str, Any] = {
            "image": f"{width}x{height}",
            "per_call": count,
            "images_per_s": round(calls * count / max(elapsed, 1e-9), 1),
            "failed": ok.count(False),
        }
        if count_syncs is not None and (width, height) == (640, 480):
            with on_stream():
                with count_syncs() as syncs:
                    backend.decode_into(images, buffer, places, handle)
                finish()
            found = syncs.as_dict()
            row["host_syncs_per_call"] = found["total"] + found["decode_lane_waits"]["total"]
            row["host_sync_sites"] = found["sites"][:3]
        out["sizes"].append(row)
        del buffer
    return out
