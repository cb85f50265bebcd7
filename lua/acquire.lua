-- acquire.lua: take `cost` from one or more limits, all or nothing.
--
-- KEYS[1]      the namespace's holds (HASH, see hold.lua)
-- KEYS[2..]    the state keys of each limit in order (ALGO[code].nkeys each), then the
--              fence marker when ARGV[7+3n] is given, then, when an acquisition id is
--              given, its lease record (a HASH)
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      max_wait_us   reserve a future slot up to this far ahead (token bucket, GCRA);
--                            negative: minus the latest slot to reserve, epoch us (a deadline)
-- ARGV[3]      n             number of limits
-- ARGV[4..3+n] 1 per limit:  code ('tb'|'gcra'|'fw'|'sw'|'conc'|'fair')
-- ARGV[4+n]    numbers       4 doubles per limit, packed '<dddd' one limit after the other:
--                            count, period_us, burst, cost (burst = the capacity: bucket
--                            size, or count for windows and concurrency; cost = tokens taken
--                            from this limit, >= 0, fractions allowed: one call may cost 1
--                            request and 2000 tokens). Packed, they arrive exact and cost
--                            Redis one argument and one unpack per limit, where each number
--                            as its own argument cost a Lua string and a conversion.
-- ARGV[5+n]    acquisition   id of the lease record, also the concurrency holder; '' = none
-- ARGV[6+n]    lease_us      how long the record and concurrency units live after the slot
-- ARGV[7+n..]  2 per limit:  its hold fields: the whole limit's, its key's ('' if none)
-- ARGV[7+3n]   fence_us      optional: the restart fence (prelude.lua); absent: none
--
-- Returns one string (one bulk reply is cheaper to parse than many). Status 0, the
-- common one, is packed doubles (struct '<d', 8 bytes each: exact, and nothing formatted
-- in Lua, where every number made text is a C sprintf that cost more than the rest of a
-- limit's arithmetic): 0, allowed, wait_us, retry_after_us, then per limit allowed,
-- remaining, retry_after_us, reset_us; 32 + 32n bytes, the first 8 zero. The other
-- statuses are text, space-separated numbers, durations whole us:
--   status 0 = decided now;
--          1 = the acquisition id already holds a live lease on these same keys (a
--              redelivery): allowed, nothing taken again, wait_us = time until its reserved
--              slot, retry_after_us = how long ago the slot passed (0 if it has not), then
--              the cost it reserved from each limit instead of per-limit fields;
--          2 = cost exceeds the capacity of limit number `allowed` (never satisfiable);
--          3 = the acquisition id holds a live lease on other limits or keys: nothing done;
--          4 = as 1, but a hold placed after the reservation covers its slot: '4 i retry'
--              with i the first held limit and retry the us until the hold ends; the lease
--              is left for the caller to settle (give up).
--   When admitted, the slot (now + wait_us) is the earliest time at which every limit
--   conforms, and every limit is charged as of that slot (see commit in prelude.lua); each
--   limit's remaining and reset describe the state committed (a limit whose own slot was
--   earlier: as charged at the common slot), measured from now as for one limit.
--   On denial nothing is taken from any limit (the only writes are a concurrency limit's
--   sweep of expired leases, and a fair limit's deny: its key is active, its plan moves),
--   and retry_after_us is the largest wait among the limits that
--   could not admit the cost now, or the slot when a window limit (fixed or sliding) was
--   denied because the slot falls in a later window than the current one (its per-limit
--   allowed 0, retry_after_us = that slot). A held limit (hold.lua) denies with allowed 0,
--   remaining 0, retry_after_us = the time until its hold ends, reset 0, without reading
--   its state.

local now = clock_us(ARGV[1])
-- Numbers of ARGV by Lua's own coercion (`* 1`): the conversion tonumber makes, exact,
-- without the C function call (about 0.08 us).
local max_wait = ARGV[2] * 1
if max_wait < 0 then
  max_wait = math.max(-max_wait - now, 0)
end
local n = ARGV[3] * 1
local acq = ARGV[5 + n]
if acq == '' then
  acq = nil
end
local fenced = ARGV[7 + 3 * n]
if fenced then
  FENCE = fence_of(acq and #KEYS - 1 or #KEYS, now, tonumber(fenced))
end

-- The holds of every limit: until (us) of the limit's and of its key's, or false when the
-- holds hash is missing (no hold placed in the namespace, or every one lifted), which
-- EXISTS tells for less than the HMGET of every limit's two fields costs. EXISTS, and the
-- MGET below, by pcall: a Redis user whose ACL lacks them (rules copied from an older
-- acl_rules) gets an error reply, not a failed call, and then the reads every version's
-- rules allow (the HMGET, a GET per limit): the same decisions, for more server time.
local held_until = false
if redis.pcall('EXISTS', KEYS[1]) ~= 0 then
  held_until = redis.call('HMGET', KEYS[1], unpack(ARGV, 7 + n, 6 + 3 * n))
end

if acq then
  local lease = KEYS[#KEYS]
  local held = redis.call('HMGET', lease, 's', 'at', 'n')
  if held[1] == '1' then
    -- Taken already (a redelivered task): nothing again, if it is the same limits and keys.
    if tonumber(held[3]) ~= n then
      return '3'
    end
    local fields = {}
    for i = 1, n do
      fields[i] = 'k' .. i
    end
    for i = 1, n do
      fields[n + i] = 'c' .. i
    end
    local recorded = redis.call('HMGET', lease, unpack(fields))
    local k = 2
    local at = tonumber(held[2])
    local reply = '1 1 ' .. ceil_us(at - now) .. ' ' .. ceil_us(now - at)
    for i = 1, n do
      if recorded[i] ~= KEYS[k] then
        return '3'
      end
      k = k + ALGO[ARGV[3 + i]].nkeys
      reply = reply .. ' ' .. recorded[n + i]
    end
    -- A hold that began after the reservation and lasts past its slot voids the slot.
    if held_until then
      for i = 1, n do
        local hold = hold_of(held_until, i)
        if hold > at and hold > now then
          return '4 ' .. i .. ' ' .. ceil_us(hold - now)
        end
      end
    end
    -- Found by this call: a give-back of the call that made it (cancelled before its
    -- reply) must leave it to this one (settle.lua's unless_found).
    redis.call('HSET', lease, 'f', '1')
    return reply
  end
end

-- Each limit's decision goes straight into the numbers of the reply (REPLY, from 4i + 1:
-- allowed, remaining, retry_after_us, reset_us), and what its commit needs into one array
-- per limit (LIMITS[i]). Both are prelude.lua's, reused from call to call in the library;
-- a limit's array is built by a constructor of its size when new (a record with named
-- fields costs a hash insert per field).
local K, ALG, COUNT, PERIOD, BURST, COST, S1, S2, S3, S4, WAIT =
  1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11
local limits, out = LIMITS, REPLY
local allowed, wait, retry = 1, 0, 0
local k = 2
-- Every state key in one MGET (KEYS[2] up to the fence marker and the lease record): one
-- command instead of a GET per limit. A key that is not a STRING (concurrency, fair) reads
-- as false here; those algorithms read their own keys, as each algorithm does when MGET is
-- refused (an error reply: states[k - 1] is nil).
local states = redis.pcall('MGET', unpack(KEYS, 2, #KEYS - (fenced and 1 or 0)
                                                      - (acq and 1 or 0)))
local numbers = ARGV[4 + n]
for i = 1, n do
  local algo = ALGO[ARGV[3 + i]]
  local count, period_us, burst, cost = struct.unpack('<dddd', numbers, 32 * i - 31)
  if cost > burst then
    return '2 ' .. i
  end
  local ok, w, r, remaining, reset, s1, s2, s3, s4 = 0, 0, 0, 0, 0, false, false, false, false
  -- Nothing held (false, false) is the usual answer: nothing to decode then.
  if held_until and (held_until[2 * i - 1] or held_until[2 * i])
      and hold_of(held_until, i) > now then
    r = ceil_us(hold_of(held_until, i) - now)
  else
    ok, w, r, remaining, reset, s1, s2, s3, s4 =
      algo.check(k, count, period_us, burst, now, cost, max_wait, states[k - 1])
  end
  local j = 4 * i
  out[j + 1], out[j + 2], out[j + 3], out[j + 4] = ok, remaining, r, reset
  local l = limits[i]
  if l then
    l[K], l[ALG], l[COUNT], l[PERIOD], l[BURST], l[COST], l[S1], l[S2], l[S3], l[S4], l[WAIT] =
      k, algo, count, period_us, burst, cost, s1, s2, s3, s4, w
  else
    limits[i] = {k, algo, count, period_us, burst, cost, s1, s2, s3, s4, w}
  end
  k = k + algo.nkeys
  if ok == 0 then
    allowed = 0
  end
  -- Compared here rather than by math.max: a C call costs more than the comparison.
  if w > wait then
    wait = w
  end
  if r > retry then
    retry = r
  end
end
if wait > retry then
  retry = wait
end

-- The slot is the earliest time at which every limit conforms: the latest of their own
-- slots (token bucket and GCRA conformance only grows with time). Every limit is committed
-- as of that slot. A window counts the call in its current window: a slot in a later one
-- is denied, and the caller comes back at that slot (nothing taken).
local slot = now + wait
if allowed == 1 and wait > 0 then
  for i = 1, n do
    local l = limits[i]
    local ends = l[ALG].ends
    if ends and slot >= ends(l[PERIOD], l[S1], l[S2], l[S3]) then
      allowed, out[4 * i + 1], out[4 * i + 3] = 0, 0, wait
    end
  end
end

if allowed == 1 then
  local expiry, record
  if acq then
    expiry = slot + tonumber(ARGV[6 + n])
    record = {'s', '1', 'at', slot, 'n', n}
  end
  for i = 1, n do
    local l = limits[i]
    -- false (committed at its own slot) unless another limit's slot is later than this one's
    local at = wait > 0 and slot > now + l[WAIT] and slot
    local mark, reset, remaining = l[ALG].commit(l[K], l[COUNT], l[PERIOD], l[BURST], now,
                                                 l[COST], acq, expiry, at, l[S1], l[S2], l[S3],
                                                 l[S4])
    if reset then
      out[4 * i + 4] = reset
    end
    if remaining then
      out[4 * i + 2] = remaining
    end
    if acq then
      record[#record + 1] = 'k' .. i
      record[#record + 1] = KEYS[l[K]]
      record[#record + 1] = 'm' .. i
      record[#record + 1] = mark
      record[#record + 1] = 'c' .. i
      record[#record + 1] = l[COST]
    end
  end
  if acq then
    -- A record of the same id settled before (a task that came back under its id) goes:
    -- its fields ('f', found by a redelivery; another acquisition's limits) are not this one's.
    redis.call('DEL', KEYS[#KEYS])
    redis.call('HSET', KEYS[#KEYS], unpack(record))
    redis.call('PEXPIRE', KEYS[#KEYS], ttl_ms(expiry - now) - 1000)
  end
else
  wait = 0
  -- An algorithm that remembers denials (fair.lua: who is active, where its plan stands).
  for i = 1, n do
    local l = limits[i]
    if out[4 * i + 1] == 0 and l[S1] and l[ALG].deny then
      l[ALG].deny(l[K], l[COUNT], l[PERIOD], l[BURST], now, l[COST], l[S1])
    end
  end
end
-- One pack of every number: a pack per limit and their concatenation cost twice as much.
out[1], out[2], out[3], out[4] = 0, allowed, wait, allowed == 1 and 0 or retry
local format = FORMAT[n]
if not format then
  format = '<' .. string.rep('d', 4 + 4 * n)
  FORMAT[n] = format
end
return struct.pack(format, unpack(out, 1, 4 + 4 * n))
