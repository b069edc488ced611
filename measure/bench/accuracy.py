"""Both resize placements against torchvision's eval transforms: the bench's `accuracy`
section, and what tests/decode/test_resample.py asserts.

The reference: each image decoded in full by Pillow, turned upright from its EXIF tag, then
torchvision's Resize(S, antialias=True) + CenterCrop(C). The host placement resizes on the
decode threads (Pillow, 8-bit between its passes); the device placement keeps the decoded
pixels in rows and resizes them in the step (float, worker/model/resample.py), in eager on
the given device. Both decode large JPEGs at libjpeg's DCT scale, which is where most of
the difference to the full-decode reference comes from.

The images: generated photos (smooth colour gradients under Gaussian noise, as
tests/support/images.py makes them) of every size class the rows distinguish (an upscaled
thumbnail; native rows, landscape, portrait and square; DCT-scaled photos; a panorama too
long for a row, reduced on the host), each in all eight EXIF orientations. The model: a
small random convnet with a fixed seed, in fp32 on the CPU; its pooled features are the
embedding, a linear layer the logits. Small sizes (S = 64) keep the whole section to about
a second on a CPU.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import nn
from torchvision import transforms

from worker.decode.cpu import DecodeSpec, decode_pixels
from worker.decode.rows import decode_row, row_side, write_decoded_row
from worker.model.resample import RowResampler

STAGING, CROP = 64, 56
SIDE = row_side(STAGING)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ORIENTATIONS = tuple(range(1, 9))

# (width, height, what the size class exercises), at S = 64: the row is 3 S wide.
SIZES: tuple[tuple[int, int, str], ...] = (
    (40, 30, "thumbnail, upscaled"),
    (150, 112, "native row, landscape"),
    (112, 150, "native row, portrait"),
    (100, 100, "native row, square"),
    (520, 390, "DCT-scaled photo"),
    (700, 1000, "DCT-scaled photo, portrait"),
    (600, 90, "panorama, reduced on the host"),
)

# What the placements must reach (tests/decode/test_resample.py asserts the same numbers). Pixel
# differences in levels of 255, per image: decoded at full size, rounding only; decoded at
# a DCT scale, libjpeg's reduced IDCT drops detail finer than the scaled grid.
THRESHOLDS = {
    "top1_agreement_min": 0.99,
    "cosine_min": 0.995,
    "pixel_mean_full_size": 0.5,
    "pixel_max_full_size": 1.0,
    "pixel_mean_dct_scaled": 1.5,
    "pixel_max_dct_scaled": 10.0,
}


@dataclass(frozen=True)
class Case:
    width: int
    height: int
    orientation: int
    data: bytes

    @property
    def dct_scaled(self) -> bool:
        """libjpeg decodes it at a reduced DCT scale (its shorter side is >= 2 S)."""
        return min(self.width, self.height) >= 2 * STAGING


def gradient_photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients with noise (sigma 12 levels): the pixel bounds below are for content
    like this. Sharper structure near the output's scale (the bench's `photo_like`) differs
    more where libjpeg decodes at a DCT scale: its reduced IDCT filters it otherwise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [
            x * 255 / max(width - 1, 1),
            y * 255 / max(height - 1, 1),
            (x + y) * 127 / max(width + height - 2, 1) + seed * 37 % 128,
        ],
        axis=-1,
    )
    noisy = base + rng.normal(0, 12, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def oriented_jpeg(width: int, height: int, orientation: int, seed: int) -> bytes:
    """A generated photo as a JPEG (q95) whose EXIF tag says `orientation`."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    gradient_photo(width, height, seed).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def cases() -> list[Case]:
    """Every size class in every orientation, grouped by size class (8 images each)."""
    return [
        Case(w, h, o, oriented_jpeg(w, h, o, seed=i))
        for i, (w, h, _) in enumerate(SIZES)
        for o in ORIENTATIONS
    ]


def reference(data: bytes) -> torch.Tensor:
    """[3, C, C] float, 0..255: torchvision's eval geometry on the full, upright decode."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB"))
    pipeline = transforms.Compose(
        [
            transforms.Resize(STAGING, antialias=True),
            transforms.CenterCrop(CROP),
            transforms.PILToTensor(),
        ]
    )
    out: torch.Tensor = pipeline(image)
    return out.float()


def host_placement(data: bytes) -> torch.Tensor:
    """[3, C, C] float: the decode thread's S x S pixels, centre-cropped as the step does."""
    pixels, _ = decode_pixels(data, DecodeSpec(size=STAGING))
    off = round((STAGING - CROP) / 2)
    crop = pixels[off : off + CROP, off : off + CROP].copy()
    return torch.from_numpy(crop).permute(2, 0, 1).float()


def decode_rows(images: list[bytes]) -> tuple[torch.Tensor, list[bool]]:
    """[N, R, R, 3] uint8 rows as the decode pool writes them, and which were reduced on the
    host (too long for a row)."""
    rows = np.zeros((len(images), SIDE, SIDE, 3), dtype=np.uint8)
    reduced = []
    for i, data in enumerate(images):
        row, _ = decode_row(data, DecodeSpec(size=STAGING), SIDE)
        write_decoded_row(rows[i], row)
        reduced.append(row.reduced)
    return torch.from_numpy(rows), reduced


def device_placement(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, 3, C, C] float on the CPU: the step's resampling of `rows`, run on `device`."""
    resampler = RowResampler(SIDE, STAGING, STAGING, CROP).to(device)
    with torch.inference_mode():
        out: torch.Tensor = resampler(rows.to(device))
    return out.cpu()


class TinyClassifier(nn.Module):
    """A small random convnet: its pooled features are the embedding, a linear layer the
    logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classes = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.features(x)
        return emb, self.classes(emb)


@dataclass(frozen=True)
class Agreement:
    top1: float  # fraction of images whose top-1 class is the reference's
    cosine: torch.Tensor  # [N] embedding cosine to the reference's


def classifier_agreement(reference: torch.Tensor, got: torch.Tensor) -> Agreement:
    """The classifier's answers on `got` against those on `reference` ([N, 3, C, C], 0..255),
    normalised as the step does, fp32 on the CPU."""
    model = TinyClassifier().eval()
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255
    with torch.inference_mode():
        emb_ref, logits_ref = model((reference - mean) / std)
        emb, logits = model((got - mean) / std)
    top1 = (logits.argmax(1) == logits_ref.argmax(1)).float().mean().item()
    return Agreement(top1, nn.functional.cosine_similarity(emb, emb_ref, dim=1))


@dataclass(frozen=True)
class Measured:
    """The pixels of every case under the reference and each placement ([N, 3, C, C])."""

    cases: list[Case]
    reference: torch.Tensor
    host: torch.Tensor
    device: torch.Tensor
    reduced: list[bool]  # per case: the device placement's row was reduced on the host
    device_ran_on: torch.device

    def placement(self, name: str) -> torch.Tensor:
        return {"host": self.host, "device": self.device}[name]


def measure(all_cases: list[Case], device: torch.device) -> Measured:
    images = [c.data for c in all_cases]
    rows, reduced = decode_rows(images)
    return Measured(
        cases=all_cases,
        reference=torch.stack([reference(d) for d in images]),
        host=torch.stack([host_placement(d) for d in images]),
        device=device_placement(rows, device),
        reduced=reduced,
        device_ran_on=device,
    )


def _placement_figures(m: Measured, name: str) -> dict[str, Any]:
    got = m.placement(name)
    agreement = classifier_agreement(m.reference, got)
    diff = (got - m.reference).abs().reshape(len(m.cases), -1)
    per_image_mean, per_image_max = diff.mean(dim=1), diff.max(dim=1).values
    t = THRESHOLDS
    misses = []
    if agreement.top1 < t["top1_agreement_min"]:
        misses.append(f"top-1 agreement {agreement.top1:.3f} < {t['top1_agreement_min']}")
    if agreement.cosine.min().item() < t["cosine_min"]:
        misses.append(f"embedding cosine {agreement.cosine.min().item():.4f} < {t['cosine_min']}")
    by_size = []
    n = len(ORIENTATIONS)
    for k, (w, h, what) in enumerate(SIZES):
        group = slice(k * n, (k + 1) * n)
        scaled = m.cases[k * n].dct_scaled
        kind = "dct_scaled" if scaled else "full_size"
        worst_mean = per_image_mean[group].max().item()
        worst = per_image_max[group].max().item()
        by_size.append(
            {
                "width": w,
                "height": h,
                "pixel_diff_mean": round(worst_mean, 3),  # the worst image's mean
                "pixel_diff_max": round(worst, 3),
            }
        )
        if worst_mean > t[f"pixel_mean_{kind}"] or worst > t[f"pixel_max_{kind}"]:
            misses.append(
                f"{w}x{h} ({what}): pixel difference mean {worst_mean:.2f} / max {worst:.2f} "
                f"over {t[f'pixel_mean_{kind}']} / {t[f'pixel_max_{kind}']}"
            )
    resized_on = (
        "cpu: Pillow on the decode threads"
        if name == "host"
        else f"{m.device_ran_on.type}: the step's resampling (worker/model/resample.py), eager"
    )
    return {
        "resized_on": resized_on,
        "top1_agreement": round(agreement.top1, 4),
        "cosine_min": round(agreement.cosine.min().item(), 5),
        "cosine_mean": round(agreement.cosine.mean().item(), 5),
        "pixel_diff_mean": round(diff.mean().item(), 3),
        "pixel_diff_max": round(diff.max().item(), 3),
        "by_size_class": by_size,
        "met": not misses,
        "misses": misses,
    }


def accuracy_section(device: torch.device) -> dict[str, Any]:
    """The bench's `accuracy` section: each placement against the reference on every case.
    The device placement resamples on `device` (CUDA where the bench runs there)."""
    m = measure(cases(), device)
    n = len(ORIENTATIONS)
    return {
        "reference": f"Pillow's full decode, upright from EXIF, torchvision "
        f"Resize({STAGING}, antialias=True) + CenterCrop({CROP})",
        "model": "a small random convnet (fixed seed), fp32 on the CPU: top-1 of its logits, "
        "cosine of its pooled features",
        "staging_size": STAGING,
        "crop_size": CROP,
        "images": len(m.cases),
        "orientations": list(ORIENTATIONS),
        "size_classes": [
            {
                "width": w,
                "height": h,
                "what": what,
                "dct_scaled": m.cases[k * n].dct_scaled,
                "reduced_on_host": all(m.reduced[k * n : (k + 1) * n]),
            }
            for k, (w, h, what) in enumerate(SIZES)
        ],
        "thresholds": dict(THRESHOLDS),
        "placements": {name: _placement_figures(m, name) for name in ("host", "device")},
        "placements_max_diff": round((m.device - m.host).abs().max().item(), 3),
    }
