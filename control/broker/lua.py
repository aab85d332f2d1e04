"""Every Lua script of the request path: the one place Lua is written (control/broker/scripts.py
wraps each in a typed class; the envelope's Lua is control/broker/envelope.py's).

What keeps a request alive when the replica holding it dies: leases, held records,
claims, the sweep that re-queues, and the delivery where the first answer wins.
Every step is one script, so each is atomic on the broker:

- A replica holds a *lease* (`keys.lease_key`, a few hundred ms, renewed by its
  batching loop) and records each request it takes from the queue in its *held* hash
  (`keys.held_key`: attempt id -> the held record of control/broker/records.py).
- Before a batch runs, the replica *claims* each request (`keys.claim_key`). A claim
  held by a replica whose lease is alive cannot be taken: a re-queued copy never runs
  while its first copy is running on a replica that holds its lease. (A replica that
  lost its lease, paused past it, is presumed dead: when it wakes, the copy it was
  running may finish too; DELIVER answers the client once and counts the other as waste.)
- When a lease lapses, SWEEP puts every held request that is still wanted back at the
  front of its queue, or answers it `expired` (504) when its deadline leaves no time for
  another batch (or when it was re-queued `MAX_REQUEUES` times already: a prompt that
  kills replicas must not kill them all). The held hash goes in the same step, so two
  sweepers cannot re-queue a request twice. Gateways run it for every lapsed lease
  (every 100 ms); the supervisor runs it for a replica it saw die, at once.
- DELIVER routes each answer to every gateway that waits for the request *now* (a retry
  through another gateway process joins it there) and deletes the owner in the same step:
  a second answer for the same request finds no owner and is counted as wasted work,
  never sent.

How a script is made: `PRELUDE` (the key stems of control/broker/keys.py as a table `K`,
the constants as `C`, built by Python at import), then the shared Lua (`LUA_LIB`: the
record parsers, cancel, notify), then the script's own body, concatenated: no script
spells a key prefix, and nothing is filled into a template. A script finds the rest of
its keys in its arguments and in the records it reads; every key carries the one hash
tag, so they all sit in one slot. A caller names one of them in KEYS[1] (the scripts
ignore it) for a cluster client to route the call by.

"""

from __future__ import annotations

from control.broker import keys
from control.broker.envelope import ENVELOPE_LUA
from control.core import protocol as p

MAX_REQUEUES = 2  # a request whose replica died this many times is a likely cause: it ends 504
OWNER_SLACK_MS = 5_000  # an owner key outlives its request's deadline by this much


def _lua_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _lua_table(name: str, values: dict[str, str] | dict[str, int]) -> str:
    fields = ", ".join(f"{k} = {_lua_string(v) if isinstance(v, str) else v}" for k, v in sorted(values.items()))
    return f"local {name} = {{{fields}}}\n"


CONSTANTS = {
    "reply_ttl_s": p.REPLY_TTL_S,
    "cancel_ttl_ms": p.CANCEL_TTL_MS,
    "max_requeues": MAX_REQUEUES,
    "owner_slack_ms": OWNER_SLACK_MS,
    "paid_priority": p.PAID_PRIORITY,
    "free_priority": p.FREE_PRIORITY,
    "behind_step": p.BEHIND_STEP,
}
PRELUDE = _lua_table("K", keys.LUA_KEYS) + _lua_table("C", CONSTANTS)

# The Lua halves of control/broker/records.py's owner, done and held records, in the
# same field order as their Python pack and parse.
RECORDS_LUA = """
-- Owner: gateways, waiting set, tenant, attempt, fingerprint of the body ('' when none),
-- the queue message as admission pushed it ('' in an owner written without it).
local function owner_parts(owner)
  local a = string.find(owner, '|', 1, true)
  local b = string.find(owner, '|', a + 1, true)
  local c = string.find(owner, '|', b + 1, true)
  local d = string.find(owner, '|', c + 1, true)
  local attempt, fingerprint, message = owner:sub(c + 1), '', ''
  if d then
    local e = string.find(owner, '|', d + 1, true)
    attempt = owner:sub(c + 1, d - 1)
    if e then fingerprint, message = owner:sub(d + 1, e - 1), owner:sub(e + 1) else fingerprint = owner:sub(d + 1) end
  end
  return owner:sub(1, a - 1), owner:sub(a + 1, b - 1), owner:sub(b + 1, c - 1), attempt, fingerprint, message
end

local function pack_owner(gateways, waiting, tenant, attempt, fingerprint, message)
  return gateways .. '|' .. waiting .. '|' .. tenant .. '|' .. attempt .. '|' .. fingerprint .. '|' .. message
end

-- The tenant a request's key is scoped to ("<tenant>:<id>", control/core/protocol.py).
local function tenant_of(key)
  local c = string.find(key, ':', 1, true)
  if c then return key:sub(1, c - 1) end
  return key
end

-- Done: fingerprint, result JSON (a bare JSON object from before fingerprints). It is
-- kept under the request's owner key once answered, after a '|' (`ANSWERED`): an owner
-- record starts with a gateway's id, never with '|'.
local ANSWERED = '|'

-- The owner record in a value read from an owner key, or nil (none, or a kept answer).
local function owner_of(value)
  if value and value:sub(1, 1) ~= ANSWERED then return value end
  return nil
end

local function get_owner(key)
  return owner_of(redis.call('GET', K.owner .. key))
end

local function done_parts(done)
  if done:sub(1, 1) == '{' then return '', done end
  local a = string.find(done, '|', 1, true)
  return done:sub(1, a - 1), done:sub(a + 1)
end

local function pack_done(fingerprint, result)
  return fingerprint .. '|' .. result
end

-- Held: deadline ms, queue, waiting set, request key; a record written with the message
-- (before the owner kept it) has it last, else the message is ''.
local function held_parts(rec)
  local a = string.find(rec, '|', 1, true)
  local b = string.find(rec, '|', a + 1, true)
  local c = string.find(rec, '|', b + 1, true)
  local d = string.find(rec, '|', c + 1, true)
  local key, message = rec:sub(c + 1), ''
  if d then key, message = rec:sub(c + 1, d - 1), rec:sub(d + 1) end
  return tonumber(rec:sub(1, a - 1)), rec:sub(a + 1, b - 1), rec:sub(b + 1, c - 1), key, message
end

-- The values of `names` in one MGET per 500 (a nil value is false).
local function mget(names)
  local out = {}
  for from = 1, #names, 500 do
    local got = redis.call('MGET', unpack(names, from, math.min(from + 499, #names)))
    for j = 1, #got do out[#out + 1] = got[j] end
  end
  return out
end

-- One call of a variadic command for `args`, 500 at a time (`head`: what comes before them).
local function call_many(command, head, args)
  for from = 1, #args, 500 do
    redis.call(command, head, unpack(args, from, math.min(from + 499, #args)))
  end
end
"""

# Shared helpers: cancel a request in flight (tell its gateway), notify gateways.
LUA_LIB = (
    PRELUDE
    + RECORDS_LUA
    + ENVELOPE_LUA
    + """
local function has_gateway(gateways, gateway)
  return string.find(',' .. gateways .. ',', ',' .. gateway .. ',', 1, true) ~= nil
end

-- A tier's waiting set of requests in line, from either of its waiting sets.
local function in_line(waiting)
  if waiting:sub(-#K.behind) == K.behind then return waiting:sub(1, #waiting - #K.behind) end
  return waiting
end

-- A tenant's share of its tier's queue (requests in either list), by deadline.
local function tenant_set(waiting, tenant)
  return in_line(waiting) .. K.tenant .. tenant
end

-- A re-queued request back in its tier's waiting set and its tenant's share, which
-- keeps a TTL as admission gives it (PEXPIRE NX: a share this makes has none yet).
local function back_in_line(waiting, tenant, deadline, id, left_ms)
  local mine = tenant_set(waiting, tenant)
  redis.call('ZADD', waiting, deadline, id)
  redis.call('ZADD', mine, deadline, id)
  redis.call('PEXPIRE', mine, left_ms + C.owner_slack_ms, 'GT')
  redis.call('PEXPIRE', mine, left_ms + C.owner_slack_ms, 'NX')
end

-- `gateways`: the comma-separated ids of every gateway process with a connection waiting.
local function notify(gateways, item)
  for gateway in string.gmatch(gateways, '[^,]+') do
    local key = K.reply .. gateway
    redis.call('RPUSH', key, '{"items":[' .. item .. ']}')
    redis.call('EXPIRE', key, C.reply_ttl_s)
  end
end

-- Items grouped by gateway, in first-seen order, so each gateway gets one message.
local function collect(out, order, gateways, item)
  for gateway in string.gmatch(gateways, '[^,]+') do
    if not out[gateway] then
      out[gateway] = {}
      order[#order + 1] = gateway
    end
    table.insert(out[gateway], item)
  end
end

local function notify_all(out, order)
  for _, gateway in ipairs(order) do
    notify(gateway, table.concat(out[gateway], ','))
  end
end

-- Cancel the request with this key, tell every gateway that waits for it. '' for tenant,
-- attempt or holder means any. A gateway giving up passes itself as holder: while another
-- gateway still waits for the request (a retry joined it there) it only stops waiting.
local function cancel(key, reason, tenant, attempt, holder)
  local owner = get_owner(key)
  if not owner then return 0 end
  local gateways, waiting, who, att, fingerprint, message = owner_parts(owner)
  if tenant ~= '' and tenant ~= who then return 0 end
  if attempt ~= '' and attempt ~= att then return 0 end
  if holder and holder ~= '' then
    if not has_gateway(gateways, holder) then return 0 end
    if gateways ~= holder then
      local rest = {}
      for gateway in string.gmatch(gateways, '[^,]+') do
        if gateway ~= holder then rest[#rest + 1] = gateway end
      end
      local kept = pack_owner(table.concat(rest, ','), waiting, who, att, fingerprint, message)
      redis.call('SET', K.owner .. key, kept, 'KEEPTTL')
      return 0
    end
  end
  redis.call('SET', K.cancel .. att, reason, 'PX', C.cancel_ttl_ms)
  redis.call('DEL', K.owner .. key)
  redis.call('ZREM', in_line(waiting), att)  -- a re-queued request waits in line, whichever list it left
  redis.call('ZREM', in_line(waiting) .. K.behind, att)
  redis.call('ZREM', tenant_set(waiting, who), att)
  notify(gateways, cjson.encode({kind = 'cancelled', id = att, reason = reason}))
  return 1
end

local function lease_alive(replica)
  return redis.call('EXISTS', K.lease .. replica) == 1
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
)

_SWEEP_FN = """
-- Re-queue or expire what a replica without a lease held; {-1, 0} if its lease is alive.
local function sweep(holder, min_ms)
  if lease_alive(holder) then return {-1, 0} end
  local held = redis.call('HGETALL', K.held .. holder)
  local now = now_ms()
  local requeued, expired = 0, 0
  for i = 1, #held, 2 do
    local id = held[i]
    local deadline, queue, waiting, key, recorded = held_parts(held[i + 1])
    local owner = get_owner(key)
    if owner then
      local _, _, who, att, _, message = owner_parts(owner)
      if message == '' then message = recorded end
      local claim = redis.call('GET', K.claim .. id)
      local copy = redis.call('GET', K.copy .. id)
      if att ~= id or (claim and claim ~= holder and lease_alive(claim)) then
        -- answered or retried under another attempt, or running on a live replica
      elseif copy and copy ~= holder and lease_alive(copy)
          and redis.call('INCR', K.requeued .. id) <= C.max_requeues then
        -- its second copy runs on a live replica, and answers: that replica holds it now,
        -- so that its sweep re-queues the request if it dies too (a hand-over counts as a
        -- re-queue: a prompt that kills replicas must not kill two at a time for ever)
        redis.call('PEXPIRE', K.requeued .. id, math.floor(math.max(1, deadline - now) + 1000))
        redis.call('HSET', K.held .. copy, id, held[i + 1])
        redis.call('SET', K.claim .. id, copy, 'PX', math.floor(math.max(1, deadline - now) + 1000))
      elseif message ~= '' and deadline - now >= min_ms and redis.call('INCR', K.requeued .. id) <= C.max_requeues then
        redis.call('PEXPIRE', K.requeued .. id, deadline - now + 1000)
        redis.call('DEL', K.claim .. id)
        redis.call('RPUSH', queue, message)  -- the consumer pops from the right: the front
        back_in_line(waiting, who, deadline, id, deadline - now)
        requeued = requeued + 1
      else
        expired = expired + cancel(key, 'expired', '', id, '')
      end
    end
  end
  redis.call('DEL', K.held .. holder)
  redis.call('SREM', K.holders, holder)
  redis.call('INCR', K.deaths)  -- gateways look for what it had taken and not yet recorded
  local model = redis.call('HGET', K.replica .. holder, 'model')
  if model then  -- peers must not count it as idle or running any more
    redis.call('ZREM', K.idle .. model, holder)
    redis.call('ZREM', K.launch .. model, holder)
  end
  return {requeued, expired}
end
"""

# ARGV: replica, min ms a request needs to still finish.
SWEEP_ONE_LUA = LUA_LIB + _SWEEP_FN + "return sweep(ARGV[1], tonumber(ARGV[2]))"

# ARGV: min ms, lock ms. Sweeps every holder whose lease lapsed; returns {holders, requeued,
# expired, deaths, epoch}: deaths, how many replicas were ever swept (and pulses found
# lapsed, `keys.pulse_key`), tells a gateway to run RESCUE, which puts back what a stopped
# replica's outstanding pull took; the epoch, set by the first sweep of the keyspace,
# changes when the broker lost it.
# With a lock (lock ms > 0) only the first call in each lock's span sweeps, whichever of the
# gateway processes makes it, and it also leaves the registry as one value (FLEET: the
# broker's time in ms, then per replica its name, its entry's fields and values, and 1 if
# its lease is alive) for every gateway to read in one GET; an entry that expired leaves the
# set of names. So the sweep and the registry cost a cell the same whatever the number of
# gateway processes.
SWEEP_DEAD_LUA = (
    LUA_LIB
    + _SWEEP_FN
    + """
local swept, requeued, expired = 0, 0, 0
local lock_ms = tonumber(ARGV[2] or '0')
local locked = lock_ms <= 0
if not locked then
  -- pcall: a broker at its memory limit refuses the write, and must still answer (full, not down)
  local got = redis.pcall('SET', K.sweeping, '1', 'NX', 'PX', lock_ms)
  locked = type(got) == 'table' and got.ok == 'OK'
end
if locked then
  for _, holder in ipairs(redis.call('SMEMBERS', K.holders)) do
    local r = sweep(holder, tonumber(ARGV[1]))
    if r[1] >= 0 then
      swept, requeued, expired = swept + 1, requeued + r[1], expired + r[2]
    end
  end
  for _, name in ipairs(redis.call('HKEYS', K.pulses)) do  -- a pulse that lapsed: a death
    if redis.call('EXISTS', K.pulse .. name) == 0 then
      redis.call('HDEL', K.pulses, name)
      redis.call('INCR', K.deaths)
    end
  end
  if lock_ms > 0 then
    local fleet = {now_ms()}
    for _, name in ipairs(redis.call('SMEMBERS', K.replicas)) do
      local entry = redis.call('HGETALL', K.replica .. name)
      if #entry == 0 then
        redis.call('SREM', K.replicas, name)
      else
        fleet[#fleet + 1] = {name, entry, redis.call('EXISTS', K.lease .. name)}
      end
    end
    redis.call('SET', K.fleet, cjson.encode(fleet), 'PX', 10 * lock_ms)
  end
end
local epoch = redis.call('GET', K.epoch)
if not epoch then  -- a new keyspace (a broker started empty); '' where the broker refuses the write
  local t = redis.call('TIME')
  local got = redis.pcall('SET', K.epoch, t[1] .. '.' .. t[2], 'NX')
  epoch = (type(got) == 'table' and got.ok == 'OK') and (t[1] .. '.' .. t[2]) or ''
end
return {swept, requeued, expired, tonumber(redis.call('GET', K.deaths) or '0'), epoch}
"""
)

# A replica's consumer pops a message, then records it as held: killed in between, the
# request is in no queue and no held hash, and no sweep can find it. After a death each
# gateway offers its own waiting requests; one that has an owner under this attempt, no
# claim, no held record, and is not in its queue is pushed back to the front of it.
# "Not in its queue": the lists are first in, first out (LPUSH at admission, the
# consumer pops from the right; a re-queue goes to the right, older still), so a
# request received before the oldest message left in its list was popped already;
# for the others the list is read once per call (its messages' ids), which costs a
# scan of the queue, after a death only.
# A gateway calls it twice a round, 30 ms apart: first to look (push 0), which returns the
# attempts it would push back, then to push (push 1) only those looked at: a request a live
# replica popped a moment ago and records late is not pushed back unless it stayed
# unrecorded across both calls.
# ARGV: min ms, push (1) or look (0), then per request the fields of `RescueOffer`; the
# message is the owner's. Returns how many were pushed back, or the attempts looked at.
RESCUE_LUA = (
    LUA_LIB
    + """
local now, min_ms, push = now_ms(), tonumber(ARGV[1]), ARGV[2] == '1'
local holders = redis.call('SMEMBERS', K.holders)
local oldest = {}
local function oldest_received(queue)  -- false: the list is empty; -1: unknown (keep all)
  if oldest[queue] == nil then
    local raw = redis.call('LINDEX', queue, -1)
    if not raw then oldest[queue] = false else oldest[queue] = envelope_received_ms(raw) end
  end
  return oldest[queue]
end
local ids = {}
local function in_queue(queue)  -- the attempts whose messages are in the list, read once
  if ids[queue] == nil then
    local found = {}
    for _, raw in ipairs(redis.call('LRANGE', queue, 0, -1)) do
      local id = envelope_attempt(raw)
      if id then found[id] = true end
    end
    ids[queue] = found
  end
  return ids[queue]
end
local rescued, seen = 0, {}
for i = 3, #ARGV, 6 do
  local att, key, queue, waiting = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local deadline, received = math.floor(tonumber(ARGV[i + 4])), tonumber(ARGV[i + 5])
  local owner = get_owner(key)
  local live, who, message = false, '', ''
  if owner then
    local _, _, tenant, owner_att, _, kept = owner_parts(owner)
    live, who, message = owner_att == att and kept ~= '' and redis.call('EXISTS', K.claim .. att) == 0, tenant, kept
  end
  if live then
    for _, holder in ipairs(holders) do
      if redis.call('HEXISTS', K.held .. holder, att) == 1 then live = false break end
    end
  end
  if live then
    local o = oldest_received(queue)
    local queued = o ~= false and (o == -1 or received >= o) and in_queue(queue)[att] ~= nil
    if not queued and deadline - now >= min_ms then
      if not push then
        seen[#seen + 1] = att
      elseif redis.call('INCR', K.requeued .. att) <= C.max_requeues then
        redis.call('PEXPIRE', K.requeued .. att, deadline - now + 1000)
        redis.call('RPUSH', queue, message)
        back_in_line(waiting, who, deadline, att, deadline - now)
        rescued = rescued + 1
      end
    end
  end
end
if push then return rescued end
return seen
"""
)

# ARGV: replica, model, then per request: attempt, held record (it names the request's key),
# running member ('' for none). Records only the requests still in flight under that
# attempt: one answered or dropped meanwhile (its owner gone) must not come back into the
# held hash. A request with a member joins the model's running set too, scored by its
# deadline: buffered for this replica's next batch, another host's batch may copy it
# (HEDGE). One MGET reads every owner, one HSET writes every record and one ZADD every
# member, whatever the number of requests.
RECORD_LUA = (
    LUA_LIB
    + """
local names = {}
for i = 3, #ARGV, 3 do
  local _, _, _, key = held_parts(ARGV[i + 1])  -- the record names the request's key
  names[#names + 1] = K.owner .. key
end
local owners, fields, members = mget(names), {}, {}
for j = 1, #names do
  local i = 3 + (j - 1) * 3
  local owner = owner_of(owners[j])
  if owner then
    local _, _, _, att = owner_parts(owner)
    if att == ARGV[i] then
      fields[#fields + 1] = ARGV[i]
      fields[#fields + 1] = ARGV[i + 1]
      if ARGV[i + 2] ~= '' then
        members[#members + 1] = held_parts(ARGV[i + 1])  -- the deadline
        members[#members + 1] = ARGV[i + 2]
      end
    end
  end
end
if #fields > 0 then call_many('HSET', K.held .. ARGV[1], fields) end
if #members > 0 and ARGV[2] ~= '' then call_many('ZADD', K.running .. ARGV[2], members) end
return #fields / 2
"""
)

# ARGV: replica, claim ttl ms, attempt ids...; returns 1 (claimed) or 0 per id.
CLAIM_LUA = (
    LUA_LIB
    + """
local me, out = ARGV[1], {}
for i = 3, #ARGV do
  local key = K.claim .. ARGV[i]
  local holder = redis.call('SET', key, me, 'NX', 'GET', 'PX', ARGV[2])  -- nothing held it: claimed
  if not holder then
    out[#out + 1] = 1
  elseif holder == me or not lease_alive(holder) then
    redis.call('SET', key, me, 'PX', ARGV[2])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# ARGV: replica, then per item: request key, attempt, keep ms, kind, item JSON, fallback gateway;
# KEYS[2], if given, says the items answer second copies (hedges) and counts their wasted
# results in place of `K.wasted`: the copy's record (`K.copy`) goes if it is this replica's,
# and a copy's failure reaches no client unless the request is this replica's own now (a
# sweep handed it over when its first replica died: its copy is then its only run).
# Returns {delivered, wasted}. An answer goes to the gateway that owns the request now;
# a drop notice whose request has no owner (a cancel took it) still reaches the gateway
# that admitted it, for its counters; any other item without an owner is wasted work.
DELIVER_LUA = (
    LUA_LIB
    + """
local holder, copies = ARGV[1], KEYS[2] ~= nil
local out, order = {}, {}
local delivered, wasted = 0, 0
local names = {}
for i = 2, #ARGV, 6 do names[#names + 1] = K.owner .. ARGV[i] end
local owners, answered, ids = mget(names), {}, {}
for j = 1, #names do
  local i = 2 + (j - 1) * 6
  local key, att, keep, kind, item, fallback = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]),
    ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  local gateway = nil
  local owner = owner_of(owners[j])
  if copies then
    if redis.call('GET', K.copy .. att) == holder then redis.call('DEL', K.copy .. att) end
    if kind ~= 'result' and redis.call('HEXISTS', K.held .. holder, att) == 0 then owner = nil end
  end
  if owner and not answered[key] then  -- the first item for a request takes its owner
    local gateways, _, _, owner_att, fingerprint = owner_parts(owner)
    if owner_att == att then
      gateway = gateways
      answered[key] = 'gone'
      if keep > 0 and kind == 'result' then  -- the answer takes the owner's place
        redis.call('SET', K.owner .. key, ANSWERED .. pack_done(fingerprint, item), 'PX', keep)
        answered[key] = 'kept'
      end
      delivered = delivered + 1
    end
  end
  if not gateway and kind == 'dropped' then
    gateway = fallback
  elseif not gateway and kind == 'result' then
    wasted = wasted + 1
  end
  if gateway then collect(out, order, gateway, item) end
  ids[#ids + 1] = att
end
local gone = {}
for key, how in pairs(answered) do
  if how == 'gone' then gone[#gone + 1] = K.owner .. key end
end
for from = 1, #gone, 500 do redis.call('DEL', unpack(gone, from, math.min(from + 499, #gone))) end
if #ids > 0 then call_many('HDEL', K.held .. holder, ids) end
notify_all(out, order)
if wasted > 0 then redis.call('INCRBY', KEYS[2] or K.wasted, wasted) end
return {delivered, wasted}
"""
)

# Streamed text goes to the gateway that owns the request now, only while the attempt
# that produced it still owns it; the owner stays (the answer comes later, by DELIVER).
# ARGV: per chunk: request key, attempt, chunk JSON.
STREAM_LUA = (
    LUA_LIB
    + """
local out, order = {}, {}
for i = 1, #ARGV, 3 do
  local key, att, item = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local owner = get_owner(key)
  if owner then
    local gateway, _, _, owner_att = owner_parts(owner)
    if owner_att == att then collect(out, order, gateway, item) end
  end
end
notify_all(out, order)
return #order
"""
)

# KEYS: the owner (read through ARGV; named so a cluster client routes the call to its slot).
# ARGV: request key, reason, tenant, attempt, holder ('' for any).
CANCEL_LUA = LUA_LIB + "return cancel(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])"

# A request answered by reuse (control/policy/reuse.py) takes its session's place as an
# admission would: the session's request in flight, if another, is superseded.
# KEYS: the session key; ARGV: the request's key, the session key's ttl ms.
SUPERSEDE_LUA = (
    LUA_LIB
    + """
local previous = redis.call('SET', KEYS[1], ARGV[1], 'GET', 'PX', ARGV[2])
if previous and previous ~= ARGV[1] then return cancel(previous, 'superseded', '', '', '') end
return 0
"""
)

# The admission, its first part: a stored answer, or a retry joining the attempt in flight.
_ADMIT_JOIN = """
local fingerprint = ARGV[1]
local current = redis.call('GET', KEYS[1])
if current and not owner_of(current) then
  -- Answered within the idempotency window: its answer, to a request that keeps one.
  if ARGV[9] ~= '' then
    local stored, answer = done_parts(current:sub(#ANSWERED + 1))
    if stored ~= fingerprint then return {4, 0, 0, ''} end
    return {2, 0, 0, answer}
  end
  current = nil  -- this one keeps none: admitted anew, in its place
end
if current and redis.call('PTTL', KEYS[1]) <= C.owner_slack_ms then
  -- Its deadline has passed (the owner outlives it by the slack): nobody is answered by
  -- that attempt any more; drop it and admit the retry as a new one.
  local _, waiting, _, attempt = owner_parts(current)
  redis.call('SET', K.cancel .. attempt, 'expired', 'PX', C.cancel_ttl_ms)
  redis.call('ZREM', waiting, attempt)
  current = nil
end
if current then
  -- A retry joins the attempt in flight; its answer comes here too.
  local gateways, waiting, tenant, attempt, held, message = owner_parts(current)
  if held ~= fingerprint then return {4, 0, 0, ''} end
  if not has_gateway(gateways, ARGV[10]) then
    local joined = pack_owner(gateways .. ',' .. ARGV[10], waiting, tenant, attempt, held, message)
    redis.call('SET', KEYS[1], joined, 'KEEPTTL')
  end
  return {3, 0, 0, attempt}
end
"""

# The admission proper, after the joins (control/policy/admission.py's `decide`, and the token
# bucket of `take_token`). Without the tenant's arguments (ARGV[11] on) only the tier's
# position counts.
_ADMIT_DECIDE = """
local now = tonumber(ARGV[7])
local tenanted = ARGV[11] ~= nil and ARGV[11] ~= ''
local bumps = ARGV[18] ~= nil and ARGV[18] ~= ''  -- ADMIT_BUMP's terms: interval ms, batch, reach ms
local is_free = ARGV[5] == 'free'
-- The keys named after the request's model, tier and tenant are made here, not sent.
local request_key = KEYS[1]:sub(#K.owner + 1)
local tenant = tenant_of(request_key)
local paid_behind_set, free_behind_set = KEYS[2] .. K.behind, KEYS[3] .. K.behind
local mine = (is_free and KEYS[3] or KEYS[2]) .. K.tenant .. tenant  -- the tenant's share of the tier
local bucket = K.bucket .. ARGV[5] .. ':' .. tenant
-- What waits is what has not expired: counted without trimming (the replicas trim their
-- model's sets with their heartbeat; a request leaving takes its entries out). Only the
-- lists ahead of this request are counted; -1 answers one not counted.
local live = '(' .. ARGV[7]
local function count(key) return redis.call('ZCOUNT', key, live, '+inf') end
local paid, paid_behind, free, free_behind = count(KEYS[2]), 0, count(KEYS[3]), 0
if tenanted then paid_behind, free_behind = -1, -1 end
if is_free and tenanted then paid_behind = count(paid_behind_set) end
local own, own_behind = KEYS[2], paid_behind_set
if is_free then own, own_behind = KEYS[3], free_behind_set end
local behind, queued, tokens, rate = false, 0, 0, 0
if tenanted then
  rate = tonumber(ARGV[15])
  if rate > 0 then
    tokens = tonumber(ARGV[16])
    local counted = redis.call('HMGET', bucket, 't', 'at')
    if counted[1] then
      tokens = math.min(tokens, tonumber(counted[1]) + math.max(0, now - tonumber(counted[2])) * rate / 1000)
    end
    if tokens < 1 then
      return {-2, paid, free, paid_behind, free_behind, tostring(math.ceil((1 - tokens) * 1000 / rate))}
    end
  end
  local fair = tonumber(ARGV[13])
  queued = redis.call('ZCOUNT', mine, live, '+inf')
  if queued >= fair then
    -- Entries of requests that left without being removed here (a path that missed
    -- it) must not hold the share: those past their deadline go (they are not counted,
    -- but the share is where a flood's garbage would pile up), and the oldest others are
    -- checked against the waiting sets.
    redis.call('ZREMRANGEBYSCORE', mine, '-inf', now)
    for _, id in ipairs(redis.call('ZRANGE', mine, live, '+inf', 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[17]))) do
      if not redis.call('ZSCORE', own, id) and not redis.call('ZSCORE', own_behind, id) then
        redis.call('ZREM', mine, id)
        queued = queued - 1
      end
    end
  end
  behind = queued >= fair
  if behind and is_free then free_behind = count(free_behind_set) end
  if behind and not is_free then paid_behind = count(paid_behind_set) end
end
-- Every request in line counts for a paid one too: the replicas run a request that would
-- otherwise miss its deadline ahead of a paid one (tasks/policy/collector.py), so paid
-- requests are admitted only to slots the queue leaves.
local position = paid + 1 + free
if is_free then position = position + paid_behind end
-- ADMIT_BUMP: a paid request waits behind paid ones only; the free ones it would delay too
-- long leave (below).
if bumps and not is_free then position = paid + 1 end
if behind then position = position + (is_free and free_behind or paid_behind) end
if behind and position > tonumber(ARGV[12]) then return {-3, paid, free, paid_behind, free_behind, ''} end
if not behind and position > tonumber(ARGV[6]) then return {-1, paid, free, paid_behind, free_behind, ''} end
if tenanted and queued >= tonumber(ARGV[14]) then return {-3, paid, free, paid_behind, free_behind, ''} end
-- The owner, made here from the request's parts; it keeps the message as pushed, which
-- is what a sweep or a rescue pushes again.
local function admitted(waiting, message)
  return pack_owner(ARGV[10], waiting, tenant, ARGV[4], fingerprint, message)
end
if behind then
  local step = ARGV[5] == 'free' and C.free_priority or C.paid_priority
  local message = envelope_behind(ARGV[8], step, C.behind_step)
  redis.call('SET', KEYS[1], admitted(own .. K.behind, message), 'PX', ARGV[2])
  redis.call('ZADD', own_behind, ARGV[3], ARGV[4])
  redis.call('LPUSH', ARGV[11], message)
else
  redis.call('SET', KEYS[1], admitted(own, ARGV[8]), 'PX', ARGV[2])
  redis.call('ZADD', own, ARGV[3], ARGV[4])
  redis.call('LPUSH', KEYS[4], ARGV[8])
  if bumps and is_free then redis.call('SET', K.keyof .. ARGV[4], request_key, 'PX', ARGV[2]) end
end
if bumps and not is_free then
  -- The paid request goes ahead of every free one in line. The first of those (by
  -- deadline) it pushes past the last batch start its budget allows leaves: cancelled,
  -- 'bumped', which its gateway answers 429. One at most: the ones after it move up by
  -- as much as the paid request moves them back. Only those whose slots hold fewer than
  -- the line's length can be pushed too far: the range read is theirs.
  local interval, batch, reach = tonumber(ARGV[18]), tonumber(ARGV[19]), tonumber(ARGV[20])
  local line = paid + 1 + free
  local horizon = now + reach + interval * math.ceil(line / batch)
  local near = redis.call('ZRANGE', KEYS[3], live, '(' .. horizon, 'BYSCORE', 'WITHSCORES')
  for i = 1, #near, 2 do
    local slots = math.max(1, math.floor((tonumber(near[i + 1]) - now - reach) / interval))
    if paid + 1 + (i + 1) / 2 > slots * batch then
      local key = redis.call('GET', K.keyof .. near[i])
      if key then cancel(key, 'bumped', '', near[i], nil) end
      break
    end
  end
end
if tenanted then
  redis.call('ZADD', mine, ARGV[3], ARGV[4])
  -- Its TTL outlives the latest deadline in it: this one's, when nothing else waits there.
  if queued == 0 then
    redis.call('PEXPIRE', mine, ARGV[2])
  else
    redis.call('PEXPIRE', mine, ARGV[2], 'GT')
  end
  if rate > 0 then
    redis.call('HSET', bucket, 't', tokens - 1, 'at', now)
    redis.call('PEXPIRE', bucket, math.ceil(tonumber(ARGV[16]) * 1000 / rate) + 1000)
  end
end
if KEYS[5] then
  local previous = redis.call('SET', KEYS[5], request_key, 'GET', 'PX', ARGV[2])
  if previous and previous ~= request_key then cancel(previous, 'superseded', '', '', '') end
end
"""

# KEYS: owner, waiting paid, waiting free, queue list, [session]; ARGV: `Admit.__call__`'s
# parameters in its order, then `TenantTerms`' (ARGV[11] on). Returns {status, paid
# waiting, free waiting, [paid behind, free behind,] extra}: the status an `Admission`.
ADMIT_LUA = (
    # Flagged (a shebang, no allow-oom): a broker at its memory limit refuses the whole
    # script (OOM, answered 503). Unflagged, only its first write is checked, and one
    # that removes is allowed at the limit, so the rest would write past it.
    "#!lua\n"
    + LUA_LIB
    + _ADMIT_JOIN
    + _ADMIT_DECIDE
    + "return {1, paid, free, paid_behind, free_behind, behind and '1' or ''}\n"
)


# A take's pop from the model's queue lists, in the order given (paid in line, paid behind,
# free in line, free behind): from each list up to its group's cap (lists of one group share
# it: a paid request behind other paid keys' ones ranks as paid), and no more than the total
# over all of them, so free requests fill only the seats paid ones left. KEYS: the lists;
# ARGV: the total, then per list its group's cap and its group's name. Returns the raw
# messages, oldest of each list first.
TAKE_QUEUED_LUA = (
    PRELUDE
    + """
local out, left, caps = {}, tonumber(ARGV[1]), {}
for i, key in ipairs(KEYS) do
  local cap, group = tonumber(ARGV[2 * i]), ARGV[2 * i + 1]
  if caps[group] == nil then caps[group] = cap end
  local n = math.min(left, caps[group])
  if n > 0 then
    local got = redis.call('RPOP', key, n)
    if got then
      for _, message in ipairs(got) do out[#out + 1] = message end
      left = left - #got
      caps[group] = caps[group] - #got
    end
  end
end
return out
"""
)

# Free-slot hedging (tasks/policy/hedging.py): the model's running set holds one member per
# request running or buffered now, "attempt|replica|host|tier|max tokens|key", scored by its
# deadline. A replica adds its requests as it records them held (RECORD) and its batch's
# in its claim's pipeline (which also trims what is past its deadline:
# tasks/replica/broker.py), and takes out its own when it answers them or they leave its
# buffer unrun. This script takes
# second copies for a batch's empty slots: each chosen member leaves the set and, while its
# request waits under that attempt, has no copy yet, and runs on that member's replica (its
# claim) or waits in its buffer (no claim, its held record), the replica's lease alive (not
# a member left by a dead replica whose request was re-queued, nor one handed back to the
# queue), its copy is recorded (`K.copy`: the sweep leaves the request to the copy's
# replica when the first one dies) and its queue message returned.
# An idle replica's batch of copies passes the least number of the model's replicas that
# must be idle (KEYS[2], the idle list, itself among them), or 0 for a batch's empty slots:
# fewer idle, it takes nothing; a member whose request is not running yet (buffered, no
# claim) is left in the set, not copied (its own batch starts soon); and a replica that
# takes a copy leaves the idle list in the same call.
# ARGV: model, replica, least idle, then the members chosen to copy. Returns the copies'
# queue messages.
HEDGE_LUA = (
    LUA_LIB
    + """
local running, me, now, least_idle = K.running .. ARGV[1], ARGV[2], now_ms(), tonumber(ARGV[3])
local claimed_only = least_idle > 0
if claimed_only and redis.call('ZCOUNT', KEYS[2], now, '+inf') < least_idle then return {} end
local out = {}
for i = 4, #ARGV do
  local member = ARGV[i]
  local deadline = tonumber(redis.call('ZSCORE', running, member))
  if deadline and deadline <= now then deadline = nil end  -- past: the next claim's trim takes it
  local cuts, at = {}, 0
  for _ = 1, 5 do
    at = at and string.find(member, '|', at + 1, true)
    cuts[#cuts + 1] = at
  end
  local att, runner, claim = '', '', false
  if deadline and at then
    att, runner = member:sub(1, cuts[1] - 1), member:sub(cuts[1] + 1, cuts[2] - 1)
    claim = redis.call('GET', K.claim .. att)
    if claimed_only and claim ~= runner then deadline = nil end
  end
  if deadline and at then
    redis.call('ZREM', running, member)
    local key = member:sub(cuts[5] + 1)
    local owner = get_owner(key)
    local runs = runner ~= me and (claim == runner or (not claim and redis.call('HEXISTS', K.held .. runner, att) == 1))
    if owner and runs and lease_alive(runner) and redis.call('EXISTS', K.cancel .. att, K.copy .. att) == 0 then
      local _, _, _, owner_att, _, message = owner_parts(owner)
      if owner_att == att and message ~= '' then
        redis.call('SET', K.copy .. att, me, 'PX', math.floor(math.max(1, deadline - now) + C.owner_slack_ms))
        out[#out + 1] = message
      end
    end
  end
end
if claimed_only and #out > 0 then redis.call('ZREM', KEYS[2], me) end
return out
"""
)

# SINGLE_LISTENER: the holder of a model's listener token keeps it (renews it) or hands it
# on, only while it is its own. KEYS: the token, the turn list; ARGV: the replica, the
# token's ms (renew), or '' (hand on: the token goes, and one item in the turn list wakes
# one idle replica blocked on it; the list keeps at most that one). Returns 1 if it held it.
LISTENER_LUA = (
    PRELUDE
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
redis.call('DEL', KEYS[1])
redis.call('LPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], 0, 0)
redis.call('PEXPIRE', KEYS[2], 1000)
return 1
"""
)

# Every script by its name (the broker bench names EVALSHA calls by these).
SOURCES = {
    "ADMIT": ADMIT_LUA,
    "CANCEL": CANCEL_LUA,
    "RECORD": RECORD_LUA,
    "CLAIM": CLAIM_LUA,
    "DELIVER": DELIVER_LUA,
    "STREAM": STREAM_LUA,
    "SWEEP_ONE": SWEEP_ONE_LUA,
    "SWEEP_DEAD": SWEEP_DEAD_LUA,
    "RESCUE": RESCUE_LUA,
    "TAKE_QUEUED": TAKE_QUEUED_LUA,
    "HEDGE": HEDGE_LUA,
    "LISTENER": LISTENER_LUA,
    "SUPERSEDE": SUPERSEDE_LUA,
}
