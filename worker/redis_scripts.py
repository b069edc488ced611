"""Server-side scripts: each does, atomically, a step that must never be seen half done.

In Redis Cluster every key a script touches must hash to one slot: give the job stream, the
result streams, the result prefix and the dead-letter stream one hash tag
(`{gpufeed}:jobs`, `{gpufeed}:results`, `{gpufeed}:result:`, `{gpufeed}:dead`).
"""

from __future__ import annotations

# Publish one result, acknowledging its job in the same step.
# KEYS: [1] job stream, [2] reply stream, [3] result hash (by job id), [4] dead-letter
#       stream, [5] the entry's own answer hash (by entry reference; the same key as [3]
#       for a job without its own id)
# ARGV: [1] group, [2] entry reference (the entry ID, or `<level>:<entry ID>` on a priority
#       level's stream: the result's `entry`; XACK takes the ID after the last ':'),
#       [3] result TTL s, [4] reply stream MAXLEN (approximate),
#       [5] result prefix, [6] '1' when the job has its own id (idempotent ids),
#       [7] model, [8] weights (a job is a duplicate only of a result served by the same
#           model and weights), [9] the worker's default results stream,
#       [10] n: how many dead-letter field/value args follow (0: not a dead letter),
#       [11 .. 10+n] the dead-letter entry, [11+n ..] the result's field/value pairs.
# Returns a PublishState (worker/writer.py):
#   1 published; 2 published as a duplicate (its id already had a result, which stands:
#   this answer goes to the reply stream with `duplicate_of` and to hash [5]);
#   0 not acknowledged here and already answered (by another worker, or an earlier try);
#   3 acknowledged here but already answered (a recreated group served the entry again);
#   -2 .. -5 the reply stream cannot take results: -2 it holds another type, -3 it is a
#   key of gpufeed's own (the job stream, the dead-letter stream, a result hash), -4 a
#   consumer group reads it (a job queue), -5 this Redis user may not write it;
#   -6 the dead-letter stream holds another type; -7 this Redis user may not write
#   gpufeed's own result or dead-letter keys. Whenever it returns below 0, nothing was done.
#
# An entry that left the pending list without an answer (XDEL or XTRIM and then a claim,
# XGROUP DESTROY, DEL of the stream) acknowledges 0 but has no answer yet: it is published
# anyway, so the job still ends with exactly one result. An answer is recognised by the
# `entry` field of hash [3] or [5].
#
# Redis does not roll a script back when a command in it fails, so everything that could
# fail is checked before the first write. Under maxmemory Redis refuses only a script's
# first write, so a refusal (an error reply) means nothing was done either.
PUBLISH_RESULT = """
local function kind(key)
  return redis.call('TYPE', key)['ok']
end
local function answered_by(key)
  if kind(key) == 'hash' then
    return redis.call('HGET', key, 'entry')
  end
  return false
end
local function may(...)
  return not redis.acl_check_cmd or redis.acl_check_cmd(...)
end
local entry, prefix, reply = ARGV[2], ARGV[5], KEYS[2]
local entry_id = string.match(entry, '[^:]*$')
if not may('TYPE', reply) or not may('XADD', reply, '*', 'f', 'v')
    or not may('XINFO', 'GROUPS', reply) then
  return -5
end
if reply == KEYS[1] or reply == KEYS[4] or string.sub(reply, 1, #prefix) == prefix then
  return -3
end
local reply_type = kind(reply)
if reply_type ~= 'stream' and reply_type ~= 'none' then
  return -2
end
if reply_type == 'stream' and reply ~= ARGV[9]
    and #redis.call('XINFO', 'GROUPS', reply) > 0 then
  return -4
end
local n = tonumber(ARGV[10])
if n > 0 then
  local dead_type = kind(KEYS[4])
  if dead_type ~= 'stream' and dead_type ~= 'none' then
    return -6
  end
  if not may('XADD', KEYS[4], '*', 'f', 'v') then
    return -7
  end
end
if not may('HSET', KEYS[3], 'f', 'v') or not may('HSET', KEYS[5], 'f', 'v') then
  return -7
end
local acked = 0
if kind(KEYS[1]) == 'stream' then
  acked = redis.call('XACK', KEYS[1], ARGV[1], entry_id)
end
if answered_by(KEYS[3]) == entry or answered_by(KEYS[5]) == entry then
  if acked == 1 then
    return 3
  end
  return 0
end
local hash = KEYS[3]
local duplicate_of = false
if ARGV[6] == '1' then
  local existing = answered_by(KEYS[3])
  if existing then
    local served = redis.call('HMGET', KEYS[3], 'model', 'weights')
    if served[1] == ARGV[7] and served[2] == ARGV[8] then
      duplicate_of = existing
      hash = KEYS[5]
    end
  end
end
if n > 0 then
  redis.call('XADD', KEYS[4], '*', unpack(ARGV, 11, 10 + n))
end
local fields = {unpack(ARGV, 11 + n)}
if duplicate_of then
  table.insert(fields, 'duplicate_of')
  table.insert(fields, duplicate_of)
end
redis.call('XADD', reply, 'MAXLEN', '~', ARGV[4], '*', unpack(fields))
redis.call('DEL', hash)
redis.call('HSET', hash, unpack(fields))
redis.call('EXPIRE', hash, ARGV[3])
if duplicate_of then
  return 2
end
return 1
"""

# Reset the idle time of entries this consumer still owns, so a slow but live batch is not
# reclaimed. Entries already reclaimed by another worker are left alone: XCLAIM alone would
# steal them back. So are entries deleted from the stream: XCLAIM would drop them from the
# pending list, and if this worker then died nobody would answer them; left pending, they
# are answered by this worker when it finishes, or as `entry_deleted` by a reclaimer.
# KEYS: [1] job stream; ARGV: [1] group, [2] consumer, [3 ..] entry ids. Returns the count.
REFRESH_OWNED = """
local refreshed = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] and #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]) > 0 then
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

# What a worker checks at start-up about the keys it will write, so that an operator's
# mistake (a key of another type, an ACL user without a key pattern) stops it with a clear
# message instead of leaving every job pending.
# KEYS: [1] job stream, [2] results stream, [3] dead-letter stream, [4] a result hash,
#       [5] the heartbeat hash. Returns a list of problems (empty: all usable).
CHECK_KEYS = """
local problems = {}
local function kind(key)
  return redis.call('TYPE', key)['ok']
end
local function may(...)
  return not redis.acl_check_cmd or redis.acl_check_cmd(...)
end
local streams = {KEYS[1], KEYS[2], KEYS[3]}
for _, key in ipairs(streams) do
  if not may('TYPE', key) or not may('XADD', key, '*', 'f', 'v') then
    table.insert(problems, key .. ': this Redis user may not read and write it')
  else
    local t = kind(key)
    if t ~= 'stream' and t ~= 'none' then
      table.insert(problems, key .. ': holds a ' .. t .. ', not a stream')
    end
  end
end
for _, key in ipairs({KEYS[4], KEYS[5]}) do
  if not may('HSET', key, 'f', 'v') or not may('EXPIRE', key, '1') then
    table.insert(problems, key .. ': this Redis user may not write it')
  end
end
return problems
"""
