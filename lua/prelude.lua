-- prelude.lua: helpers shared by every operation script.
--
-- throttle/redis/scripts.py builds each script sent to Redis as
--   prelude.lua + the file of each algorithm the call uses + the operation file,
-- so every algorithm's arithmetic exists exactly once, a single-limit call carries only its
-- own algorithm, and a multi-limit acquisition over several algorithms is still one atomic
-- script. On Redis 7 it also builds one function library of the same files (this file,
-- every algorithm's, then a function per operation whose body is the operation file:
-- scripts.py's library_source), loaded once, where what this file and the algorithms
-- define is made when the library loads instead of on every call. Nothing here touches a
-- key.
--
-- Units everywhere: time in microseconds (us) since the Unix epoch, read from Redis TIME;
-- amounts (tokens, cost) are Lua numbers (doubles), fractions allowed. State is written
-- exactly and in C, never formatted in Lua: several numbers packed as doubles (struct), or
-- one number passed to redis.call, which Redis formats as '%.17g'; replies are strings
-- (EVAL would truncate a bare float reply and turn false into nil): the acquire scripts'
-- decided replies packed doubles (every number made text in Lua is a C sprintf, which cost
-- more than a limit's arithmetic), the rest text.
--
-- Each algorithm file defines local functions check and commit that take plain values (no
-- per-call table: this runs on every acquire), then, after the line
--   -- ==== several limits only: acquire_one.lua is sent without the rest of this file ====
-- registers them with its adjust in ALGO[code] = {nkeys, check, commit, adjust[, ends]} for the
-- drivers of several limits (acquire.lua, settle.lua). In a script of several algorithms
-- each file's check and commit shadow the previous file's, after that file registered its
-- own. The one-limit script (acquire_one.lua) is this file and one algorithm's, each up to
-- that line, and calls check and commit directly: every table and function a script
-- creates costs server time on each call. The parking lot's operations (park.lua,
-- claim_parked.lua, commit_parked.lua, accept_parked.lua) use no algorithm: they are this
-- file up to that line + the operation file. Each function gets k, the index in KEYS of the
-- limit's first key, and the limit's count, period_us and burst:
--   check(k, count, period_us, burst, now, cost, max_wait)
--     -> allowed (1/0), wait (us until a reserved slot), retry (us until it could admit),
--        remaining (tokens), reset (us until full), then up to four values of the state it
--        read (s1, s2, s3, s4), handed to commit; reads only
--   commit(k, count, period_us, burst, now, cost, holder, expiry, at, s1, s2, s3, s4)
--     writes the state check read with cost taken; -> mark (text kept in the lease record)
--     [, reset[, remaining]: when committing makes them differ from check's]. at (us) = false: the cost is taken at this
--     limit's own slot (now + wait); or a later time, the slot of several limits (the
--     latest of their slots): the cost is taken as of at, as if the call came then (a
--     token bucket or GCRA does not bank the capacity before at that nobody used). Never
--     earlier than the limit's own slot. The state is still written as of now (never a
--     state dated in the future, which a call before at would misread).
--   ends(period_us, s1, s2, s3) (windows only; nil for the others)
--     -> the time (us) from which check's admission no longer holds: the end of the window
--     it counted in. Several limits whose slot falls there or later are denied (a window
--     counts a call in the window it is made in; it keeps one window's count), and come
--     back at that slot. Token bucket and GCRA admissions hold at any later time
--     (conformance is monotone in time); a concurrency unit is held from now (check) to
--     the lease's end, however late the slot.
--   adjust(k, count, period_us, burst, now, delta, mark, holder)
--     charge (delta > 0) or refund (delta < 0)
--   deny(k, count, period_us, burst, now, cost, s1)   optional (fair.lua only): called by
--     acquire.lua for a limit whose check denied, when the acquisition is denied

-- The globals the scripts use, as locals. A function library (FUNCTION LOAD) reads a
-- global through its own environment, a miss there and a lookup in the real globals; a
-- local (an upvalue in a function) is one step. A script binds them as it starts; the
-- library, which sees only a loading-time `redis` while it loads, on its first call
-- (library.py's wrapper calls bind_globals while `struct` is nil).
local function globals()
  return redis, struct, math, string, table, tonumber, unpack, ipairs
end
local redis, struct, math, string, table, tonumber, unpack, ipairs = redis
local function bind_globals()
  redis, struct, math, string, table, tonumber, unpack, ipairs = globals()
end
if not redis.register_function then
  bind_globals()
end

-- Whether now is Redis TIME, the clock key expiry runs on (false: a test's explicit time).
local REDIS_CLOCK = true

-- The one clock. ARGV carries an explicit time only in tests (Limiter(clock_us=...)); a
-- negative one is Redis TIME that many us ago (a shadow look sent a moment after it was
-- taken: Limiter.acquire_each). Either way every write then sets its key's TTL.
local function clock_us(explicit)
  if explicit ~= '' then
    REDIS_CLOCK = false
    local us = tonumber(explicit)
    if us >= 0 then
      return us
    end
    local t = redis.call('TIME')
    return t[1] * 1000000 + t[2] + us
  end
  REDIS_CLOCK = true
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end

-- A duration in us rounded up to a whole us, never negative (for replies). x % 1 is the
-- fraction (x - floor(x), exact): math.ceil's result without a C function call, which
-- costs more than this arithmetic, and this runs a few times per limit on every acquire.
local function ceil_us(x)
  if x <= 0 then
    return 0
  end
  local fraction = x % 1
  if fraction > 0 then
    return x - fraction + 1
  end
  return x
end

-- Key lifetime: until the state would read the same as a missing key (idle_us from now),
-- plus one second so a key never vanishes a moment before it is no longer needed. Capped
-- (about 300 years) so that PEXPIRE always accepts it, however absurd a debt or lease: a
-- script that failed half-way would leave its first writes done.
local function ttl_ms(idle_us)
  return math.min(math.ceil(math.max(idle_us, 0) / 1000) + 1000, 1e13)
end

-- Writing a limit's state keeps the key's TTL when it already lasts long enough: SET ... PX
-- costs Redis about twice a SETRANGE of the same bytes, and a hot key is written on every
-- call. lifetime(idle_us, now, lives) -> until (us), px (ms, or false: keep the TTL), where
-- lives is when the key's TTL ends as last set (us; false: a missing key, or not known).
-- A TTL set is one second longer than ttl_ms asks, so that a key whose need moves on with
-- time (a bucket refilling, a GCRA's TAT) sets it about once a second. Only on Redis
-- TIME: a test's clock is not the one the TTL runs on, so every write sets it there.
local function lifetime(idle_us, now, lives)
  if lives and REDIS_CLOCK and lives >= now + idle_us + 1000000 then
    return lives, false
  end
  local px = ttl_ms(idle_us) + 1000
  return now + px * 1000, px
end

-- Writes KEYS[k] = state (STRING) with a TTL of px ms, or in place keeping its TTL (px
-- false: the key exists, and the state has the length it had).
local function store(k, state, px)
  if px then
    redis.call('SET', KEYS[k], state, 'PX', px)
  else
    redis.call('SETRANGE', KEYS[k], 0, state)
  end
end

-- The end of a restart's fence, us on the Redis clock (0: none), set by the acquire and
-- space scripts from the fence marker (fence_of) before any check. A Redis that lost the
-- marker (new, restarted without its data, flushed, an empty replica promoted) may have lost
-- every limit's state with it while tasks still sleep to slots that state granted, up to
-- fence_us ahead, and the lost state may have spent its whole burst up to there; so a
-- reserving algorithm (token bucket, GCRA) reads a missing state as one that was empty at
-- the fence's end and refills from there: its first slot comes a spacing (period / count x
-- cost) after the latest slot the lost state may have granted.
local FENCE = 0

-- The fence marker KEYS[k] (a number: the fence's end, us): the first script that finds it
-- missing writes now + fence_us. No TTL: the marker is this Redis's memory of having been
-- seen, and its loss the sign that states may be gone.
local function fence_of(k, now, fence_us)
  local marker = redis.call('GET', KEYS[k])
  if marker then
    return tonumber(marker)
  end
  redis.call('SET', KEYS[k], now + fence_us)
  return now + fence_us
end

-- ==== several limits only: acquire_one.lua is sent without the rest of this file ====

-- A number as text, exactly (peek.lua and settle.lua's replies). Past the cut: the scripts
-- that reply packed doubles would only create it and drop it on every call.
local function fmt(x)
  return string.format('%.17g', x)
end

local ALGO = {}

-- The hold of limit number i (us, 0: none): the later of the whole limit's and its key's,
-- in held (the HMGET of every limit's two hold fields: acquire.lua).
local function hold_of(held, i)
  return math.max(tonumber(held[2 * i - 1]) or 0, tonumber(held[2 * i]) or 0)
end

-- acquire.lua's working tables: one array of values per limit (LIMITS[i]), the numbers of
-- its reply (REPLY) and the pack format of a reply per count of limits (FORMAT[n]). In
-- the function library they are made once and reused by every call, which writes every
-- value it reads: a multi-limit acquire then allocates no table (a script makes them on
-- each call, as it makes everything).
local LIMITS, REPLY, FORMAT = {}, {}, {}

-- The record of limit number i of the ARGV layout of settle.lua and peek.lua (5 values
-- per limit from ARGV[5i - 1], as text: code, count, period_us, burst, cost), whose first
-- key is KEYS[k]. Created with every field (check's outcome and the state it read), so
-- that no table is resized on that path. cost is nil when its ARGV is '' (settle.lua: as
-- reserved). acquire.lua, on every multi-limit acquire, reads the same numbers packed
-- (its ARGV[4+n]) and keeps them in an array (cheaper to build than named fields).
local function limit_record(i, k)
  local a = 5 * i - 2
  return {k = k, code = ARGV[a + 1], algo = ALGO[ARGV[a + 1]], count = tonumber(ARGV[a + 2]),
          period_us = tonumber(ARGV[a + 3]), burst = tonumber(ARGV[a + 4]),
          cost = tonumber(ARGV[a + 5]),
          allowed = 0, wait = 0, retry = 0, remaining = 0, reset = 0,
          s1 = false, s2 = false, s3 = false}
end
