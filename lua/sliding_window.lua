-- sliding_window.lua: sliding-window counter, O(1) memory per key.
--
-- The count over the last period_us is estimated as
--   previous_window_count * (1 - fraction_of_current_window_elapsed) + current_window_count
-- (Cloudflare's approximation). It removes the 2 x burst of a fixed window at its edge.
--
-- State: one HASH per (limit, key): w = the current window index, c = its count, p = the
-- count of window w - 1. The key expires when its count no longer weighs on the
-- estimate, at the end of window w + 1. Reservation is not supported (max_wait ignored).
-- mark = the window index the cost was counted in.
-- If Redis TIME steps back into an earlier window, counting goes on in the stored, later
-- window, with no credit for the time elapsed in it.
-- Private fields of l: w, cur, prev (the window and the counts read by check).

-- The current window and its two counts: floor(now / period_us), or the stored window
-- when it is later (the clock stepped back).
local function sw_read(l, now)
  local w = math.floor(now / l.period_us)
  local s = redis.call('HMGET', KEYS[l.k], 'w', 'c', 'p')
  local stored = tonumber(s[1])
  if stored == nil or stored < w - 1 then
    return w, 0, 0
  elseif stored == w - 1 then
    return w, 0, tonumber(s[2])
  end
  return stored, tonumber(s[2]), tonumber(s[3])
end

local function sw_store(l, now, w, cur, prev)
  redis.call('HSET', KEYS[l.k], 'w', w, 'c', cur, 'p', prev)
  redis.call('PEXPIRE', KEYS[l.k], ttl_ms((w + 2) * l.period_us - now))
end

ALGO.sw = {
  nkeys = 1,
  check = function(l, now, cost, max_wait)
    local period = l.period_us
    local w, cur, prev = sw_read(l, now)
    local start = w * period
    local est = prev * (1 - math.max(now - start, 0) / period) + cur
    l.w, l.cur, l.prev = w, cur, prev
    local after_cur = cur
    if est + cost <= l.count then
      l.allowed = 1
      est = est + cost
      after_cur = cur + cost
    elseif cur + cost <= l.count then
      -- Enough room once the previous window has decayed a little more, in this window.
      local f = 1 - (l.count - cur - cost) / prev
      l.retry = ceil_us(start + f * period - now)
    else
      -- Only in the next window, once this window's count has decayed enough.
      local f = math.max(1 - (l.count - cost) / cur, 0)
      l.retry = ceil_us(start + (1 + f) * period - now)
    end
    l.remaining = math.max(l.count - est, 0)
    if after_cur > 0 then
      l.reset = ceil_us(start + 2 * period - now)
    else
      l.reset = ceil_us(start + period - now)
    end
  end,
  commit = function(l, now, cost, holder, expiry)
    sw_store(l, now, l.w, l.cur + cost, l.prev)
    return l.w
  end,
  -- A charge lands in the current window; a refund goes back to the window that paid while
  -- that window still weighs on the estimate (the current or the previous one).
  adjust = function(l, now, delta, mark, holder)
    local w, cur, prev = sw_read(l, now)
    local paid = tonumber(mark)
    if delta > 0 or paid == w then
      cur = math.max(cur + delta, 0)
    elseif paid == w - 1 then
      prev = math.max(prev + delta, 0)
    else
      return
    end
    sw_store(l, now, w, cur, prev)
  end,
}
