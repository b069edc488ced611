"""What the step returns per image: one `OutputField` per tensor, fixed at start-up.

The heads declare their layout with these, and the output ring (worker/pipeline/staging.py)
is sized from it once, so the ring never reallocates when the output kind changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutputField:
    """One tensor of the step's output: its name, its shape per image and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes per image."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


def classify_layout(top_k: int) -> tuple[OutputField, ...]:
    """The softmax classifier's output: top-k indices and scores."""
    return (
        OutputField("indices", (top_k,), torch.int32),
        OutputField("scores", (top_k,), torch.float32),
    )
