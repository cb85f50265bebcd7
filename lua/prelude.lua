-- prelude.lua: helpers shared by every operation script.
--
-- throttle/scripts.py builds each operation script (acquire.lua, settle.lua) as
--   prelude.lua + one file per algorithm + the operation file,
-- so every algorithm's arithmetic exists exactly once and a multi-limit acquisition is
-- still one atomic script. Nothing here touches a key.
--
-- Units everywhere: time in microseconds (us) since the Unix epoch, read from Redis TIME;
-- amounts (tokens, cost) are Lua numbers (doubles), fractions allowed.
-- Numbers go back to Redis and to the client as '%.17g' strings (exact round trip) or as
-- integers that were rounded on purpose: EVAL truncates bare floats and turns false into nil.

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

-- Key lifetime: until the state would read the same as a missing key (idle_us from now),
-- plus one second so a key never vanishes a moment before it is no longer needed.
local function ttl_ms(idle_us)
  return math.ceil(math.max(idle_us, 0) / 1000) + 1000
end
