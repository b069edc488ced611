"""The job streams a worker reads ("lanes"), and how its read budget is shared among them.

Without priorities a worker has one lane, the job stream. With GPUFEED_PRIORITIES it has one
lane per level, highest first, each a stream of its own (producer/priorities.py names them)
with a weight from GPUFEED_PRIORITY_WEIGHTS. Tenants (GPUFEED_TENANTS, producer/tenants.py)
add their own lanes the same way, one per level per tenant, each lane's weight its level's
times its tenant's: everything that reads, reclaims, trims or reports per stream iterates
this object, so none of it needs to know why there are several streams.

The share rule (docs/priorities.md): of B free in-flight places, every level below the
highest earns B * w / W credits per read (W: the weights' sum); it may read as many entries
as whole credits it holds, and pays one per entry read. Credits carry over while the level
has work, so a share below one place per read still adds up, and are dropped when it has
none, so an idle level cannot bank a burst. The highest level may read all the rest. What a
level leaves unused (it had less waiting) flows down: the levels are asked again, highest
first, for the spare places. With tenants the same rule runs over every lane: each tenant's
lanes earn their share whatever another tenant's backlog, so a backlog of thousands in one
stream takes only what the others leave.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from producer.priorities import level_stream
from producer.shards import Shard


@dataclass
class Lane:
    level: str  # "" without priorities
    stream: str
    weight: int
    # Whole and fractional read places this lane has earned and not used yet.
    credit: float = 0.0
    # The keys its jobs are answered with (results stream, result hashes); None: the
    # reader's own (a lane built without them, as in tests of the share rule).
    keys: Shard | None = None


@dataclass
class Lanes:
    lanes: list[Lane] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        stream: str,
        levels: Sequence[str],
        weights: Sequence[int],
        *,
        plain: bool = False,
        keys: Shard | None = None,
        share: int = 1,
    ) -> Lanes:
        """`plain`: with levels, read the plain `stream` too, as one more lane after the
        lowest level with its weight (jobs added there by a producer that was not told
        the levels are served, not stranded). Its jobs keep level "": results name their
        entries by the entry ID alone, as that producer expects. `keys`: the key set the
        lanes' jobs are answered with; `share`: its tenant's weight, times each level's."""
        if not levels:
            return cls([Lane("", stream, share, keys=keys)])
        lanes = [
            Lane(lv, level_stream(stream, lv), w * share, keys=keys)
            for lv, w in zip(levels, weights, strict=True)
        ]
        if plain:
            lanes.append(Lane("", stream, weights[-1] * share, keys=keys))
        return cls(lanes)

    @classmethod
    def merged(cls, each: Sequence[Lanes]) -> Lanes:
        """Several key sets' lanes (the operator's and each tenant's, built alike) as one:
        level by level, highest first, each level's lanes in the order given."""
        if len(each) == 1:
            return each[0]
        rows = zip(*(lanes.lanes for lanes in each), strict=True)
        return cls([lane for row in rows for lane in row])

    def __iter__(self) -> Iterator[Lane]:
        return iter(self.lanes)

    def __len__(self) -> int:
        return len(self.lanes)

    @property
    def streams(self) -> list[str]:
        return [lane.stream for lane in self.lanes]

    def shares(self, budget: int) -> list[int]:
        """How many entries each lane may read now, of `budget` places (first pass)."""
        if len(self.lanes) == 1:
            return [budget]
        total_w = sum(lane.weight for lane in self.lanes)
        out = [0] * len(self.lanes)
        left = budget
        for i in range(len(self.lanes) - 1, 0, -1):
            lane = self.lanes[i]
            lane.credit += budget * lane.weight / total_w
            out[i] = min(int(lane.credit), left)
            left -= out[i]
        out[0] = left
        return out

    def settle(self, asked: Sequence[int], got: Sequence[int]) -> None:
        """Charge each lane for what it read in the first pass; a lane that had less than
        it asked for has no more work: it loses its leftover credit."""
        for lane, a, g in zip(self.lanes, asked, got, strict=True):
            if lane is self.lanes[0]:
                continue
            lane.credit = 0.0 if g < a else max(0.0, lane.credit - g)
