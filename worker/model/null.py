"""GPUFEED_MODEL=null: the whole pipeline and the classify result format around a step that
does next to no work, for measuring gpufeed itself (the part Triton's identity model plays
for perf_analyzer).

Per image: the channel means of the normalised input times a fixed 3 x N matrix, N logits
for the classes null_0 .. null_{N-1}. One reduction and one tiny matmul: the step compiles
to one graph and takes microseconds, so what a benchmark measures is the reader, decode,
staging, copy, completion and writer, not the model.
"""

from __future__ import annotations

import torch
from torch import nn

NULL_CLASSES = 8
# 64 px: the side of the overhead benchmark's tiny JPEGs, so staging does not upscale them.
NULL_INPUT_SIZE = 64


class NullClassifier(nn.Module):
    """x: [B, 3, H, W] -> logits [B, NULL_CLASSES]; the same for a given image every time."""

    def __init__(self, classes: int = NULL_CLASSES) -> None:
        super().__init__()
        # Fixed, not random: the answer for an image does not depend on the process.
        weight = torch.linspace(-1.0, 1.0, 3 * classes).view(3, classes)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3)) @ self.weight.to(x.dtype)
