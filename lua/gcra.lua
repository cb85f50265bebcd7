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
-- Private field of l: new_tat (the TAT if admitted).

local function gcra_tat(l, now)
  local tat = tonumber(redis.call('GET', KEYS[l.k]))
  if tat == nil or tat < now then
    return now
  end
  return tat
end

local function gcra_store(l, now, tat)
  redis.call('SET', KEYS[l.k], tat, 'PX', ttl_ms(tat - now))
end

ALGO.gcra = {
  nkeys = 1,
  check = function(l, now, cost, max_wait)
    local interval = l.period_us / l.count
    local tat = gcra_tat(l, now)
    local new_tat = tat + cost * interval
    local conform_at = new_tat - l.burst * interval
    l.new_tat = new_tat
    local after = tat
    if conform_at <= now then
      l.allowed = 1
      after = new_tat
    else
      local need = ceil_us(conform_at - now)
      if need <= max_wait then
        l.allowed = 1
        l.wait = need
        after = new_tat
      else
        l.retry = need
      end
    end
    l.remaining = math.max(l.burst - (after - now) / interval, 0)
    l.reset = ceil_us(after - now)
  end,
  commit = function(l, now, cost, holder, expiry)
    gcra_store(l, now, l.new_tat)
    return ''
  end,
  -- delta > 0 pushes TAT later; delta < 0 pulls it back, never earlier than now.
  adjust = function(l, now, delta, mark, holder)
    local tat = gcra_tat(l, now)
    gcra_store(l, now, math.max(now, tat + delta * l.period_us / l.count))
  end,
}
