"""REFERENCE ONLY: the naive inference worker that gpufeed replaces. Never deploy it.

This is the design found in many image services, kept here so the benchmark can measure
gpufeed against it on the same machine, model, Redis stream and images:

- one job at a time (`XREADGROUP COUNT 1`, its own consumer group);
- the full-resolution decode on the CPU (`Image.open(...).convert("RGB")`), whatever the
  image size;
- torchvision's classification transforms on the CPU, per image (Resize, CenterCrop,
  ToTensor, Normalize; for a model directory its own resize: squash or letterbox);
- one forward per job (batch 1, fp32), then `.item()` on the top-1 class and score (other
  output kinds: `.cpu()` of the output): a host sync per job;
- `torch.backends.cudnn.benchmark = True` on CUDA, as such services usually set it. With the
  centre crop every input has the same shape, so cuDNN tunes once here; services that skip
  the crop, or batch whatever has arrived, re-tune for every new shape.

It answers each job on the job's own results stream (id, entry, status, top1, score and a
msgpack `result` with per-stage timings, like gpufeed) and acknowledges it in the same
MULTI, so the benchmark reads both workers' results the same way.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import redis
import torch
import torchvision.transforms as T
from PIL import Image

from producer import wire
from worker.decode.cpu import letterbox_geometry
from worker.model.ceiling import direct_feed_ceiling
from worker.model.heads import make_head
from worker.model.loader import load_configured


class Letterbox:
    """Fit into size x size keeping the aspect ratio, black bars (gpufeed's geometry)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, im: Image.Image) -> Image.Image:
        nw, nh, left, top = letterbox_geometry(im.width, im.height, self.size)
        canvas = Image.new(im.mode, (self.size, self.size), 0)
        canvas.paste(im.resize((nw, nh), Image.Resampling.BILINEAR), (left, top))
        return canvas


class NaivePreprocess:
    """The full decode and torchvision's transforms, on the CPU, one image at a time."""

    def __init__(
        self,
        *,
        resize: int,
        crop: int,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
        geometry: str = "shorter-crop",
    ) -> None:
        fit: list[Callable[[Image.Image], Any]]
        if geometry == "squash":
            fit = [T.Resize((crop, crop))]
        elif geometry == "letterbox":
            fit = [Letterbox(crop)]
        else:
            fit = [T.Resize(resize), T.CenterCrop(crop)]
        self.transform: Callable[[Image.Image], torch.Tensor] = T.Compose(
            [*fit, T.ToTensor(), T.Normalize(mean, std)]
        )

    @staticmethod
    def decode(data: bytes) -> Image.Image:
        """The full-resolution decode: every pixel of the JPEG, whatever the model needs."""
        return Image.open(io.BytesIO(data)).convert("RGB")

    def __call__(self, data: bytes) -> torch.Tensor:
        """x: [3, crop, crop] float32, normalised."""
        return self.transform(self.decode(data))


class NaiveWorker:
    """One job at a time from `stream`: decode, transform, forward, `.item()`, answer."""

    def __init__(
        self,
        *,
        redis_url: str,
        stream: str,
        group: str,
        results_stream: str,
        result_prefix: str,
        result_ttl_s: int,
        model: str,
        weights: str,
        input_size: int,
        device: torch.device,
        consumer: str = "naive",
    ) -> None:
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.results_stream = results_stream
        self.result_prefix = result_prefix
        self.result_ttl_s = result_ttl_s
        self.device = device
        self.model_name = model
        loaded = load_configured(model, weights, input_size=input_size, batch_size=1)
        self.model = loaded.module.to(device).eval()
        # The same output kind as gpufeed serves (softmax top-k for a classifier), eager.
        self.head = make_head(loaded.output, loaded.output_shape, top_k=5).to(device)
        self.classify = loaded.output.kind == "classify"
        self.crop_size = loaded.crop_size
        self.resize_size = loaded.resize_size
        self.resize_mode = loaded.resize_mode
        self.mean, self.std = loaded.mean, loaded.std
        self.preprocess = NaivePreprocess(
            resize=loaded.resize_size,
            crop=loaded.crop_size,
            mean=loaded.mean,
            std=loaded.std,
            geometry=loaded.resize_mode,
        )
        self.client = redis.Redis.from_url(redis_url)
        self.stop = threading.Event()
        self.answered = 0

    def ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def model_only(self, *, iters: int, warmup: int) -> dict[str, Any]:
        """Images/s of this worker's forward alone at batch 1, measured with the same code as
        the direct-feed ceiling (worker/model/ceiling.py: a random input already on the device)."""
        x = torch.randn(1, 3, self.crop_size, self.crop_size, device=self.device)

        def forward(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.model(batch)
            return logits, logits

        previous = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = self.device.type == "cuda"  # as when serving
        try:
            return direct_feed_ceiling(forward, x, iters=iters, warmup=warmup)
        finally:
            torch.backends.cudnn.benchmark = previous

    def serve(self, count: int, *, block_ms: int = 200) -> int:
        """Answer jobs until `count` were answered or `stop` is set; returns how many."""
        previous = torch.backends.cudnn.benchmark
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        try:
            while self.answered < count and not self.stop.is_set():
                reply: Any = self.client.xreadgroup(
                    self.group, self.consumer, {self.stream: ">"}, count=1, block=block_ms
                )
                for _stream, entries in reply or []:
                    for entry_id, fields in entries:
                        self._answer(entry_id.decode(), fields)
        finally:
            torch.backends.cudnn.benchmark = previous
        return self.answered

    def _answer(self, entry_id: str, fields: dict[bytes, bytes]) -> None:
        t0 = time.perf_counter()
        raw_id = fields.get(wire.JOB_ID)
        job_id = raw_id.decode() if raw_id else entry_id
        timings: dict[str, float] = {}
        out: dict[bytes | str, bytes | str] = {
            wire.RES_ID: job_id,
            wire.RES_ENTRY: entry_id,
        }
        try:
            img = NaivePreprocess.decode(fields[wire.JOB_IMAGE])
            t1 = time.perf_counter()
            x = self.preprocess.transform(img).unsqueeze(0).to(self.device)
            t2 = time.perf_counter()
            top1_index: int | None = None
            with torch.inference_mode():
                outputs = self.head(self.model(x))
                # The host syncs gpufeed never makes: each waits for the GPU to finish.
                if self.classify:
                    top1_index = int(outputs[0][0, 0].item())
                    top1_score = float(outputs[1][0, 0].item())
                else:
                    for t in outputs:
                        t.cpu()
            t3 = time.perf_counter()
            timings = {
                "decode": (t1 - t0) * 1000,
                "preprocess": (t2 - t1) * 1000,
                "compute": (t3 - t2) * 1000,
            }
            out[wire.RES_STATUS] = wire.STATUS_OK
            if top1_index is not None:
                out[wire.RES_TOP1] = str(top1_index)
                out[wire.RES_SCORE] = f"{top1_score:.6f}"
        except Exception as exc:  # noqa: BLE001 - a bad job gets an error result, as in gpufeed
            out[wire.RES_STATUS] = wire.STATUS_ERROR
            out[wire.RES_ERROR] = f"decode_error: {type(exc).__name__}: {exc}"[:200]
        timings["total"] = (time.perf_counter() - t0) * 1000
        details = {
            "model": self.model_name,
            "worker": "naive-reference",
            "device": str(self.device),
            "timings_ms": {k: round(v, 3) for k, v in timings.items()},
        }
        out[wire.RES_RESULT] = msgpack.packb(details, use_bin_type=True)
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, entry_id)
        pipe.xadd(self.results_stream, out)  # type: ignore[arg-type]
        key = wire.result_key(job_id, self.result_prefix)
        pipe.hset(key, mapping=out)  # type: ignore[arg-type]
        pipe.expire(key, self.result_ttl_s)
        pipe.execute()
        self.answered += 1

    def close(self) -> None:
        self.client.close()
