-- fixed_window.lua: at most `count` per window of period_us, windows aligned to the Unix
-- epoch (a "/d" window runs 00:00-24:00 UTC). Cheap and exact for hour or day quotas; at a
-- window edge up to 2 x count can pass within a short time, so use GCRA or a token bucket
-- to shape short-term traffic and this for the quota on top.
--
-- State: one HASH per (limit, key): w = window index floor(now / period_us), n = the cost
-- counted in it. The key expires when its window ends. Reservation is not
-- supported (max_wait is ignored). mark (kept in the lease record) = the window index the
-- cost was counted in, so that a refund only returns cost to the window that paid.
-- If Redis TIME steps back into an earlier window, counting goes on in the stored, later
-- window: a step back must not reopen a window that is full.
-- Private fields of l: w, n (the window and its count read by check).

-- The window now counts in and its count: floor(now / period_us), or the stored window
-- when it is later (the clock stepped back).
local function fw_read(l, now)
  local w = math.floor(now / l.period_us)
  local s = redis.call('HMGET', KEYS[l.k], 'w', 'n')
  local stored = tonumber(s[1])
  if stored == nil or stored < w then
    return w, 0
  end
  return stored, tonumber(s[2])
end

local function fw_store(l, now, w, n)
  redis.call('HSET', KEYS[l.k], 'w', w, 'n', n)
  redis.call('PEXPIRE', KEYS[l.k], ttl_ms((w + 1) * l.period_us - now))
end

ALGO.fw = {
  nkeys = 1,
  check = function(l, now, cost, max_wait)
    local w, n = fw_read(l, now)
    local window_end = (w + 1) * l.period_us - now
    l.w, l.n = w, n
    l.reset = ceil_us(window_end)
    local after = n
    if n + cost <= l.count then
      l.allowed = 1
      after = n + cost
    else
      l.retry = ceil_us(window_end)
    end
    l.remaining = math.max(l.count - after, 0)
  end,
  commit = function(l, now, cost, holder, expiry)
    fw_store(l, now, l.w, l.n + cost)
    return l.w
  end,
  -- A charge lands in the current window; a refund only in the window that paid, if current.
  adjust = function(l, now, delta, mark, holder)
    local w, n = fw_read(l, now)
    if delta < 0 and tonumber(mark) ~= w then
      return
    end
    fw_store(l, now, w, math.max(n + delta, 0))
  end,
}
