"""Deterministic image sets for the benchmark: photo-like JPEGs, made here, cached on disk.

A set is fully described by its `ImageSetSpec`; the same spec gives the same bytes on every
run (same seed, same libjpeg), and its `key()` names the cache folder, so a changed
generator or parameter never reuses stale files.

The pictures are built to cost what photographs cost to decode: smooth multi-scale
structure (sky, walls, blurred objects) plus a little sensor noise, so the entropy decoder
has real work, at the sizes and qualities cameras and web pages produce. One image in
`portrait_every` is portrait (width and height swapped), as in a real photo collection.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image

# Bump when `photo_like` changes: it is part of every cache key.
GENERATOR_VERSION = 1
_NOISE_TILE = 256


@dataclass(frozen=True)
class ImageSetSpec:
    name: str
    width: int
    height: int
    count: int  # distinct images; the jobs of a run cycle through them
    quality: int = 90
    seed: int = 0
    noise: int = 4  # amplitude of the per-pixel noise, in 8-bit levels
    portrait_every: int = 4  # every Nth image is portrait; 0: none

    def __post_init__(self) -> None:
        if self.width < 16 or self.height < 16:
            raise ValueError(f"{self.name}: images must be at least 16x16")
        if self.count < 1:
            raise ValueError(f"{self.name}: count must be at least 1")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"{self.name}: JPEG quality must be 1..100")

    @property
    def label(self) -> str:
        return f"{self.width}x{self.height} JPEG q{self.quality}"

    def key(self) -> str:
        """A short hash of everything that determines the bytes."""
        payload = json.dumps({"v": GENERATOR_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    def size_of(self, index: int) -> tuple[int, int]:
        if self.portrait_every and index % self.portrait_every == self.portrait_every - 1:
            return self.height, self.width
        return self.width, self.height


@dataclass(frozen=True)
class ImageSet:
    spec: ImageSetSpec
    images: tuple[bytes, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def mean_bytes(self) -> int:
        return sum(map(len, self.images)) // len(self.images)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.spec.name,
            "label": self.spec.label,
            "width": self.spec.width,
            "height": self.spec.height,
            "quality": self.spec.quality,
            "distinct_images": len(self.images),
            "portrait_every": self.spec.portrait_every,
            "mean_bytes": self.mean_bytes,
            "key": self.spec.key(),
        }


def photo_like(width: int, height: int, seed: int, noise: int = 4) -> Image.Image:
    """A deterministic photo-like RGB picture of `width` x `height`."""
    rng = np.random.default_rng(seed)
    # Structure at 1/8 resolution (three octaves of smooth random fields), upscaled once:
    # cheap to make even at 12 megapixels, and smooth like optics make real pictures.
    sw, sh = max(8, width // 8), max(8, height // 8)
    acc = np.full((sh, sw, 3), 128.0, dtype=np.float32)
    amplitude = 90.0
    for cells in (50, 12, 3):
        gw, gh = max(2, sw // cells), max(2, sh // cells)
        grid = rng.integers(0, 256, (gh, gw, 3), dtype=np.uint8)
        layer = Image.fromarray(grid, "RGB").resize((sw, sh), Image.Resampling.BICUBIC)
        acc += amplitude / 128.0 * (np.asarray(layer, dtype=np.float32) - 128.0)
        amplitude *= 0.5
    small = Image.fromarray(np.clip(acc, 0, 255).astype(np.uint8), "RGB")
    picture = small.resize((width, height), Image.Resampling.BICUBIC)
    if noise <= 0:
        return picture
    # Sensor noise from one tile, shifted per image: the encoder sees full-entropy noise and
    # generating it costs a tile, not 12 million random numbers.
    tile = rng.integers(-noise, noise + 1, (_NOISE_TILE, _NOISE_TILE, 3), dtype=np.int16)
    reps = (-(-height // _NOISE_TILE) + 1, -(-width // _NOISE_TILE) + 1, 1)
    dy, dx = (int(v) for v in rng.integers(0, _NOISE_TILE, 2))
    grain: npt.NDArray[np.int16] = np.tile(tile, reps)[dy : dy + height, dx : dx + width]
    pixels = np.asarray(picture, dtype=np.int16) + grain
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def generate(spec: ImageSetSpec, index: int) -> bytes:
    width, height = spec.size_of(index)
    picture = photo_like(width, height, seed=spec.seed * 100_003 + index, noise=spec.noise)
    buf = io.BytesIO()
    picture.save(buf, "JPEG", quality=spec.quality)
    return buf.getvalue()


def load_image_set(spec: ImageSetSpec, cache_dir: Path | None = None) -> ImageSet:
    """The set's images, from `cache_dir/<name>-<key>/` when there, else generated (and
    written there, atomically per file, when a cache folder is given)."""
    if cache_dir is None:
        return ImageSet(spec, tuple(generate(spec, i) for i in range(spec.count)))
    folder = cache_dir / f"{spec.name}-{spec.key()}"
    folder.mkdir(parents=True, exist_ok=True)
    images: list[bytes] = []
    for i in range(spec.count):
        path = folder / f"{i:04d}.jpg"
        if path.is_file():
            images.append(path.read_bytes())
            continue
        data = generate(spec, i)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(path)
        images.append(data)
    return ImageSet(spec, tuple(images))
