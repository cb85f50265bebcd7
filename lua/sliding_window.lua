-- sliding_window.lua: sliding-window counter, O(1) memory per key.
--
-- The count over the last period_us is estimated as
--   previous_window_count * (1 - fraction_of_current_window_elapsed) + current_window_count
-- (Cloudflare's approximation). It removes the 2 x burst of a fixed window at its edge.
--
-- State: one HASH per (limit, key): w = current window index, c = its count, p = the count
-- of window w - 1. The key expires when its count no longer weighs on the estimate, at the
-- end of window w + 1. Reservation is not supported (max_wait ignored).
-- mark = the window index the cost was counted in.

local function sw_read(key, w)
  local s = redis.call('HMGET', key, 'w', 'c', 'p')
  local sw = tonumber(s[1])
  if sw == w then
    return tonumber(s[2]), tonumber(s[3])
  elseif sw == w - 1 then
    return 0, tonumber(s[2])
  end
  return 0, 0
end

local function sw_store(key, p, now, w, cur, prev)
  redis.call('HSET', key, 'w', fmt(w), 'c', fmt(cur), 'p', fmt(prev))
  redis.call('PEXPIRE', key, ttl_ms((w + 2) * p.period_us - now))
end

ALGO.sw = {
  nkeys = 1,
  check = function(keys, p, now, cost, max_wait)
    local w = math.floor(now / p.period_us)
    local start = w * p.period_us
    local cur, prev = sw_read(keys[1], w)
    local est = prev * (1 - (now - start) / p.period_us) + cur
    local r = {w = w, cur = cur, prev = prev, allowed = 0, wait = 0, retry = 0}
    local after_cur = cur
    if est + cost <= p.count then
      r.allowed = 1
      est = est + cost
      after_cur = cur + cost
    elseif cur + cost <= p.count then
      -- Enough room once the previous window has decayed a little more, in this window.
      local f = 1 - (p.count - cur - cost) / prev
      r.retry = ceil_us(start + f * p.period_us - now)
    else
      -- Only in the next window, once this window's count has decayed enough.
      local f = math.max(1 - (p.count - cost) / cur, 0)
      r.retry = ceil_us(start + (1 + f) * p.period_us - now)
    end
    r.remaining = math.max(p.count - est, 0)
    if after_cur > 0 then
      r.reset = ceil_us(start + 2 * p.period_us - now)
    else
      r.reset = ceil_us(start + p.period_us - now)
    end
    return r
  end,
  commit = function(keys, p, now, cost, r, holder, expiry)
    sw_store(keys[1], p, now, r.w, r.cur + cost, r.prev)
    return fmt(r.w)
  end,
  -- A charge lands in the current window; a refund goes back to the window that paid while
  -- that window still weighs on the estimate (the current or the previous one).
  adjust = function(keys, p, now, delta, mark, holder)
    local w = math.floor(now / p.period_us)
    local cur, prev = sw_read(keys[1], w)
    local paid = tonumber(mark)
    if delta > 0 or paid == w then
      cur = math.max(cur + delta, 0)
    elseif paid == w - 1 then
      prev = math.max(prev + delta, 0)
    else
      return
    end
    sw_store(keys[1], p, now, w, cur, prev)
  end,
}
