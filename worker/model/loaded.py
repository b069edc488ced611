"""What loading a model gives the worker, whichever way it was loaded: a torchvision
classifier (loader.py), a model directory (directory.py) or the null model (null.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from worker.model.manifest import OutputSpec


@dataclass(frozen=True)
class LoadedModel:
    name: str
    module: nn.Module
    weights_label: str  # what was loaded, for logs and results
    categories: tuple[str, ...] | None
    crop_size: int  # the model's input side
    resize_size: int  # the staging side: shorter side resized to this, then center-cropped
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    num_classes: int  # classify; 0 for the other kinds
    # What the step's head makes of the model's output (the torchvision classifiers:
    # softmax and GPUFEED_TOP_K), and that output's shape per image.
    output: OutputSpec = field(default_factory=OutputSpec)
    output_shape: tuple[int, ...] = ()
    # How the decoder fits an image into the staging square (decoder.GEOMETRIES).
    resize_mode: str = "shorter-crop"
    source: str = "torchvision"  # or export, torchscript, entry (a model directory), null


def file_label(path: Path) -> str:
    """A weights or model file as results name it: its path and a digest of its content, so
    that a file replaced under the same name is told apart (idempotent ids compare it)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"{path} (sha256 {digest.hexdigest()[:12]})"
