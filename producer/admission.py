"""Admission control: refuse work that would only queue, checked and added in one step.

With `max_backlog` (or `max_memory_share`) set, a producer adds its jobs through one
server-side script that counts the backlog (entries not yet read by the group, plus those
pending), checks Redis's memory, and adds the jobs only if they fit, all at once; so
concurrent producers can never push the stream past the limit together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.typing import EncodableT, FieldT

# KEYS: [1] job stream. ARGV: [1] group, [2] max backlog (0: no limit), [3] max share of
# maxmemory in use (0: no limit), [4] number of jobs, then per job: its field count n and n
# field/value pairs. Returns {1, entry ids...} when added, {-1, backlog} when the backlog is
# full, {-2, used_memory, maxmemory} when Redis's memory is.
# The backlog is the group's lag plus its pending count; where Redis does not know the lag
# (after entries were deleted) or the group does not exist yet, the stream's length stands
# in, which counts too much rather than too little.
ADMIT = """
local max_backlog = tonumber(ARGV[2])
local max_share = tonumber(ARGV[3])
local jobs = tonumber(ARGV[4])
if max_backlog > 0 then
  local backlog = nil
  if redis.call('EXISTS', KEYS[1]) == 1 then
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
      local info = {}
      for i = 1, #g, 2 do
        info[g[i]] = g[i + 1]
      end
      if info['name'] == ARGV[1] and info['lag'] then
        backlog = info['lag'] + info['pending']
      end
    end
    if not backlog then
      backlog = redis.call('XLEN', KEYS[1])
    end
  else
    backlog = 0
  end
  if backlog + jobs > max_backlog then
    return {-1, backlog}
  end
end
if max_share > 0 then
  local info = redis.call('INFO', 'memory')
  local used = tonumber(string.match(info, 'used_memory:(%d+)'))
  local max = tonumber(string.match(info, 'maxmemory:(%d+)'))
  if max and max > 0 and used >= max_share * max then
    return {-2, used, max}
  end
end
local ids = {1}
local i = 5
for _ = 1, jobs do
  local n = tonumber(ARGV[i])
  table.insert(ids, redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 1, i + 2 * n)))
  i = i + 1 + 2 * n
end
return ids
"""


class AdmissionRefused(Exception):
    """The jobs were not added (none of them): the queue or Redis is full."""


class BacklogFull(AdmissionRefused):
    def __init__(self, backlog: int, max_backlog: int, jobs: int) -> None:
        super().__init__(
            f"backlog full: {backlog} jobs waiting or pending, {jobs} more would pass "
            f"max_backlog={max_backlog}"
        )
        self.backlog = backlog
        self.max_backlog = max_backlog


class RedisMemoryFull(AdmissionRefused):
    def __init__(self, used: int, maxmemory: int, share: float) -> None:
        super().__init__(
            f"Redis memory full: {used} of maxmemory {maxmemory} bytes in use, over the "
            f"max_memory_share={share:g}"
        )
        self.used = used
        self.maxmemory = maxmemory


def admit_args(
    group: str,
    max_backlog: int,
    max_memory_share: float,
    jobs: Sequence[Mapping[FieldT, EncodableT]],
) -> list[EncodableT]:
    args: list[EncodableT] = [group, max_backlog, repr(max_memory_share), len(jobs)]
    for fields in jobs:
        args.append(len(fields))
        for k, v in fields.items():
            args += [k, v]
    return args


def admitted(
    reply: Any, *, max_backlog: int, max_memory_share: float, jobs: int
) -> list[bytes | str]:
    """The entry ids the script added; BacklogFull or RedisMemoryFull when it refused."""
    status = int(reply[0])
    if status == -1:
        raise BacklogFull(int(reply[1]), max_backlog, jobs)
    if status == -2:
        raise RedisMemoryFull(int(reply[1]), int(reply[2]), max_memory_share)
    return list(reply[1:])


def backlog_of(groups: Sequence[Mapping[Any, Any]], group: str, length: int) -> int:
    """The backlog the admission script counts, from XINFO GROUPS (redis-py's dicts) and
    XLEN: the group's lag plus its pending entries, or the stream's length where Redis does
    not know the lag or the group does not exist yet."""
    for info in groups:
        name = info.get("name")
        if (name.decode() if isinstance(name, bytes) else name) != group:
            continue
        lag = info.get("lag")
        if lag is not None:
            return int(lag) + int(info.get("pending") or 0)
    return length


def check_admission(
    backlog: int,
    memory: Mapping[str, Any],
    *,
    max_backlog: int,
    max_memory_share: float,
    jobs: int,
) -> None:
    """The admission script's two checks over values read without it (INFO memory as
    redis-py parses it); raises BacklogFull or RedisMemoryFull."""
    if max_backlog > 0 and backlog + jobs > max_backlog:
        raise BacklogFull(backlog, max_backlog, jobs)
    used, maxmemory = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
    if max_memory_share > 0 and maxmemory > 0 and used >= max_memory_share * maxmemory:
        raise RedisMemoryFull(used, maxmemory, max_memory_share)
