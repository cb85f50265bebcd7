-- prelude.lua: helpers shared by every operation script.
--
-- throttle/scripts.py builds each script sent to Redis as
--   prelude.lua + the file of each algorithm the call uses + the operation file,
-- so every algorithm's arithmetic exists exactly once, a single-limit call carries only its
-- own algorithm, and a multi-limit acquisition over several algorithms is still one atomic
-- script. Nothing here touches a key.
--
-- Units everywhere: time in microseconds (us) since the Unix epoch, read from Redis TIME;
-- amounts (tokens, cost) are Lua numbers (doubles), fractions allowed. State is written by
-- passing Lua numbers to redis.call, which Redis formats as '%.17g' (exact round trip) in C,
-- faster than string.format in Lua; replies are text (EVAL would truncate a bare float reply
-- and turn false into nil).
--
-- An algorithm is a table ALGO[code] = {nkeys, check, commit, adjust}. Its functions get
-- `l`, the record of one limit, built once per limit and call by the operation script:
--   l.k (index in KEYS of the limit's first key), l.count, l.period_us, l.burst
--   and the outcome that check() fills in: l.allowed (1/0), l.wait (us until a reserved
--   slot), l.retry (us until it could admit), l.remaining (tokens), l.reset (us until full).
-- An algorithm may add a few private fields to l (what check read, for commit); the record
-- is created with room for them, so that no table grows on this hot path.
--   check(l, now, cost, max_wait)
--   commit(l, now, cost, holder, expiry) -> mark (text kept in the lease record)
--   adjust(l, now, delta, mark, holder)   charge (delta > 0) or refund (delta < 0)

local ALGO = {}

-- The one clock. ARGV carries an explicit time only in tests (Limiter(clock_us=...)).
local function clock_us(explicit)
  if explicit ~= '' then
    return tonumber(explicit)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function fmt(x)
  return string.format('%.17g', x)
end

-- A duration in us rounded up to a whole us, never negative (for replies).
local function ceil_us(x)
  if x <= 0 then
    return 0
  end
  return math.ceil(x)
end

-- The record of limit number i of the ARGV layout shared by acquire.lua and settle.lua
-- (5 values per limit from ARGV[5i - 1]: code, count, period_us, burst, cost), whose first
-- key is KEYS[k]. Created with every field (and room for an algorithm's private ones), so
-- that no table is resized on the hot path. cost is nil when its ARGV is ''.
local function limit_record(i, k)
  local a = 5 * i - 2
  return {k = k, code = ARGV[a + 1], algo = ALGO[ARGV[a + 1]], count = tonumber(ARGV[a + 2]),
          period_us = tonumber(ARGV[a + 3]), burst = tonumber(ARGV[a + 4]),
          cost = tonumber(ARGV[a + 5]),
          allowed = 0, wait = 0, retry = 0, remaining = 0, reset = 0}
end

-- Key lifetime: until the state would read the same as a missing key (idle_us from now),
-- plus one second so a key never vanishes a moment before it is no longer needed. Capped
-- (about 300 years) so that PEXPIRE always accepts it, however absurd a debt or lease: a
-- script that failed half-way would leave its first writes done.
local function ttl_ms(idle_us)
  return math.min(math.ceil(math.max(idle_us, 0) / 1000) + 1000, 1e13)
end
