"""Server-side scripts: each does, atomically, a step that must never be seen half done.

In Redis Cluster every key a script touches must hash to one slot: give the job stream, the
result streams, the result prefix and the dead-letter stream one hash tag
(`{gpufeed}:jobs`, `{gpufeed}:results`, `{gpufeed}:result:`, `{gpufeed}:dead`).
"""

from __future__ import annotations

# Publish results, acknowledging each job in the same step: one call for many jobs of one
# job stream (the writer groups a flush by stream: in Redis Cluster every key of a call must
# be in one slot), each job handled exactly as if it had a call of its own, in order.
# KEYS: [1] job stream, [2] dead-letter stream, [3 ..] the jobs' reply streams and result
#       hashes, each declared once (the records below name them by index).
# ARGV: [1] group, [2] result TTL s, [3] reply stream MAXLEN (approximate), [4] result
#       prefix, [5] model, [6] weights (a job is a duplicate only of a result served by the
#       same model and weights), [7] the worker's default results stream,
#       [8] the jobs: a msgpack array (raw strings, no bin type: Redis's cmsgpack reads
#       only those) of records [entry reference (the entry ID, or `<level>:<entry ID>` on a
#       priority level's stream: the result's `entry`; XACK takes the ID after the last
#       ':'), reply stream key index, result hash key index (by job id), answer hash key
#       index (by entry reference; the same index for a job without its own id), own id
#       (bool: idempotent ids), dead-letter field/value list (empty: not a dead letter),
#       the result's field/value list]. The jobs of one call were served by one model and
#       weights (ARGV[5], ARGV[6]: the main step's, or the degraded step's).
# Returns one PublishState (worker/delivery/writer.py) per record, in order:
#   1 published; 2 published as a duplicate (its id already had a result, which stands:
#   this answer goes to the reply stream with `duplicate_of` and to the answer hash);
#   0 not acknowledged here and already answered (by another worker, or an earlier try);
#   3 acknowledged here but already answered (a recreated group served the entry again);
#   -2 .. -5 the reply stream cannot take results: -2 it holds another type, -3 it is a
#   key of gpufeed's own (the job stream, the dead-letter stream, a result hash; the writer
#   refuses every other one, by producer/shards.py's `own_keys`, before it calls this
#   script), -4 a consumer group reads it (a job queue), -5 this Redis user may not write it;
#   -6 the dead-letter stream holds another type; -7 this Redis user may not write
#   gpufeed's own result or dead-letter keys; -8 a result hash key of the job (by its id,
#   or by its entry) holds something other than a gpufeed result (another type, or a hash
#   without `entry`): it is never deleted or overwritten. Whenever a job's state is below
#   0, nothing was done for it.
#
# An entry that left the pending list without an answer (XDEL or XTRIM and then a claim,
# XGROUP DESTROY, DEL of the stream) acknowledges 0 but has no answer yet: it is published
# anyway, so the job still ends with exactly one result. An answer is recognised by the
# `entry` field of its result or answer hash.
#
# Redis does not roll a script back when a command in it fails, so everything that could
# fail for a job is checked before its first write. Under maxmemory Redis refuses only a
# script's first write (once a script wrote, it may go on), so a refusal (an error reply)
# means nothing was done for any job of the call: the first job that writes XACKs first
# when its stream exists, and where it does not, the call's first write is that job's XADD.
#
# What the checks find about a reply stream or the dead-letter stream is kept for the rest
# of the call: the call's own writes (XADDs to a stream without groups) cannot change it.
PUBLISH_RESULTS = """
local group, ttl, maxlen, prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local model, weights, default_reply = ARGV[5], ARGV[6], ARGV[7]
local jobs_key, dead_key = KEYS[1], KEYS[2]
local function kind(key)
  return redis.call('TYPE', key)['ok']
end
-- What a result key holds: usable (nothing, or a gpufeed result hash: one with `entry`),
-- and the entry it answers (false: none).
local function probe(key)
  local t = kind(key)
  if t == 'none' then
    return true, false
  elseif t == 'hash' then
    local answered = redis.call('HGET', key, 'entry')
    return answered ~= false, answered
  end
  return false, false
end
local function may(...)
  return not redis.acl_check_cmd or redis.acl_check_cmd(...)
end
local reply_checked = {}
local function check_reply(reply)
  local state = reply_checked[reply]
  if state then
    return state
  end
  if not may('TYPE', reply) or not may('XADD', reply, '*', 'f', 'v')
      or not may('XINFO', 'GROUPS', reply) then
    state = -5
  elseif reply == jobs_key or reply == dead_key or string.sub(reply, 1, #prefix) == prefix then
    state = -3
  else
    local reply_type = kind(reply)
    if reply_type ~= 'stream' and reply_type ~= 'none' then
      state = -2
    elseif reply_type == 'stream' and reply ~= default_reply
        and #redis.call('XINFO', 'GROUPS', reply) > 0 then
      state = -4
    else
      state = 0
    end
  end
  reply_checked[reply] = state
  return state
end
local dead_checked = false
local function check_dead()
  if not dead_checked then
    local dead_type = kind(dead_key)
    if dead_type ~= 'stream' and dead_type ~= 'none' then
      dead_checked = -6
    elseif not may('XADD', dead_key, '*', 'f', 'v') then
      dead_checked = -7
    else
      dead_checked = 0
    end
  end
  return dead_checked
end
local jobs_is_stream = kind(jobs_key) == 'stream'
local function publish(job)
  local entry, reply, hash, entry_hash = job[1], KEYS[job[2]], KEYS[job[3]], KEYS[job[4]]
  local dead, fields = job[6], job[7]
  local state = check_reply(reply)
  if state < 0 then
    return state
  end
  if #dead > 0 then
    state = check_dead()
    if state < 0 then
      return state
    end
  end
  if not may('HSET', hash, 'f', 'v')
      or (entry_hash ~= hash and not may('HSET', entry_hash, 'f', 'v')) then
    return -7
  end
  -- Read-only, so before the XACK: a refused job must have had nothing done for it.
  local usable, existing = probe(hash)
  local entry_usable, entry_answered = usable, existing
  if entry_hash ~= hash then
    entry_usable, entry_answered = probe(entry_hash)
  end
  if not usable or not entry_usable then
    return -8
  end
  local acked = 0
  if jobs_is_stream then
    acked = redis.call('XACK', jobs_key, group, string.match(entry, '[^:]*$'))
  end
  if existing == entry or entry_answered == entry then
    if acked == 1 then
      return 3
    end
    return 0
  end
  local duplicate_of = false
  if job[5] then
    if existing then
      local served = redis.call('HMGET', hash, 'model', 'weights')
      if served[1] == model and served[2] == weights then
        duplicate_of = existing
        hash = entry_hash
      end
    end
  end
  if #dead > 0 then
    redis.call('XADD', dead_key, '*', unpack(dead))
  end
  if duplicate_of then
    table.insert(fields, 'duplicate_of')
    table.insert(fields, duplicate_of)
  end
  redis.call('XADD', reply, 'MAXLEN', '~', maxlen, '*', unpack(fields))
  redis.call('DEL', hash)
  redis.call('HSET', hash, unpack(fields))
  redis.call('EXPIRE', hash, ttl)
  if duplicate_of then
    return 2
  end
  return 1
end
local states = {}
for i, job in ipairs(cmsgpack.unpack(ARGV[8])) do
  states[i] = publish(job)
end
return states
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

# What the degrade switch measures a job stream by (worker/pipeline/degrade.py), in one step so that
# the server's time and the stream's IDs are read together, and without moving any entry's
# fields over the wire. KEYS: [1] job stream; ARGV: [1] group.
# Returns {seconds, microseconds (TIME), the stream's last-generated-id, the ID of the first
# entry the group has not delivered} ('' for an ID there is not: no stream, or none waits).
WAITING_HEAD = """
local t = redis.call('TIME')
local key = KEYS[1]
if redis.call('TYPE', key)['ok'] ~= 'stream' then
  return {t[1], t[2], '', ''}
end
local function field(flat, name)
  for i = 1, #flat, 2 do
    if flat[i] == name then
      return flat[i + 1]
    end
  end
  return false
end
local last = field(redis.call('XINFO', 'STREAM', key), 'last-generated-id') or ''
local head = ''
for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
  if field(g, 'name') == ARGV[1] then
    local delivered = field(g, 'last-delivered-id') or '0-0'
    local first = redis.call('XRANGE', key, '(' .. delivered, '+', 'COUNT', 1)
    if #first > 0 then
      head = first[1][1]
    end
  end
end
return {t[1], t[2], last, head}
"""
