-- concurrency.lua: at most `count` units in flight; each holder takes `cost` units
-- (1 per task by default) until it releases them or its lease expires.
--
-- State: two keys per (limit, key)
--   KEYS[k]     ZSET  member = holder id, score = lease expiry (us)
--   KEYS[k + 1] HASH  'h:' .. holder = units held;  't' = total units held
-- A holder that dies without releasing frees its units when its lease expires: every
-- check first sweeps the expired leases. Reservation is not supported (max_wait ignored);
-- on denial `retry` is the time until the earliest lease expires: a holder usually releases
-- sooner, and with weighted costs that one lease may not free enough units.
-- Private field of l: total (units held, read by check).

-- Leases swept per batch: unpack() has a limit (about 8000 values), and a crowd of dead
-- holders must not make every later acquire fail.
local SWEEP_BATCH = 1000

local function conc_sweep(l, now)
  local z, h = KEYS[l.k], KEYS[l.k + 1]
  local total = tonumber(redis.call('HGET', h, 't')) or 0
  local gone = redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, SWEEP_BATCH)
  if #gone == 0 then
    return total
  end
  while #gone > 0 do
    local fields = {}
    for i, m in ipairs(gone) do
      fields[i] = 'h:' .. m
    end
    for _, c in ipairs(redis.call('HMGET', h, unpack(fields))) do
      total = total - (tonumber(c) or 0)
    end
    redis.call('HDEL', h, unpack(fields))
    redis.call('ZREM', z, unpack(gone))
    if #gone < SWEEP_BATCH then
      break
    end
    gone = redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, SWEEP_BATCH)
  end
  if redis.call('ZCARD', z) == 0 then
    -- Nobody holds anything: drop the rounding dust of fractional costs.
    total = 0
  end
  redis.call('HSET', h, 't', total)
  return total
end

-- Expire both keys with the last lease (or delete them when nobody holds anything);
-- returns the time in us until the last lease ends.
local function conc_expire(l, now)
  local z, h = KEYS[l.k], KEYS[l.k + 1]
  local last = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  if last[2] == nil then
    redis.call('DEL', z, h)
    return 0
  end
  local idle = tonumber(last[2]) - now
  redis.call('PEXPIRE', z, ttl_ms(idle))
  redis.call('PEXPIRE', h, ttl_ms(idle))
  return idle
end

ALGO.conc = {
  nkeys = 2,
  check = function(l, now, cost, max_wait)
    local total = conc_sweep(l, now)
    l.total = total
    local after = total
    if total + cost <= l.count then
      l.allowed = 1
      after = total + cost
    else
      local first = redis.call('ZRANGE', KEYS[l.k], 0, 0, 'WITHSCORES')
      l.retry = ceil_us(tonumber(first[2]) - now)
    end
    l.remaining = math.max(l.count - after, 0)
  end,
  -- A holder of 0 units is not recorded: it holds nothing, and must not crowd the set.
  commit = function(l, now, cost, holder, expiry)
    if cost > 0 then
      redis.call('ZADD', KEYS[l.k], expiry, holder)
      redis.call('HSET', KEYS[l.k + 1], 'h:' .. holder, cost, 't', l.total + cost)
    end
    l.reset = ceil_us(conc_expire(l, now))
    return ''
  end,
  -- Settling a concurrency limit releases the holder's units; the cost change is irrelevant.
  adjust = function(l, now, delta, mark, holder)
    local z, h = KEYS[l.k], KEYS[l.k + 1]
    -- Sweep first: a lease that expired has already given its units back.
    local total = conc_sweep(l, now)
    local held = tonumber(redis.call('HGET', h, 'h:' .. holder))
    if held == nil then
      return
    end
    redis.call('ZREM', z, holder)
    redis.call('HDEL', h, 'h:' .. holder)
    total = total - held
    if total < 0 or redis.call('ZCARD', z) == 0 then
      total = 0
    end
    redis.call('HSET', h, 't', total)
    conc_expire(l, now)
  end,
}
