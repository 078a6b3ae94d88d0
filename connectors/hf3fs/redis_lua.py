"""Server-side Lua of the Redis-protocol page index (``redis_index.py``).

One namespace (a data file: ``"{rank}:{pool}"``) is five Redis keys sharing one hash tag,
so they live in one cluster slot and one script serves a whole batch atomically:

====== ====== ===================================================================
suffix type   contents
====== ====== ===================================================================
``m``  hash   ``np`` pages, ``pb`` page bytes, ``rl`` / ``wl`` read / write lease
              (ms), ``fr`` first never-used slot, ``gt`` last generation handed
              out, ``ev`` evictions, ``ex`` expired reservations, ``sw`` next sweep
``k``  hash   confirmed key -> ``<i8 slot><i8 gen><u4 crc>`` (20 bytes), plus one field
              ``~`` whose long value keeps the hash a real hash table: Redis stores a
              small hash (<= 512 short fields) as a list it searches linearly, which made
              a 128-key lookup in a file of a few hundred pages cost ~1 ms instead of ~0.05
``l``  zset   confirmed key, score = last use (ms): the LRU order. A confirm scores
              ``now``; a ``get`` (or a reserve that finds the key) scores ``now + 0.5``:
              the half marks a read lease, held while the score is above ``now - rl``.
              (Scores are doubles: at ~1.8e12 ms their resolution is ~0.0002.)
``f``  zset   free slot, score = the time it may be handed out again (the read lease
              of the key that last held it)
``p``  hash   reserved key -> ``<i8 slot><i8 gen><i8 deadline ms>``
``w``  hash   ``<i8 slot>`` leased to a writer ahead of its writes (no key yet) ->
              ``<i8 gen><i8 deadline ms>`` (the one-call write path, as the kvconnect
              service's ``Lease`` / ``Put``)
====== ====== ===================================================================

A key is its 16-byte digest (``pageid.key_digest``, computed by the client): fixed-width fields make a
batch one bulk string the script cuts with ``string.sub``, and an index entry costs 16
bytes of key instead of SGLang's 64 hex characters. Values are stored and compared as the
packed bytes the client sends, so the hot paths run few Lua operations per key. Time is the
server's (``TIME``); scripts are replicated by their effects (Redis >= 5), so a replica
applies the same writes whatever its clock. Replies are packed little-endian arrays (one
bulk string), which the client decodes with one C loop.

A ``get`` moves a key to the LRU tail (and so starts a new read lease) unless its lease
began less than a tenth of the read lease ago: hot keys read again and again cost a lookup,
not a sorted-set update. A reader's lease is therefore at least 0.9 of ``rl`` from its
call, and the store trusts 0.8 of it (``store.LEASE_TRUST``).
"""

from __future__ import annotations

SUFFIXES = ("m", "k", "l", "f", "p", "w")
KEY_BYTES = 16

_PRELUDE = r"""
if redis.replicate_commands then pcall(redis.replicate_commands) end
local M, K, L, F, P, W = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local sub = string.sub
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function split(blob)  -- 16-byte keys, back to back
  local t = {}
  local n = #blob / 16
  for i = 1, n do t[i] = sub(blob, 16 * i - 15, 16 * i) end
  return t, n
end
local function many(cmd, key, args, opt)  -- one command per 4000 arguments (Lua's C stack)
  local n = #args
  local i = 1
  while i <= n do
    local j = math.min(n, i + 3999)
    if opt then
      redis.call(cmd, key, opt, unpack(args, i, j))
    else
      redis.call(cmd, key, unpack(args, i, j))
    end
    i = j + 1
  end
end
local function flags(t)  -- u8 per item (any count: no unpack)
  local out = {}
  for i = 1, #t do out[i] = string.char(t[i]) end
  return table.concat(out)
end
local function hmget(H, fields)  -- HMGET of any number of fields, 4000 at a time
  local out, n = {}, #fields
  local i = 1
  while i <= n do
    local j = math.min(n, i + 3999)
    local part = redis.call('HMGET', H, unpack(fields, i, j))
    for k = 1, j - i + 1 do out[i + k - 1] = part[k] end
    i = j + 1
  end
  return out
end
local function leased(sc, now, rl)  -- a score with the read mark, within its lease
  return sc - math.floor(sc) >= 0.25 and sc > now - rl
end
local function release(H, fields, fargs)  -- drop these fields of hash H; fargs: their slots into F
  if #fields > 0 then
    many('HDEL', H, fields)
    many('ZADD', F, fargs)
  end
end
local function expire(H, now, entry)  -- entries of hash H past their deadline: slots free
  if redis.call('HLEN', H) == 0 then return 0 end
  local all = redis.call('HGETALL', H)
  local dead, fargs = {}, {}
  for i = 1, #all, 2 do
    local slot, deadline = entry(all[i], all[i + 1])
    if deadline <= now then
      dead[#dead + 1] = all[i]
      fargs[#fargs + 1] = now
      fargs[#fargs + 1] = slot
    end
  end
  release(H, dead, fargs)
  return #dead
end
local function take_free(want, now, np, fresh)  -- never-used slots, then freed ones past their lease
  local got = {}
  local take = math.min(want, np - fresh)
  if take > 0 then
    for j = 0, take - 1 do got[#got + 1] = fresh + j end
    redis.call('HSET', M, 'fr', fresh + take)
  end
  if #got < want then
    local fr = redis.call('ZRANGEBYSCORE', F, '-inf', now, 'LIMIT', 0, want - #got)
    if #fr > 0 then
      many('ZREM', F, fr)
      for _, s in ipairs(fr) do got[#got + 1] = tonumber(s) end
    end
  end
  return got
end
local function sweep(now)  -- once a second: reservations and write leases past their deadline
  local expired = expire(P, now, function(k, v)
    local s, g, d = struct.unpack('<i8i8i8', v)
    return s, d
  end) + expire(W, now, function(k, v)
    return struct.unpack('<i8', k), struct.unpack('<i8', v, 9)
  end)
  redis.call('HSET', M, 'sw', now + 1000)
  if expired > 0 then redis.call('HINCRBY', M, 'ex', expired) end
end
local function give_back(GB, now)  -- <i8 slot><i8 gen> items: write leases handed back unused
  local n = #GB / 16
  local ok = {}
  if n == 0 then return ok end
  local fields = {}
  for i = 1, n do fields[i] = sub(GB, 16 * i - 15, 16 * i - 8) end
  local cur = hmget(W, fields)  -- a writer can hand back thousands
  local del, fargs = {}, {}
  for i = 1, n do
    ok[i] = 0
    if cur[i] and sub(cur[i], 1, 8) == sub(GB, 16 * i - 7, 16 * i) then
      ok[i] = 1
      cur[i] = false
      del[#del + 1] = fields[i]
      fargs[#fargs + 1] = 0  -- never held a key: free at once
      fargs[#fargs + 1] = struct.unpack('<i8', fields[i])
    end
  end
  release(W, del, fargs)
  return ok
end
"""

# ARGV: num_pages, page_bytes, read lease ms, write lease ms. Creates the namespace when
# num_pages > 0 and it does not exist; answers {pages, bytes, read ms, write ms}.
INITIALIZE = _PRELUDE + r"""
local v = redis.call('HMGET', M, 'np', 'pb', 'rl', 'wl')
if v[1] then return {tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), tonumber(v[4])} end
if tonumber(ARGV[1]) <= 0 then return {0, 0, tonumber(ARGV[3]), tonumber(ARGV[4])} end
redis.call('HSET', M, 'np', ARGV[1], 'pb', ARGV[2], 'rl', ARGV[3], 'wl', ARGV[4], 'fr', 0, 'gt', 0,
           'ev', 0, 'ex', 0, 'sw', 0)
redis.call('HSET', K, '~', string.rep('~', 80))
return {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
"""

# ARGV: keys. Reply: u8 status[n] (index.NEW/EXISTS/INFLIGHT/NOSPACE), i64 slot[n], i64 gen[n].
RESERVE = _PRELUDE + r"""
local meta = redis.call('HMGET', M, 'np', 'rl', 'wl', 'fr', 'sw')
if not meta[1] then return redis.error_reply('NOINIT namespace is not initialized') end
local np, rl, wl, fresh, sw = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]),
  tonumber(meta[4]), tonumber(meta[5])
local now = now_ms()
local keys, n = split(ARGV[1])
local expired = 0
if now >= sw then sweep(now) end
local npend = redis.call('HLEN', P)
local found = redis.call('HMGET', K, unpack(keys))
local pend = nil
if npend > 0 then pend = redis.call('HMGET', P, unpack(keys)) end
local NONE, ZERO = struct.pack('<i8', -1), struct.pack('<i8', 0)
local status, slots, gens, want, claimed, touch = {}, {}, {}, {}, {}, {}
for i = 1, n do
  local v = found[i]
  if v then
    status[i] = 1
    slots[i] = sub(v, 1, 8)
    gens[i] = sub(v, 9, 16)
    touch[#touch + 1] = now + 0.5  -- a writer met it: in use (and no reader loses a lease)
    touch[#touch + 1] = keys[i]
  else
    local k = keys[i]
    slots[i] = NONE
    gens[i] = ZERO
    local busy = false
    local p = pend and pend[i]
    if p then
      local ps, pg, pd = struct.unpack('<i8i8i8', p)
      if pd > now then
        busy = true
      else  -- an expired reservation: take it over
        redis.call('HDEL', P, k)
        redis.call('ZADD', F, now, ps)
        expired = expired + 1
      end
    end
    if busy or claimed[k] then
      status[i] = 2
    else
      claimed[k] = true
      status[i] = 0
      want[#want + 1] = i
    end
  end
end
if #touch > 0 then many('ZADD', L, touch) end
if expired > 0 then redis.call('HINCRBY', M, 'ex', expired) end
local m = #want
if m > 0 then
  local got = take_free(m, now, np, fresh)
  if #got < m then  -- evict the least recently used keys that no reader holds (looking 64 past)
    local need = m - #got
    local scan = redis.call('ZRANGE', L, 0, need + 63, 'WITHSCORES')
    local cand = {}
    for j = 1, #scan, 2 do
      if not leased(tonumber(scan[j + 1]), now, rl) then
        cand[#cand + 1] = scan[j]
        if #cand == need then break end
      end
    end
    if #cand > 0 then
      local vals = redis.call('HMGET', K, unpack(cand))
      for j = 1, #cand do
        if vals[j] then got[#got + 1] = struct.unpack('<i8', vals[j]) end
      end
      redis.call('HDEL', K, unpack(cand))
      redis.call('ZREM', L, unpack(cand))
      redis.call('HINCRBY', M, 'ev', #cand)
    end
  end
  local got_n = #got
  if got_n > 0 then
    -- ascending slots for the batch's keys in order: adjacent pages of the caller's buffer
    -- land in adjacent slots, and a read of the batch is a few large copies, not one per page
    table.sort(got)
    local g = redis.call('HINCRBY', M, 'gt', 1)  -- one new generation for the batch
    local gp = struct.pack('<i8', g)
    local tail = gp .. struct.pack('<i8', now + wl)
    local pargs = {}
    for j = 1, got_n do
      local i = want[j]
      local sp = struct.pack('<i8', got[j])
      slots[i] = sp
      gens[i] = gp
      pargs[2 * j - 1] = keys[i]
      pargs[2 * j] = sp .. tail
    end
    many('HSET', P, pargs)
  end
  for j = got_n + 1, m do status[want[j]] = 3 end
end
return flags(status) .. table.concat(slots) .. table.concat(gens)
"""

# ARGV: <i8 slot><i8 gen><u4 crc> per key (the index entry to store), u8 confirm[n], keys.
# Reply: u8 ok[n].
COMMIT = _PRELUDE + r"""
local VALS, CF = ARGV[1], ARGV[2]
local keys, n = split(ARGV[3])
if n == 0 then return '' end
local now = now_ms()
local pend = redis.call('HMGET', P, unpack(keys))
local ok, done, kargs, largs, fargs = {}, {}, {}, {}, {}
for i = 1, n do
  local val = sub(VALS, 20 * i - 19, 20 * i)
  local sg = sub(val, 1, 16)
  local p = pend[i]
  ok[i] = 0
  if p then
    if sub(p, 1, 16) == sg then
      done[#done + 1] = keys[i]
      if string.byte(CF, i) ~= 0 then
        kargs[#kargs + 1] = keys[i]
        kargs[#kargs + 1] = val
        largs[#largs + 1] = now
        largs[#largs + 1] = keys[i]
      else  -- a failed write: its slot is free at once
        fargs[#fargs + 1] = 0
        fargs[#fargs + 1] = struct.unpack('<i8', p)
      end
      ok[i] = 1
    end
  elseif string.byte(CF, i) ~= 0 then  -- already confirmed by an earlier attempt of this call?
    local v = redis.call('HGET', K, keys[i])
    if v and sub(v, 1, 16) == sg then ok[i] = 1 end
  end
end
if #done > 0 then redis.call('HDEL', P, unpack(done)) end
if #kargs > 0 then
  many('HSET', K, kargs)
  many('ZADD', L, largs)
end
if #fargs > 0 then many('ZADD', F, fargs) end
return flags(ok)
"""

# ARGV: keys. Reply: <i8 slot><i8 gen><u4 crc> per key (slot -1: a miss). Starts read leases.
GET = _PRELUDE + r"""
local keys, n = split(ARGV[1])
local vals = redis.call('HMGET', K, unpack(keys))
local miss = struct.pack('<i8i8I4', -1, 0, 0)
local out, hit = {}, {}
for i = 1, n do
  local v = vals[i]
  if v then
    out[i] = v
    hit[#hit + 1] = keys[i]
  else
    out[i] = miss
  end
end
if #hit > 0 then
  local now = now_ms()
  local rl = tonumber(redis.call('HGET', M, 'rl') or '0')
  local recent = now - math.floor(rl / 10)
  local scores = redis.call('ZMSCORE', L, unpack(hit))
  local touch = {}
  for j = 1, #hit do  -- a new lease unless one began less than rl / 10 ago
    local sc = scores[j] and tonumber(scores[j])
    if not sc or sc - math.floor(sc) < 0.25 or sc < recent then
      touch[#touch + 1] = now + 0.5
      touch[#touch + 1] = hit[j]
    end
  end
  if #touch > 0 then many('ZADD', L, touch) end
end
return table.concat(out)
"""

# ARGV: keys. Reply: u8 present[n]. Reads only (no LRU touch).
EXISTS = _PRELUDE + r"""
local keys, n = split(ARGV[1])
local vals = redis.call('HMGET', K, unpack(keys))
local out = {}
for i = 1, n do out[i] = vals[i] and 1 or 0 end
return flags(out)
"""

# ARGV: <i8 slot><i8 gen> per key, keys. Reply: u8 ok[n] (the key still maps to that page).
VALIDATE = _PRELUDE + r"""
local SG = ARGV[1]
local keys, n = split(ARGV[2])
if n == 0 then return '' end
local vals = redis.call('HMGET', K, unpack(keys))
local out = {}
for i = 1, n do
  out[i] = (vals[i] and sub(vals[i], 1, 16) == sub(SG, 16 * i - 15, 16 * i)) and 1 or 0
end
return flags(out)
"""

# ARGV: <i8 slot><i8 gen> per key (or an empty string: unconditional), keys. Removes each
# key (only where it still maps to that page when one is named); its slot is free again once
# the key's read lease ran out. Reply: u8 removed[n].
DELETE = _PRELUDE + r"""
local SG = ARGV[1]
local keys, n = split(ARGV[2])
if n == 0 then return '' end
local rl = tonumber(redis.call('HGET', M, 'rl') or '0')
local vals = redis.call('HMGET', K, unpack(keys))
local out, gone, fargs, seen = {}, {}, {}, {}
for i = 1, n do
  out[i] = 0
  local v = vals[i]
  local k = keys[i]
  if v and not seen[k] and (#SG == 0 or sub(v, 1, 16) == sub(SG, 16 * i - 15, 16 * i)) then
    local score = tonumber(redis.call('ZSCORE', L, k) or '0')
    seen[k] = true
    gone[#gone + 1] = k
    fargs[#fargs + 1] = math.floor(score) + rl  -- free once a reader's lease would have run out
    fargs[#fargs + 1] = struct.unpack('<i8', v)
    out[i] = 1
  end
end
if #gone > 0 then
  redis.call('HDEL', K, unpack(gone))
  redis.call('ZREM', L, unpack(gone))
  many('ZADD', F, fargs)
end
return flags(out)
"""

# No ARGV. Drops every confirmed key (reservations stay); their slots are free after one
# read lease. Reply: keys removed.
CLEAR = _PRELUDE + r"""
local rl = tonumber(redis.call('HGET', M, 'rl') or '0')
local all = redis.call('HGETALL', K)
local until_ms = now_ms() + rl
local fargs = {}
for i = 1, #all, 2 do
  if all[i] ~= '~' then
    fargs[#fargs + 1] = until_ms
    fargs[#fargs + 1] = struct.unpack('<i8', all[i + 1])
  end
end
if #fargs > 0 then many('ZADD', F, fargs) end
redis.call('DEL', K, L)
redis.call('HSET', K, '~', string.rep('~', 80))
return #fargs / 2
"""

# ARGV: need, extra, <i8 slot><i8 gen> items given back first. Leases up to need + extra
# free slots (extra at most num_pages / 16; never evicts: a writer short of need reserves
# instead), each the caller's until its deadline. Reply: <i8 write lease ms>, i64 slot[n],
# i64 gen[n].
LEASE = _PRELUDE + r"""
local meta = redis.call('HMGET', M, 'np', 'wl', 'fr', 'sw')
if not meta[1] then return redis.error_reply('NOINIT namespace is not initialized') end
local np, wl, fresh, sw = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4])
local now = now_ms()
give_back(ARGV[3], now)
if now >= sw then sweep(now) end
local got = take_free(tonumber(ARGV[1]) + math.min(tonumber(ARGV[2]), math.floor(np / 16)), now, np, fresh)
table.sort(got)  -- see reserve
local slots = {}
local gp = ''
if #got > 0 then
  local g = redis.call('HINCRBY', M, 'gt', 1)
  gp = struct.pack('<i8', g)
  local tail = gp .. struct.pack('<i8', now + wl)
  local wargs = {}
  for j = 1, #got do
    local sp = struct.pack('<i8', got[j])
    slots[j] = sp
    wargs[2 * j - 1] = sp
    wargs[2 * j] = tail
  end
  many('HSET', W, wargs)
end
return struct.pack('<i8', wl) .. table.concat(slots) .. string.rep(gp, #got)
"""

# ARGV: <i8 slot><i8 gen><u4 crc> per key (slots of the caller's write leases, pages written),
# keys. Stores each key at its slot. Reply: u8 status[n] (index.PUT_*): PUT_OK, PUT_DUP (the
# key is stored or in flight elsewhere; the slot stays leased), PUT_LOST (not this writer's
# lease any more).
PUT = _PRELUDE + r"""
local VALS = ARGV[1]
local keys, n = split(ARGV[2])
if n == 0 then return '' end
local now = now_ms()
local fields = {}
for i = 1, n do fields[i] = sub(VALS, 20 * i - 19, 20 * i - 12) end
local lv = redis.call('HMGET', W, unpack(fields))
local kv = redis.call('HMGET', K, unpack(keys))
local pv = nil
if redis.call('HLEN', P) > 0 then pv = redis.call('HMGET', P, unpack(keys)) end
local st, del, kargs, largs, claimed = {}, {}, {}, {}, {}
for i = 1, n do
  local val = sub(VALS, 20 * i - 19, 20 * i)
  local k = keys[i]
  local l = lv[i]
  if not l or sub(l, 1, 8) ~= sub(val, 9, 16) or claimed[fields[i]] then
    st[i] = (kv[i] and sub(kv[i], 1, 16) == sub(val, 1, 16)) and 1 or 0  -- stored by an earlier attempt?
  elseif kv[i] or (pv and pv[i]) or claimed[k] then
    st[i] = 2
  else
    st[i] = 1
    claimed[k] = true
    claimed[fields[i]] = true
    del[#del + 1] = fields[i]
    kargs[#kargs + 1] = k
    kargs[#kargs + 1] = val
    largs[#largs + 1] = now
    largs[#largs + 1] = k
  end
end
if #del > 0 then
  redis.call('HDEL', W, unpack(del))
  many('HSET', K, kargs)
  many('ZADD', L, largs)
end
return flags(st)
"""

# ARGV: <i8 slot><i8 gen> items. Write leases given back unused. Reply: u8 ok[n].
UNLEASE = _PRELUDE + r"""
local ok = give_back(ARGV[1], now_ms())
if #ok == 0 then return '' end
return flags(ok)
"""

SCRIPTS = {"initialize": INITIALIZE, "reserve": RESERVE, "commit": COMMIT, "get": GET, "exists": EXISTS,
           "validate": VALIDATE, "delete": DELETE, "clear": CLEAR, "lease": LEASE, "put": PUT, "unlease": UNLEASE}
