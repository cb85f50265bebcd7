-- concurrency.lua: at most `count` units in flight; each holder takes `cost` units
-- (1 per task by default) until it releases them or its lease expires.
--
-- State: two keys per (limit, key)
--   KEYS[1] ZSET  member = holder id, score = lease expiry (us)
--   KEYS[2] HASH  'h:' .. holder = units held;  't' = total units held
-- A holder that dies without releasing frees its units when its lease expires: every
-- check first sweeps the expired leases. Reservation is not supported (max_wait ignored);
-- on denial `retry` is the time until the earliest lease expires: an upper bound, because
-- a holder usually releases well before its lease ends.

local function conc_sweep(keys, now)
  local total = tonumber(redis.call('HGET', keys[2], 't')) or 0
  local gone = redis.call('ZRANGEBYSCORE', keys[1], '-inf', now)
  if #gone > 0 then
    local fields = {}
    for i, m in ipairs(gone) do
      fields[i] = 'h:' .. m
    end
    for _, c in ipairs(redis.call('HMGET', keys[2], unpack(fields))) do
      total = total - (tonumber(c) or 0)
    end
    redis.call('HDEL', keys[2], unpack(fields))
    redis.call('ZREMRANGEBYSCORE', keys[1], '-inf', now)
    if redis.call('ZCARD', keys[1]) == 0 then
      -- Nobody holds anything: drop the rounding dust of fractional costs.
      total = 0
    end
    redis.call('HSET', keys[2], 't', fmt(total))
  end
  return total
end

local function conc_expire(keys, now)
  local last = redis.call('ZRANGE', keys[1], -1, -1, 'WITHSCORES')
  if last[2] == nil then
    redis.call('DEL', keys[1], keys[2])
    return 0
  end
  local idle = tonumber(last[2]) - now
  redis.call('PEXPIRE', keys[1], ttl_ms(idle))
  redis.call('PEXPIRE', keys[2], ttl_ms(idle))
  return idle
end

ALGO.conc = {
  nkeys = 2,
  check = function(keys, p, now, cost, max_wait)
    local total = conc_sweep(keys, now)
    local r = {total = total, allowed = 0, wait = 0, retry = 0, reset = 0}
    local after = total
    if total + cost <= p.count then
      r.allowed = 1
      after = total + cost
    else
      local first = redis.call('ZRANGE', keys[1], 0, 0, 'WITHSCORES')
      r.retry = ceil_us(tonumber(first[2]) - now)
    end
    r.remaining = math.max(p.count - after, 0)
    return r
  end,
  commit = function(keys, p, now, cost, r, holder, expiry)
    redis.call('ZADD', keys[1], expiry, holder)
    redis.call('HSET', keys[2], 'h:' .. holder, fmt(cost), 't', fmt(r.total + cost))
    r.reset = ceil_us(conc_expire(keys, now))
    return ''
  end,
  -- Settling a concurrency limit releases the holder's units; the cost change is irrelevant.
  adjust = function(keys, p, now, delta, mark, holder)
    -- Sweep first: a lease that expired has already given its units back.
    local total = conc_sweep(keys, now)
    local held = tonumber(redis.call('HGET', keys[2], 'h:' .. holder))
    if held == nil then
      return
    end
    redis.call('ZREM', keys[1], holder)
    redis.call('HDEL', keys[2], 'h:' .. holder)
    total = total - held
    if total < 0 or redis.call('ZCARD', keys[1]) == 0 then
      total = 0
    end
    redis.call('HSET', keys[2], 't', fmt(total))
    conc_expire(keys, now)
  end,
}
