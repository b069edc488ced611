"""What a model answered for one image, by output kind, and how each kind reads on the wire.

Each answer gives its plain result-hash fields (readable with `redis-cli HGETALL`) and its
entries of the msgpack `result` map; the writer adds the fields every result has. Torch-free:
these are host values, made by the completion watcher from a pinned output slot.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Protocol

from producer import wire


class Answer(Protocol):
    def hash_fields(self) -> list[bytes | str]:
        """Flat field/value list for the result hash and stream entry."""
        ...

    def details(self) -> dict[str, Any]:
        """Entries of the msgpack `result` map."""
        ...


# Answers are named tuples: one is made per image on the event loop, and a tuple is made
# several times faster than a frozen dataclass (which sets each field through
# object.__setattr__).


class Classification(NamedTuple):
    """Top-k classes; with a sigmoid (multi-label) also every class at or above the
    threshold, best first. Scores as they go on the wire: the reader rounds them to 6
    decimals, once per batch."""

    indices: list[int]
    scores: list[float]
    names: list[str] | None = None  # of `indices`, when the model has class names
    threshold: float | None = None  # set for multi-label answers only
    positives: list[int] | None = None
    positive_scores: list[float] | None = None
    positive_names: list[str] | None = None

    def hash_fields(self) -> list[bytes | str]:
        out: list[bytes | str] = [wire.RES_TOP1, str(self.indices[0])]
        if self.names:
            out += [wire.RES_LABEL, self.names[0]]
        out += [wire.RES_SCORE, f"{self.scores[0]:.6f}"]
        if self.positive_names is not None:
            out += [wire.RES_LABELS, json.dumps(self.positive_names, ensure_ascii=False)]
        return out

    def details(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "top_k": self.indices,
            "scores": self.scores,
        }
        if self.threshold is None:
            if self.names is not None:
                out["labels"] = self.names
            return out
        # Multi-label: `labels` are the classes the model assigns, not the top-k names.
        out["labels"] = self.positive_names or []
        out["label_indices"] = self.positives or []
        out["label_scores"] = self.positive_scores or []
        out["threshold"] = self.threshold
        return out


class Embedding(NamedTuple):
    """One vector, as little-endian bytes of `dtype`."""

    vector: bytes
    dim: int
    dtype: str

    def hash_fields(self) -> list[bytes | str]:
        return [
            wire.RES_EMBEDDING, self.vector,
            wire.RES_DIM, str(self.dim),
            wire.RES_DTYPE, self.dtype,
        ]  # fmt: skip

    def details(self) -> dict[str, Any]:
        return {"embedding": self.vector, "dim": self.dim, "dtype": self.dtype}


class RawOutput(NamedTuple):
    """The model's whole output for one image, as little-endian bytes of `dtype`."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str

    def hash_fields(self) -> list[bytes | str]:
        return [
            wire.RES_OUTPUT, self.data,
            wire.RES_SHAPE, json.dumps(list(self.shape)),
            wire.RES_DTYPE, self.dtype,
        ]  # fmt: skip

    def details(self) -> dict[str, Any]:
        return {"output": self.data, "shape": list(self.shape), "dtype": self.dtype}
