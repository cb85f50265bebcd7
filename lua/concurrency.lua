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
-- check hands commit s1 = total (the units held); commit also returns the new reset.

-- Leases swept per batch: unpack() has a limit (about 8000 values), and a crowd of dead
-- holders must not make every later acquire fail.
local SWEEP_BATCH = 1000

local function conc_sweep(k, now)
  local z, h = KEYS[k], KEYS[k + 1]
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
local function conc_expire(k, now)
  local z, h = KEYS[k], KEYS[k + 1]
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

local function check(k, count, period_us, burst, now, cost, max_wait)
  local total = conc_sweep(k, now)
  local allowed, retry, after = 0, 0, total
  if total + cost <= count then
    allowed, after = 1, total + cost
  else
    local first = redis.call('ZRANGE', KEYS[k], 0, 0, 'WITHSCORES')
    retry = ceil_us(tonumber(first[2]) - now)
  end
  return allowed, 0, retry, math.max(count - after, 0), 0, total
end

-- A holder of 0 units is not recorded: it holds nothing, and must not crowd the set.
local function commit(k, count, period_us, burst, now, cost, holder, expiry, at, total)
  if cost > 0 then
    redis.call('ZADD', KEYS[k], expiry, holder)
    redis.call('HSET', KEYS[k + 1], 'h:' .. holder, cost, 't', total + cost)
  end
  return '', ceil_us(conc_expire(k, now))
end

-- ==== several limits only: acquire_one.lua is sent without the rest of this file ====

ALGO.conc = {
  nkeys = 2,
  check = check,
  commit = commit,
  -- Settling a concurrency limit releases the holder's units; the cost change is irrelevant.
  adjust = function(k, count, period_us, burst, now, delta, mark, holder)
    local z, h = KEYS[k], KEYS[k + 1]
    -- Sweep first: a lease that expired has already given its units back.
    local total = conc_sweep(k, now)
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
    conc_expire(k, now)
  end,
}
