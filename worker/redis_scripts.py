"""Server-side scripts: each does, atomically, a step that must never be seen half done.

In Redis Cluster every key a script touches must hash to one slot: give the job stream, the
result streams, the result prefix and the dead-letter stream one hash tag
(`{gpufeed}:jobs`, `{gpufeed}:results`, `{gpufeed}:result:`, `{gpufeed}:dead`).
"""

from __future__ import annotations

# Publish one result, acknowledging its job in the same step.
# KEYS: [1] job stream, [2] reply stream, [3] result hash, [4] dead-letter stream
# ARGV: [1] group, [2] entry id, [3] result TTL s, [4] reply stream MAXLEN (approximate),
#       [5] 'ack' (publish only if XACK acknowledged the entry) or 'deleted' (the entry left
#           the pending list already, through XAUTOCLAIM, so there is nothing to ack),
#       [6] '1' to refuse a second result for a job id that already has one (idempotent ids),
#       [7] n: how many dead-letter field/value args follow (0: not a dead letter),
#       [8 .. 7+n] the dead-letter entry, [8+n ..] the result's field/value pairs.
# Returns 1 published, 0 not ours any more (someone else acknowledged it), 2 acknowledged
# as a duplicate of an id that already has a result, -2 the reply stream key holds another
# type (nothing done, so the caller can answer elsewhere), -3 the dead-letter stream key
# holds another type (nothing done; an operator must fix GPUFEED_DEAD_STREAM).
# Redis does not roll a script back when a command in it fails, so everything that could
# fail is checked before the XACK.
PUBLISH_RESULT = """
local reply_type = redis.call('TYPE', KEYS[2])['ok']
if reply_type ~= 'stream' and reply_type ~= 'none' then
  return -2
end
if tonumber(ARGV[7]) > 0 then
  local dead_type = redis.call('TYPE', KEYS[4])['ok']
  if dead_type ~= 'stream' and dead_type ~= 'none' then
    return -3
  end
end
if ARGV[5] == 'ack' then
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
    return 0
  end
elseif redis.call('HGET', KEYS[3], 'entry') == ARGV[2] then
  -- 'deleted' has no XACK to guard it: a resent script finds its own earlier result.
  return 0
end
if ARGV[6] == '1' then
  local existing = redis.call('HGET', KEYS[3], 'entry')
  if existing and existing ~= ARGV[2] then
    return 2
  end
end
local n = tonumber(ARGV[7])
if n > 0 then
  redis.call('XADD', KEYS[4], '*', unpack(ARGV, 8, 7 + n))
end
local first = 8 + n
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, first))
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], unpack(ARGV, first))
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
"""

# Reset the idle time of entries this consumer still owns, so a slow but live batch is not
# reclaimed. Entries already reclaimed by another worker are left alone: XCLAIM alone would
# steal them back.
# KEYS: [1] job stream; ARGV: [1] group, [2] consumer, [3 ..] entry ids. Returns the count.
REFRESH_OWNED = """
local refreshed = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    refreshed = refreshed + 1
  end
end
return refreshed
"""

# Delete a consumer only if it holds no pending entry; checked and done in one step so no
# entry can be delivered to it in between.
# KEYS: [1] job stream; ARGV: [1] group, [2] consumer. Returns -1 when it still holds entries.
DELETE_IDLE_CONSUMER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then
  return -1
end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""
