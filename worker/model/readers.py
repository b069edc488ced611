"""From a finished output slot to answers, one reader per output kind (the host side of heads.py).

Called by the completion watcher on the event loop once the batch's done-event fired, so
the slot's pinned memory holds the batch's results and reading it waits on nothing. Each
reader works per batch where numpy can (one `tolist()` of the whole slot, one threshold
compare), and per row only to cut the batch into answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from worker.model.answers import Answer, Classification, Embedding, RawOutput
from worker.model.manifest import OutputSpec

Arrays = Sequence[npt.NDArray[Any]]


class OutputReader(Protocol):
    def read(self, arrays: Arrays, rows: Sequence[int]) -> list[Answer]:
        """One answer per row in `rows`, from the slot's arrays (one per layout field)."""
        ...


# Decimals of the scores on the wire: float32 outputs carry about 7 significant digits.
SCORE_DECIMALS = 6


class ClassifyReader:
    def __init__(
        self, categories: Sequence[str] | None = None, *, threshold: float | None = None
    ) -> None:
        self.categories = list(categories) if categories is not None else None
        # The names as an object array, so a batch's top-k names are one fancy index.
        self._cats = np.array(self.categories, dtype=object) if self.categories else None
        self.threshold = threshold  # multi-label (sigmoid) only

    def _names(self, indices: Sequence[int]) -> list[str] | None:
        cats = self.categories
        if cats is None:
            return None
        return [cats[i] if 0 <= i < len(cats) else str(i) for i in indices]

    def _batch_names(self, indices: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
        """The names of a batch's top-k indices ([B, k] objects); an index the names do
        not cover reads as its number."""
        cats = self._cats
        if cats is None:
            return None if self.categories is None else indices.astype(str).astype(object)
        # ndarray methods, not numpy's functions: their Python wrappers cost more than the
        # work on a batch's few hundred indices.
        last = len(cats) - 1
        names: npt.NDArray[Any] = cats[indices.clip(0, last)]
        if indices.min() < 0 or indices.max() > last:
            outside = (indices < 0) | (indices > last)
            names[outside] = indices[outside].astype(str).astype(object)
        return names

    def read(self, arrays: Arrays, rows: Sequence[int]) -> list[Answer]:
        all_indices = arrays[0].tolist()
        # Rounded for the wire here, once per batch, not per answer.
        all_scores = arrays[1].astype(np.float64).round(SCORE_DECIMALS).tolist()
        names_of = self._batch_names(arrays[0])
        all_names = names_of.tolist() if names_of is not None else None
        if self.threshold is None:
            if all_names is None:
                return [Classification(all_indices[row], all_scores[row]) for row in rows]
            return [
                Classification(all_indices[row], all_scores[row], all_names[row]) for row in rows
            ]
        positive = arrays[2] >= self.threshold  # [B, C], one compare for the batch
        out: list[Answer] = []
        for row in rows:
            indices: list[int] = all_indices[row]
            scores: list[float] = all_scores[row]
            names = all_names[row] if all_names is not None else None
            probs = arrays[2][row]
            found = np.flatnonzero(positive[row])
            found = found[np.argsort(-probs[found], kind="stable")]
            chosen: list[int] = found.tolist()
            out.append(
                Classification(
                    indices,
                    scores,
                    names,
                    threshold=self.threshold,
                    positives=chosen,
                    positive_scores=np.round(
                        probs[found].astype(np.float64), SCORE_DECIMALS
                    ).tolist(),
                    positive_names=self._names(chosen) or [str(i) for i in chosen],
                )
            )
        return out


class EmbedReader:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        # The wire format is little-endian whatever the host: a no-op view on x86 and ARM.
        self._wire = np.dtype(dtype).newbyteorder("<")

    def read(self, arrays: Arrays, rows: Sequence[int]) -> list[Answer]:
        vectors = arrays[0].astype(self._wire, copy=False)
        dim = int(vectors.shape[1])
        return [Embedding(vectors[row].tobytes(), dim, self.dtype) for row in rows]


class RawReader:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._wire = np.dtype(dtype).newbyteorder("<")

    def read(self, arrays: Arrays, rows: Sequence[int]) -> list[Answer]:
        outputs = arrays[0].astype(self._wire, copy=False)
        shape = tuple(int(d) for d in outputs.shape[1:])
        return [RawOutput(outputs[row].tobytes(), shape, self.dtype) for row in rows]


def make_reader(spec: OutputSpec, categories: Sequence[str] | None) -> OutputReader:
    """The reader for `spec`; `categories`: the class names of a classifier."""
    if spec.kind == "classify":
        sigmoid = spec.activation == "sigmoid"
        return ClassifyReader(categories, threshold=spec.threshold if sigmoid else None)
    if spec.kind == "embed":
        return EmbedReader(spec.dtype)
    if spec.kind == "raw":
        return RawReader(spec.dtype)
    raise ValueError(f"unknown output kind {spec.kind!r}")
