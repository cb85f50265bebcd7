-- fixed_window.lua: at most `count` per window of period_us, windows aligned to the Unix
-- epoch (a "/d" window runs 00:00-24:00 UTC). Cheap and exact for hour or day quotas; at a
-- window edge up to 2 x count can pass within a short time, so use GCRA or a token bucket
-- to shape short-term traffic and this for the quota on top.
--
-- State: one HASH per (limit, key): w = window index (floor(now / period_us)), n = used.
-- The key expires when its window ends. Reservation is not supported (max_wait ignored).
-- mark (kept in the lease record) = the window index the cost was counted in, so that a
-- refund only returns cost to the window that paid it.

local function fw_used(key, w)
  local s = redis.call('HMGET', key, 'w', 'n')
  if tonumber(s[1]) == w then
    return tonumber(s[2])
  end
  return 0
end

local function fw_store(key, p, now, w, n)
  redis.call('HSET', key, 'w', fmt(w), 'n', fmt(n))
  redis.call('PEXPIRE', key, ttl_ms((w + 1) * p.period_us - now))
end

ALGO.fw = {
  nkeys = 1,
  check = function(keys, p, now, cost, max_wait)
    local w = math.floor(now / p.period_us)
    local n = fw_used(keys[1], w)
    local window_end = (w + 1) * p.period_us - now
    local r = {w = w, n = n, allowed = 0, wait = 0, retry = 0, reset = ceil_us(window_end)}
    local after = n
    if n + cost <= p.count then
      r.allowed = 1
      after = n + cost
    else
      r.retry = ceil_us(window_end)
    end
    r.remaining = math.max(p.count - after, 0)
    return r
  end,
  commit = function(keys, p, now, cost, r, holder, expiry)
    fw_store(keys[1], p, now, r.w, r.n + cost)
    return fmt(r.w)
  end,
  -- A charge lands in the current window; a refund only in the window that paid, if current.
  adjust = function(keys, p, now, delta, mark, holder)
    local w = math.floor(now / p.period_us)
    if delta < 0 and tonumber(mark) ~= w then
      return
    end
    fw_store(keys[1], p, now, w, math.max(fw_used(keys[1], w) + delta, 0))
  end,
}
