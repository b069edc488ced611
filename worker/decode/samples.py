"""Photo-like JPEGs made here: what the GPU codecs are probed with at start-up, what the
decoders are timed on (calibration, the split's start-up rates) and what the checks and
benchmarks feed, so that none of them needs an image from outside."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def synthetic_jpeg(
    width: int, height: int, seed: int = 0, quality: int = 90, mode: str = "RGB"
) -> bytes:
    """A photo-like JPEG (gradient plus noise), for calibration and benchmarks; `mode`:
    the JPEG's colour mode as Pillow writes it (RGB, L for grey, CMYK as Adobe does)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1
    )
    noisy = np.clip(base + rng.normal(0, 12, size=base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noisy, "RGB").convert(mode).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
