"""`--part I/N`: one source split among N clients on N machines, each id in exactly one part.

Part I keeps the items whose id (as the source names it, before any --id-prefix) hashes to
I modulo N: the 64-bit hash the run keeps for every id anyway (producer/batch_ids.py, the
first 8 bytes of the id's BLAKE2b digest, little-endian). A fixed rule, chosen over leases
in Redis: every client computes its share alone from the id, so no client's death strands
a lease, a part can be rerun on any machine at any time, and the split does not depend on
the order in which a source is listed (a bucket listed again, a folder walked again). The
hash is not the shard rule's CRC-32, so each part feeds every shard evenly.

Each client still reads the whole source. A manifest's lines of other parts cost the
client only their id (read, split, hashed a page at a time), not the rest of an item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from producer.batch_ids import Hashes, id_hashes

T = TypeVar("T")


@dataclass(frozen=True)
class Part:
    """This client's part of the source: index I of count N."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Part:
        """`I/N` with 0 <= I < N; ValueError with one line otherwise."""
        left, sep, right = text.partition("/")
        try:
            index, count = int(left), int(right)
        except ValueError:
            index = count = -1
        if not sep or count < 1 or not 0 <= index < count:
            raise ValueError(
                f"--part {text!r}: give I/N, this client's part I of N (0 <= I < N), "
                "e.g. 0/3, 1/3 and 2/3 on three machines"
            )
        return cls(index, count)

    @property
    def whole(self) -> bool:
        return self.count == 1

    def mine(self, hashes: Hashes) -> npt.NDArray[np.bool_]:
        """Which of the ids (as their hashes) are this part's."""
        if self.count == 1:
            return np.ones(len(hashes), dtype=bool)
        return np.asarray(hashes % np.uint64(self.count) == np.uint64(self.index))

    def keep(
        self,
        chunks: Iterator[list[T]],
        id_of: Callable[[T], str | None],
        on_other: Callable[[int], None] | None = None,
    ) -> Iterator[list[T]]:
        """`chunks` with only this part's entries; an entry whose id is None (one the
        source refuses or skips further on) is kept, so that every part meets it. The
        count of the other parts' entries of each chunk goes to `on_other`."""
        for chunk in chunks:
            ids = [id_of(entry) for entry in chunk]
            known = [i for i in ids if i is not None]
            mine = iter(self.mine(id_hashes(known)).tolist())
            kept = [e for e, i in zip(chunk, ids, strict=True) if i is None or next(mine)]
            if on_other is not None and len(kept) < len(chunk):
                on_other(len(chunk) - len(kept))
            if kept:
                yield kept

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
