"""Server-side Lua of the Redis-protocol page index (``redis_index.py``).

One namespace (a data file: ``"{rank}:{pool}"``) is eight Redis keys sharing one hash tag,
so they live in one cluster slot and one script serves a whole batch atomically:

====== ====== ===================================================================
suffix type   contents
====== ====== ===================================================================
``m``  hash   ``np`` pages, ``pb`` page bytes, ``rl`` / ``wl`` read / write lease
              (ms), ``fr`` first never-used slot, ``gt`` last generation handed
              out, ``ev`` evictions, ``ex`` expired reservations / leases, ``sw`` next
              sweep, ``t0`` / ``tk`` origin and length (ms) of the read-stamp tick,
              ``lt`` entries in ``l``, ``ls`` slots leased to writers, ``lv`` layout
``k``  hash   confirmed key -> ``<i8 slot><i8 gen><u4 crc>`` (20 bytes), plus one field
              ``~`` whose long value keeps the hash a real hash table: Redis stores a
              small hash (<= 512 short fields) as a list it searches linearly, which made
              a 128-key lookup in a file of a few hundred pages cost ~1 ms instead of ~0.05
``l``  list   the LRU queue, one element per confirmed batch, oldest first:
              ``<i8 ms><n x 16-byte key><n x 20-byte entry>`` (what the writer sent, as
              is). An element whose key was since removed or rewritten is skipped.
``r``  string ``u32`` (big-endian) per slot: the tick of the slot's last read (0: never),
              a read lease and the recency the LRU queue consults
``f``  zset   free slot, score = the time it may be handed out again (the end of the
              read lease of the key that last held it)
``p``  hash   reserved key -> ``<i8 slot><i8 gen><i8 deadline ms>``
``o``  string ``u32`` per slot: the low 32 bits of the generation of the write lease that
              holds it (0: none)
``w``  hash   write lease ``<i8 gen>`` -> ``<i8 deadline ms>`` + ``<i8 first><i8 count>``
              per run of its slots (the one-call write path, as the kvconnect service's
              ``Lease`` / ``Put``)
====== ====== ===================================================================

A key is its 16-byte digest (``pageid.key_digest``, computed by the client): fixed-width
fields make a batch one bulk string the script cuts with ``string.sub``, and an index entry
costs 16 bytes of key instead of SGLang's 64 hex characters. Values are stored and compared
as the packed bytes the client sends, so the hot paths run few Lua operations per key. Time
is the server's (``TIME``); scripts are replicated by their effects (Redis >= 5), so a
replica applies the same writes whatever its clock. Replies are packed little-endian arrays
(one bulk string), which the client decodes with one C loop.

**Reads write one stamp per run of slots, not a sorted-set entry per key.** A ``get`` writes
the current tick (``tk`` = a tenth of the read lease) into ``r`` for the slots it found, with
one ``SETRANGE`` per run of adjacent slots (a batch written together lies in one run), and
nothing where the run carries this tick already (hot keys: a lookup, no write, nothing
replicated). A slot is under a read lease while ``now - stamp <= ceil(rl / tk)`` ticks: from
the read for at least ``rl`` (and at most ``rl + 2 tk``); no eviction, delete or clear
hands it to another key before that. The store trusts 0.8 of ``rl`` from its call
(``lanes.LEASE_TRUST``).

**LRU by a queue of batches with a second chance.** A confirm appends one element (the
batch as the writer sent it) instead of a sorted-set entry per key. Eviction pops elements
from the head (the oldest writes): an entry that is gone is dropped; one under a read lease
goes to the tail; one read since it was queued is kept aside; the others are evicted, oldest
first. If those are too few, the entries read since they were queued are evicted next,
least recently read first. What is not taken goes back to the head (one element, its oldest
queue time), never to the tail: older pages do not move behind newer ones, so an unread new
page is not evicted while older ones wait. So eviction prefers pages nobody read, then those
read longest ago, and never takes one under a read lease.

**Write leases are a generation per slot.** ``lease`` writes the lease's generation into
``o`` for its slots (one ``SETRANGE`` per run: slots come sorted, fresh ones adjacent) and
one ``w`` entry per lease (deadline, runs); ``put`` compares ``o`` over the batch's runs
(one ``GETRANGE`` each), checks the lease is alive in ``w``, and zeroes ``o`` for what it
stored. Expiry (the once-a-second sweep) and give-back free the slots whose ``o`` still
names the lease.
"""

from __future__ import annotations

SUFFIXES = ("m", "k", "l", "f", "p", "w", "r", "o")
KEY_BYTES = 16
LAYOUT = 2  # ``lv``: a namespace of another layout is rebuilt empty by ``initialize``
MAX_PAGES = 1 << 27  # ``r`` / ``o`` hold 4 bytes per slot; a Redis string holds 512 MiB

_PRELUDE = r"""
if redis.replicate_commands then pcall(redis.replicate_commands) end
local M, K, L, F, P, W, R, O = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local sub, pack, unpack_s, rep = string.sub, struct.pack, struct.unpack, string.rep
local floor = math.floor
local TWO32 = 4294967296
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end
local function split(blob)  -- 16-byte keys, back to back
  local t = {}
  local n = #blob / 16
  for i = 1, n do t[i] = sub(blob, 16 * i - 15, 16 * i) end
  return t, n
end
local function many(cmd, key, args, per)  -- one command per ~4000 arguments (Lua's C stack)
  local n = #args
  per = per or 4000
  local i = 1
  while i <= n do
    local j = math.min(n, i + per - 1)
    redis.call(cmd, key, unpack(args, i, j))
    i = j + 1
  end
end
local function flags(t, all1)  -- u8 per item (any count: no unpack); all1: every item is 1
  if all1 then return rep('\1', #t) end
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
local function clock(now, t0, tk, rl)  -- the current tick (>= 1) and the read lease in ticks
  return floor((now - t0) / tk) + 1, math.ceil(rl / tk)
end
-- u32 arrays (r, o): one value per slot, big-endian (what BITFIELD u32 #slot reads)
local function runs_of(slots, vals)  -- {first slot, count, value} per run of adjacent slots with one value
  local out, n = {}, 0
  local s0, c, v0 = nil, 0, nil
  for i = 1, #slots do
    local s, v = slots[i], vals and vals[i]
    if s0 ~= nil and s == s0 + c and v == v0 then
      c = c + 1
    else
      if s0 ~= nil then n = n + 1; out[n] = {s0, c, v0} end
      s0, c, v0 = s, 1, v
    end
  end
  if s0 ~= nil then n = n + 1; out[n] = {s0, c, v0} end
  return out
end
local function u32_get(S, slots)  -- values at slots (numbers), any count
  local out, n = {}, #slots
  local i = 1
  while i <= n do
    local j = math.min(n, i + 1299)
    local args = {}
    for k = i, j do
      local a = 3 * (k - i)
      args[a + 1] = 'GET'; args[a + 2] = 'u32'; args[a + 3] = slots[k] * 32
    end
    local part = redis.call('BITFIELD_RO', S, unpack(args))
    for k = 1, j - i + 1 do out[i + k - 1] = part[k] end
    i = j + 1
  end
  return out
end
local function u32_set(S, slots, v, check, rs)  -- S[slot] = v for every slot (check: write only what differs)
  local n = #slots
  if n == 0 then return end
  rs = rs or runs_of(slots)
  local vb = pack('>I4', v)
  if #rs <= 4 then  -- a few runs: one range each
    for _, r in ipairs(rs) do
      local want = rep(vb, r[2])
      if not check or redis.call('GETRANGE', S, 4 * r[1], 4 * (r[1] + r[2]) - 1) ~= want then
        redis.call('SETRANGE', S, 4 * r[1], want)
      end
    end
    return
  end
  local cur = check and u32_get(S, slots)
  local args = {}
  for i = 1, n do
    if not cur or cur[i] ~= v then
      local a = #args
      args[a + 1] = 'SET'; args[a + 2] = 'u32'; args[a + 3] = slots[i] * 32; args[a + 4] = v
    end
  end
  if #args > 0 then many('BITFIELD', S, args, 4000) end
end
local function u32_match(S, slots, vals)  -- ok[i]: S[slots[i]] == vals[i]; and whether all are
  local ok, n, all = {}, #slots, true
  local rs = runs_of(slots, vals)
  if #rs <= 4 then
    local curs = {}
    for j, r in ipairs(rs) do
      curs[j] = redis.call('GETRANGE', S, 4 * r[1], 4 * (r[1] + r[2]) - 1)
      if curs[j] ~= rep(pack('>I4', r[3]), r[2]) then all = false end
    end
    if all then return ok, true, rs end
    local i = 0
    for j, r in ipairs(rs) do
      local vb, cur = pack('>I4', r[3]), curs[j]
      for k = 1, r[2] do ok[i + k] = sub(cur, 4 * k - 3, 4 * k) == vb end
      i = i + r[2]
    end
    return ok, false, rs
  end
  local cur = u32_get(S, slots)
  for i = 1, n do
    ok[i] = cur[i] == vals[i]
    all = all and ok[i]
  end
  return ok, all, rs
end
local function g32(g)  -- a generation in ``o`` (never 0: generations that would give 0 are skipped)
  return g % TWO32
end
local function new_gen()
  local g = redis.call('HINCRBY', M, 'gt', 1)
  if g % TWO32 == 0 then g = redis.call('HINCRBY', M, 'gt', 1) end
  return g
end
local function lease_end(st, t0, tk, lt)  -- when a slot last read in tick st may be reused
  if st == 0 then return 0 end
  return t0 + (st + lt) * tk
end
local function release(H, fields, fargs)  -- drop these fields of hash H; fargs: their slots into F
  if #fields > 0 then
    many('HDEL', H, fields)
    many('ZADD', F, fargs)
  end
end
local function expire_reservations(now)
  if redis.call('HLEN', P) == 0 then return 0 end
  local all = redis.call('HGETALL', P)
  local dead, fargs = {}, {}
  for i = 1, #all, 2 do
    local s, g, d = unpack_s('<i8i8i8', all[i + 1])
    if d <= now then
      dead[#dead + 1] = all[i]
      fargs[#fargs + 1] = now
      fargs[#fargs + 1] = s
    end
  end
  release(P, dead, fargs)
  return #dead
end
local function lease_slots(v)  -- the slots of a ``w`` entry
  local out = {}
  for j = 9, #v, 16 do
    local s, c = unpack_s('<i8i8', v, j)
    for x = s, s + c - 1 do out[#out + 1] = x end
  end
  return out
end
local function free_leased(slots, gens32)  -- slots whose ``o`` still names their lease: free at once
  local ok, all = u32_match(O, slots, gens32)
  local freed, fargs = {}, {}
  for i = 1, #slots do
    if all or ok[i] then
      freed[#freed + 1] = slots[i]
      fargs[#fargs + 1] = 0  -- never held a key: free at once
      fargs[#fargs + 1] = slots[i]
    end
  end
  if #freed > 0 then
    u32_set(O, freed, 0)
    many('ZADD', F, fargs)
    redis.call('HINCRBY', M, 'ls', -#freed)
  end
  if all then for i = 1, #slots do ok[i] = true end end
  return ok
end
local function give_back(GB)  -- <i8 slot><i8 gen> items: write leases handed back unused
  local n = #GB / 16
  if n == 0 then return {} end
  local slots, gens = {}, {}
  for i = 1, n do
    local s, g = unpack_s('<i8i8', GB, 16 * i - 15)
    slots[i] = s
    gens[i] = g32(g)
  end
  return free_leased(slots, gens)
end
local function expire_leases(now)
  if redis.call('HLEN', W) == 0 then return 0 end
  local all = redis.call('HGETALL', W)
  local dead, n = {}, 0
  for i = 1, #all, 2 do
    local v = all[i + 1]
    if unpack_s('<i8', v) <= now then
      dead[#dead + 1] = all[i]
      local slots = lease_slots(v)
      local gv, gens = g32(unpack_s('<i8', all[i])), {}
      for j = 1, #slots do gens[j] = gv end
      local ok = free_leased(slots, gens)
      for j = 1, #ok do if ok[j] then n = n + 1 end end
    end
  end
  if #dead > 0 then many('HDEL', W, dead) end
  return n
end
local function take_free(want, now, np, fresh)  -- never-used slots, then freed ones past their lease; ascending?
  local got, n = {}, 0
  local take = math.min(want, np - fresh)
  if take > 0 then
    for j = 1, take do got[j] = fresh + j - 1 end
    n = take
    redis.call('HSET', M, 'fr', fresh + take)
  end
  if n < want then
    local fr = redis.call('ZRANGEBYSCORE', F, '-inf', now, 'LIMIT', 0, want - n)
    if #fr > 0 then
      many('ZREM', F, fr)
      for j = 1, #fr do got[n + j] = tonumber(fr[j]) end
      return got, false
    end
  end
  return got, true
end
local function queue(blob_keys, blob_vals, t)  -- append confirmed entries to the LRU queue
  local n = #blob_keys / 16
  if n == 0 then return end
  redis.call('RPUSH', L, pack('<i8', t) .. blob_keys .. blob_vals)
  redis.call('HINCRBY', M, 'lt', n)
end
local function pop_batch()  -- the queue's oldest element: its time, count, keys, entries, the keys' values now
  local e = redis.call('LPOP', L)
  if not e then return nil end
  local n = (#e - 8) / 36
  local keys, vals = {}, {}
  local o = 16 * n - 11
  for i = 1, n do
    keys[i] = sub(e, 16 * i - 7, 16 * i + 8)
    vals[i] = sub(e, o + 20 * i, o + 20 * i + 19)
  end
  return unpack_s('<i8', e), n, keys, vals, hmget(K, keys)
end
local function compact(np)  -- the queue holds far more entries than keys (deletes): drop the gone ones
  local lt = tonumber(redis.call('HGET', M, 'lt') or '0')
  if lt <= 2 * np + 4096 then return end
  local popped, ks, vs, kept, t_min = 0, {}, {}, 0, nil
  while popped < 8192 do
    local t, n, keys, vals, cur = pop_batch()
    if not t then break end
    popped = popped + n
    t_min = t_min and math.min(t_min, t) or t
    for i = 1, n do
      if cur[i] == vals[i] then
        kept = kept + 1
        ks[kept] = keys[i]; vs[kept] = vals[i]
      end
    end
  end
  if popped > 0 then redis.call('HINCRBY', M, 'lt', -popped) end
  if kept > 0 then  -- back at the head, where they were: the queue keeps its order
    redis.call('LPUSH', L, pack('<i8', t_min) .. table.concat(ks) .. table.concat(vs))
    redis.call('HINCRBY', M, 'lt', kept)
  end
end
local function sweep(now, np)  -- once a second: reservations and write leases past their deadline
  local expired = expire_reservations(now) + expire_leases(now)
  redis.call('HSET', M, 'sw', now + 1000)
  if expired > 0 then redis.call('HINCRBY', M, 'ex', expired) end
  compact(np)
end
local function evict(need, now, tick, lt, t0, tk)  -- least recently used keys no reader holds: their slots
  local victims, vslots, nv = {}, {}, 0
  local tail_k, tail_v, nt, tail_t = {}, {}, 0, nil  -- under a read lease, or read since queued and not taken
  local second, ns = {}, 0  -- {stamp, key, entry, slot} read since queued
  local back_k, back_v, nb, back_t = {}, {}, 0, 0  -- the unused rest of the last element
  local seen, popped, blobs = 0, 0, 0
  while nv < need and seen < need + 64 and popped < need + 8192 and blobs < 64 do
    local t, n, keys, vals, cur = pop_batch()
    if not t then break end
    blobs = blobs + 1
    popped = popped + n
    local live, lslots, nl = {}, {}, 0
    for i = 1, n do
      local v = vals[i]
      if cur[i] == v then  -- still this entry (another is a key removed, or written again since)
        nl = nl + 1
        live[nl] = i
        lslots[nl] = unpack_s('<i8', v)
      end
    end
    local st = u32_get(R, lslots)
    local t_tick = floor((t - t0) / tk) + 1
    seen = seen + nl
    for j = 1, nl do
      local i, s = live[j], st[j]
      if s > 0 and tick - s <= lt then
        nt = nt + 1
        tail_k[nt] = keys[i]; tail_v[nt] = vals[i]
        tail_t = tail_t and math.min(tail_t, t) or t
      elseif s > 0 and s >= t_tick then
        ns = ns + 1
        second[ns] = {s, keys[i], vals[i], lslots[j], t}
      elseif nv < need then
        nv = nv + 1
        victims[nv] = keys[i]; vslots[nv] = lslots[j]
      else
        nb = nb + 1
        back_k[nb] = keys[i]; back_v[nb] = vals[i]; back_t = t
      end
    end
  end
  if nv < need and ns > 0 then  -- then those read longest ago
    table.sort(second, function(a, b) return a[1] < b[1] end)
  end
  for _, c in ipairs(second) do
    if nv < need then
      nv = nv + 1
      victims[nv] = c[2]; vslots[nv] = c[4]
    else
      nt = nt + 1
      tail_k[nt] = c[2]; tail_v[nt] = c[3]
      tail_t = tail_t and math.min(tail_t, c[5]) or c[5]
    end
  end
  if popped > 0 then redis.call('HINCRBY', M, 'lt', -popped) end
  if nb > 0 then
    redis.call('LPUSH', L, pack('<i8', back_t) .. table.concat(back_k) .. table.concat(back_v))
    redis.call('HINCRBY', M, 'lt', nb)
  end
  if nt > 0 then  -- kept where they were (at the head, their oldest queue time): newer pages stay behind them
    redis.call('LPUSH', L, pack('<i8', tail_t) .. table.concat(tail_k) .. table.concat(tail_v))
    redis.call('HINCRBY', M, 'lt', nt)
  end
  if nv > 0 then
    many('HDEL', K, victims)
    redis.call('HINCRBY', M, 'ev', nv)
  end
  return vslots
end
"""

# ARGV: num_pages, page_bytes, read lease ms, write lease ms. Creates the namespace when
# num_pages > 0 and it does not exist (or holds another layout: rebuilt empty); answers
# {pages, bytes, read ms, write ms}.
INITIALIZE = _PRELUDE + r"""
local v = redis.call('HMGET', M, 'np', 'pb', 'rl', 'wl', 'lv')
if v[1] and tonumber(v[5] or '0') == """ + str(LAYOUT) + r""" then
  return {tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), tonumber(v[4])}
end
if v[1] then redis.call('DEL', M, K, L, F, P, W, R, O) end  -- written by another layout: rebuilt empty
if tonumber(ARGV[1]) <= 0 then return {0, 0, tonumber(ARGV[3]), tonumber(ARGV[4])} end
local rl = tonumber(ARGV[3])
redis.call('HSET', M, 'np', ARGV[1], 'pb', ARGV[2], 'rl', ARGV[3], 'wl', ARGV[4], 'fr', 0, 'gt', 0,
           'ev', 0, 'ex', 0, 'sw', 0, 't0', now_ms(), 'tk', math.max(1, floor(rl / 10)), 'lt', 0, 'ls', 0,
           'lv', """ + str(LAYOUT) + r""")
redis.call('HSET', K, '~', rep('~', 80))
return {tonumber(ARGV[1]), tonumber(ARGV[2]), rl, tonumber(ARGV[4])}
"""

_META = r"""
if not meta[1] or not meta[6] then return redis.error_reply('NOINIT namespace is not initialized') end
"""

# ARGV: keys. Reply: u8 status[n] (index.NEW/EXISTS/INFLIGHT/NOSPACE), i64 slot[n], i64 gen[n].
RESERVE = _PRELUDE + r"""
local meta = redis.call('HMGET', M, 'np', 'rl', 'wl', 'fr', 'sw', 't0', 'tk')
""" + _META + r"""
local np, rl, wl, fresh, sw, t0, tk = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]),
  tonumber(meta[4]), tonumber(meta[5]), tonumber(meta[6]), tonumber(meta[7])
local now = now_ms()
local tick, lt = clock(now, t0, tk, rl)
local keys, n = split(ARGV[1])
local expired = 0
if now >= sw then sweep(now, np) end
local npend = redis.call('HLEN', P)
local found = redis.call('HMGET', K, unpack(keys))
local pend = nil
if npend > 0 then pend = redis.call('HMGET', P, unpack(keys)) end
local NONE, ZERO = pack('<i8', -1), pack('<i8', 0)
local status, slots, gens, want, claimed, touch, m, nt = {}, {}, {}, {}, {}, {}, 0, 0
for i = 1, n do
  local v = found[i]
  if v then
    status[i] = 1
    slots[i] = sub(v, 1, 8)
    gens[i] = sub(v, 9, 16)
    nt = nt + 1
    touch[nt] = unpack_s('<i8', v)  -- a writer met it: in use (and no reader loses a lease)
  else
    local k = keys[i]
    slots[i] = NONE
    gens[i] = ZERO
    local busy = false
    local p = pend and pend[i]
    if p then
      local ps, pg, pd = unpack_s('<i8i8i8', p)
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
      m = m + 1
      want[m] = i
    end
  end
end
u32_set(R, touch, tick, true)
if expired > 0 then redis.call('HINCRBY', M, 'ex', expired) end
if m > 0 then
  local got = take_free(m, now, np, fresh)
  local got_n = #got
  if got_n < m then
    local ev = evict(m - got_n, now, tick, lt, t0, tk)
    for j = 1, #ev do got[got_n + j] = ev[j] end
  end
  got_n = #got
  if got_n > 0 then
    -- ascending slots for the batch's keys in order: adjacent pages of the caller's buffer
    -- land in adjacent slots, and a read of the batch is a few large copies, not one per page
    table.sort(got)
    local gp = pack('<i8', new_gen())  -- one new generation for the batch
    local tail = gp .. pack('<i8', now + wl)
    local pargs = {}
    for j = 1, got_n do
      local i = want[j]
      local sp = pack('<i8', got[j])
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
local ok, done, kargs, qk, qv, fargs, nd, nk, nf = {}, {}, {}, {}, {}, {}, 0, 0, 0
local all1 = true
for i = 1, n do
  local val = sub(VALS, 20 * i - 19, 20 * i)
  local sg = sub(val, 1, 16)
  local p = pend[i]
  ok[i] = 0
  if p then
    if sub(p, 1, 16) == sg then
      nd = nd + 1
      done[nd] = keys[i]
      if string.byte(CF, i) ~= 0 then
        nk = nk + 1
        kargs[2 * nk - 1] = keys[i]
        kargs[2 * nk] = val
        qk[nk] = keys[i]
        qv[nk] = val
      else  -- a failed write: its slot is free at once
        nf = nf + 2
        fargs[nf - 1] = 0
        fargs[nf] = unpack_s('<i8', p)
      end
      ok[i] = 1
    end
  elseif string.byte(CF, i) ~= 0 then  -- already confirmed by an earlier attempt of this call?
    local v = redis.call('HGET', K, keys[i])
    if v and sub(v, 1, 16) == sg then ok[i] = 1 end
  end
  all1 = all1 and ok[i] == 1
end
if nd > 0 then redis.call('HDEL', P, unpack(done)) end
if nk > 0 then
  many('HSET', K, kargs)
  if nk == n then queue(ARGV[3], VALS, now) else queue(table.concat(qk), table.concat(qv), now) end
end
if nf > 0 then many('ZADD', F, fargs) end
return flags(ok, all1)
"""

# ARGV: keys. Reply: <i8 slot><i8 gen><u4 crc> per key (slot -1: a miss). Stamps the slots
# found with the current tick (their read lease), one range per run of adjacent slots.
GET = _PRELUDE + r"""
local keys, n = split(ARGV[1])
local vals = redis.call('HMGET', K, unpack(keys))
local miss = pack('<i8i8I4', -1, 0, 0)
local out, hit, nh = {}, {}, 0
for i = 1, n do
  local v = vals[i]
  if v then
    out[i] = v
    nh = nh + 1
    hit[nh] = unpack_s('<i8', v)
  else
    out[i] = miss
  end
end
if nh > 0 then
  local m = redis.call('HMGET', M, 't0', 'tk')
  if m[1] then u32_set(R, hit, floor((now_ms() - tonumber(m[1])) / tonumber(m[2])) + 1, true) end
end
return table.concat(out)
"""

# ARGV: keys. Reply: u8 present[n]. Reads only.
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
# its read lease ran out. Reply: u8 removed[n]. (Its queue entry is skipped when met.)
DELETE = _PRELUDE + r"""
local SG = ARGV[1]
local keys, n = split(ARGV[2])
if n == 0 then return '' end
local meta = redis.call('HMGET', M, 'rl', 't0', 'tk')
local vals = redis.call('HMGET', K, unpack(keys))
local out, gone, gslots, seen = {}, {}, {}, {}
for i = 1, n do
  out[i] = 0
  local v = vals[i]
  local k = keys[i]
  if v and not seen[k] and (#SG == 0 or sub(v, 1, 16) == sub(SG, 16 * i - 15, 16 * i)) then
    seen[k] = true
    gone[#gone + 1] = k
    gslots[#gslots + 1] = unpack_s('<i8', v)
    out[i] = 1
  end
end
if #gone > 0 then
  redis.call('HDEL', K, unpack(gone))
  local t0, tk = tonumber(meta[2] or '0'), tonumber(meta[3] or '1')
  local lt = math.ceil(tonumber(meta[1] or '0') / tk)
  local st = u32_get(R, gslots)
  local fargs = {}
  for j = 1, #gslots do
    fargs[2 * j - 1] = lease_end(st[j], t0, tk, lt)  -- free once a reader's lease ran out
    fargs[2 * j] = gslots[j]
  end
  many('ZADD', F, fargs)
end
return flags(out)
"""

# No ARGV. Drops every confirmed key (reservations and write leases stay); their slots are
# free once every read lease begun so far ran out. Reply: keys removed.
CLEAR = _PRELUDE + r"""
local meta = redis.call('HMGET', M, 'rl', 't0', 'tk')
local all = redis.call('HGETALL', K)
local now = now_ms()
local until_ms = now + tonumber(meta[1] or '0')
if meta[2] then
  local t0, tk = tonumber(meta[2]), tonumber(meta[3])
  local tick, lt = clock(now, t0, tk, tonumber(meta[1]))
  until_ms = lease_end(tick, t0, tk, lt)
end
local fargs = {}
for i = 1, #all, 2 do
  if all[i] ~= '~' then
    fargs[#fargs + 1] = until_ms
    fargs[#fargs + 1] = unpack_s('<i8', all[i + 1])
  end
end
if #fargs > 0 then many('ZADD', F, fargs) end
redis.call('DEL', K, L)
redis.call('HSET', K, '~', rep('~', 80))
redis.call('HSET', M, 'lt', 0)
return #fargs / 2
"""

# ARGV: need, extra, <i8 slot><i8 gen> items given back first. Leases up to need + extra
# free slots (extra at most num_pages / 16; never evicts: a writer short of need reserves
# instead), each the caller's until its deadline. Reply: <i8 write lease ms>, <i8 gen> (0: no
# slot), then <i8 first slot><i8 count> per run of the slots, ascending.
LEASE = _PRELUDE + r"""
local meta = redis.call('HMGET', M, 'np', 'wl', 'fr', 'sw', 'rl', 't0')
""" + _META + r"""
local np, wl, fresh, sw = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4])
local now = now_ms()
give_back(ARGV[3])
if now >= sw then sweep(now, np) end
local got, ascending = take_free(tonumber(ARGV[1]) + math.min(tonumber(ARGV[2]), floor(np / 16)), now, np, fresh)
if #got == 0 then return pack('<i8i8', wl, 0) end
if not ascending then table.sort(got) end  -- see reserve
local g = new_gen()
local gp = pack('<i8', g)
local runs = runs_of(got)
u32_set(O, got, g32(g), false, runs)
local rs = {}
for _, r in ipairs(runs) do rs[#rs + 1] = pack('<i8i8', r[1], r[2]) end
rs = table.concat(rs)
redis.call('HSET', W, gp, pack('<i8', now + wl) .. rs)
redis.call('HINCRBY', M, 'ls', #got)
return pack('<i8', wl) .. gp .. rs
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
local slots, gv, glist, g32s = {}, {}, {}, {}
local g_prev, x_prev, s_prev, inc = nil, nil, -1, true
for i = 1, n do
  local s, g = unpack_s('<i8i8', VALS, 20 * i - 19)
  slots[i] = s
  inc = inc and s > s_prev
  s_prev = s
  if g ~= g_prev then
    x_prev = g32s[g]
    if not x_prev then
      x_prev = g32(g)
      g32s[g] = x_prev
      glist[#glist + 1] = g
    end
    g_prev = g
  end
  gv[i] = x_prev
end
local gp = {}
for j = 1, #glist do gp[j] = pack('<i8', glist[j]) end
local av = redis.call('HMGET', W, unpack(gp))  -- the leases named (one, as a rule) are not expired
local alive, all_alive = {}, true
for j = 1, #glist do
  alive[glist[j]] = av[j] and true or false
  all_alive = all_alive and alive[glist[j]]
end
local own, all_own, runs = u32_match(O, slots, gv)
local kv = redis.call('HMGET', K, unpack(keys))
local pv = nil
if redis.call('HLEN', P) > 0 then pv = redis.call('HMGET', P, unpack(keys)) end
local st, kargs, claimed = {}, {}, {}
local ok_n = 0
for i = 1, n do
  local k = keys[i]
  if not ((all_own or own[i]) and (all_alive or alive[select(2, unpack_s('<i8i8', VALS, 20 * i - 19))]))
     or (not inc and claimed[slots[i]]) then
    st[i] = (kv[i] and sub(kv[i], 1, 16) == sub(VALS, 20 * i - 19, 20 * i - 4)) and 1 or 0  -- stored by an earlier attempt?
  elseif kv[i] or (pv and pv[i]) or claimed[k] then
    st[i] = 2
  else
    st[i] = 1
    ok_n = ok_n + 1
    claimed[k] = i
    if not inc then claimed[slots[i]] = true end
    kargs[2 * ok_n - 1] = k
    kargs[2 * ok_n] = sub(VALS, 20 * i - 19, 20 * i)
  end
end
if ok_n > 0 then
  many('HSET', K, kargs)
  if ok_n == n then
    u32_set(O, slots, 0, false, runs)
    queue(ARGV[2], VALS, now)
  else
    local used, qk, qv = {}, {}, {}
    for j = 1, ok_n do
      local i = claimed[kargs[2 * j - 1]]
      used[j] = slots[i]
      qk[j] = keys[i]
      qv[j] = kargs[2 * j]
    end
    u32_set(O, used, 0)
    queue(table.concat(qk), table.concat(qv), now)
  end
  redis.call('HINCRBY', M, 'ls', -ok_n)
end
return flags(st, ok_n == n)
"""

# ARGV: <i8 slot><i8 gen> items. Write leases given back unused. Reply: u8 ok[n].
UNLEASE = _PRELUDE + r"""
local ok = give_back(ARGV[1])
if #ok == 0 then return '' end
local out = {}
for i = 1, #ok do out[i] = ok[i] and 1 or 0 end
return flags(out)
"""

SCRIPTS = {"initialize": INITIALIZE, "reserve": RESERVE, "commit": COMMIT, "get": GET, "exists": EXISTS,
           "validate": VALIDATE, "delete": DELETE, "clear": CLEAR, "lease": LEASE, "put": PUT, "unlease": UNLEASE}
