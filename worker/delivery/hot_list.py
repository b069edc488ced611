"""The fleet's hot list: the `url` and `path` images most often answered from the decode
cache, kept in Redis so that a worker that starts can decode them before it takes a job
(worker/lifecycle/warm_start.py).

One sorted set, `<GPUFEED_STREAM>:hot` (one key, so one hash slot on a cluster and one key
pattern for an ACL user): each member an image, its score the cache hits it had, each hit
worth half as much every HALF_LIFE_S, so the list follows what is asked for now. Members are
JSON, readable with `redis-cli ZREVRANGE gpufeed:jobs:hot 0 9 WITHSCORES`:

    ["path", "<reply_to>", "<path as the job gave it>"]
    ["url",  "<reply_to>", "<url>"]

The reply stream is part of each member because it is part of each decode-cache key
(worker/decode/cache.py): a warmed row serves only jobs answered where the hits were. A
URL with a query string is never listed: it is often signed, and a signature must not
outlive its job in Redis (it has expired by the time a worker starts anyway). Inline
`image` jobs have nothing to fetch again and are not listed either, nor are names with a
control character (doctor shows the list on a terminal).

A worker counts the hits of each batch in memory (`HotList.counts`, bounded) and adds
them every FLUSH_INTERVAL_S and when it stops, in one script that also ages the scores,
drops those worth less than MIN_SCORE and keeps the HOT_LIST best (a tuning constant). The script
keeps the time it last aged the list in the set itself, as the (negative) score of the
member `*aging*`, which no image member can equal and which ranks below every image.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, cast

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from producer import shards, wire
from worker.delivery.redis_errors import ANY, FAILING_OVER, PASSING, temporary
from worker.jobs import Job

log = structlog.get_logger("gpufeed.hot_list")

HALF_LIFE_S = 600
FLUSH_INTERVAL_S = 10.0
# A hit ages below this after two half-lives: the image leaves the list.
MIN_SCORE = 0.25
# An idle fleet's list goes after a week without a flush.
TTL_S = 7 * 86_400
AGING_MEMBER = "*aging*"
# The longest path a member may carry (Linux's PATH_MAX).
MAX_PATH_BYTES = 4096
KINDS = ("path", "url")

# KEYS[1]: the hot list. ARGV: [1] how many images it keeps, [2] half-life (s), [3] the
# lowest score kept, [4] its time to live (s), then member, hits, member, hits, ...
# Returns how many images it holds.
ADD_HITS = """
if redis.replicate_commands then redis.replicate_commands() end
local key = KEYS[1]
local size, half_life = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(redis.call('TIME')[1])
local mark = redis.call('ZSCORE', key, '*aging*')
if not mark then
  redis.call('ZADD', key, -now, '*aging*')
else
  local elapsed = now + tonumber(mark)
  if elapsed >= half_life / 8 then
    redis.call('ZUNIONSTORE', key, 1, key, 'WEIGHTS', 0.5 ^ (elapsed / half_life))
    redis.call('ZADD', key, -now, '*aging*')
  end
end
for i = 5, #ARGV, 2 do
  redis.call('ZINCRBY', key, ARGV[i + 1], ARGV[i])
end
redis.call('ZREMRANGEBYSCORE', key, 0, '(' .. ARGV[3])
local images = redis.call('ZCARD', key) - 1
if images > size then
  redis.call('ZREMRANGEBYRANK', key, 1, images - size)
  images = size
end
redis.call('EXPIRE', key, ARGV[4])
return images
"""


def hot_list_key(stream: str) -> str:
    """The fleet's hot list for workers reading `stream` (GPUFEED_STREAM), named where every
    key gpufeed owns is (producer/shards.py)."""
    return shards.hot_list_key(stream)


class HotEntry(NamedTuple):
    kind: str  # "path" or "url"
    reply_to: str
    ref: str  # the path or the URL
    score: float

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "reply_to": self.reply_to, "ref": self.ref, "score": self.score}


def member_of(job: Job) -> str | None:
    """The hot-list member of `job`'s image, or None when it cannot be listed."""
    if job.path is not None:
        try:
            kind, ref = "path", job.path.decode("utf-8")
        except UnicodeDecodeError:
            return None
    elif job.url is not None and "?" not in job.url:
        kind, ref = "url", job.url
    else:
        return None
    if not (ref.isprintable() and job.reply_to.isprintable()):
        # Shown by doctor on a terminal: no control character reaches it from a job.
        return None
    return json.dumps([kind, job.reply_to, ref], ensure_ascii=False, separators=(",", ":"))


def entry_of(member: bytes | str, score: float) -> HotEntry | None:
    """The entry a member names; None for anything this worker would not have written (the
    list is in Redis: whoever may write there may write anything into it)."""
    try:
        value = json.loads(member)
    except (ValueError, UnicodeDecodeError):
        return None
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, str) for v in value)):
        return None
    kind, reply_to, ref = value
    limit = MAX_PATH_BYTES if kind == "path" else wire.MAX_URL_BYTES
    if (
        kind not in KINDS
        or not reply_to.strip()
        or len(reply_to.encode("utf-8", "surrogatepass")) > wire.MAX_REPLY_TO_BYTES
        or not ref
        or len(ref.encode("utf-8", "surrogatepass")) > limit
        or not ref.isprintable()
        or not reply_to.isprintable()
        or (kind == "url" and "?" in ref)
    ):
        return None
    return HotEntry(kind, reply_to, ref, float(score))


class HotCounts:
    """Hits counted since the last flush, member -> hits; at most `limit` members (new ones
    past it wait for the next flush to be counted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._hits: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._hits)

    def add(self, jobs: Iterable[Job]) -> None:
        """Count one hit for each of `jobs` (jobs answered from the decode cache)."""
        hits = self._hits
        for job in jobs:
            if job.path is None and job.url is None:
                continue
            member = member_of(job)
            if member is None:
                continue
            if member in hits:
                hits[member] += 1
            elif len(hits) < self.limit:
                hits[member] = 1

    def take(self) -> dict[str, int]:
        hits, self._hits = self._hits, {}
        return hits


class HotList:
    """The hot list of one fleet (its job stream) in Redis."""

    def __init__(
        self, client: aioredis.Redis, stream: str, size: int, *, half_life_s: float = HALF_LIFE_S
    ) -> None:
        self.key = hot_list_key(stream)
        self.size = size
        # This worker's hits since the last flush; past four times the list's size, new
        # images wait for the next flush to be counted.
        self.counts = HotCounts(4 * size)
        self.half_life_s = half_life_s
        self._client = client
        self._add = client.register_script(ADD_HITS)
        # Set once a flush was refused (a Redis user without the commands, a key of
        # another type): said once, then the worker goes on without the list.
        self.refused: str | None = None

    async def add(self, hits: Mapping[str, int]) -> int:
        """Add `hits` (member -> hits), age and trim the list; how many images it holds."""
        args: list[Any] = [self.size, self.half_life_s, MIN_SCORE, TTL_S]
        for member, count in hits.items():
            args += [member, count]
        return int(await self._add(keys=[self.key], args=args))

    async def top(self, limit: int | None = None) -> list[HotEntry]:
        """The best `limit` images (all kept by default), best first; members this worker
        could not have written are left out."""
        count = self.size if limit is None else min(limit, self.size)
        if count <= 0:
            return []
        raw = cast(
            "list[tuple[bytes, float]]",
            await self._client.zrevrangebyscore(
                self.key, "+inf", 0, start=0, num=count, withscores=True
            ),
        )
        entries = [entry_of(member, score) for member, score in raw]
        return [e for e in entries if e is not None]

    async def count(self) -> int:
        """How many images the list holds."""
        return int(await self._client.zcount(self.key, 0, "+inf"))

    async def flush(self) -> None:
        """Add the hits counted since the last flush; a refusal is said once and turns the
        list off."""
        hits = self.counts.take()
        if not hits or self.refused is not None:
            return
        try:
            await self.add(hits)
        except (*ANY, *FAILING_OVER) as exc:
            # Refused for good (no permission, a key of another type): not asked again.
            if isinstance(exc, ResponseError) and not (isinstance(exc, PASSING) or temporary(exc)):
                self.refused = str(exc)
                log.warning(
                    "hot_list_refused",
                    key=self.key,
                    error=str(exc),
                    note="the worker goes on without the hot list",
                )
            else:
                # Redis away, or refusing everyone for a moment (BUSY: a script holds it):
                # these hits are lost, the next ones are counted.
                log.info("hot_list_not_flushed", key=self.key, error=str(exc))

    async def run(self, interval_s: float = FLUSH_INTERVAL_S) -> None:
        """Flush the counted hits every `interval_s` until cancelled."""
        while self.refused is None:
            await asyncio.sleep(interval_s)
            await self.flush()
