"""The end of the compiled step, one head per output kind: model output in, fixed-shape
tensors out, ready to be copied into a pinned output slot.

A head runs inside the one compiled graph, so every kind keeps the hot path: no host sync,
the same shapes every batch. Its `layout` (one OutputField per returned tensor) sizes the
output ring once at start-up. To add a kind: a head here, a reader in readers.py, an answer
in answers.py, and its name in manifest.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.manifest import OutputSpec
from worker.model.outputs import OutputField, classify_layout

_DTYPES = {"float16": torch.float16, "float32": torch.float32}


class Head(nn.Module):
    """y: the model's output [B, ...] -> a tuple of [B, ...] tensors matching `layout`."""

    layout: tuple[OutputField, ...]


class ClassifyHead(Head):
    """(indices [B, K] int32, scores [B, K] float32); with a sigmoid also every class's
    probability [B, C] float32, which the reader thresholds per batch on the host."""

    def __init__(self, *, classes: int, top_k: int, activation: str = "softmax") -> None:
        super().__init__()
        self.top_k = min(top_k, classes)
        self.activation = activation
        self.layout = classify_layout(self.top_k)
        if activation == "sigmoid":
            self.layout += (OutputField("probs", (classes,), torch.float32),)

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = y.float()
        if self.activation == "softmax":
            y = y.softmax(dim=-1)
        elif self.activation == "sigmoid":
            y = y.sigmoid()
        scores, indices = y.topk(self.top_k, dim=-1)
        if self.activation == "sigmoid":
            return indices.to(torch.int32), scores, y
        return indices.to(torch.int32), scores


class EmbedHead(Head):
    """(vector [B, D] float16/float32,), L2-normalised in fp32 first when asked."""

    def __init__(self, *, dim: int, normalize: bool, dtype: str) -> None:
        super().__init__()
        self.normalize = normalize
        self.out_dtype = _DTYPES[dtype]
        self.layout = (OutputField("embedding", (dim,), self.out_dtype),)

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        v = y.float()
        if self.normalize:
            v = F.normalize(v, p=2.0, dim=-1)
        return (v.to(self.out_dtype),)


class RawHead(Head):
    """(output [B, ...] float16/float32,): the model's output as it is."""

    def __init__(self, *, shape: tuple[int, ...], dtype: str) -> None:
        super().__init__()
        self.out_dtype = _DTYPES[dtype]
        self.layout = (OutputField("output", shape, self.out_dtype),)

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (y.to(self.out_dtype),)


def make_head(spec: OutputSpec, output_shape: tuple[int, ...], *, top_k: int) -> Head:
    """The head for `spec`, given the model's output shape per image; `top_k` is
    GPUFEED_TOP_K, used when the manifest gives none."""
    if spec.kind == "classify":
        return ClassifyHead(
            classes=output_shape[0], top_k=spec.top_k or top_k, activation=spec.activation
        )
    if spec.kind == "embed":
        return EmbedHead(dim=output_shape[0], normalize=spec.normalize, dtype=spec.dtype)
    if spec.kind == "raw":
        return RawHead(shape=output_shape, dtype=spec.dtype)
    raise ValueError(f"unknown output kind {spec.kind!r}")
