"""The ids a batch run has seen, kept as 64-bit hashes in sorted numpy arrays.

A manifest can hold tens of millions of entries, and a resumed run must skip every id
already in the output. A Python set of those strings would take about 100 bytes an id; a
sorted uint64 array takes 8, answers a whole chunk of look-ups with one `searchsorted`, and
needs no file of its own (the output is the only record: the store is rebuilt from it at
start). A sqlite table would take less memory still, but costs a B-tree insert per id at
start and during the run, which a client meant to outrun its workers cannot afford.

Hashes can collide: with 40 million ids, the odds that any two of them share a 64-bit
hash are about 1 in 20,000, and such an id would be taken for done and skipped.

New hashes go into a small sorted run; runs of similar size are merged (as in a
log-structured merge tree), so adding n ids costs O(n log n) in all and a look-up searches
O(log n) runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

Hashes = npt.NDArray[np.uint64]


def id_hashes(ids: Iterable[str]) -> Hashes:
    """The 64-bit hash of each id (the first 8 bytes of its BLAKE2b digest, little-endian),
    the digests joined and read as one array."""
    blake = hashlib.blake2b
    digests = b"".join([blake(i.encode(), digest_size=8).digest() for i in ids])
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def contains(sorted_hashes: Hashes, hashes: Hashes) -> npt.NDArray[np.bool_]:
    """For each of `hashes`, whether it is in `sorted_hashes` (sorted ascending)."""
    if not len(sorted_hashes) or not len(hashes):
        return np.zeros(len(hashes), dtype=bool)
    at = np.searchsorted(sorted_hashes, hashes)
    at[at == len(sorted_hashes)] = 0
    return np.asarray(sorted_hashes[at] == hashes)


class IdStore:
    """A set of id hashes that only grows: `add_new` keeps the ones not seen before."""

    def __init__(self, initial: Hashes | None = None) -> None:
        self._runs: list[Hashes] = []
        if initial is not None and len(initial):
            self._runs.append(np.unique(initial))

    def __len__(self) -> int:
        return sum(len(r) for r in self._runs)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._runs)

    def seen(self, hashes: Hashes) -> npt.NDArray[np.bool_]:
        found = np.zeros(len(hashes), dtype=bool)
        for run in self._runs:
            found |= contains(run, hashes)
        return found

    def add_new(self, hashes: Hashes) -> npt.NDArray[np.bool_]:
        """Add `hashes`; the mask of those that were new (the first of any repeated in
        `hashes` itself counts as new, the others do not)."""
        new = ~self.seen(hashes)
        _, first = np.unique(hashes, return_index=True)
        once = np.zeros(len(hashes), dtype=bool)
        once[first] = True
        new &= once
        if new.any():
            self._push(np.sort(hashes[new]))
        return new

    def _push(self, run: Hashes) -> None:
        self._runs.append(run)
        # Merge while the newest run is at least half the size of the one before it.
        while len(self._runs) > 1 and 2 * len(self._runs[-1]) >= len(self._runs[-2]):
            last = self._runs.pop()
            self._runs[-1] = np.sort(np.concatenate((self._runs[-1], last)))
