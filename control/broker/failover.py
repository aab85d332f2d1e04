"""What keeps a request alive when the replica holding it dies: leases, held records,
claims, the sweep that re-queues, and the delivery where the first answer wins.

Every piece is one Lua script, so each step is atomic on the broker:

- A replica holds a *lease* (`kb:lease:<replica>`, a few hundred ms, renewed by its
  batching loop) and records each request it takes from the queue in its *held* hash
  (`kb:held:<replica>`: attempt id -> deadline, queue, waiting set, request key, message).
- Before a batch runs, the replica *claims* each request (`kb:claim:<attempt>`). A claim
  held by a replica whose lease is alive cannot be taken: a re-queued copy never runs
  while its first copy is running on a replica that holds its lease. (A replica that
  lost its lease, paused past it, is presumed dead: when it wakes, the copy it was
  running may finish too; DELIVER answers the client once and counts the other as waste.)
- When a lease lapses, `SWEEP` puts every held request that is still wanted back at the
  front of its queue, or answers it `expired` (504) when its deadline leaves no time for
  another batch (or when it was re-queued `MAX_REQUEUES` times already: a prompt that
  kills replicas must not kill them all). The held hash goes in the same step, so two sweepers cannot re-queue
  a request twice. Gateways run it for every lapsed lease (every 100 ms); the supervisor
  runs it for a replica it saw die, at once.
- `DELIVER` routes each answer to every gateway that waits for the request *now* (a retry
  through another gateway process joins it there) and deletes the owner in the same step:
  a second answer for the same request finds no owner and is counted as wasted work,
  never sent.

The owner value is "<gateways>|<waiting set>|<tenant>|<attempt id>|<body fingerprint>",
the gateways comma-separated; see api/gateway.py.

The scripts read their keys' names from ARGV and from what they find; every key carries
the one hash tag (control/core/protocol.py), so they all sit in one slot. A caller may name one
of them in KEYS[1] (the scripts ignore it) for a cluster client to route the call by.
"""

from __future__ import annotations

import redis

from control.core import protocol as p

# Shared helpers: split an owner value, and cancel a request in flight (tell its gateway).
LUA_LIB = (
    """
local P = 'PREFIX:'  -- every key's prefix, its hash tag included
-- gateways, waiting set, tenant, attempt, fingerprint of the body ('' when none).
local function owner_parts(owner)
  local a = string.find(owner, '|', 1, true)
  local b = string.find(owner, '|', a + 1, true)
  local c = string.find(owner, '|', b + 1, true)
  local d = string.find(owner, '|', c + 1, true)
  local attempt, fingerprint = owner:sub(c + 1), ''
  if d then attempt, fingerprint = owner:sub(c + 1, d - 1), owner:sub(d + 1) end
  return owner:sub(1, a - 1), owner:sub(a + 1, b - 1), owner:sub(b + 1, c - 1), attempt, fingerprint
end

local function has_gateway(gateways, gateway)
  return string.find(',' .. gateways .. ',', ',' .. gateway .. ',', 1, true) ~= nil
end

-- A stored answer: "<fingerprint>|<result JSON>" (a bare JSON object from before fingerprints).
local function done_parts(done)
  if done:sub(1, 1) == '{' then return '', done end
  local a = string.find(done, '|', 1, true)
  return done:sub(1, a - 1), done:sub(a + 1)
end

-- A tier's waiting set of requests in line, from either of its waiting sets.
local function in_line(waiting)
  local behind = 'BEHIND_SUFFIX'
  if waiting:sub(-#behind) == behind then return waiting:sub(1, #waiting - #behind) end
  return waiting
end

-- A tenant's share of its tier's queue (requests in either list), by deadline.
local function tenant_set(waiting, tenant)
  return in_line(waiting) .. ':t:' .. tenant
end

-- `gateways`: the comma-separated ids of every gateway process with a connection waiting.
local function notify(gateways, item)
  for gateway in string.gmatch(gateways, '[^,]+') do
    local key = P .. 'reply:' .. gateway
    redis.call('RPUSH', key, '{"items":[' .. item .. ']}')
    redis.call('EXPIRE', key, REPLY_TTL_S)
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
  local owner = redis.call('GET', P .. 'req:' .. key)
  if not owner then return 0 end
  local gateways, waiting, who, att, fingerprint = owner_parts(owner)
  if tenant ~= '' and tenant ~= who then return 0 end
  if attempt ~= '' and attempt ~= att then return 0 end
  if holder and holder ~= '' then
    if not has_gateway(gateways, holder) then return 0 end
    if gateways ~= holder then
      local rest = {}
      for gateway in string.gmatch(gateways, '[^,]+') do
        if gateway ~= holder then rest[#rest + 1] = gateway end
      end
      local left = table.concat(rest, ',') .. '|' .. waiting .. '|' .. who .. '|' .. att .. '|' .. fingerprint
      redis.call('SET', P .. 'req:' .. key, left, 'KEEPTTL')
      return 0
    end
  end
  redis.call('SET', P .. 'cancel:' .. att, reason, 'PX', CANCEL_TTL_MS)
  redis.call('DEL', P .. 'req:' .. key)
  redis.call('ZREM', in_line(waiting), att)  -- a re-queued request waits in line, whichever list it left
  redis.call('ZREM', in_line(waiting) .. 'BEHIND_SUFFIX', att)
  redis.call('ZREM', tenant_set(waiting, who), att)
  notify(gateways, cjson.encode({kind = 'cancelled', id = att, reason = reason}))
  return 1
end

local function lease_alive(replica)
  return redis.call('EXISTS', P .. 'lease:' .. replica) == 1
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
""".replace("PREFIX", p.PREFIX)
    .replace("REPLY_TTL_S", str(p.REPLY_TTL_S))
    .replace("CANCEL_TTL_MS", str(p.CANCEL_TTL_MS))
    .replace("BEHIND_SUFFIX", p.BEHIND_SUFFIX)
)

# A request whose replica died this many times is a likely cause, not a victim: it ends 504.
MAX_REQUEUES = 2

_SWEEP_FN = """
-- Re-queue or expire what a replica without a lease held; {-1, 0} if its lease is alive.
local function sweep(holder, min_ms)
  if lease_alive(holder) then return {-1, 0} end
  local held = redis.call('HGETALL', P .. 'held:' .. holder)
  local now = now_ms()
  local requeued, expired = 0, 0
  for i = 1, #held, 2 do
    local id, rec = held[i], held[i + 1]
    local a = string.find(rec, '|', 1, true)
    local b = string.find(rec, '|', a + 1, true)
    local c = string.find(rec, '|', b + 1, true)
    local d = string.find(rec, '|', c + 1, true)
    local deadline, queue = tonumber(rec:sub(1, a - 1)), rec:sub(a + 1, b - 1)
    local waiting, key, message = rec:sub(b + 1, c - 1), rec:sub(c + 1, d - 1), rec:sub(d + 1)
    local owner = redis.call('GET', P .. 'req:' .. key)
    if owner then
      local _, _, who, att = owner_parts(owner)
      local claim = redis.call('GET', P .. 'claim:' .. id)
      if att ~= id or (claim and claim ~= holder and lease_alive(claim)) then
        -- answered or retried under another attempt, or running on a live replica
      elseif deadline - now >= min_ms and redis.call('INCR', P .. 'requeued:' .. id) <= MAX_REQUEUES then
        redis.call('PEXPIRE', P .. 'requeued:' .. id, deadline - now + 1000)
        redis.call('DEL', P .. 'claim:' .. id)
        redis.call('RPUSH', queue, message)  -- the consumer pops from the right: the front
        redis.call('ZADD', waiting, deadline, id)
        redis.call('ZADD', tenant_set(waiting, who), deadline, id)
        requeued = requeued + 1
      else
        expired = expired + cancel(key, 'expired', '', id, '')
      end
    end
  end
  redis.call('DEL', P .. 'held:' .. holder)
  redis.call('SREM', P .. 'holders', holder)
  redis.call('INCR', P .. 'deaths')  -- gateways look for what it had taken and not yet recorded
  local model = redis.call('HGET', P .. 'replica:' .. holder, 'model')
  if model then  -- peers must not count it as idle or running any more
    redis.call('ZREM', P .. 'idle:' .. model, holder)
    redis.call('ZREM', P .. 'launch:' .. model, holder)
  end
  return {requeued, expired}
end
"""

_SWEEP_FN = _SWEEP_FN.replace("MAX_REQUEUES", str(MAX_REQUEUES))

# ARGV: replica, min ms a request needs to still finish.
SWEEP_ONE_LUA = LUA_LIB + _SWEEP_FN + "return sweep(ARGV[1], tonumber(ARGV[2]))"

# ARGV: min ms. Sweeps every holder whose lease lapsed; returns {holders, requeued, expired,
# deaths}: the last, how many replicas were ever swept, tells a gateway to run RESCUE.
SWEEP_DEAD_LUA = (
    LUA_LIB
    + _SWEEP_FN
    + """
local swept, requeued, expired = 0, 0, 0
for _, holder in ipairs(redis.call('SMEMBERS', P .. 'holders')) do
  local r = sweep(holder, tonumber(ARGV[1]))
  if r[1] >= 0 then
    swept, requeued, expired = swept + 1, requeued + r[1], expired + r[2]
  end
end
return {swept, requeued, expired, tonumber(redis.call('GET', P .. 'deaths') or '0')}
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
# ARGV: min ms, then per request: attempt, request key, queue, waiting set, deadline ms,
# received ms, message. Returns how many were pushed back.
RESCUE_LUA = (
    LUA_LIB
    + """
local now, min_ms = now_ms(), tonumber(ARGV[1])
local holders = redis.call('SMEMBERS', P .. 'holders')
local oldest = {}
local function oldest_received(queue)  -- false: the list is empty; -1: unknown (keep all)
  if oldest[queue] == nil then
    local raw = redis.call('LINDEX', queue, -1)
    if not raw then
      oldest[queue] = false
    else
      local ok, env = pcall(cjson.decode, raw)
      local received = -1
      if ok and type(env) == 'table' and type(env.body) == 'string' then
        local ok2, body = pcall(cjson.decode, env.body)
        if ok2 and type(body) == 'table' and type(body[1]) == 'table' and type(body[1][1]) == 'table' then
          received = tonumber(body[1][1].received_ms) or -1
        end
      end
      oldest[queue] = received
    end
  end
  return oldest[queue]
end
local ids = {}
local function in_queue(queue)  -- the attempts whose messages are in the list, read once
  if ids[queue] == nil then
    local found = {}
    for _, raw in ipairs(redis.call('LRANGE', queue, 0, -1)) do
      local id = string.match(raw, '"correlation_id":"([^"]+)"')
      if id then found[id] = true end
    end
    ids[queue] = found
  end
  return ids[queue]
end
local rescued = 0
for i = 2, #ARGV, 7 do
  local att, key, queue, waiting = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local deadline, received, message = math.floor(tonumber(ARGV[i + 4])), tonumber(ARGV[i + 5]), ARGV[i + 6]
  local owner = redis.call('GET', P .. 'req:' .. key)
  local live, who = false, ''
  if owner then
    local _, _, tenant, owner_att = owner_parts(owner)
    live, who = owner_att == att and redis.call('EXISTS', P .. 'claim:' .. att) == 0, tenant
  end
  if live then
    for _, holder in ipairs(holders) do
      if redis.call('HEXISTS', P .. 'held:' .. holder, att) == 1 then live = false break end
    end
  end
  if live then
    local o = oldest_received(queue)
    local queued = o ~= false and (o == -1 or received >= o) and in_queue(queue)[att] ~= nil
    if not queued and deadline - now >= min_ms and redis.call('INCR', P .. 'requeued:' .. att) <= MAX_REQUEUES then
      redis.call('PEXPIRE', P .. 'requeued:' .. att, deadline - now + 1000)
      redis.call('RPUSH', queue, message)
      redis.call('ZADD', waiting, deadline, att)
      redis.call('ZADD', tenant_set(waiting, who), deadline, att)
      rescued = rescued + 1
    end
  end
end
return rescued
""".replace("MAX_REQUEUES", str(MAX_REQUEUES))
)

# ARGV: replica, then per request: attempt, request key, held record. Records only the
# requests still in flight under that attempt: one answered or dropped meanwhile (its
# owner gone) must not come back into the held hash.
RECORD_LUA = (
    LUA_LIB
    + """
local held = P .. 'held:' .. ARGV[1]
local n = 0
for i = 2, #ARGV, 3 do
  local owner = redis.call('GET', P .. 'req:' .. ARGV[i + 1])
  if owner then
    local _, _, _, att = owner_parts(owner)
    if att == ARGV[i] then
      redis.call('HSET', held, ARGV[i], ARGV[i + 2])
      n = n + 1
    end
  end
end
return n
"""
)

# ARGV: replica, claim ttl ms, attempt ids...; returns 1 (claimed) or 0 per id.
CLAIM_LUA = (
    LUA_LIB
    + """
local me, out = ARGV[1], {}
for i = 3, #ARGV do
  local key = P .. 'claim:' .. ARGV[i]
  local holder = redis.call('GET', key)
  if not holder or holder == me or not lease_alive(holder) then
    redis.call('SET', key, me, 'PX', ARGV[2])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# ARGV: replica, then per item: request key, attempt, keep ms, kind, item JSON, fallback gateway.
# Returns {delivered, wasted}. An answer goes to the gateway that owns the request now;
# a drop notice whose request has no owner (a cancel took it) still reaches the gateway
# that admitted it, for its counters; any other item without an owner is wasted work.
DELIVER_LUA = (
    LUA_LIB
    + """
local holder = ARGV[1]
local out, order = {}, {}
local delivered, wasted = 0, 0
for i = 2, #ARGV, 6 do
  local key, att, keep, kind, item, fallback = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]),
    ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  local gateway = nil
  local owner = redis.call('GET', P .. 'req:' .. key)
  if owner then
    local gateways, _, _, owner_att, fingerprint = owner_parts(owner)
    if owner_att == att then
      gateway = gateways
      redis.call('DEL', P .. 'req:' .. key)
      if keep > 0 and kind == 'result' then
        redis.call('SET', P .. 'done:' .. key, fingerprint .. '|' .. item, 'PX', keep)
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
  redis.call('HDEL', P .. 'held:' .. holder, att)
end
notify_all(out, order)
if wasted > 0 then redis.call('INCRBY', P .. 'stats:wasted', wasted) end
return {delivered, wasted}
"""
)

# Streamed text goes to the gateway that owns the request now, only while the attempt
# that produced it still owns it; the owner stays (the answer comes later, by DELIVER).
STREAM_LUA = (
    LUA_LIB
    + """
local out, order = {}, {}
for i = 1, #ARGV, 3 do
  local key, att, item = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local owner = redis.call('GET', P .. 'req:' .. key)
  if owner then
    local gateway, _, _, owner_att = owner_parts(owner)
    if owner_att == att then collect(out, order, gateway, item) end
  end
end
notify_all(out, order)
return #order
"""
)


def release_replica(client: redis.Redis, name: str, min_ms: float = 265.0) -> tuple[int, int]:
    """A replica is known dead (its supervisor saw it exit): drop its lease and re-queue
    what it held now, rather than when the lease would have lapsed. (requeued, expired)"""
    client.delete(p.lease_key(name))
    requeued, expired = client.register_script(SWEEP_ONE_LUA)(keys=[p.held_key(name)], args=[name, min_ms])
    return max(0, int(requeued)), int(expired)
