-- gcra.lua: Generic Cell Rate Algorithm, the leaky bucket kept as one timestamp.
--
-- State: one STRING per (limit, key) = TAT, the theoretical arrival time in us.
-- Emission interval T = period_us / count (us per token); tolerance = burst * T.
-- A request of `cost` tokens conforms at time t when  max(TAT, t) + cost*T - t <= burst*T.
-- With burst = 1 and cost = 1 that is strict spacing: one call every T.
-- Reservation (the queue of the leaky bucket, kept as that single timestamp): with
-- max_wait_us > 0 a request that conforms within max_wait_us takes the next free slot now;
-- `wait` is how long until that slot.
-- A missing key reads as TAT = now (a full bucket); the key expires when TAT has passed.

local function gcra_tat(key, now)
  local tat = tonumber(redis.call('GET', key))
  if tat == nil or tat < now then
    return now
  end
  return tat
end

local function gcra_store(key, p, now, tat)
  redis.call('SET', key, fmt(tat), 'PX', ttl_ms(tat - now))
end

ALGO.gcra = {
  nkeys = 1,
  check = function(keys, p, now, cost, max_wait)
    local interval = p.period_us / p.count
    local tat = gcra_tat(keys[1], now)
    local new_tat = tat + cost * interval
    local conform_at = new_tat - p.burst * interval
    local r = {new_tat = new_tat, allowed = 0, wait = 0, retry = 0}
    local after = tat
    if conform_at <= now then
      r.allowed = 1
      after = new_tat
    else
      local need = ceil_us(conform_at - now)
      if need <= max_wait then
        r.allowed = 1
        r.wait = need
        after = new_tat
      else
        r.retry = need
      end
    end
    r.remaining = math.max(p.burst - (after - now) / interval, 0)
    r.reset = ceil_us(after - now)
    return r
  end,
  commit = function(keys, p, now, cost, r, holder, expiry)
    gcra_store(keys[1], p, now, r.new_tat)
    return ''
  end,
  -- delta > 0 pushes TAT later; delta < 0 pulls it back, never earlier than now.
  adjust = function(keys, p, now, delta, mark, holder)
    local tat = gcra_tat(keys[1], now)
    gcra_store(keys[1], p, now, math.max(now, tat + delta * p.period_us / p.count))
  end,
}
